"""Plain-torch implementation: the definition of the ops' semantics.

Runs on any device torch runs on. It favours clarity over speed: the write
selects the non-padding tokens with a boolean mask, which synchronizes with a
GPU, so this backend is not meant for CUDA-graph capture (use ``triton``).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import fp8
from ..opcodes import OP_DECODE, OP_ROPE_CACHE
from ..validation import Problem


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """RoPE of ``x[..., R]`` (float32) with ``cos``/``sin`` ``[..., R/2]`` broadcast over heads."""
    half = x.shape[-1] // 2
    if is_neox:
        x1, x2 = x[..., :half], x[..., half:]
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(cos, sin)`` ``[T, R/2]`` of the first ``num_tokens`` positions."""
    # Out-of-range positions are clamped (documented behaviour), never read out of bounds.
    pos = positions[:num_tokens].long().clamp(0, cos_sin_cache.shape[0] - 1)
    cs = cos_sin_cache.index_select(0, pos).float()
    half = cs.shape[-1] // 2
    return cs[:, :half], cs[:, half:]


def _rotate_and_write_cache(
    p: Problem, positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, kv_cache_scale
) -> tuple[torch.Tensor, torch.Tensor]:
    """What both ops share: rotate q_pe and k_pe (float32, not stored) and write the cache rows."""
    cos, sin = cos_sin(positions, cos_sin_cache, p.num_tokens)
    q_rot = rotate(q_pe.float(), cos[:, None], sin[:, None], is_neox)
    k_rot = rotate(k_pe.reshape(p.num_tokens, p.rope_dim).float(), cos, sin, is_neox)
    slots = slot_mapping[: p.num_tokens].long()
    block_size = kv_cache.shape[1]
    # Padding (< 0) and slots past the cache's capacity write nothing.
    keep = (slots >= 0) & (slots < kv_cache.shape[0] * block_size)
    latent = kv_c.reshape(p.num_tokens, p.kv_lora_rank).float()[keep]
    slots = slots[keep]
    if p.cache_format == fp8.FP8_DS_MLA:
        kv_cache[slots // block_size, slots % block_size] = fp8_ds_mla_rows(latent, k_rot[keep])
    else:
        cache = fp8.typed_view(kv_cache, p.cache_dtype)
        rows = torch.cat((latent, k_rot[keep]), dim=-1)
        cache[slots // block_size, slots % block_size] = fp8.round_for_store(rows, p.cache_dtype, kv_cache_scale)
    return q_rot, k_rot


def fp8_ds_mla_scales(amax: torch.Tensor) -> torch.Tensor:
    """float32 scale of each group from its float32 ``amax``: ``2**ceil(log2(max(amax / 448, 1e-4)))``,
    as vLLM 0.33's writer computes it (docs/vllm.md). A power of two, so ``x / scale`` is exact."""
    s = (amax / torch.finfo(fp8.DS_MLA_FP8).max).clamp_min(fp8.DS_MLA_MIN_SCALE)
    # s = m * 2**e with 0.5 <= m < 1 (exact, unlike a float log2): the ceiling of log2(s) is e,
    # or e - 1 when s is a power of two (m == 0.5).
    m, e = torch.frexp(s)
    scale = torch.ldexp(torch.ones_like(s), e - (m == 0.5).to(e.dtype))
    return torch.where(s.isinf(), s, scale)  # an infinite amax: exp2f(inf) = inf, as vLLM's


def fp8_ds_mla_rows(latent: torch.Tensor, k_rot: torch.Tensor) -> torch.Tensor:
    """The fp8_ds_mla rows ``uint8 [n, L + 4 L/128 + 2 R]`` of float32 ``latent [n, L]`` and ``k_rot [n, R]``:
    ``latent / scale`` of each group of 128 as fp8 e4m3fn (saturated, nearest even), the groups' float32
    scales, ``k_rot`` rounded once to bf16; multi-byte values in the machine's (little-endian) order."""
    n, L = latent.shape
    groups = latent.view(n, L // fp8.DS_MLA_GROUP, fp8.DS_MLA_GROUP)
    # vLLM's reduction (fmaxf) skips NaN: a NaN leaves the rest of its group's values intact.
    amax = groups.abs().masked_fill(groups.isnan(), 0).amax(dim=-1)
    scales = fp8_ds_mla_scales(amax)
    values = fp8.saturate_to_fp8(groups, scales[..., None], fp8.DS_MLA_FP8)
    parts = (values.view(n, L), scales, k_rot.to(torch.bfloat16))
    return torch.cat([part.view(torch.uint8) for part in parts], dim=-1)


def rope_cache_write(
    p: Problem, positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, kv_cache_scale
) -> None:
    q_rot, k_rot = _rotate_and_write_cache(
        p, positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, kv_cache_scale
    )
    q_pe.copy_(q_rot.to(q_pe.dtype))
    k_pe.copy_(k_rot.to(k_pe.dtype).view(k_pe.shape))


def decode_rope_cache_write(p: Problem, positions, ql_nope, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping,
                            kv_cache, q_out, kv_cache_scale, q_scale, is_nope_first) -> None:  # fmt: skip
    q_rot, _ = _rotate_and_write_cache(
        p, positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, kv_cache_scale
    )
    parts = (ql_nope.float(), q_rot) if is_nope_first else (q_rot, ql_nope.float())
    q_out.copy_(fp8.round_for_store(torch.cat(parts, dim=-1), q_out.dtype, q_scale))


def prefill_rope_cache_write(p: Problem, positions, q_pe, k_pe, kv_c, k_nope, cos_sin_cache, is_neox, slot_mapping,
                             kv_cache, k_out, kv_cache_scale, key_start: int = 0) -> None:  # fmt: skip
    q_rot, k_rot = _rotate_and_write_cache(
        p, positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, kv_cache_scale
    )
    # The key's rope part comes from the float32 rotation, rounded once to k_out's type
    # (not through k_pe's dtype first); fp8 keys saturate, with no scale. Tokens before
    # key_start (a mixed batch's decode tokens) have no key row.
    key = torch.cat((k_nope.float(), k_rot[key_start:, None, :].expand(-1, p.num_heads, -1)), dim=-1)
    k_out.copy_(fp8.round_for_store(key, k_out.dtype, None))
    q_pe.copy_(q_rot.to(q_pe.dtype))
    k_pe.copy_(k_rot.to(k_pe.dtype).view(k_pe.shape))


def bind(p: Problem, op: int, is_neox: bool, is_nope_first: bool, *_layout):
    """The reference for one validated layout (binding.py): nothing to precompute but the op
    (the layout's tensors and ``early_index_loads`` change nothing here)."""

    def site(T, positions, q_pe, k_pe, kv_c, cos_sin_cache, slot_mapping, kv_cache, kv_cache_scale, nope, out,
             out_scale, key_start=0) -> None:  # fmt: skip
        call = dataclasses.replace(p, num_tokens=T)
        if op == OP_ROPE_CACHE:
            rope_cache_write(call, positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache,
                             kv_cache_scale)  # fmt: skip
        elif op == OP_DECODE:
            decode_rope_cache_write(call, positions, nope, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping,
                                    kv_cache, out, kv_cache_scale, out_scale, is_nope_first)  # fmt: skip
        else:
            prefill_rope_cache_write(call, positions, q_pe, k_pe, kv_c, nope, cos_sin_cache, is_neox, slot_mapping,
                                     kv_cache, out, kv_cache_scale, key_start)  # fmt: skip

    return site
