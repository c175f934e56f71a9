"""Argument checks shared by every entry point (public functions, custom ops, fakes).

Only shapes, dtypes, devices and Python values are inspected, so a check costs
no device sync and no allocation and also runs on fake tensors while
torch.compile traces. Every failure is a ValueError or TypeError naming the
argument and what was expected, raised before any kernel runs.

``VLLM_MLA_FUSION_DEBUG=1`` adds host-side checks of the index *values*
(slot range, duplicate slots, position range). They synchronize with the
device, so they are skipped while a CUDA graph is being captured.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import fp8
from .environment import environment_value

INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Problem:
    """Sizes and element formats of one call, derived from its arguments."""

    num_tokens: int  # T
    num_heads: int  # H
    kv_lora_rank: int  # L
    rope_dim: int  # R
    cache_dtype: torch.dtype  # element format stored in kv_cache (typed fp8 for uint8 storage)
    q_out_dtype: torch.dtype | None = None  # decode op only
    nope_dim: int | None = None  # P, prefill op only
    k_out_dtype: torch.dtype | None = None  # prefill op only
    # None: kv_cache rows are [L + R] elements of cache_dtype. fp8.FP8_DS_MLA: packed rows
    # (fp8.ds_mla_row_bytes), cache_dtype being the latent's fp8 type.
    cache_format: str | None = None


def _require_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _require_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")


def _require_ndim(name: str, t: torch.Tensor, ndims: tuple[int, ...], layout: str) -> None:
    if t.dim() not in ndims:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")


def _require_distinct_elements(name: str, t: torch.Tensor) -> None:
    """``t``, which the op writes, has no two elements at one address: no dimension of stride 0 (an
    ``expand``-ed view), the overlap torch's own in-place ops refuse. Its programs would write one
    address at once from several elements' values. The token dimension (the first) counts whatever
    its size: a layout, once bound, serves every token count (binding.py)."""
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if stride == 0 and (dim == 0 or size > 1):
            raise ValueError(f"{name} is written by the op, so no two of its elements may share memory; it has "
                             f"stride 0 in dimension {dim} (shape {tuple(t.shape)}, strides {t.stride()}): "
                             "pass a tensor that owns its elements (not an expand()-ed view)")  # fmt: skip


def check_argument_types(**args: object) -> None:
    """Python types of a public function's arguments, checked before torch's dispatcher sees them.

    The dispatcher would reject a non-tensor with a RuntimeError, and silently turn
    ``is_neox=1`` into True; the public functions promise a TypeError naming the argument.
    Flags must be bool, ``kv_cache_dtype`` a str, scales a tensor or None, the rest tensors.
    """
    for name, value in args.items():
        if name == "key_start":
            _check_key_start_type(value)
        elif name in ("is_neox", "is_nope_first"):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        elif name == "kv_cache_dtype":
            if not isinstance(value, str):
                raise TypeError(f"kv_cache_dtype must be a str, got {type(value).__name__}")
        elif name.endswith("_scale"):
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a float32 tensor or None, got {type(value).__name__}")
        else:
            _require_tensor(name, value)


def argument_types_ok(tensors: tuple, flags: tuple, kv_cache_dtype: object, scales: tuple, key_start=0) -> bool:
    """Whether :func:`check_argument_types` would pass, in one pass and without its messages.

    The public ops' common case costs a few isinstance checks (~0.3 us) instead of a loop over
    named arguments (~2.5 us on a GPU host's CPU); on False the caller runs
    check_argument_types, which names the argument (and accepts what this fast path leaves to it,
    a SymInt key_start)."""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            return False
    for f in flags:
        if type(f) is not bool:
            return False
    for s in scales:
        if s is not None and not isinstance(s, torch.Tensor):
            return False
    return isinstance(kv_cache_dtype, str) and type(key_start) is int


def _check_key_start_type(key_start: object) -> None:
    # bool is an int subclass; a flag passed where a token count belongs is a bug, not 0 or 1.
    # A SymInt is what a fake (torch.compile tracing) may receive.
    if not isinstance(key_start, (int, torch.SymInt)) or isinstance(key_start, bool):
        raise TypeError(f"key_start must be an int, got {type(key_start).__name__}")


def _check_scale(name: str, scale: object, device: torch.device) -> None:
    if scale is None:
        return
    scale = _require_tensor(name, scale)
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be a float32 tensor, got {scale.dtype}")
    if scale.numel() != 1:
        raise ValueError(f"{name} must have exactly one element, got shape {tuple(scale.shape)}")
    if scale.device != device:
        raise ValueError(f"{name} is on {scale.device} but the other tensors are on {device}")


def _check_common(
    positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, kv_cache_dtype, kv_cache_scale
) -> Problem:
    for name, t in (
        ("positions", positions),
        ("q_pe", q_pe),
        ("k_pe", k_pe),
        ("kv_c", kv_c),
        ("cos_sin_cache", cos_sin_cache),
        ("slot_mapping", slot_mapping),
        ("kv_cache", kv_cache),
    ):
        _require_tensor(name, t)
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox must be a bool, got {type(is_neox).__name__}")

    _require_dtype("positions", positions, INDEX_DTYPES)
    _require_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    _require_dtype("q_pe", q_pe, fp8.ACTIVATION_DTYPES)
    act = q_pe.dtype
    for name, t in (("k_pe", k_pe), ("kv_c", kv_c)):
        if t.dtype != act:
            raise TypeError(f"{name} dtype {t.dtype} must match q_pe dtype {act}")
    if cos_sin_cache.dtype not in (torch.float32, act):
        raise TypeError(f"cos_sin_cache must be float32 or the activation dtype {act}, got {cos_sin_cache.dtype}")

    _require_ndim("positions", positions, (1,), "1-D [num_tokens]")
    _require_ndim("slot_mapping", slot_mapping, (1,), "1-D [num_tokens]")
    _require_ndim("q_pe", q_pe, (3,), "3-D [num_tokens, num_heads, rope_dim]")
    _require_ndim("k_pe", k_pe, (2, 3), "[num_tokens, rope_dim] or [num_tokens, 1, rope_dim]")
    _require_ndim("kv_c", kv_c, (2, 3), "[num_tokens, kv_lora_rank] or [num_tokens, 1, kv_lora_rank]")
    _require_ndim("cos_sin_cache", cos_sin_cache, (2,), "2-D [max_position, rope_dim]")
    _require_ndim("kv_cache", kv_cache, (3,), "3-D [num_blocks, block_size, kv_lora_rank + rope_dim]")

    T, H, R = q_pe.shape
    if k_pe.dim() == 3 and k_pe.shape[1] != 1:
        raise ValueError(f"k_pe must have a single head ([T, 1, R]), got shape {tuple(k_pe.shape)}")
    if kv_c.dim() == 3 and kv_c.shape[1] != 1:
        raise ValueError(f"kv_c must have a single head ([T, 1, L]), got shape {tuple(kv_c.shape)}")
    L = kv_c.shape[-1]
    if R < 2 or R % 2:
        raise ValueError(f"rope_dim (q_pe.shape[-1]) must be a positive even number, got {R}")
    if H < 1:
        raise ValueError(f"q_pe must have at least one head, got shape {tuple(q_pe.shape)}")
    if L < 1:
        raise ValueError(f"kv_c must have a positive last dimension, got shape {tuple(kv_c.shape)}")
    if k_pe.shape[0] != T or k_pe.shape[-1] != R:
        raise ValueError(f"k_pe shape {tuple(k_pe.shape)} does not match q_pe's T={T}, R={R}")
    if kv_c.shape[0] != T:
        raise ValueError(f"kv_c has {kv_c.shape[0]} rows but q_pe has T={T}")
    if positions.shape[0] < T:
        raise ValueError(f"positions has {positions.shape[0]} entries, fewer than the T={T} tokens of q_pe")
    if slot_mapping.shape[0] < T:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries, fewer than the T={T} tokens of q_pe")
    if cos_sin_cache.shape[1] != R:
        raise ValueError(f"cos_sin_cache last dim must equal rope_dim R={R}, got shape {tuple(cos_sin_cache.shape)}")
    if cos_sin_cache.shape[0] < 1:
        raise ValueError("cos_sin_cache must have at least one position row")
    ds_mla = isinstance(kv_cache_dtype, str) and kv_cache_dtype.lower() == fp8.FP8_DS_MLA
    if ds_mla:
        _check_ds_mla(act, L, R, kv_cache, kv_cache_dtype)
    elif kv_cache.shape[2] != L + R:
        raise ValueError(
            f"kv_cache last dim must be kv_lora_rank + rope_dim = {L} + {R} = {L + R}, got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.shape[1] < 1:
        raise ValueError(f"kv_cache block_size must be positive, got shape {tuple(kv_cache.shape)}")

    device = q_pe.device
    for name, t in (
        ("positions", positions),
        ("k_pe", k_pe),
        ("kv_c", kv_c),
        ("cos_sin_cache", cos_sin_cache),
        ("slot_mapping", slot_mapping),
        ("kv_cache", kv_cache),
    ):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but q_pe is on {device}; all tensors must share a device")
    _check_scale("kv_cache_scale", kv_cache_scale, device)
    cache_dtype = fp8.cache_store_dtype(kv_cache, kv_cache_dtype)
    if ds_mla and fp8.platform_fp8_e4m3(device) != fp8.DS_MLA_FP8:
        # vLLM's writer divides by 224 and stores e4m3fnuz there; the reference writes the e4m3fn format only.
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not implemented on {device}, whose fp8 is "
                         f"{fp8.platform_fp8_e4m3(device)} (MI300-class GPUs)")  # fmt: skip
    return Problem(T, H, L, R, cache_dtype, cache_format=fp8.FP8_DS_MLA if ds_mla else None)


def _check_ds_mla(act: torch.dtype, L: int, R: int, kv_cache: torch.Tensor, kv_cache_dtype: str) -> None:
    """The fp8_ds_mla row (fp8.py): uint8 storage, a latent in whole groups, the width the sizes give, bf16 input."""
    fp8.cache_store_dtype(kv_cache, kv_cache_dtype)  # uint8, or a TypeError naming kv_cache
    if act != torch.bfloat16:
        # The row's RoPE part is bf16: vLLM's writer copies k_pe's 16-bit values as they are.
        raise TypeError(f"kv_c, k_pe and q_pe must be bfloat16 for kv_cache_dtype={kv_cache_dtype!r} (the cache "
                        f"stores the RoPE part as bf16), got {act}")  # fmt: skip
    group = fp8.DS_MLA_GROUP
    if L % group:
        raise ValueError(f"kv_c's last dimension (kv_lora_rank) must be a multiple of {group} for "
                         f"kv_cache_dtype={kv_cache_dtype!r} (one scale per {group} values), got {L}")  # fmt: skip
    width = fp8.ds_mla_row_bytes(L, R)
    if kv_cache.shape[2] != width:
        raise ValueError(
            f"kv_cache last dim must be {L} fp8 + {L // group} float32 scales + {R} bf16 = {width} bytes for "
            f"kv_cache_dtype={kv_cache_dtype!r}, got shape {tuple(kv_cache.shape)}"
        )


def check_rope_cache_write(
    positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, kv_cache_dtype, kv_cache_scale
) -> Problem:
    """Validate the arguments of ``mla_rope_cache_write``; return the call's sizes."""
    p = _check_common(
        positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, kv_cache_dtype, kv_cache_scale
    )
    for name, t in (("q_pe", q_pe), ("k_pe", k_pe), ("kv_cache", kv_cache)):
        _require_distinct_elements(name, t)
    _debug_check_indices(p, positions, slot_mapping, cos_sin_cache, kv_cache)
    return p


def check_decode_rope_cache_write(
    positions,
    ql_nope,
    q_pe,
    k_pe,
    kv_c,
    cos_sin_cache,
    is_neox,
    slot_mapping,
    kv_cache,
    q_out,
    kv_cache_dtype,
    kv_cache_scale,
    q_scale,
    is_nope_first,
) -> Problem:
    """Validate the arguments of ``mla_decode_rope_cache_write``; return the call's sizes."""
    p = _check_common(
        positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, kv_cache_dtype, kv_cache_scale
    )
    _require_tensor("ql_nope", ql_nope)
    _require_tensor("q_out", q_out)
    if not isinstance(is_nope_first, bool):
        raise TypeError(f"is_nope_first must be a bool, got {type(is_nope_first).__name__}")
    if ql_nope.dtype != q_pe.dtype:
        raise TypeError(f"ql_nope dtype {ql_nope.dtype} must match q_pe dtype {q_pe.dtype}")
    _require_dtype("q_out", q_out, fp8.ACTIVATION_DTYPES + fp8.FP8_DTYPES)
    _require_ndim("ql_nope", ql_nope, (3,), "3-D [num_tokens, num_heads, kv_lora_rank]")
    _require_ndim("q_out", q_out, (3,), "3-D [num_tokens, num_heads, kv_lora_rank + rope_dim]")
    T, H, L, R = p.num_tokens, p.num_heads, p.kv_lora_rank, p.rope_dim
    if tuple(ql_nope.shape) != (T, H, L):
        raise ValueError(f"ql_nope must have shape [T, H, L] = {[T, H, L]}, got {tuple(ql_nope.shape)}")
    if tuple(q_out.shape) != (T, H, L + R):
        raise ValueError(f"q_out must have shape [T, H, L + R] = {[T, H, L + R]}, got {tuple(q_out.shape)}")
    for name, t in (("ql_nope", ql_nope), ("q_out", q_out)):
        if t.device != q_pe.device:
            raise ValueError(f"{name} is on {t.device} but q_pe is on {q_pe.device}; all tensors must share a device")
    _check_scale("q_scale", q_scale, q_pe.device)
    for name, t in (("q_out", q_out), ("kv_cache", kv_cache)):  # q_pe and k_pe are only read here
        _require_distinct_elements(name, t)
    _debug_check_indices(p, positions, slot_mapping, cos_sin_cache, kv_cache)
    return replace(p, q_out_dtype=q_out.dtype)


def check_prefill_rope_cache_write(
    positions,
    q_pe,
    k_pe,
    kv_c,
    k_nope,
    cos_sin_cache,
    is_neox,
    slot_mapping,
    kv_cache,
    k_out,
    kv_cache_dtype,
    kv_cache_scale,
    key_start=0,
) -> Problem:
    """Validate the arguments of ``mla_prefill_rope_cache_write``; return the call's sizes.

    ``k_nope`` and ``k_out`` hold the key rows of tokens ``key_start .. T - 1``."""
    p = _check_common(
        positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, kv_cache_dtype, kv_cache_scale
    )
    _require_tensor("k_nope", k_nope)
    _require_tensor("k_out", k_out)
    if k_nope.dtype != q_pe.dtype:
        raise TypeError(f"k_nope dtype {k_nope.dtype} must match q_pe dtype {q_pe.dtype}")
    if k_out.dtype != q_pe.dtype and not fp8.is_fp8(k_out.dtype):
        raise TypeError(
            f"k_out must have q_pe's dtype {q_pe.dtype} or an fp8 dtype (float8_e4m3fn, float8_e4m3fnuz, "
            f"float8_e5m2), got {k_out.dtype}"
        )
    _require_ndim("k_nope", k_nope, (3,), "3-D [num_tokens, num_heads, qk_nope_head_dim]")
    _require_ndim("k_out", k_out, (3,), "3-D [num_tokens, num_heads, qk_nope_head_dim + rope_dim]")
    T, H, L, R = p.num_tokens, p.num_heads, p.kv_lora_rank, p.rope_dim
    _check_key_start_type(key_start)
    if not 0 <= key_start <= T:
        raise ValueError(f"key_start must be in [0, T] = [0, {T}], got {key_start}")
    # The key's rows: every token's, or a mixed batch's tokens from key_start on.
    rows, rows_name = (T, "T") if key_start == 0 else (T - key_start, "T - key_start")
    P = k_nope.shape[-1]
    if tuple(k_nope.shape[:2]) != (rows, H):
        raise ValueError(f"k_nope must have shape [{rows_name}, H, P] with {rows_name}={rows}, H={H}, "
                         f"got {tuple(k_nope.shape)}")  # fmt: skip
    if P < 1:
        raise ValueError(f"k_nope must have a positive last dimension (qk_nope_head_dim), got {tuple(k_nope.shape)}")
    if tuple(k_out.shape) != (rows, H, P + R):
        raise ValueError(f"k_out must have shape [{rows_name}, H, P + R] = {[rows, H, P + R]}, "
                         f"got {tuple(k_out.shape)}")  # fmt: skip
    for name, t in (("k_nope", k_nope), ("k_out", k_out)):
        if t.device != q_pe.device:
            raise ValueError(f"{name} is on {t.device} but q_pe is on {q_pe.device}; all tensors must share a device")
    for name, t in (("q_pe", q_pe), ("k_pe", k_pe), ("kv_cache", kv_cache), ("k_out", k_out)):
        _require_distinct_elements(name, t)
    _debug_check_indices(p, positions, slot_mapping, cos_sin_cache, kv_cache)
    return replace(p, nope_dim=P, k_out_dtype=k_out.dtype)


def debug_enabled() -> bool:
    return environment_value("VLLM_MLA_FUSION_DEBUG") not in (None, "", "0")


def _debug_check_indices(p: Problem, positions, slot_mapping, cos_sin_cache, kv_cache) -> None:
    if not debug_enabled() or p.num_tokens == 0:
        return
    if positions.device.type == "meta" or isinstance(positions, torch._subclasses.FakeTensor):
        return
    if positions.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    T = p.num_tokens
    pos = positions[:T]
    max_pos = cos_sin_cache.shape[0]
    bad = ((pos < 0) | (pos >= max_pos)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"VLLM_MLA_FUSION_DEBUG: positions[{i}]={int(pos[i])} is outside [0, {max_pos}) "
            f"(cos_sin_cache rows); without debug mode it would be clamped"
        )
    slots = slot_mapping[:T].to(torch.int64)
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    bad = (slots >= num_slots).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"VLLM_MLA_FUSION_DEBUG: slot_mapping[{i}]={int(slots[i])} is past the cache's {num_slots} slots"
        )
    valid = slots[slots >= 0]
    if valid.numel() != torch.unique(valid).numel():
        raise ValueError("VLLM_MLA_FUSION_DEBUG: slot_mapping writes the same slot twice in one call")
