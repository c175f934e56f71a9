"""The public ops and their ``torch.library`` registrations (namespace ``mla_fusion``).

Each op is defined once, by its public function: the signature users read, with its types,
defaults and documentation. From it come (``OpCall``, at the end of this module)

- the custom op's schema: the same parameters, as torch.ops callers pass them;
- its kernel: the call mapped by parameter name onto a :class:`~.binding.BoundOp` (the op's
  kind and static flags, then its tensors), kept per flag set; the BoundOp validates each new
  layout (shape/dtype only, no sync) and, for a layout it has validated, only checks that the
  call has the same one;
- its fake: the same validation, so that a bad call fails at trace time with the same message;
- ``eager``: the kernel without torch's dispatcher, for callers already inside an opaque op
  (tools, benchmarks).

The public function also checks the Python types of its arguments (the dispatcher would
silently turn ``is_neox=1`` into True), then calls the custom op.

The ops are registered with ``torch.library.Library`` (define, implementation for the
CPU and CUDA dispatch keys, fake), as vLLM registers its own: a call costs one trip
through the dispatcher. ``torch.library.custom_op`` would add its Python autograd and
in-place wrappers to every call (tens of microseconds on a GPU host), which an
inference op never needs.

The vLLM plugin does not come through here: its fused layers share the BoundOps of their setting
(binding.shared_ops, from vllm_plugin/custom_ops.py), bound with the early-index-loads promise.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch

from . import dispatch, validation
from .binding import BoundOp, shared_ops
from .opcodes import OP_DECODE, OP_PREFILL, OP_ROPE_CACHE
from .validation import argument_types_ok, check_argument_types

__all__ = ["mla_rope_cache_write", "mla_decode_rope_cache_write", "mla_prefill_rope_cache_write", "eager"]

NAMESPACE = "mla_fusion"
# The ops' lifetime is the library object's: kept for the process.
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def bound_op(op: int, is_neox: bool, kv_cache_dtype: str, is_nope_first: bool, backend: str | None) -> BoundOp:
    """The BoundOp a public call runs through. The backend named by the keyword or
    ``VLLM_MLA_FUSION_BACKEND`` and ``VLLM_MLA_FUSION_DEBUG`` are read per call here (users
    and tests change them between calls); the plugin's BoundOps read them once."""
    ops = shared_ops(dispatch.requested_backend(backend), validation.debug_enabled())
    return ops.get(op, kv_cache_dtype, is_neox, is_nope_first)


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
            ``"fp8_ds_mla"``: uint8 ``[num_blocks, block_size, L + 4 * L / 128 + 2 * R]``
            (656 bytes for DeepSeek-V3.2), each row vLLM's sparse-MLA format: ``kv_c`` in
            groups of 128 as fp8 e4m3fn divided by the group's float32 scale
            ``2**ceil(log2(max(amax / 448, 1e-4)))``, the scales, then ``rope(k_pe)`` as bf16
            (docs/vllm.md). Torch backend only for now; bf16 activations, L a multiple of 128.
        kv_cache_dtype: ``"auto"`` (the tensor's dtype), ``"fp8"``/``"fp8_e4m3"``
            (the platform's e4m3: e4m3fnuz on MI300-class GPUs, e4m3fn elsewhere),
            ``"fp8_e5m2"``, a float name matching the tensor, or ``"fp8_ds_mla"``.
        kv_cache_scale: float32 one-element tensor, fp8 caches only; None means 1.0.
            ``fp8_ds_mla`` ignores it (its scales come from the data), as vLLM's writer does.
        backend: ``"torch"``, ``"triton"``, ``"aiter"`` or None/``"auto"``
            (``VLLM_MLA_FUSION_BACKEND``, else chosen by device).

    Rotation is computed in float32 and rounded once to each output's dtype.
    Entries of ``positions`` and ``slot_mapping`` past T are ignored.
    Raises ValueError/TypeError, before anything is written, on malformed input.
    """
    if not argument_types_ok((positions, q_pe, k_pe, kv_c, cos_sin_cache, slot_mapping, kv_cache), (is_neox,),
                             kv_cache_dtype, (kv_cache_scale,)):  # fmt: skip
        check_argument_types(positions=positions, q_pe=q_pe, k_pe=k_pe, kv_c=kv_c, cos_sin_cache=cos_sin_cache,
                             is_neox=is_neox, slot_mapping=slot_mapping, kv_cache=kv_cache,
                             kv_cache_dtype=kv_cache_dtype, kv_cache_scale=kv_cache_scale)  # fmt: skip
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
    if not argument_types_ok((positions, ql_nope, q_pe, k_pe, kv_c, cos_sin_cache, slot_mapping, kv_cache, q_out),
                             (is_neox, is_nope_first), kv_cache_dtype, (kv_cache_scale, q_scale)):  # fmt: skip
        check_argument_types(positions=positions, ql_nope=ql_nope, q_pe=q_pe, k_pe=k_pe, kv_c=kv_c,
                             cos_sin_cache=cos_sin_cache, is_neox=is_neox, slot_mapping=slot_mapping,
                             kv_cache=kv_cache, q_out=q_out, kv_cache_dtype=kv_cache_dtype,
                             kv_cache_scale=kv_cache_scale, q_scale=q_scale, is_nope_first=is_nope_first)  # fmt: skip
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
    key_start: int = 0,
    backend: str | None = None,
) -> None:
    """The prefill epilogue of an MLA layer in one kernel launch: RoPE, cache rows and the attention key.

    Everything :func:`mla_rope_cache_write` does (``q_pe`` and ``k_pe`` rotated
    in place, ``[kv_c | rope(k_pe)]`` written at each valid slot), plus the full
    key of MHA-style prefill attention, for every token ``key_start <= t < T``
    (padding tokens included):

        ``k_out[t - key_start, h, :P] = k_nope[t - key_start, h]`` and
        ``k_out[t - key_start, h, P:] = rope(k_pe[t])``.

    Args:
        k_nope: ``[T - key_start, H, P]`` (``P = qk_nope_head_dim``), q_pe's dtype, any
            strides (vLLM hands over a split view of ``kv_b_proj``'s output). Read only.
        k_out: ``[T - key_start, H, P + R]``, any strides, **written** for every row. Its
            dtype is q_pe's (the nope part an exact copy) or an fp8 type
            (``float8_e4m3fn``, ``float8_e4m3fnuz``, ``float8_e5m2``) for fp8
            prefill attention. fp8 stores ``saturate(x)`` with no scale, as vLLM
            casts the key without one. Unlike ``tensor.to(fp8)``, which turns a
            value past the format's largest finite number into NaN (e4m3) or inf
            (e5m2), the op clamps it to that largest number; NaN stays NaN.
        key_start: ``0 <= key_start <= T``: the tokens before it get what
            :func:`mla_rope_cache_write` does and no key row. vLLM orders a mixed
            batch's decode tokens first; with ``key_start = num_decode_tokens`` one
            launch serves the whole batch where the decode query keeps ``q_pe`` as it is.

    The other arguments are those of :func:`mla_rope_cache_write`. The rope part
    of ``k_out`` is the float32 rotation rounded once to ``k_out``'s dtype (for an
    fp8 key: not rounded through ``k_pe``'s dtype first). The AITER backend has no
    such op: on ROCm the Triton kernel runs it.
    """
    if not argument_types_ok((positions, q_pe, k_pe, kv_c, k_nope, cos_sin_cache, slot_mapping, kv_cache, k_out),
                             (is_neox,), kv_cache_dtype, (kv_cache_scale,), key_start):  # fmt: skip
        check_argument_types(positions=positions, q_pe=q_pe, k_pe=k_pe, kv_c=kv_c, k_nope=k_nope,
                             cos_sin_cache=cos_sin_cache, is_neox=is_neox, slot_mapping=slot_mapping,
                             kv_cache=kv_cache, k_out=k_out, kv_cache_dtype=kv_cache_dtype,
                             kv_cache_scale=kv_cache_scale, key_start=key_start)  # fmt: skip
    torch.ops.mla_fusion.mla_prefill_rope_cache_write(
        positions, q_pe, k_pe, kv_c, k_nope, cos_sin_cache, is_neox, slot_mapping, kv_cache, k_out,
        kv_cache_dtype, kv_cache_scale, backend or "auto", key_start=key_start,
    )  # fmt: skip


# --- the custom ops, derived from the public functions -------------------------------------------

# The tensor arguments every op has, in BoundOp's order; each op's own three follow (OpCall's roles).
_COMMON = ("positions", "q_pe", "k_pe", "kv_c", "cos_sin_cache", "slot_mapping", "kv_cache", "kv_cache_scale")
_FLAGS = ("is_neox", "kv_cache_dtype", "is_nope_first", "backend")


class OpCall:
    """One custom op, derived from its public function: its schema, kernel and fake.

    The schema is the public signature as ``torch.ops`` callers pass it: every parameter
    positional, in order, except ``key_start`` (keyword-only, last); ``backend`` a ``str``
    defaulting to ``"auto"`` (the public functions turn None into it).

    The kernel and the fake are plain functions with exactly the schema's parameters, written
    out here from it (as ``dataclasses`` writes ``__init__``): Python binds and defaults a
    call's arguments, names a missing or unknown one, and the body is one BoundOp call, its
    flags (op, is_neox, kv_cache_dtype, is_nope_first or True, backend) then its tensors in
    BoundOp's order. ``roles`` names the op's own input, output and output scale (BoundOp's
    ``nope``, ``out``, ``out_scale``; None where the op has none).
    """

    def __init__(self, public, op: int, writes: tuple[str, ...], roles: tuple[str | None, str | None, str | None]):
        self.public, self.op, self.writes = public, op, writes
        positional, keyword = [], []
        for prm in inspect.signature(public, eval_str=True).parameters.values():
            if prm.name == "key_start":
                keyword.append(prm)
            elif prm.name == "backend":
                positional.append(prm.replace(kind=prm.POSITIONAL_OR_KEYWORD, annotation=str, default="auto"))
            else:
                positional.append(prm.replace(kind=prm.POSITIONAL_OR_KEYWORD))
        self.signature = inspect.Signature(positional + keyword, return_annotation=None)
        names = set(self.signature.parameters)
        unused = names - {*_FLAGS, *_COMMON, *roles, "key_start"}
        if unused:  # a parameter the op would take and never pass on
            raise TypeError(f"{public.__name__}: parameters {sorted(unused)} reach no BoundOp argument")
        nope_first = "is_nope_first" if "is_nope_first" in names else "True"
        key_start = "key_start" if "key_start" in names else "0"
        call = (f"bound_op({op}, is_neox, kv_cache_dtype, {nope_first}, backend)"
                f"({', '.join((*_COMMON, *(r or 'None' for r in roles), key_start))})")  # fmt: skip
        self.kernel = self._function(call)
        self.fake = self._function(call.replace(")(", ").validate(", 1))

    def _function(self, body: str):
        """A function with the schema's parameters (no annotations) whose body is ``body``; its globals
        are this module's, so ``bound_op`` is looked up at each call."""
        plain = self.signature.replace(parameters=[prm.replace(annotation=prm.empty)
                                                   for prm in self.signature.parameters.values()],
                                       return_annotation=inspect.Signature.empty)  # fmt: skip
        namespace: dict = {}
        exec(f"def {self.public.__name__}{plain}:\n    {body}\n", globals(), namespace)  # noqa: S102
        return namespace[self.public.__name__]

    def schema(self) -> str:
        def prototype(*args, **kwargs) -> None: ...

        prototype.__signature__ = self.signature
        return torch.library.infer_schema(prototype, mutates_args=self.writes)


OP_CALLS = {
    "mla_rope_cache_write": OpCall(mla_rope_cache_write, OP_ROPE_CACHE, ("q_pe", "k_pe", "kv_cache"),
                                   (None, None, None)),
    "mla_decode_rope_cache_write": OpCall(mla_decode_rope_cache_write, OP_DECODE, ("kv_cache", "q_out"),
                                          ("ql_nope", "q_out", "q_scale")),
    "mla_prefill_rope_cache_write": OpCall(mla_prefill_rope_cache_write, OP_PREFILL,
                                           ("q_pe", "k_pe", "kv_cache", "k_out"), ("k_nope", "k_out", None)),
}  # fmt: skip
for _name, _call in OP_CALLS.items():
    _LIB.define(_name + _call.schema())
    for _key in ("CPU", "CUDA"):  # CUDA also serves ROCm's HIP tensors
        _LIB.impl(_name, _call.kernel, _key)
    torch.library.register_fake(f"{NAMESPACE}::{_name}", _call.fake, lib=_LIB)

# The ops' bodies without torch's dispatcher (arguments as ``torch.ops.mla_fusion.*`` takes them).
eager = SimpleNamespace(**{name: call.kernel for name, call in OP_CALLS.items()})
