"""The public ops and their ``torch.library`` registrations (namespace ``mla_fusion``).

Each public function is a thin call of its custom op, so eager code,
``torch.compile(fullgraph=True)`` and CUDA/HIP graph capture all go through
the same path: validation (shape/dtype only, no sync), backend selection
(dispatch.py), one backend call. The fakes run the same validation, so a bad
call fails at trace time with the same message.

``eager`` holds the custom ops' bodies themselves (same validation, selection
and backend call, positional arguments as in ``torch.ops.mla_fusion.*``), for
callers that already run inside an opaque custom op, such as the vLLM plugin's
attention op: nothing traces there, and the dispatcher's per-call host cost
would be paid per layer and step for nothing.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from . import dispatch
from .validation import (
    check_argument_types,
    check_decode_rope_cache_write,
    check_prefill_rope_cache_write,
    check_rope_cache_write,
)

__all__ = ["mla_rope_cache_write", "mla_decode_rope_cache_write", "mla_prefill_rope_cache_write", "eager"]


def _rope_cache_write(
    positions: torch.Tensor,
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    kv_c: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_cache_dtype: str = "auto",
    kv_cache_scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    p = check_rope_cache_write(
        positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, kv_cache_dtype, kv_cache_scale
    )
    name = dispatch.resolve(backend, q_pe.device, decode=False, problem=p)
    if p.num_tokens == 0:
        return
    dispatch.load(name).rope_cache_write(
        p, positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, kv_cache_scale
    )


_mla_rope_cache_write_op = torch.library.custom_op(
    "mla_fusion::mla_rope_cache_write", mutates_args=("q_pe", "k_pe", "kv_cache")
)(_rope_cache_write)


@_mla_rope_cache_write_op.register_fake
def _(positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache,
      kv_cache_dtype="auto", kv_cache_scale=None, backend="auto") -> None:  # fmt: skip
    check_rope_cache_write(
        positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, kv_cache_dtype, kv_cache_scale
    )
    dispatch.requested_backend(backend)


def _decode_rope_cache_write(
    positions: torch.Tensor,
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    kv_c: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    q_out: torch.Tensor,
    kv_cache_dtype: str = "auto",
    kv_cache_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    is_nope_first: bool = True,
    backend: str = "auto",
) -> None:
    p = check_decode_rope_cache_write(
        positions, ql_nope, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, q_out,
        kv_cache_dtype, kv_cache_scale, q_scale, is_nope_first,
    )  # fmt: skip
    name = dispatch.resolve(backend, q_pe.device, decode=True, problem=p)
    if p.num_tokens == 0:
        return
    dispatch.load(name).decode_rope_cache_write(
        p, positions, ql_nope, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, q_out,
        kv_cache_scale, q_scale, is_nope_first,
    )  # fmt: skip


_mla_decode_rope_cache_write_op = torch.library.custom_op(
    "mla_fusion::mla_decode_rope_cache_write", mutates_args=("kv_cache", "q_out")
)(_decode_rope_cache_write)


@_mla_decode_rope_cache_write_op.register_fake
def _(positions, ql_nope, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, q_out,
      kv_cache_dtype="auto", kv_cache_scale=None, q_scale=None, is_nope_first=True, backend="auto") -> None:  # fmt: skip
    check_decode_rope_cache_write(
        positions, ql_nope, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, q_out,
        kv_cache_dtype, kv_cache_scale, q_scale, is_nope_first,
    )  # fmt: skip
    dispatch.requested_backend(backend)


def _prefill_rope_cache_write(
    positions: torch.Tensor,
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_nope: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    k_out: torch.Tensor,
    kv_cache_dtype: str = "auto",
    kv_cache_scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    p = check_prefill_rope_cache_write(
        positions, q_pe, k_pe, kv_c, k_nope, cos_sin_cache, is_neox, slot_mapping, kv_cache, k_out,
        kv_cache_dtype, kv_cache_scale,
    )  # fmt: skip
    name = dispatch.resolve(backend, q_pe.device, decode=False, problem=p)
    if p.num_tokens == 0:
        return
    dispatch.load(name).prefill_rope_cache_write(
        p, positions, q_pe, k_pe, kv_c, k_nope, cos_sin_cache, is_neox, slot_mapping, kv_cache, k_out, kv_cache_scale
    )


_mla_prefill_rope_cache_write_op = torch.library.custom_op(
    "mla_fusion::mla_prefill_rope_cache_write", mutates_args=("q_pe", "k_pe", "kv_cache", "k_out")
)(_prefill_rope_cache_write)

def _named(qualname: str, body):
    """``body`` under the custom op's name in a torch.profiler trace (when one is recording),
    so that a profile shows the same op names whichever entry point ran."""

    def call(*args):
        if torch.autograd._profiler_enabled():
            with torch.profiler.record_function(qualname):
                return body(*args)
        return body(*args)

    call.__name__, call.__doc__ = body.__name__, body.__doc__
    return call


eager = SimpleNamespace(
    mla_rope_cache_write=_named("mla_fusion::mla_rope_cache_write", _rope_cache_write),
    mla_decode_rope_cache_write=_named("mla_fusion::mla_decode_rope_cache_write", _decode_rope_cache_write),
    mla_prefill_rope_cache_write=_named("mla_fusion::mla_prefill_rope_cache_write", _prefill_rope_cache_write),
)


@_mla_prefill_rope_cache_write_op.register_fake
def _(positions, q_pe, k_pe, kv_c, k_nope, cos_sin_cache, is_neox, slot_mapping, kv_cache, k_out,
      kv_cache_dtype="auto", kv_cache_scale=None, backend="auto") -> None:  # fmt: skip
    check_prefill_rope_cache_write(
        positions, q_pe, k_pe, kv_c, k_nope, cos_sin_cache, is_neox, slot_mapping, kv_cache, k_out,
        kv_cache_dtype, kv_cache_scale,
    )  # fmt: skip
    dispatch.requested_backend(backend)


def mla_rope_cache_write(
    positions: torch.Tensor,
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    kv_c: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_cache_dtype: str = "auto",
    kv_cache_scale: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> None:
    """Rotate ``q_pe`` and ``k_pe`` in place and write ``[kv_c | rope(k_pe)]`` into the paged MLA cache.

    A drop-in for vLLM's ``concat_and_cache_mla_rope_fused`` (same argument
    names and order); one kernel launch on a GPU.

    Args:
        positions: ``[>=T]`` int32/int64 position of each token, any stride. Out-of-range
            positions are clamped to ``[0, max_position)``, never read out of bounds.
        q_pe: ``[T, H, R]`` fp16/bf16/fp32, any strides. **Rotated in place** for
            every token (padding tokens too, so their rows stay finite).
        k_pe: ``[T, R]`` or ``[T, 1, R]``, q_pe's dtype, any strides. **Rotated in place.**
        kv_c: ``[T, L]`` or ``[T, 1, L]`` latent (``kv_c_normed``), q_pe's dtype. Read only.
        cos_sin_cache: ``[max_position, R]``, each row ``[cos (R/2) | sin (R/2)]``,
            float32 or q_pe's dtype.
        is_neox: False rotates interleaved pairs ``(x[2i], x[2i+1])`` (GPT-J style,
            DeepSeek); True rotates ``(x[i], x[i + R/2])``.
        slot_mapping: ``[>=T]`` int32/int64 cache slot of each token, any stride,
            ``block * block_size + offset``; entries < 0 are padding and write nothing.
            Entries ``>= num_blocks * block_size`` (past the cache: a scheduler or
            connector bug, a stale mapping under graph padding) also write nothing,
            and the rest of the batch is unaffected: such a slot costs its row, never
            a write outside ``kv_cache``. ``VLLM_MLA_FUSION_DEBUG=1`` raises a
            ValueError naming ``slot_mapping`` for them instead, before any write.
        kv_cache: ``[num_blocks, block_size, L + R]``, any strides. **Written** at
            the row of each slot in ``[0, num_blocks * block_size)``, nowhere else.
            bf16/fp16/fp32 store the values cast; fp8 (typed, or uint8 storage named
            by ``kv_cache_dtype``) stores ``saturate(x / kv_cache_scale)``.
        kv_cache_dtype: ``"auto"`` (the tensor's dtype), ``"fp8"``/``"fp8_e4m3"``
            (the platform's e4m3: e4m3fnuz on MI300-class GPUs, e4m3fn elsewhere),
            ``"fp8_e5m2"``, or a float name matching the tensor.
        kv_cache_scale: float32 one-element tensor, fp8 caches only; None means 1.0.
        backend: ``"torch"``, ``"triton"``, ``"aiter"`` or None/``"auto"``
            (``VLLM_MLA_FUSION_BACKEND``, else chosen by device).

    Rotation is computed in float32 and rounded once to each output's dtype.
    Entries of ``positions`` and ``slot_mapping`` past T are ignored.
    Raises ValueError/TypeError, before anything is written, on malformed input.
    """
    check_argument_types(positions=positions, q_pe=q_pe, k_pe=k_pe, kv_c=kv_c, cos_sin_cache=cos_sin_cache,
                         is_neox=is_neox, slot_mapping=slot_mapping, kv_cache=kv_cache, kv_cache_dtype=kv_cache_dtype,
                         kv_cache_scale=kv_cache_scale)  # fmt: skip
    torch.ops.mla_fusion.mla_rope_cache_write(
        positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache,
        kv_cache_dtype, kv_cache_scale, backend or "auto",
    )  # fmt: skip


def mla_decode_rope_cache_write(
    positions: torch.Tensor,
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    kv_c: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    q_out: torch.Tensor,
    kv_cache_dtype: str = "auto",
    kv_cache_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    *,
    is_nope_first: bool = True,
    backend: str | None = None,
) -> None:
    """Assemble the MLA decode query and write the KV cache, in one kernel launch.

    ``q_out[t, h] = [ql_nope[t, h] | rope(q_pe[t, h])]`` (``is_nope_first=False``:
    ``[rope(q_pe[t, h]) | ql_nope[t, h]]``), and the same cache write as
    :func:`mla_rope_cache_write`. ``q_pe`` and ``k_pe`` are **not** modified.

    Args:
        ql_nope: ``[T, H, L]`` absorbed query (``q_nope @ W_UK``), any strides.
        q_out: ``[T, H, L + R]`` **written** for every token, padding tokens
            included (positions clamped), since attention kernels may read those
            rows. bf16/fp16/fp32, or fp8 storing ``saturate(x / q_scale)``.
        q_scale: float32 one-element tensor, fp8 ``q_out`` only; None means 1.0.

    The other arguments are those of :func:`mla_rope_cache_write`.
    """
    check_argument_types(positions=positions, ql_nope=ql_nope, q_pe=q_pe, k_pe=k_pe, kv_c=kv_c,
                         cos_sin_cache=cos_sin_cache, is_neox=is_neox, slot_mapping=slot_mapping, kv_cache=kv_cache,
                         q_out=q_out, kv_cache_dtype=kv_cache_dtype, kv_cache_scale=kv_cache_scale, q_scale=q_scale,
                         is_nope_first=is_nope_first)  # fmt: skip
    torch.ops.mla_fusion.mla_decode_rope_cache_write(
        positions, ql_nope, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, q_out,
        kv_cache_dtype, kv_cache_scale, q_scale, is_nope_first, backend or "auto",
    )  # fmt: skip


def mla_prefill_rope_cache_write(
    positions: torch.Tensor,
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_nope: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    k_out: torch.Tensor,
    kv_cache_dtype: str = "auto",
    kv_cache_scale: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> None:
    """The prefill epilogue of an MLA layer in one kernel launch: RoPE, cache rows and the attention key.

    Everything :func:`mla_rope_cache_write` does (``q_pe`` and ``k_pe`` rotated
    in place, ``[kv_c | rope(k_pe)]`` written at each valid slot), plus the full
    key of MHA-style prefill attention, for every token ``t < T`` (padding
    tokens included):

        ``k_out[t, h, :P] = k_nope[t, h]`` and ``k_out[t, h, P:] = rope(k_pe[t])``.

    Args:
        k_nope: ``[T, H, P]`` (``P = qk_nope_head_dim``), q_pe's dtype, any
            strides (vLLM hands over a split view of ``kv_b_proj``'s output). Read only.
        k_out: ``[T, H, P + R]``, any strides, **written** for every token. Its
            dtype is q_pe's (the nope part an exact copy) or an fp8 type
            (``float8_e4m3fn``, ``float8_e4m3fnuz``, ``float8_e5m2``) for fp8
            prefill attention. fp8 stores ``saturate(x)`` with no scale, as vLLM
            casts the key without one. Unlike ``tensor.to(fp8)``, which turns a
            value past the format's largest finite number into NaN (e4m3) or inf
            (e5m2), the op clamps it to that largest number; NaN stays NaN.

    The other arguments are those of :func:`mla_rope_cache_write`. The rope part
    of ``k_out`` is the float32 rotation rounded once to ``k_out``'s dtype (for an
    fp8 key: not rounded through ``k_pe``'s dtype first). The AITER backend has no
    such op: on ROCm the Triton kernel runs it.
    """
    check_argument_types(positions=positions, q_pe=q_pe, k_pe=k_pe, kv_c=kv_c, k_nope=k_nope,
                         cos_sin_cache=cos_sin_cache, is_neox=is_neox, slot_mapping=slot_mapping, kv_cache=kv_cache,
                         k_out=k_out, kv_cache_dtype=kv_cache_dtype, kv_cache_scale=kv_cache_scale)  # fmt: skip
    torch.ops.mla_fusion.mla_prefill_rope_cache_write(
        positions, q_pe, k_pe, kv_c, k_nope, cos_sin_cache, is_neox, slot_mapping, kv_cache, k_out,
        kv_cache_dtype, kv_cache_scale, backend or "auto",
    )  # fmt: skip
