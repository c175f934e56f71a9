"""Cache and query element formats: which float type a tensor stores, and fp8 saturation.

vLLM allocates fp8 KV caches as ``torch.uint8`` storage and names the format
with a string (``kv_cache_dtype``); AITER and Triton want a typed fp8 tensor.
Everything here is shape/dtype logic on the host: no device work, no sync.

One named format is not rows of one element type: ``fp8_ds_mla`` (sparse MLA,
DeepSeek-V3.2), whose rows pack the latent as fp8 e4m3 in groups of 128 values,
one float32 scale per group, then the rotated RoPE part as bf16 (656 bytes for
L = 512, R = 64). Its constants are here; backends/reference.py defines the bytes,
and docs/vllm.md ("The fp8_ds_mla cache format") gives vLLM's writer they follow.
"""

from __future__ import annotations

import functools

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# vLLM's cache-dtype vocabulary (vllm/config/cache.py), plus plain float names.
_E4M3_NAMES = ("fp8", "fp8_e4m3")
_FLOAT_NAMES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
}
# Formats whose rows are [L + R] elements of one type (the vLLM plugin fuses layers with these).
KV_CACHE_DTYPES = ("auto", *_E4M3_NAMES, "fp8_e5m2", *_FLOAT_NAMES)

# The packed sparse-MLA format, as vLLM 0.33's writer stores it (docs/vllm.md).
FP8_DS_MLA = "fp8_ds_mla"
DS_MLA_GROUP = 128  # latent values sharing one scale
DS_MLA_FP8 = torch.float8_e4m3fn  # the latent's element type (max 448)
DS_MLA_MIN_SCALE = 1e-4  # vLLM floors amax / 448 here before rounding the scale up to a power of two


def ds_mla_row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one fp8_ds_mla cache row: the fp8 latent, a float32 scale per group, the bf16 RoPE part."""
    return kv_lora_rank + 4 * (kv_lora_rank // DS_MLA_GROUP) + 2 * rope_dim


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


@functools.lru_cache(maxsize=None)
def platform_fp8_e4m3(device: torch.device) -> torch.dtype:
    """The e4m3 flavour vLLM means by "fp8" on ``device``.

    MI300-class GPUs (gfx942) use the "fnuz" encoding (bias 8, max 240);
    everything else, MI350 (gfx950) and NVIDIA included, uses e4m3fn (max 448).
    Cached per device: the property query is not free and never changes.
    """
    if device.type == "cuda" and torch.version.hip is not None:
        arch = torch.cuda.get_device_properties(device).gcnArchName
        if arch.startswith("gfx94"):
            return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def cache_store_dtype(kv_cache: torch.Tensor, kv_cache_dtype: str) -> torch.dtype:
    """The element format written into ``kv_cache``, checked against ``kv_cache_dtype``.

    Raises ValueError/TypeError naming the argument when the string and the
    tensor disagree (an fp8 string with a bf16 cache, "auto" with uint8
    storage whose format nobody named, e5m2 named for an e4m3 tensor, ...).
    For ``fp8_ds_mla`` it is the latent's fp8 type (validation.py checks the rest of the row).
    """
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"kv_cache_dtype must be a str, got {type(kv_cache_dtype).__name__}")
    name = kv_cache_dtype.lower()
    dtype = kv_cache.dtype
    if name == FP8_DS_MLA:
        if dtype != torch.uint8:
            raise TypeError(f"kv_cache must be uint8 storage for kv_cache_dtype={kv_cache_dtype!r} (its rows pack "
                            f"fp8 values, float32 scales and bf16 values), got {dtype}")  # fmt: skip
        return DS_MLA_FP8
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported; expected one of {(*KV_CACHE_DTYPES, FP8_DS_MLA)} "
            "(nvfp4_ds_mla and other packed layouts are not handled by this op)"
        )
    if dtype == torch.uint8:
        if name in _E4M3_NAMES:
            return platform_fp8_e4m3(kv_cache.device)
        if name == "fp8_e5m2":
            return torch.float8_e5m2
        raise ValueError(
            f"kv_cache is uint8 storage, so kv_cache_dtype must name its fp8 format "
            f"('fp8', 'fp8_e4m3' or 'fp8_e5m2'), got {kv_cache_dtype!r}"
        )
    if dtype not in ACTIVATION_DTYPES and dtype not in FP8_DTYPES:
        raise TypeError(
            f"kv_cache dtype {dtype} is not supported; expected bfloat16, float16, float32, "
            "an fp8 dtype, or uint8 storage of fp8"
        )
    if name == "auto":
        return dtype
    if name in _FLOAT_NAMES:
        if _FLOAT_NAMES[name] != dtype:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} does not match kv_cache dtype {dtype}")
        return dtype
    expected = (torch.float8_e4m3fn, torch.float8_e4m3fnuz) if name in _E4M3_NAMES else (torch.float8_e5m2,)
    if dtype not in expected:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} does not match kv_cache dtype {dtype}")
    return dtype


def float_dtype_of_name(kv_cache_dtype: str) -> torch.dtype | None:
    """The float dtype a non-fp8 ``kv_cache_dtype`` name denotes (None for "auto" and fp8 names)."""
    return _FLOAT_NAMES.get(kv_cache_dtype.lower())


def typed_view(t: torch.Tensor, store_dtype: torch.dtype) -> torch.Tensor:
    """``t`` viewed as ``store_dtype`` (uint8 fp8 storage becomes a typed fp8 view)."""
    return t if t.dtype == store_dtype else t.view(store_dtype)


def saturate_to_fp8(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``saturate(x / scale)`` rounded to ``dtype``: finite values never become inf or NaN."""
    if scale is not None:
        x = x / scale.to(x.dtype)
    fmax = torch.finfo(dtype).max
    return x.clamp(-fmax, fmax).to(dtype)


def round_for_store(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """float32 ``x`` as stored in a ``dtype`` output: a plain cast, or for fp8 ``saturate(x / scale)``."""
    return saturate_to_fp8(x, scale, dtype) if is_fp8(dtype) else x.to(dtype)
