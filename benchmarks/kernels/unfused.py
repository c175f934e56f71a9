"""The unfused chain vLLM runs without the fusion, as separate Triton kernels.

What vLLM 0.33 runs per MLA layer when nothing is fused (docs/performance-history.md, "What is measured"):

1. ``rotary_embedding``: RoPE on ``q_pe`` ``[T, H, R]`` and ``k_pe`` ``[T, R]``
   in place (one launch; vLLM's CUDA kernel takes one token per block);
2. ``concat_and_cache_mla``: the cache row ``[kv_c | k_pe]`` (fp8: quantized)
   stored at each non-negative slot (one launch);
3. decode only: the query ``[ql_nope | q_pe]`` per head, ``torch.cat`` or
   ``concat_mla_q`` for a bf16 query, ``_DecodeConcatQuantFP8`` (concat +
   static fp8 quant) for an fp8 query (one launch).

These are written as reasonable Triton kernels, not straw men: contiguous row
loads (the GPT-J pairs are split in registers), float32 math rounded once,
int64 offsets, several rows per program when the batch is large enough to
fill the GPU, fp8 stores saturated like vLLM's ``scaled_convert``. They use
no shared memory tricks and no persistent grids; neither do vLLM's kernels.

Each host function launches exactly one kernel and allocates nothing, so the
chain can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _rows_per_program(rows: int, device: torch.device, cap: int) -> int:
    """Power of two <= cap, shrunk until the grid gives every SM about two programs."""
    per = cap
    while per > 1 and triton.cdiv(rows, per) < 2 * _num_sms(device):
        per //= 2
    return per


def _fp8_meta(t: torch.Tensor, scale: torch.Tensor | None) -> tuple[bool, float, torch.Tensor | None]:
    is_fp8 = t.dtype in FP8_TYPES
    return is_fp8, (float(torch.finfo(t.dtype).max) if is_fp8 else 0.0), scale if is_fp8 else None


@triton.jit
def _quantize(x, scale_ptr, IS_FP8: tl.constexpr, HAS_SCALE: tl.constexpr, FP8_MAX: tl.constexpr):
    """float32 ``x`` -> value to store: fp8 is ``saturate(x / scale)``, anything else a plain cast later."""
    if IS_FP8:
        if HAS_SCALE:
            x = x / tl.load(scale_ptr)
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    return x


# ---------------------------------------------------------------------------
# 1. RoPE in place on q_pe and k_pe (vLLM ``rotary_embedding``).


@triton.jit
def _rotate_rows(ptr, row_off, stride_r, cos, sin, mask, IS_NEOX: tl.constexpr, R: tl.constexpr,
                 BLOCK_R2: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """Rotate rows ``[ROWS, R]`` at ``ptr + row_off`` in place (float32 math, one rounding)."""
    i = tl.arange(0, BLOCK_R2)
    if IS_NEOX:
        m = mask[:, None] & (i < R // 2)[None, :]
        p1 = ptr + row_off[:, None] + i[None, :] * stride_r
        p2 = ptr + row_off[:, None] + (i[None, :] + R // 2) * stride_r
        x1 = tl.load(p1, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(p2, mask=m, other=0.0).to(tl.float32)
        tl.store(p1, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=m)
        tl.store(p2, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=m)
    else:
        # One contiguous load per row; the interleaved pairs (x[2i], x[2i+1]) are split in registers.
        r = tl.arange(0, 2 * BLOCK_R2)
        m = mask[:, None] & (r < R)[None, :]
        p = ptr + row_off[:, None] + r[None, :] * stride_r
        x = tl.load(p, mask=m, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, [ROWS, BLOCK_R2, 2]))
        y = tl.reshape(tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin), [ROWS, 2 * BLOCK_R2])
        tl.store(p, y.to(ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["num_tokens", "num_heads"])
def _rope_inplace_kernel(
    pos_ptr,  # [>=T] int32/int64
    q_ptr,  # [T, H, R], rotated in place
    k_ptr,  # [T, R], rotated in place
    cos_sin_ptr,  # [max_pos, R], row = [cos | sin]
    num_tokens,
    num_heads,
    max_pos,
    stride_q_t, stride_q_h, stride_q_r,
    stride_k_t, stride_k_r,
    stride_cs_p, stride_cs_r,
    R: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program
    BLOCK_R2: tl.constexpr,  # next_power_of_2(R // 2)
):  # fmt: skip
    # Grid (T, cdiv(H, BLOCK_H)): a program rotates BLOCK_H heads of one token
    # (vLLM: one block per token looping over heads); head block 0 also rotates k_pe.
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)
    i = tl.arange(0, BLOCK_R2)
    i_mask = i < R // 2
    cs = cos_sin_ptr + pos * stride_cs_p
    cos = tl.load(cs + i * stride_cs_r, mask=i_mask, other=1.0).to(tl.float32)[None, :]
    sin = tl.load(cs + (i + R // 2) * stride_cs_r, mask=i_mask, other=0.0).to(tl.float32)[None, :]

    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    _rotate_rows(q_ptr, t * stride_q_t + h.to(tl.int64) * stride_q_h, stride_q_r, cos, sin, h < num_heads,
                 IS_NEOX, R, BLOCK_R2, BLOCK_H)  # fmt: skip
    if hb == 0:
        row = tl.arange(0, 1).to(tl.int64)  # a one-row tile: k_pe has a single head
        _rotate_rows(k_ptr, t * stride_k_t + row, stride_k_r, cos, sin, row == 0,
                     IS_NEOX, R, BLOCK_R2, 1)  # fmt: skip


def rope_inplace(positions, q_pe, k_pe, cos_sin_cache, is_neox: bool) -> None:
    """RoPE ``q_pe`` [T, H, R] and ``k_pe`` [T, R] (or [T, 1, R]) in place: one launch."""
    T, H, R = q_pe.shape
    k2 = k_pe.select(1, 0) if k_pe.dim() == 3 else k_pe
    block_h = min(triton.next_power_of_2(H), 32)
    grid = (T, triton.cdiv(H, block_h))
    _rope_inplace_kernel[grid](
        positions, q_pe, k2, cos_sin_cache, T, H, cos_sin_cache.shape[0],
        *q_pe.stride(), *k2.stride(), *cos_sin_cache.stride(),
        R=R, IS_NEOX=is_neox, BLOCK_H=block_h, BLOCK_R2=triton.next_power_of_2(R // 2), num_warps=4,
    )  # fmt: skip


# ---------------------------------------------------------------------------
# 2. Cache write (vLLM ``concat_and_cache_mla``).


@triton.jit(do_not_specialize=["num_tokens", "block_size"])
def _concat_and_cache_kernel(
    kv_c_ptr,  # [T, L]
    k_pe_ptr,  # [T, R] (already rotated)
    slot_ptr,  # [>=T] int32/int64; < 0 = padding
    cache_ptr,  # [num_blocks, block_size, L + R] (typed fp8 view for fp8 caches)
    scale_ptr,  # [1] float32
    num_tokens,
    block_size,
    stride_c_t, stride_c_l,
    stride_k_t, stride_k_r,
    stride_kv_b, stride_kv_s, stride_kv_d,
    L: tl.constexpr,
    R: tl.constexpr,
    IS_FP8: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=t_mask, other=-1).to(tl.int64)
    write = t_mask & (slot >= 0)
    slot = tl.maximum(slot, 0)
    row = (slot // block_size) * stride_kv_b + (slot % block_size) * stride_kv_s
    out_ty = cache_ptr.dtype.element_ty

    col = tl.arange(0, BLOCK_L)
    m = write[:, None] & (col < L)[None, :]
    c = tl.load(kv_c_ptr + t[:, None] * stride_c_t + col[None, :] * stride_c_l, mask=m, other=0.0)
    c = _quantize(c.to(tl.float32), scale_ptr, IS_FP8, HAS_SCALE, FP8_MAX)
    tl.store(cache_ptr + row[:, None] + col[None, :] * stride_kv_d, c.to(out_ty), mask=m)

    r = tl.arange(0, BLOCK_R)
    m = write[:, None] & (r < R)[None, :]
    k = tl.load(k_pe_ptr + t[:, None] * stride_k_t + r[None, :] * stride_k_r, mask=m, other=0.0)
    k = _quantize(k.to(tl.float32), scale_ptr, IS_FP8, HAS_SCALE, FP8_MAX)
    tl.store(cache_ptr + row[:, None] + (L + r[None, :]) * stride_kv_d, k.to(out_ty), mask=m)


def concat_and_cache_mla(kv_c, k_pe, slot_mapping, kv_cache, kv_cache_scale=None) -> None:
    """Write ``[kv_c | k_pe]`` into ``kv_cache`` [NB, BS, L+R] at each slot >= 0: one launch.

    ``kv_cache`` must be typed (a float8 view for fp8 caches; vLLM's uint8
    storage is viewed by the caller, which is free).
    """
    kv2 = kv_c.select(1, 0) if kv_c.dim() == 3 else kv_c
    k2 = k_pe.select(1, 0) if k_pe.dim() == 3 else k_pe
    T, L = kv2.shape
    R = k2.shape[-1]
    is_fp8, fp8_max, scale = _fp8_meta(kv_cache, kv_cache_scale)
    block_t = _rows_per_program(T, kv_cache.device, 8)
    _concat_and_cache_kernel[(triton.cdiv(T, block_t),)](
        kv2, k2, slot_mapping, kv_cache, scale if scale is not None else kv2,
        T, kv_cache.shape[1],
        *kv2.stride(), *k2.stride(), *kv_cache.stride(),
        L=L, R=R, IS_FP8=is_fp8, HAS_SCALE=scale is not None, FP8_MAX=fp8_max,
        BLOCK_T=block_t, BLOCK_L=triton.next_power_of_2(L), BLOCK_R=triton.next_power_of_2(R), num_warps=4,
    )  # fmt: skip


# ---------------------------------------------------------------------------
# 3. Decode-query assembly (vLLM ``concat_mla_q`` / ``_DecodeConcatQuantFP8``).


@triton.jit(do_not_specialize=["num_rows", "num_heads"])
def _concat_q_kernel(
    ql_nope_ptr,  # [T, H, L]
    q_pe_ptr,  # [T, H, R] (already rotated)
    q_out_ptr,  # [T, H, L + R]
    scale_ptr,  # [1] float32
    num_rows,  # T * H
    num_heads,
    stride_n_t, stride_n_h, stride_n_l,
    stride_p_t, stride_p_h, stride_p_r,
    stride_o_t, stride_o_h, stride_o_d,
    L: tl.constexpr,
    R: tl.constexpr,
    IS_FP8: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    r_mask = rows < num_rows
    t = rows // num_heads
    h = rows % num_heads
    out = t * stride_o_t + h * stride_o_h
    out_ty = q_out_ptr.dtype.element_ty

    col = tl.arange(0, BLOCK_L)
    m = r_mask[:, None] & (col < L)[None, :]
    x = tl.load(ql_nope_ptr + (t * stride_n_t + h * stride_n_h)[:, None] + col[None, :] * stride_n_l, mask=m, other=0.0)
    x = _quantize(x.to(tl.float32), scale_ptr, IS_FP8, HAS_SCALE, FP8_MAX)
    tl.store(q_out_ptr + out[:, None] + col[None, :] * stride_o_d, x.to(out_ty), mask=m)

    r = tl.arange(0, BLOCK_R)
    m = r_mask[:, None] & (r < R)[None, :]
    y = tl.load(q_pe_ptr + (t * stride_p_t + h * stride_p_h)[:, None] + r[None, :] * stride_p_r, mask=m, other=0.0)
    y = _quantize(y.to(tl.float32), scale_ptr, IS_FP8, HAS_SCALE, FP8_MAX)
    tl.store(q_out_ptr + out[:, None] + (L + r[None, :]) * stride_o_d, y.to(out_ty), mask=m)


def concat_mla_q(ql_nope, q_pe, q_out, q_scale=None) -> None:
    """``q_out[t, h] = [ql_nope[t, h] | q_pe[t, h]]`` (fp8 ``q_out``: ``saturate(x / q_scale)``): one launch."""
    T, H, L = ql_nope.shape
    R = q_pe.shape[-1]
    is_fp8, fp8_max, scale = _fp8_meta(q_out, q_scale)
    block_rows = _rows_per_program(T * H, q_out.device, 4)
    _concat_q_kernel[(triton.cdiv(T * H, block_rows),)](
        ql_nope, q_pe, q_out, scale if scale is not None else ql_nope, T * H, H,
        *ql_nope.stride(), *q_pe.stride(), *q_out.stride(),
        L=L, R=R, IS_FP8=is_fp8, HAS_SCALE=scale is not None, FP8_MAX=fp8_max,
        BLOCK_ROWS=block_rows, BLOCK_L=triton.next_power_of_2(L), BLOCK_R=triton.next_power_of_2(R), num_warps=4,
    )  # fmt: skip


# ---------------------------------------------------------------------------
# 4. Prefill key concat (vLLM ``_concat_k_nope_k_pe``: FlashInfer's ``concat_mla_k``).


@triton.jit(do_not_specialize=["num_rows", "num_heads"])
def _concat_k_kernel(
    k_nope_ptr,  # [T, H, P]
    k_pe_ptr,  # [T, R] (already rotated), broadcast over heads
    k_out_ptr,  # [T, H, P + R]
    num_rows,  # T * H
    num_heads,
    stride_n_t, stride_n_h, stride_n_p,
    stride_p_t, stride_p_r,
    stride_o_t, stride_o_h, stride_o_d,
    P: tl.constexpr,
    R: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    r_mask = rows < num_rows
    t = rows // num_heads
    h = rows % num_heads
    out = t * stride_o_t + h * stride_o_h
    col = tl.arange(0, BLOCK_P)
    m = r_mask[:, None] & (col < P)[None, :]
    x = tl.load(k_nope_ptr + (t * stride_n_t + h * stride_n_h)[:, None] + col[None, :] * stride_n_p, mask=m)
    tl.store(k_out_ptr + out[:, None] + col[None, :] * stride_o_d, x, mask=m)
    r = tl.arange(0, BLOCK_R)
    m = r_mask[:, None] & (r < R)[None, :]
    y = tl.load(k_pe_ptr + (t * stride_p_t)[:, None] + r[None, :] * stride_p_r, mask=m)
    tl.store(k_out_ptr + out[:, None] + (P + r[None, :]) * stride_o_d, y, mask=m)


def concat_mla_k(k_nope, k_pe, k_out) -> None:
    """``k_out[t, h] = [k_nope[t, h] | k_pe[t]]`` in one launch (same dtype throughout, like FlashInfer's)."""
    T, H, P = k_nope.shape
    k2 = k_pe.reshape(T, -1) if k_pe.dim() == 3 else k_pe
    R = k2.shape[-1]
    block_rows = _rows_per_program(T * H, k_out.device, 16)
    _concat_k_kernel[(triton.cdiv(T * H, block_rows),)](
        k_nope, k2, k_out, T * H, H, *k_nope.stride(), *k2.stride(), *k_out.stride(),
        P=P, R=R, BLOCK_ROWS=block_rows, BLOCK_P=triton.next_power_of_2(P), BLOCK_R=triton.next_power_of_2(R),
        num_warps=4,
    )  # fmt: skip


# ---------------------------------------------------------------------------
# The chains.


def prefill_chain(positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, kv_cache_scale=None):
    """Op 1 semantics, unfused: RoPE in place, then the cache write (2 launches)."""
    rope_inplace(positions, q_pe, k_pe, cos_sin_cache, is_neox)
    concat_and_cache_mla(kv_c, k_pe, slot_mapping, kv_cache, kv_cache_scale)


def decode_chain(positions, ql_nope, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, q_out,
                 kv_cache_scale=None, q_scale=None):  # fmt: skip
    """Op 2 semantics, unfused: RoPE in place, cache write, query concat (+ quant) (3 launches).

    Unlike op 2, ``q_pe`` and ``k_pe`` end up rotated in place (vLLM's chain does that).
    """
    rope_inplace(positions, q_pe, k_pe, cos_sin_cache, is_neox)
    concat_and_cache_mla(kv_c, k_pe, slot_mapping, kv_cache, kv_cache_scale)
    concat_mla_q(ql_nope, q_pe, q_out, q_scale)


def epilogue_chain(positions, q_pe, k_pe, kv_c, k_nope, cos_sin_cache, is_neox, slot_mapping, kv_cache, k_out,
                   kv_cache_scale=None, key_scratch=None):  # fmt: skip
    """Op 3 semantics as vLLM's DeepSeek prefill runs them: RoPE in place, cache write, key concat
    (3 launches); an fp8 key is concatenated in q's dtype into ``key_scratch``, then cast (a 4th)."""
    rope_inplace(positions, q_pe, k_pe, cos_sin_cache, is_neox)
    concat_and_cache_mla(kv_c, k_pe, slot_mapping, kv_cache, kv_cache_scale)
    if key_scratch is None:
        concat_mla_k(k_nope, k_pe, k_out)
    else:
        concat_mla_k(k_nope, k_pe, key_scratch)
        k_out.copy_(key_scratch)


LAUNCHES = {"prefill": 2, "decode": 3, "mixed": 3, "epilogue": 3}
