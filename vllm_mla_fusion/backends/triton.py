"""Triton implementation: each op in one kernel launch.

Each op has its own entry point (``_mla_rope_cache_kernel_op1``, ``_op2``,
``_op3``), which takes only what that op reads and writes and runs the shared
body (``_mla_rope_cache``, with the ``OP`` constexpr) on it. The 1-D grid has
two kinds of program:

- *cache programs* (the first ``n_cache_programs``), each taking a tile of
  ``BLOCK_T`` tokens: load the position and slot, rotate ``k_pe`` (write it back in place
  for ops 1 and 3), and store ``[kv_c | rope(k_pe)]`` into the token's cache
  row unless the slot is padding or past the cache; op 3 also stores
  ``rope(k_pe)`` into the rope part of every head's key row ``k_out[t, h]``;
- *query programs*, each taking a tile of ``BLOCK_ROWS`` (token, head) rows: ops 1 and 3
  rotate ``q_pe`` in place; op 2 writes ``[ql_nope | rope(q_pe)]`` into
  ``q_out``; op 3 copies ``k_nope`` into the nope part of ``k_out``.

Op 3's key rows start at token ``key_start`` (0 unless the batch is mixed: its
decode tokens come first and need no key, only what op 1 does), so the key row
of token ``t`` is ``t - key_start``.

Splitting the two lets a decode step (few tokens, many heads) spread over many
programs, while every program keeps a tile of a few thousand elements so large
prefills stay bandwidth-bound. Everything is computed in float32 and rounded
once on store. Token, block and slot indices are widened to int64 before they
multiply a stride, so tensors past 2**31 elements are addressed correctly; the
cache's block size is a constexpr (``BLOCK_SIZE``), so a slot's block and row
within it are a shift and a mask (a multiply for other block sizes), not a
64-bit division by a runtime value.

With programmatic dependent launch (sm_90), a program first waits for the
kernel launched before it (``_wait_for_inputs``). Launches bound with
``EARLY_INDEX_LOADS`` (the caller's promise that no kernel still running when
ours starts writes the positions, slots or rope table: binding.py; the vLLM
plugin makes it, the public ops do not) load those first, wait, then load their
data, overlapping the previous kernel's tail as K3's ops do. Either way the data
a rotation takes is loaded before its rope-table rows, whose address waits for
the position.

Each kind of program is a loads helper and a stores helper: all of a tile's
loads are issued before any of its stores (latent and nope columns past the
first 512 excepted, loaded by the stores helper as they are stored). A program
that rotates its input in place (ops 1 and 3) waits at a CTA barrier between
the two, so that no warp stores into a small tile another warp has yet to load
(``_loads_before_in_place_stores``).

The entry points take 23 (op 1), 29 (op 2) and 29 (op 3) parameters: the
pointers, the sizes, the data tensors' strides as one tuple bound with the
layout (Triton's launchers take tuple arguments in the signature's nesting, the
direct launch below too) and the constexprs (sizes, rotation style, tiles, PDL, the
cache's block size, the early index loads, and one store format per store, the
cache and the output: ``_store_mode`` names it, e.g.
``"float8_e4m3fnuz/bits/scaled"``, and the kernel derives the rounding mode, the
scale and the fp8 format's constants from it through constexpr functions,
``_store_params``). Inside, each tensor travels with its strides (and the cache with
its slots, an fp8 output with its scale) as one named tuple, the sizes as one and the
constexprs as two (``dims``, ``meta``), so no helper takes more than 10 arguments;
Triton unpacks tuples while it compiles: they cost no instruction.

fp8 outputs store ``saturate(x / scale)``: the product with the reciprocal and one
residual step, or, in programs whose scale is a power of two (vLLM's default 1.0;
``_scale_is_pow2``, decided once per program), the bare product. The GPU converts with its native
instructions; Triton's interpreter (CPU) rounds fp8 wrongly, and NVIDIA GPUs
have no e4m3fnuz type, so there the kernel encodes the bits itself
(``_fp8_bits``), round-to-nearest-even like torch's conversion.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton import knobs as _triton_knobs
from triton.runtime import driver as _triton_driver

from .. import fp8
from ..validation import Problem

# fp8 encodings for _fp8_bits: (exponent bias, mantissa bits, has negative zero, NaN's bits).
_FP8_FORMATS = {
    torch.float8_e4m3fn: (7, 3, True, 0x7F),
    torch.float8_e4m3fnuz: (8, 3, False, 0x80),
    torch.float8_e5m2: (15, 2, True, 0x7F),
}

# Output modes: how a tile is rounded on store. Plain cast; fp8 by the GPU's saturating
# conversion (NVIDIA); fp8 by our own bit encoder; fp8 clamped, then converted (ROCm).
_PLAIN, _FP8_SATURATING, _FP8_BITS, _FP8_CLAMPED = 0, 1, 2, 3
_ROUNDINGS = {"saturating": _FP8_SATURATING, "bits": _FP8_BITS, "clamped": _FP8_CLAMPED}


@triton.constexpr_function
def _store_params(store: str) -> dict:
    """The rounding constants of a store format (``_store_mode``): "plain" (cast as is) or
    ``"<fp8 dtype>/<rounding>[/scaled[/pow2]]"``, rounding one of ``_ROUNDINGS``. MODE: how a tile
    is rounded; HAS_SCALE: whether it is divided by the scale first; POW2_SCALE: the scale is a
    power of two with a normal reciprocal (``_scale_is_pow2``, decided per program); the fp8 format's largest
    finite value FP8_MAX, exponent bias BIAS, mantissa bits MAN, whether it has a negative zero
    (SIGNED_ZERO) and its NaN's bits (NAN), which the bit encoder needs."""
    if store == "plain":
        return dict(MODE=_PLAIN, HAS_SCALE=False, POW2_SCALE=False, FP8_MAX=0.0, BIAS=0, MAN=0, SIGNED_ZERO=True,
                    NAN=0)  # fmt: skip
    name, rounding, *scaled = store.split("/")
    dtype = getattr(torch, name)
    bias, man, signed_zero, nan = _FP8_FORMATS[dtype]
    return dict(MODE=_ROUNDINGS[rounding], HAS_SCALE=scaled[:1] == ["scaled"], POW2_SCALE=scaled == ["scaled", "pow2"],
                FP8_MAX=float(torch.finfo(dtype).max), BIAS=bias, MAN=man, SIGNED_ZERO=signed_zero, NAN=nan)  # fmt: skip


@triton.constexpr_function
def _store_param(store, name):
    """One of ``_store_params(store)``, as a constexpr of the kernel."""
    return _store_params(store)[name]


@triton.constexpr_function
def _unscaled(store):
    """``store`` without its scale."""
    return store.split("/scaled")[0]


@triton.constexpr_function
def _pow2_scaled(store):
    """``store`` for a program whose scale ``_scale_is_pow2`` found a power of two (an unscaled
    store as it is: Triton 3.6 compiles both sides of a branch on ``_scale_is_pow2``'s constexpr
    False, and folds the branch only afterwards)."""
    return store + "/pow2" if store.endswith("/scaled") else store


@triton.constexpr_function
def _pow2_at_least(n):
    """The smallest power of two >= ``n`` (``n`` >= 1)."""
    return 1 << (n - 1).bit_length()


@triton.constexpr_function
def _row_step(n):
    """Columns a program moves per step along a row of ``n``: the power of two covering it, at
    most 512 (wider rows take several steps: latent or nope widths past 512)."""
    return min(1 << (max(n, 1) - 1).bit_length(), 512)


@triton.jit
def _fp8_bits(x, STORE: tl.constexpr):
    """Bit pattern of ``x`` (float32, already clamped to the format's finite range) in the fp8
    format of ``STORE`` (exponent bias ``BIAS``, ``MAN`` mantissa bits), rounded to nearest even."""
    BIAS: tl.constexpr = _store_param(STORE, "BIAS")
    MAN: tl.constexpr = _store_param(STORE, "MAN")
    SIGNED_ZERO: tl.constexpr = _store_param(STORE, "SIGNED_ZERO")
    NAN_BITS: tl.constexpr = _store_param(STORE, "NAN")
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    exp32 = a >> 23
    # Normal results: re-bias the float32 exponent, then round the mantissa by
    # adding half an ulp (minus one, plus the kept lsb: ties go to even); a carry
    # into the exponent is the correct rounding.
    shift: tl.constexpr = 23 - MAN
    v = a - ((127 - BIAS) << 23)
    normal = (v + ((1 << (shift - 1)) - 1) + ((v >> shift) & 1)) >> shift
    # Subnormal results: shift the full significand right and round to nearest even.
    sub_shift = tl.minimum(tl.maximum(shift + (1 - (exp32 - 127 + BIAS)), 1), 31)
    sig = (a & 0x7FFFFF) | 0x800000
    one = tl.full(sig.shape, 1, tl.int32)
    q = sig >> sub_shift
    rem = sig & ((one << sub_shift) - 1)
    half = one << (sub_shift - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(exp32 - 127 + BIAS >= 1, normal, q)
    code = tl.where(exp32 == 0, 0, code)  # float32 zero/subnormal: far below fp8's range
    if SIGNED_ZERO:
        code = code | (sign << 7)
    else:
        code = tl.where(code == 0, 0, code | (sign << 7))  # fnuz has no -0 (0x80 is NaN)
    code = tl.where(x != x, NAN_BITS, code)
    return code.to(tl.uint8)


@triton.jit
def _load_scale(scale_ptr, STORE: tl.constexpr):
    """(scale, 1/scale) of an fp8 output, loaded once per tile; (1, 1) without a scale."""
    if _store_param(STORE, "HAS_SCALE"):
        scale = tl.load(scale_ptr)
        inv = tl.fdiv(1.0, scale, ieee_rounding=True)  # correctly rounded on every target (libdevice-free)
        scale = tl.minimum(scale, 3.4028234663852886e38)  # x / inf = +-0: keeps the residual step finite
    else:
        scale = 1.0
        inv = 1.0
    return scale, inv


@triton.jit
def _scale_is_pow2(scale_ptr, STORE: tl.constexpr):
    """Whether the store's scale is a power of two whose reciprocal is a normal float32 too
    (vLLM's default scale, 1.0, is one): a scalar, the same for every program of a launch. False
    for a store without a scale (a constexpr: Triton 3.8 compiles the caller's branch once)."""
    if _store_param(STORE, "HAS_SCALE"):
        # 2**k: sign and mantissa bits zero, biased exponent k + 127 (negative here for a negative
        # scale); 2**k and 2**-k are both normal for biased exponents 1..253.
        bits = tl.load(scale_ptr).to(tl.int32, bitcast=True)
        biased = bits >> 23
        return ((bits & 0x7FFFFF) == 0) & (biased >= 1) & (biased <= 253)
    else:
        return False


@triton.jit
def _round_for_store(x, scale, inv_scale, out_ptr, STORE: tl.constexpr):
    """``x`` (float32) as the element type stored at ``out_ptr``, rounded as the store format
    ``STORE`` says (``_store_params``)."""
    MODE: tl.constexpr = _store_param(STORE, "MODE")
    HAS_SCALE: tl.constexpr = _store_param(STORE, "HAS_SCALE")
    POW2_SCALE: tl.constexpr = _store_param(STORE, "POW2_SCALE")
    FP8_MAX: tl.constexpr = _store_param(STORE, "FP8_MAX")
    if MODE == 0:
        y = x.to(out_ptr.dtype.element_ty)
    else:
        if POW2_SCALE:
            # The reciprocal of such a scale is exact, so the product rounds the same real number
            # as the division: x / scale, correctly rounded, in one multiply.
            x = x * inv_scale
        elif HAS_SCALE:
            # x / scale, correctly rounded, without a division per element (a full-precision
            # division is ~10 instructions and made the fp8 paths compute-bound): the product
            # with the reciprocal is within an ulp, and one residual step (exact through the
            # fma) rounds it correctly. The product is clamped first so that the step stays
            # finite (quotients past the fp8 range saturate below anyway; a NaN x still makes
            # a NaN residual), and the residual is taken as q * scale - x: for either zero and
            # a positive scale that is +0, and q + (+0) * -(1/scale) = q keeps the sign torch
            # keeps. -(1/scale) is a product with -1, not a negation: Triton negates as 0 - v,
            # which is +0, not -0, for v = +0, and turned -0 quotients into +0 on the GPU.
            q = tl.minimum(tl.maximum(x * inv_scale, -2 * FP8_MAX), 2 * FP8_MAX)
            r = tl.fma(q, scale, -x)
            x = tl.fma(r, inv_scale * -1.0, q)
        if MODE == 1:
            # NVIDIA converts with cvt.rn.satfinite: saturation and NaN handling come free.
            y = x.to(out_ptr.dtype.element_ty)
        else:
            # Saturate finite values and infinities; NaN stays NaN (min/max would drop it).
            x = tl.where(x != x, x, tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX))
            if MODE == 2:
                y = _fp8_bits(x, STORE)
            else:
                y = x.to(out_ptr.dtype.element_ty)
    return y


@triton.jit
def _load_cos_sin(rope, pos, max_pos, mask, R: tl.constexpr, BLOCK_R2: tl.constexpr):
    """The rope table's rows ``[cos | sin]`` (``rope``: the positions and the table, as the
    entry points pass them) at positions ``pos``, clamped into ``[0, max_pos)``, as ``(cos, sin)``
    ``[ROWS, BLOCK_R2]`` in float32 (1 and 0 where ``mask`` is off)."""
    cos_ptr, stride_cs_p, stride_cs = rope.table_ptr, rope.stride_pos, rope.stride_col
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)  # clamp: never read past the table
    cs_off = pos * stride_cs_p
    sin_ptr = cos_ptr + (R // 2) * stride_cs
    i = tl.arange(0, BLOCK_R2)
    m2 = mask[:, None] & (i < R // 2)[None, :]
    cos = tl.load(cos_ptr + cs_off[:, None] + i[None, :] * stride_cs, mask=m2, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + cs_off[:, None] + i[None, :] * stride_cs, mask=m2, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _load_halves(x_ptr, row_off, mask, IS_NEOX: tl.constexpr, R: tl.constexpr, BLOCK_R2: tl.constexpr, stride_x,
                 ROWS: tl.constexpr):  # fmt: skip
    """Rows of x ``[ROWS, R]`` at ``x_ptr + row_off`` as the halves a rotation pairs, ``(first, second)``
    ``[ROWS, BLOCK_R2]`` in float32: for GPT-J, the even and odd elements; for NeoX, the lower
    and upper halves."""
    i = tl.arange(0, BLOCK_R2)
    m2 = mask[:, None] & (i < R // 2)[None, :]
    if IS_NEOX:
        x1 = tl.load(x_ptr + row_off[:, None] + i[None, :] * stride_x, mask=m2, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + row_off[:, None] + (i[None, :] + R // 2) * stride_x, mask=m2, other=0.0)
        x2 = x2.to(tl.float32)
    else:
        # One contiguous load of the whole row (vectorizes), then split the
        # interleaved pairs (x[2i], x[2i+1]) in registers.
        r = tl.arange(0, 2 * BLOCK_R2)
        mr = mask[:, None] & (r < R)[None, :]
        x = tl.load(x_ptr + row_off[:, None] + r[None, :] * stride_x, mask=mr, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, [ROWS, BLOCK_R2, 2]))
    return x1, x2


@triton.jit
def _rotate(x1, x2, cos, sin):
    """The rotated halves (``_load_halves``'s, by ``_load_cos_sin``'s table rows), in float32."""
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _wait_for_inputs(USE_PDL: tl.constexpr):
    """With programmatic dependent launch (sm_90+), wait until the kernel launched before this one
    has finished and its writes are visible, then let the next kernel get scheduled. A program
    launched early overlaps the previous kernel's tail until here: no load before this call may
    read what that kernel writes."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _store_rotated(out_ptr, row_off, y1, y2, mask, IS_NEOX: tl.constexpr, R: tl.constexpr,
                   BLOCK_R2: tl.constexpr, stride_out, ROWS: tl.constexpr):  # fmt: skip
    """Store halves from _rotate (already rounded to the output type) as rows ``[ROWS, R]``."""
    if IS_NEOX:
        i = tl.arange(0, BLOCK_R2)
        m2 = mask[:, None] & (i < R // 2)[None, :]
        tl.store(out_ptr + row_off[:, None] + i[None, :] * stride_out, y1, mask=m2)
        tl.store(out_ptr + row_off[:, None] + (i[None, :] + R // 2) * stride_out, y2, mask=m2)
    else:
        r = tl.arange(0, 2 * BLOCK_R2)
        mr = mask[:, None] & (r < R)[None, :]
        y = tl.reshape(tl.join(y1, y2), [ROWS, 2 * BLOCK_R2])
        tl.store(out_ptr + row_off[:, None] + r[None, :] * stride_out, y, mask=mr)


# Which op a launch computes (the kernel's OP constexpr).
OP_ROPE_CACHE = tl.constexpr(1)  # op 1: q_pe, k_pe rotated in place, cache rows
OP_DECODE = tl.constexpr(2)  # op 2: q_out = [ql_nope | rope(q_pe)], cache rows; q_pe, k_pe untouched
OP_PREFILL = tl.constexpr(3)  # op 3: op 1 + the attention key k_out = [k_nope | rope(k_pe)]


_NO_STORE = tl.constexpr("plain")  # the store format of an output an op does not have


# The token count changes every step: specializing on it (==1, %16) would only add compilations;
# num_slots too: a bound checked once per token, and scratch caches used to compile ahead must
# not select another specialization than the real cache; key_start (op 3's decode rows in a mixed
# step) changes every step as well. The index tensors' alignment neither:
# a mixed step's prefill rows start at row num_decode of vLLM's positions and slot mapping, 8
# bytes off a 16-byte boundary when that is odd, and the variants compiled ahead (prewarm.py)
# must serve them; the kernel reads one index per token or row, so no vector load is lost.
#
# Each entry point takes its data tensors' strides as one tuple, in the order of its pointers
# (cos/sin 2, q_pe 3, k_pe 2, kv_c 2, the cache 3, then ops 2 and 3's nope input 3 and output 3),
# bound with the layout (BoundLaunch.strides): a launch builds no tuple of its own. It comes after
# the sizes: placed before them, ptxas (Triton 3.6) gave some variants 2 more registers for the same PTX.
#
# Inside the kernel each tensor travels as one named tuple with what indexes it (Triton unpacks
# tuples while it compiles: they cost no instruction); the sizes as one, the constexprs as two.
class _Rope(NamedTuple):
    """The positions and the rope table they index (rows ``[cos | sin]``)."""

    pos_ptr: object
    table_ptr: object
    stride_pos: object
    stride_col: object


class _TokenRows(NamedTuple):
    """A ``[T, width]`` input: k_pe, kv_c."""

    ptr: object
    stride_t: object
    stride_col: object


class _HeadRows(NamedTuple):
    """A ``[T, H, width]`` input: q_pe, the nope input (ql_nope or k_nope)."""

    ptr: object
    stride_t: object
    stride_h: object
    stride_col: object


class _Output(NamedTuple):
    """The ``[T, H, width]`` output of ops 2 and 3 (q_out, k_out), with its fp8 scale."""

    ptr: object
    scale_ptr: object
    stride_t: object
    stride_h: object
    stride_col: object


class _Cache(NamedTuple):
    """The KV cache, the slots that index it, its fp8 scale, and its block size: a constexpr, so that
    a slot's block and row are a shift and a mask, not a 64-bit division by a runtime value."""

    slot_ptr: object
    ptr: object
    scale_ptr: object
    stride_block: object
    stride_slot: object
    stride_col: object
    BLOCK_SIZE: object


class _Sizes(NamedTuple):
    num_tokens: object
    max_pos: object  # rows of the rope table
    num_slots: object  # num_blocks * BLOCK_SIZE: slots at or past it write nothing
    key_start: object  # op 3: first token with a key row (k_nope / k_out row t - key_start); else 0
    n_cache_programs: object  # the grid's first programs; the query programs follow


class _Dims(NamedTuple):
    """Constexprs: heads, latent width, rope width, and the nope input's width (L for op 2, P for op 3)."""

    H: object
    L: object
    R: object
    NOPE: object


class _Meta(NamedTuple):
    """Constexprs: what a launch computes and how (the _mla_rope_cache docstring says what each is)."""

    OP: object
    IS_NEOX: object
    NOPE_FIRST: object
    CACHE_STORE: object
    OUT_STORE: object
    BLOCK_T: object
    BLOCK_ROWS: object
    BLOCK_H: object
    USE_PDL: object
    EARLY_INDEX_LOADS: object


@triton.jit
def _op1_tensors(pos_ptr, slot_ptr, cos_sin_ptr, q_pe_ptr, k_pe_ptr, kv_c_ptr, cache_ptr, cache_scale_ptr, strides,
                 BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """The tensors every op reads and writes (op 1's), each with its strides (``strides``' first 12)."""
    return (_Rope(pos_ptr, cos_sin_ptr, strides[0], strides[1]),
            _HeadRows(q_pe_ptr, strides[2], strides[3], strides[4]),
            _TokenRows(k_pe_ptr, strides[5], strides[6]),
            _TokenRows(kv_c_ptr, strides[7], strides[8]),
            _Cache(slot_ptr, cache_ptr, cache_scale_ptr, strides[9], strides[10], strides[11], BLOCK_SIZE))


@triton.jit(do_not_specialize=["num_tokens", "n_cache_programs", "num_slots"],
            do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])  # fmt: skip
def _mla_rope_cache_kernel_op1(
    pos_ptr, slot_ptr,  # [>=T] int32/int64
    cos_sin_ptr,  # [max_pos, R], row = [cos | sin]
    q_pe_ptr,  # [T, H, R], rotated in place
    k_pe_ptr,  # [T, R], rotated in place
    kv_c_ptr,  # [T, L]
    cache_ptr,  # [num_blocks, BLOCK_SIZE, L + R]
    cache_scale_ptr,  # [1] float32
    num_tokens, max_pos, num_slots, n_cache_programs,
    strides,  # (12,): cos/sin, q_pe, k_pe, kv_c, cache
    H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, IS_NEOX: tl.constexpr, CACHE_STORE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_ROWS: tl.constexpr, USE_PDL: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, EARLY_INDEX_LOADS: tl.constexpr,
):  # fmt: skip
    """Op 1: q_pe and k_pe rotated in place, [kv_c | rope(k_pe)] written to the cache."""
    rope, q_pe, k_pe, kv_c, cache = _op1_tensors(pos_ptr, slot_ptr, cos_sin_ptr, q_pe_ptr, k_pe_ptr, kv_c_ptr, cache_ptr,
                                                 cache_scale_ptr, strides, BLOCK_SIZE)
    _mla_rope_cache(
        rope, q_pe, k_pe, kv_c, cache,
        _HeadRows(q_pe_ptr, 0, 0, 0),  # no nope input
        _Output(q_pe_ptr, cache_scale_ptr, 0, 0, 0),  # no output: neither is read
        _Sizes(num_tokens, max_pos, num_slots, 0, n_cache_programs),
        _Dims(H, L, R, 1),
        _Meta(OP_ROPE_CACHE, IS_NEOX, True, CACHE_STORE, _NO_STORE, BLOCK_T, BLOCK_ROWS, 1, USE_PDL,
               EARLY_INDEX_LOADS),
    )


@triton.jit(do_not_specialize=["num_tokens", "n_cache_programs", "num_slots", "key_start"],
            do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])  # fmt: skip
def _mla_rope_cache_kernel_op2(
    pos_ptr, slot_ptr, cos_sin_ptr, q_pe_ptr, k_pe_ptr, kv_c_ptr, cache_ptr, cache_scale_ptr,  # as op 1's;
    # q_pe and k_pe untouched
    ql_nope_ptr,  # [T, H, L]
    q_out_ptr,  # [T, H, L + R]
    q_scale_ptr,  # [1] float32
    num_tokens, max_pos, num_slots, n_cache_programs,
    key_start,  # 0: every token has an output row. Passed at run time, not as the constant: with the
    # constant, ptxas gave some variants up to 8 more registers (sm_90: 32 -> 40) for 3 fewer instructions
    strides,  # (18,): op 1's, ql_nope, q_out
    H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, IS_NEOX: tl.constexpr,
    NOPE_FIRST: tl.constexpr,  # q_out = [nope | rope] (else [rope | nope])
    CACHE_STORE: tl.constexpr, OUT_STORE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr, BLOCK_SIZE: tl.constexpr, EARLY_INDEX_LOADS: tl.constexpr,
):  # fmt: skip
    """Op 2: q_out = [ql_nope | rope(q_pe)] (rounded as OUT_STORE says), the cache rows as op 1's."""
    rope, q_pe, k_pe, kv_c, cache = _op1_tensors(pos_ptr, slot_ptr, cos_sin_ptr, q_pe_ptr, k_pe_ptr, kv_c_ptr, cache_ptr,
                                                 cache_scale_ptr, strides, BLOCK_SIZE)
    _mla_rope_cache(
        rope, q_pe, k_pe, kv_c, cache,
        _HeadRows(ql_nope_ptr, strides[12], strides[13], strides[14]),
        _Output(q_out_ptr, q_scale_ptr, strides[15], strides[16], strides[17]),
        _Sizes(num_tokens, max_pos, num_slots, key_start, n_cache_programs),
        _Dims(H, L, R, L),
        _Meta(OP_DECODE, IS_NEOX, NOPE_FIRST, CACHE_STORE, OUT_STORE, BLOCK_T, BLOCK_ROWS, 1, USE_PDL,
               EARLY_INDEX_LOADS),
    )


@triton.jit(do_not_specialize=["num_tokens", "n_cache_programs", "num_slots", "key_start"],
            do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])  # fmt: skip
def _mla_rope_cache_kernel_op3(
    pos_ptr, slot_ptr, cos_sin_ptr, q_pe_ptr, k_pe_ptr, kv_c_ptr, cache_ptr, cache_scale_ptr,  # as op 1's
    k_nope_ptr,  # [T - key_start, H, NOPE]
    k_out_ptr,  # [T - key_start, H, NOPE + R]
    num_tokens, max_pos, num_slots, n_cache_programs,
    key_start,  # first token with a key row (k_nope / k_out row t - key_start)
    strides,  # (18,): op 1's, k_nope, k_out
    H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, NOPE: tl.constexpr, IS_NEOX: tl.constexpr,
    CACHE_STORE: tl.constexpr, OUT_STORE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per k_out store in a cache program
    USE_PDL: tl.constexpr, BLOCK_SIZE: tl.constexpr, EARLY_INDEX_LOADS: tl.constexpr,
):  # fmt: skip
    """Op 3: op 1's work, and the attention key k_out = [k_nope | rope(k_pe)] of tokens from key_start on."""
    rope, q_pe, k_pe, kv_c, cache = _op1_tensors(pos_ptr, slot_ptr, cos_sin_ptr, q_pe_ptr, k_pe_ptr, kv_c_ptr, cache_ptr,
                                                 cache_scale_ptr, strides, BLOCK_SIZE)
    _mla_rope_cache(
        rope, q_pe, k_pe, kv_c, cache,
        _HeadRows(k_nope_ptr, strides[12], strides[13], strides[14]),
        _Output(k_out_ptr, cache_scale_ptr, strides[15], strides[16], strides[17]),  # the key has no scale: never read
        _Sizes(num_tokens, max_pos, num_slots, key_start, n_cache_programs),
        _Dims(H, L, R, NOPE),
        _Meta(OP_PREFILL, IS_NEOX, True, CACHE_STORE, OUT_STORE, BLOCK_T, BLOCK_ROWS, BLOCK_H, USE_PDL,
               EARLY_INDEX_LOADS),
    )


@triton.jit
def _mla_rope_cache(rope, q_pe, k_pe, kv_c, cache, nope, out, sizes, dims, meta):
    """The three ops' body (its arguments: the named tuples above the entry points): each entry
    point passes its op, its tensors, and stand-ins that its op never reads for the rest (op 1:
    no nope input or output; ops 1 and 2: ``key_start`` 0). The cache programs come first in the
    grid, ``n_cache_programs`` of them; the query programs follow.

    ``meta``: OP (OP_ROPE_CACHE, OP_DECODE or OP_PREFILL); IS_NEOX; NOPE_FIRST (op 2: q_out =
    [nope | rope], else [rope | nope]); CACHE_STORE and OUT_STORE, the store formats of the cache
    and the output (_store_params: rounding, fp8 format, scale; op 1's output is "plain"); BLOCK_T,
    tokens per cache tile; BLOCK_ROWS, (token, head) rows per query tile; BLOCK_H, heads per
    k_out store in a cache tile (op 3); USE_PDL, launched with programmatic dependent launch
    (sm_90+); EARLY_INDEX_LOADS, with USE_PDL: positions, slots and cos/sin read before the wait
    (BoundLaunch)."""
    CACHE_STORE: tl.constexpr = meta.CACHE_STORE
    OUT_STORE: tl.constexpr = meta.OUT_STORE
    USE_PDL: tl.constexpr = meta.USE_PDL
    EARLY_INDEX_LOADS: tl.constexpr = meta.EARLY_INDEX_LOADS
    n_cache_programs = sizes.n_cache_programs
    if not EARLY_INDEX_LOADS:
        # Launched early, overlapping the previous kernel's tail: wait for its writes
        # (our inputs) before touching memory, then let the next kernel get scheduled.
        _wait_for_inputs(USE_PDL)
    pid = tl.program_id(0)
    # Each kind of program lives in its own function so that their locals (tiles of
    # different shapes) never meet in one scope. A scaled fp8 store whose scale is a power of
    # two (vLLM's default, 1.0) runs a program specialized to it (one multiply per element,
    # _round_for_store): the branch holds the whole program, so no tile crosses it. With
    # EARLY_INDEX_LOADS the scale's bits are read before the wait too (binding.py's promise).
    if pid < n_cache_programs:
        if _scale_is_pow2(cache.scale_ptr, CACHE_STORE):
            _cache_program(pid, rope, k_pe, kv_c, cache, out, sizes, dims, meta, True)
        else:
            _cache_program(pid, rope, k_pe, kv_c, cache, out, sizes, dims, meta, False)
    else:
        if _scale_is_pow2(out.scale_ptr, OUT_STORE):
            _query_program(pid - n_cache_programs, rope, q_pe, nope, out, sizes, dims, meta, True)
        else:
            _query_program(pid - n_cache_programs, rope, q_pe, nope, out, sizes, dims, meta, False)


@triton.jit
def _loads_before_in_place_stores(OP: tl.constexpr):
    """Where a program rotates its input in place (ops 1 and 3: k_pe in the cache programs, q_pe in
    the query programs), a CTA barrier between the tile's loads and its stores: no warp stores
    before every warp has loaded.

    A small tile is held whole by several warps at once (one or two tokens of k_pe, two rows of
    q_pe, on 4 warps), and a store is made by one warp holding the element, not by every warp
    that loaded it. Without the barrier a warp running behind can load an element that another
    warp has already rotated in place, and store what it derives from it: op 3's key rows, which
    every warp stores for its heads from its own copy of the k_pe tile, came out rotated twice on
    an H100 (docs/performance-history.md, optimisation log, row 34). Op 1's stores happened to be
    safe without it (the same layout as their loads, or a layout conversion whose shared-memory
    round trip synchronizes the warps), but only as long as the compiler keeps choosing such
    layouts; with the barrier it holds whatever layouts the compiler picks (the sm_90 compile check
    asserts every load of the in-place tensor before it and every store after it, in Triton's GPU
    IR too). Op 2 writes only tensors it does not read."""
    if OP != OP_DECODE:
        tl.debug_barrier()


@triton.jit
def _cache_program(pid, rope, k_pe, kv_c, cache, key, sizes, dims, meta, POW2_SCALE: tl.constexpr):
    """A tile of BLOCK_T tokens (tile ``pid``): rotate k_pe (in place for ops 1
    and 3), write [kv_c | rope(k_pe)] at each slot in [0, num_slots); op 3 also writes rope(k_pe)
    into the key row (``key``: k_out) of every head (tokens from key_start on). ``POW2_SCALE``: the
    cache's scale is a power of two (_scale_is_pow2), which its store format then says (_pow2_scaled).

    A slot past the cache (a scheduler or connector bug, a stale mapping under graph
    padding) costs its row, never a write into whatever memory follows the cache.
    This program is the only one that reads or writes k_pe, which is what makes the
    in-place rotation safe while op 3's key rows need the un-rotated value. Within the program,
    ops 1 and 3 wait for all their warps' loads before any store (_loads_before_in_place_stores).

    A tile's loads are issued before any of its stores (_cache_tile_loads, then
    _cache_tile_stores; latent columns past the first 512 excepted, loaded as they are stored):
    the compiler may not move a load above a store that could alias it, and on small batches each
    serialized round trip to memory is a visible part of the kernel's time. (A program does not
    take a second tile whose loads would overlap these stores: that doubles the registers, halves
    the programs in flight, and measured slower at every shape tried: docs/performance-history.md,
    optimisation log, row 28.)
    """
    tile = _cache_tile_loads(pid, rope, k_pe, kv_c, cache, sizes, dims, meta, POW2_SCALE)
    _loads_before_in_place_stores(meta.OP)
    _cache_tile_stores(tile, k_pe, kv_c, cache, key, sizes, dims, meta, POW2_SCALE)


@triton.jit
def _cache_tile_loads(index, rope, k_pe, kv_c, cache, sizes, dims, meta, POW2_SCALE: tl.constexpr):
    """Cache tile ``index``'s loads, returned as the tile ``_cache_tile_stores`` takes.

    The loads that do not depend on the position (kv_c, k_pe) go out before the rope table's,
    which waits for the position to arrive; with ``EARLY_INDEX_LOADS`` the positions, slots and
    table rows are read first, before the grid-dependency wait, overlapping the previous kernel's
    tail (BoundLaunch says when)."""
    L: tl.constexpr = dims.L
    R: tl.constexpr = dims.R
    IS_NEOX: tl.constexpr = meta.IS_NEOX
    CACHE_STORE: tl.constexpr = _pow2_scaled(meta.CACHE_STORE) if POW2_SCALE else meta.CACHE_STORE
    BLOCK_T: tl.constexpr = meta.BLOCK_T
    USE_PDL: tl.constexpr = meta.USE_PDL
    EARLY_INDEX_LOADS: tl.constexpr = meta.EARLY_INDEX_LOADS
    BLOCK_R2: tl.constexpr = _pow2_at_least(R // 2)  # the rotation's half-width, padded for tl.arange
    BLOCK_L: tl.constexpr = _row_step(L)  # latent columns per step
    num_tokens, max_pos = sizes.num_tokens, sizes.max_pos
    k_pe_ptr, stride_k_t, stride_k_r = k_pe.ptr, k_pe.stride_t, k_pe.stride_col
    kv_c_ptr, stride_c_t, stride_c_l = kv_c.ptr, kv_c.stride_t, kv_c.stride_col
    slot_ptr, cache_scale_ptr = cache.slot_ptr, cache.scale_ptr

    t = index.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < num_tokens
    pos = tl.load(rope.pos_ptr + t, mask=t_mask, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + t, mask=t_mask, other=-1).to(tl.int64)
    if EARLY_INDEX_LOADS:
        cos, sin = _load_cos_sin(rope, pos, max_pos, t_mask, R, BLOCK_R2)
        _wait_for_inputs(USE_PDL)
    col = tl.arange(0, BLOCK_L)
    c_mask = t_mask[:, None] & (col < L)[None, :]
    c = tl.load(kv_c_ptr + t[:, None] * stride_c_t + col[None, :] * stride_c_l, mask=c_mask, other=0.0)
    scale, inv_scale = _load_scale(cache_scale_ptr, CACHE_STORE)
    k_off = t * stride_k_t
    k1, k2 = _load_halves(k_pe_ptr, k_off, t_mask, IS_NEOX, R, BLOCK_R2, stride_k_r, BLOCK_T)
    if not EARLY_INDEX_LOADS:
        cos, sin = _load_cos_sin(rope, pos, max_pos, t_mask, R, BLOCK_R2)
    return t, t_mask, slot, c, k_off, k1, k2, cos, sin, scale, inv_scale


@triton.jit
def _cache_tile_stores(tile, k_pe, kv_c, cache, key, sizes, dims, meta, POW2_SCALE: tl.constexpr):
    """A cache tile's rotation and stores (``tile``: what _cache_tile_loads returned), and the loads
    of latent columns past the first 512, each step stored as it is loaded."""
    H: tl.constexpr = dims.H
    L: tl.constexpr = dims.L
    R: tl.constexpr = dims.R
    NOPE: tl.constexpr = dims.NOPE
    OP: tl.constexpr = meta.OP
    IS_NEOX: tl.constexpr = meta.IS_NEOX
    CACHE_STORE: tl.constexpr = _pow2_scaled(meta.CACHE_STORE) if POW2_SCALE else meta.CACHE_STORE
    KEY_STORE: tl.constexpr = _unscaled(meta.OUT_STORE)  # k_out has no scale (vLLM casts the key without one)
    BLOCK_T: tl.constexpr = meta.BLOCK_T
    BLOCK_H: tl.constexpr = meta.BLOCK_H
    BLOCK_R2: tl.constexpr = _pow2_at_least(R // 2)
    BLOCK_L: tl.constexpr = _row_step(L)
    num_slots, key_start = sizes.num_slots, sizes.key_start
    k_pe_ptr, stride_k_t, stride_k_r = k_pe.ptr, k_pe.stride_t, k_pe.stride_col
    kv_c_ptr, stride_c_t, stride_c_l = kv_c.ptr, kv_c.stride_t, kv_c.stride_col
    cache_ptr, stride_kv_b, stride_kv_s, stride_kv_d = cache.ptr, cache.stride_block, cache.stride_slot, cache.stride_col
    BLOCK_SIZE: tl.constexpr = cache.BLOCK_SIZE
    t, t_mask, slot, c, k_off, k1, k2, cos, sin, scale, inv_scale = tile

    k1, k2 = _rotate(k1, k2, cos, sin)
    if OP != OP_DECODE:
        _store_rotated(k_pe_ptr, k_off, k1.to(k_pe_ptr.dtype.element_ty), k2.to(k_pe_ptr.dtype.element_ty),
                       t_mask, IS_NEOX, R, BLOCK_R2, stride_k_r, BLOCK_T)  # fmt: skip
    if OP == OP_PREFILL:
        # The key's rope part is the same for every head: round it once, store it H times.
        key_ptr, stride_o_t, stride_o_h, stride_o_d = key.ptr, key.stride_t, key.stride_h, key.stride_col
        y1 = _round_for_store(k1, 1.0, 1.0, key_ptr, KEY_STORE)
        y2 = _round_for_store(k2, 1.0, 1.0, key_ptr, KEY_STORE)
        ROWS: tl.constexpr = BLOCK_T * BLOCK_H
        y1 = tl.reshape(tl.broadcast_to(y1[:, None, :], [BLOCK_T, BLOCK_H, BLOCK_R2]), [ROWS, BLOCK_R2])
        y2 = tl.reshape(tl.broadcast_to(y2[:, None, :], [BLOCK_T, BLOCK_H, BLOCK_R2]), [ROWS, BLOCK_R2])
        key_mask = t_mask & (t >= key_start)
        for h0 in tl.static_range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            off = (t - key_start)[:, None] * stride_o_t + h[None, :].to(tl.int64) * stride_o_h + NOPE * stride_o_d
            m = key_mask[:, None] & (h < H)[None, :]
            _store_rotated(key_ptr, tl.reshape(off, [ROWS]), y1, y2, tl.reshape(m, [ROWS]), IS_NEOX, R, BLOCK_R2,
                           stride_o_d, ROWS)  # fmt: skip
    write = t_mask & (slot >= 0) & (slot < num_slots)
    slot = tl.maximum(slot, 0)
    # By a constexpr: a shift and a mask for the usual power-of-two block sizes (a multiply for
    # others), not a 64-bit division by a runtime value; the slot stays 64-bit (caches past 2**31 elements).
    row = (slot // BLOCK_SIZE) * stride_kv_b + (slot % BLOCK_SIZE) * stride_kv_s
    k1 = _round_for_store(k1, scale, inv_scale, cache_ptr, CACHE_STORE)
    k2 = _round_for_store(k2, scale, inv_scale, cache_ptr, CACHE_STORE)
    _store_rotated(cache_ptr, row + L * stride_kv_d, k1, k2, write, IS_NEOX, R, BLOCK_R2, stride_kv_d, BLOCK_T)
    col = tl.arange(0, BLOCK_L)
    c = _round_for_store(c.to(tl.float32), scale, inv_scale, cache_ptr, CACHE_STORE)
    tl.store(cache_ptr + row[:, None] + col[None, :] * stride_kv_d, c, mask=write[:, None] & (col < L)[None, :])
    for l0 in tl.static_range(BLOCK_L, L, BLOCK_L):  # latent widths past BLOCK_L (> 512)
        col = l0 + tl.arange(0, BLOCK_L)
        m = write[:, None] & (col < L)[None, :]
        c = tl.load(kv_c_ptr + t[:, None] * stride_c_t + col[None, :] * stride_c_l, mask=m, other=0.0)
        c = _round_for_store(c.to(tl.float32), scale, inv_scale, cache_ptr, CACHE_STORE)
        tl.store(cache_ptr + row[:, None] + col[None, :] * stride_kv_d, c, mask=m)


@triton.jit
def _query_program(pid, rope, q_pe, nope, out, sizes, dims, meta, POW2_SCALE: tl.constexpr):
    """A tile of BLOCK_ROWS (token, head) rows of q_pe (tile ``pid``), rotated:
    in place (ops 1 and 3) or into q_out (op 2); ops 2 and 3 also copy the row's nope input into
    the output row: op 2 q_out = [ql_nope | rope(q_pe)], op 3 the k_nope part of k_out (whose rope
    part the cache programs write), for tokens from key_start on (always 0 for op 2).
    ``POW2_SCALE``: the output's scale is a power of two, as in _cache_program. Loads before
    stores, as there, and a CTA barrier between them where q_pe is rotated in place (ops 1 and 3:
    _loads_before_in_place_stores)."""
    tile = _query_tile_loads(pid, rope, q_pe, nope, out, sizes, dims, meta, POW2_SCALE)
    _loads_before_in_place_stores(meta.OP)
    _query_tile_stores(tile, q_pe, nope, out, dims, meta, POW2_SCALE)


@triton.jit
def _query_tile_loads(index, rope, q_pe, nope, out, sizes, dims, meta, POW2_SCALE: tl.constexpr):
    """Query tile ``index``'s loads, returned as the tile ``_query_tile_stores`` takes. As in
    _cache_tile_loads, the position-independent loads (the nope input, q_pe) go out before the
    rope table's; with ``EARLY_INDEX_LOADS``, the positions and the table rows before the
    grid-dependency wait. Op 1 has no nope input: its tile carries 0 in those places."""
    H: tl.constexpr = dims.H
    R: tl.constexpr = dims.R
    NOPE: tl.constexpr = dims.NOPE
    OP: tl.constexpr = meta.OP
    IS_NEOX: tl.constexpr = meta.IS_NEOX
    OUT_STORE: tl.constexpr = _pow2_scaled(meta.OUT_STORE) if POW2_SCALE else meta.OUT_STORE
    BLOCK_ROWS: tl.constexpr = meta.BLOCK_ROWS
    USE_PDL: tl.constexpr = meta.USE_PDL
    EARLY_INDEX_LOADS: tl.constexpr = meta.EARLY_INDEX_LOADS
    BLOCK_R2: tl.constexpr = _pow2_at_least(R // 2)  # the rotation's half-width, padded for tl.arange
    BLOCK_N: tl.constexpr = _row_step(NOPE)  # nope columns per step (ops 2 and 3)
    num_tokens, max_pos, key_start = sizes.num_tokens, sizes.max_pos, sizes.key_start
    q_pe_ptr, stride_q_t, stride_q_h, stride_q_r = q_pe.ptr, q_pe.stride_t, q_pe.stride_h, q_pe.stride_col
    nope_ptr, stride_n_t, stride_n_h, stride_n_d = nope.ptr, nope.stride_t, nope.stride_h, nope.stride_col
    out_scale_ptr, stride_o_t, stride_o_h = out.scale_ptr, out.stride_t, out.stride_h

    rows = index.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    t = rows // H
    h = rows % H
    r_mask = t < num_tokens
    pos = tl.load(rope.pos_ptr + t, mask=r_mask, other=0).to(tl.int64)
    if EARLY_INDEX_LOADS:
        cos, sin = _load_cos_sin(rope, pos, max_pos, r_mask, R, BLOCK_R2)
        _wait_for_inputs(USE_PDL)
    if OP != OP_ROPE_CACHE:
        o_mask = r_mask & (t >= key_start)  # rows with an output row (op 2: every row)
        n_off = (t - key_start) * stride_n_t + h * stride_n_h
        col = tl.arange(0, BLOCK_N)
        n_mask = o_mask[:, None] & (col < NOPE)[None, :]
        x = tl.load(nope_ptr + n_off[:, None] + col[None, :] * stride_n_d, mask=n_mask, other=0.0)
        scale, inv_scale = _load_scale(out_scale_ptr, OUT_STORE)
        o_off = (t - key_start) * stride_o_t + h * stride_o_h
    else:
        o_mask, n_off, n_mask, x, scale, inv_scale, o_off = 0, 0, 0, 0, 1.0, 1.0, 0
    q_off = t * stride_q_t + h * stride_q_h
    q1, q2 = _load_halves(q_pe_ptr, q_off, r_mask, IS_NEOX, R, BLOCK_R2, stride_q_r, BLOCK_ROWS)
    if not EARLY_INDEX_LOADS:
        cos, sin = _load_cos_sin(rope, pos, max_pos, r_mask, R, BLOCK_R2)
    return r_mask, o_mask, n_off, n_mask, x, scale, inv_scale, o_off, q_off, q1, q2, cos, sin


@triton.jit
def _query_tile_stores(tile, q_pe, nope, out, dims, meta, POW2_SCALE: tl.constexpr):
    """A query tile's rotation and stores (``tile``: what _query_tile_loads returned), and the loads
    of nope columns past the first 512, each step stored as it is loaded."""
    R: tl.constexpr = dims.R
    NOPE: tl.constexpr = dims.NOPE
    OP: tl.constexpr = meta.OP
    IS_NEOX: tl.constexpr = meta.IS_NEOX
    NOPE_FIRST: tl.constexpr = meta.NOPE_FIRST
    OUT_STORE: tl.constexpr = _pow2_scaled(meta.OUT_STORE) if POW2_SCALE else meta.OUT_STORE
    BLOCK_ROWS: tl.constexpr = meta.BLOCK_ROWS
    BLOCK_R2: tl.constexpr = _pow2_at_least(R // 2)
    BLOCK_N: tl.constexpr = _row_step(NOPE)
    q_pe_ptr, stride_q_r = q_pe.ptr, q_pe.stride_col
    nope_ptr, stride_n_d = nope.ptr, nope.stride_col
    out_ptr, stride_o_d = out.ptr, out.stride_col
    r_mask, o_mask, n_off, n_mask, x, scale, inv_scale, o_off, q_off, q1, q2, cos, sin = tile

    q1, q2 = _rotate(q1, q2, cos, sin)
    if OP != OP_DECODE:
        _store_rotated(q_pe_ptr, q_off, q1.to(q_pe_ptr.dtype.element_ty), q2.to(q_pe_ptr.dtype.element_ty),
                       r_mask, IS_NEOX, R, BLOCK_R2, stride_q_r, BLOCK_ROWS)  # fmt: skip
    else:
        rope_col = NOPE if NOPE_FIRST else 0
        q1 = _round_for_store(q1, scale, inv_scale, out_ptr, OUT_STORE)
        q2 = _round_for_store(q2, scale, inv_scale, out_ptr, OUT_STORE)
        _store_rotated(out_ptr, o_off + rope_col * stride_o_d, q1, q2, o_mask, IS_NEOX, R, BLOCK_R2,
                       stride_o_d, BLOCK_ROWS)  # fmt: skip
    if OP != OP_ROPE_CACHE:
        nope_col = R if (OP == OP_DECODE and not NOPE_FIRST) else 0
        col = tl.arange(0, BLOCK_N)
        x = _round_for_store(x.to(tl.float32), scale, inv_scale, out_ptr, OUT_STORE)
        tl.store(out_ptr + o_off[:, None] + (nope_col + col[None, :]) * stride_o_d, x, mask=n_mask)
        for n0 in tl.static_range(BLOCK_N, NOPE, BLOCK_N):  # nope widths past BLOCK_N (> 512)
            col = n0 + tl.arange(0, BLOCK_N)
            m = o_mask[:, None] & (col < NOPE)[None, :]
            x = tl.load(nope_ptr + n_off[:, None] + col[None, :] * stride_n_d, mask=m, other=0.0)
            x = _round_for_store(x.to(tl.float32), scale, inv_scale, out_ptr, OUT_STORE)
            tl.store(out_ptr + o_off[:, None] + (nope_col + col[None, :]) * stride_o_d, x, mask=m)


# ---------------------------------------------------------------------------
# Host side: views, launch configuration, launch.
#
# Outside a CUDA graph (every prefill step, and the attention op of piecewise graphs)
# this runs per layer and step, so it is kept to plain Python arithmetic and cached
# decisions: triton.cdiv / next_power_of_2 are constexpr functions in Triton 3.8 and
# cost microseconds per call on the host.


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def _pow2_floor(n: int) -> int:
    """Largest power of two <= n (1 for n < 1)."""
    return 1 << max(n.bit_length() - 1, 0)


@functools.lru_cache(maxsize=None)
def _native_fp8_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether Triton can convert to ``dtype`` with the device's own instructions here."""
    if device.type != "cuda":
        return False  # interpreter: its fp8 rounding is wrong, encode the bits ourselves
    if torch.version.hip is not None:
        arch = torch.cuda.get_device_properties(device).gcnArchName
        # gfx942 (MI300) converts to the fnuz types in hardware, gfx950 (MI350) to the OCP ones;
        # anything else takes the bit encoder, which is plain integer arithmetic.
        if arch.startswith("gfx94"):
            return dtype == torch.float8_e4m3fnuz
        if arch.startswith("gfx95"):
            return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        return False
    # NVIDIA: e4m3fn and e5m2 convert natively from sm_89 on; no e4m3fnuz.
    return dtype != torch.float8_e4m3fnuz and torch.cuda.get_device_capability(device) >= (8, 9)


def _store_mode(dtype: torch.dtype | None, has_scale: bool, device: torch.device) -> tuple[str, str]:
    """How the kernel stores an output of element format ``dtype``: the view it stores through
    ("as is", "typed": the fp8 dtype itself, "bytes": uint8 bits it encodes) and the store
    format, the kernel's one constexpr for that store (``_store_params`` reads it): "plain", or
    the fp8 dtype, its rounding and whether it is scaled, e.g. "float8_e4m3fn/saturating/scaled".
    Anything not fp8 (None too) is stored as is."""
    if not fp8.is_fp8(dtype):
        return "as is", "plain"
    scaled = "/scaled" if has_scale else ""
    name = str(dtype).removeprefix("torch.")
    if _native_fp8_ok(device, dtype):
        return "typed", f"{name}/{'clamped' if torch.version.hip is not None else 'saturating'}{scaled}"
    return "bytes", f"{name}/bits{scaled}"


def _store_view(out: torch.Tensor, dtype: torch.dtype, view: str) -> torch.Tensor:
    """The tensor the kernel stores into, for ``_store_mode``'s ``view``."""
    if view == "typed":
        return fp8.typed_view(out, dtype)
    return out.view(torch.uint8) if view == "bytes" else out


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _pdl_ok(device: torch.device) -> bool:
    """Programmatic dependent launch: NVIDIA sm_90+, not disabled by VLLM_MLA_FUSION_PDL=0."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    if os.environ.get("VLLM_MLA_FUSION_PDL", "1").strip() in ("0", "false", "off"):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


# Set by benchmarks/kernels/tune_launch.py to time other launch configurations, and by
# forced_launch_config while kernels are compiled ahead of use; None in normal use.
LAUNCH_CONFIG_OVERRIDE: dict | None = None


def launch_configs(p: Problem, op: int, device: torch.device, max_tokens: int) -> list[dict]:
    """The distinct launch configurations (each a compiled kernel) ``op`` uses for 1 to
    ``max_tokens`` tokens of ``p``'s other sizes."""
    configs: list[dict] = []
    sms, pdl = _num_sms(device), _pdl_ok(device)
    for T in range(1, max_tokens + 1):
        # Uncached: a sweep over every token count must not evict the configurations in use.
        cfg = _launch_config_for.__wrapped__(dataclasses.replace(p, num_tokens=T), op, sms, pdl)
        if cfg not in configs:
            configs.append(cfg)
    return configs


@contextlib.contextmanager
def forced_launch_config(cfg: dict):
    """Launch with ``cfg`` whatever the token count (to compile its kernel on a small call)."""
    global LAUNCH_CONFIG_OVERRIDE
    previous, LAUNCH_CONFIG_OVERRIDE = LAUNCH_CONFIG_OVERRIDE, dict(cfg)
    try:
        yield
    finally:
        LAUNCH_CONFIG_OVERRIDE = previous


def _launch_config(p: Problem, op: int, device: torch.device) -> dict:
    """Block sizes and warps by shape class (see _launch_config_for); a fresh dict."""
    if LAUNCH_CONFIG_OVERRIDE is not None:
        return dict(LAUNCH_CONFIG_OVERRIDE)
    return dict(_launch_config_for(p, op, _num_sms(device), _pdl_ok(device)))


@functools.lru_cache(maxsize=4096)
def _launch_config_for(p: Problem, op: int, sms: int, pdl: bool) -> dict:
    """Block sizes and warps by shape class; cached, so callers must not mutate the result.

    Traffic per query row: R elements in and out (op 1), L + R (op 2), P + R (op 3);
    per cache token L + R, plus op 3's H copies of the key's rope part. Programs aim at
    ~4K elements (8 KB of bf16) of traffic each (op 3's cache programs ~8K) so that large
    batches run at full bandwidth; small batches shrink the tiles so that the work spreads
    over more SMs instead of queueing on a few.
    """
    H, L, R = p.num_heads, p.kv_lora_rank, p.rope_dim
    nope = {OP_ROPE_CACHE.value: 0, OP_DECODE.value: L, OP_PREFILL.value: p.nope_dim or 0}[op]
    row_elems = nope + R
    rows = p.num_tokens * H
    # Measured on an H200 (benchmarks/kernels/tune_launch.py, docs/performance-history.md): ~4K-element
    # tiles, except op 1 with few heads, where 2K-element tiles (32 rows of 64) won by ~12%.
    # Op 3 moves two row widths per row (q_pe and the key): 4K-element tiles cost 168
    # registers a thread (3 programs per SM); 2K-element ones 96.
    if op == OP_PREFILL.value:
        target = 2048
    else:
        target = 4096 if op != OP_ROPE_CACHE.value or H * R >= 4096 else 2048
    block_rows = max(1, min(_pow2(max(1, target // row_elems)), 256))
    # Shrink while the grid would leave most SMs idle.
    while block_rows > 1 and _cdiv(rows, block_rows) < sms:
        block_rows //= 2
    # Cache programs: ~4K elements for ops 1 and 2 (8 tokens of L + R = 576 at DeepSeek's sizes).
    # Op 3's tokens also store their key's rope part for every head (H * R more): there the tuner
    # measured 4 tokens fastest at H=16, T 1024-16384 (T=16384: 76.8 us against 79.3 with 2 and
    # 81.9 with 8), so op 3 takes the most tokens within ~8K elements: 4 at H=16 (6.4K), and 1
    # where one token already exceeds that (H=128: 8.8K).
    if op == OP_PREFILL.value:
        block_t = min(_pow2_floor(8192 // (L + R + H * R)), 64)
    else:
        block_t = min(_pow2(max(1, 4096 // (L + R))), 64)
    while block_t > 1 and _cdiv(p.num_tokens, block_t) < sms // 2:
        block_t //= 2
    # Op 3's cache programs store the key's rope part for every head in tiles of ~2K elements
    # (at H=16, 4 tokens by 8 heads: the tuner's joint grid timed 8 heads as fast as 16).
    block_h = _pow2(H) if op == OP_PREFILL.value else 1
    while block_h > 1 and block_t * block_h * R > 2048:
        block_h //= 2
    return dict(BLOCK_T=block_t, BLOCK_ROWS=block_rows, BLOCK_H=block_h, num_warps=4, USE_PDL=pdl)


# Each op's entry point.
_KERNELS = {OP_ROPE_CACHE.value: _mla_rope_cache_kernel_op1, OP_DECODE.value: _mla_rope_cache_kernel_op2,
            OP_PREFILL.value: _mla_rope_cache_kernel_op3}  # fmt: skip


def _constexpr_names(kernel) -> tuple:
    """A kernel's constexprs in signature order: a compiled kernel's launcher takes every argument,
    constexprs included, in that order. Read from the Python source so that Triton's interpreter,
    which keeps no parameter list, agrees."""
    return tuple(name for name, prm in inspect.signature(kernel.fn).parameters.items()
                 if "constexpr" in str(prm.annotation))  # fmt: skip


_CONSTEXPR_NAMES = {op: _constexpr_names(kernel) for op, kernel in _KERNELS.items()}
# The data pointers Triton specializes on 16-byte alignment (every pointer but the index tensors').
_ALIGNMENT_MASK = 15


@dataclasses.dataclass
class _Plan:
    """One token count's launch: grid, block sizes, and the compiled kernel's launcher once known."""

    grid: int
    n_cache: int
    num_warps: int
    constexprs: dict  # by name, for Triton's own launch path
    values: tuple  # the same in signature order, for the compiled kernel's launcher
    compiled: tuple | None = None  # _compiled(kernel) of its configuration, once it has been launched


class BoundLaunch:
    """The kernel for one op, bound to one validated layout on one device (binding.py's Site).

    Fixed here: the op's constexprs (sizes, rotation style, store modes of the cache and the
    output, from their element types), every stride, the rope table's and the cache block's
    sizes. Per call: the token count picks a plan (grid and block sizes, cached per count),
    and the compiled kernel of the plan's configuration is launched with integer addresses
    through its own launcher, called as Triton's launch path calls it (``CompiledKernel.run``);
    when a profiler has installed a launch hook, through ``CompiledKernel[grid]``, which builds
    the launch metadata and calls the hooks. No argument binding, no specialization key, no
    views.

    The first launch of each configuration goes through Triton's ``kernel[grid](...)``, which
    compiles the variant (or finds it in its caches) for exactly these tensors and returns it.
    A later call reuses it only when everything Triton specialized on is the same: dtypes,
    strides and sizes are (the layout is bound), the token count, slot count and program count
    are never specialized (``do_not_specialize``) and stay 32-bit, and every data pointer is
    16-byte aligned as in the first launch (checked per call; a misaligned one takes Triton's
    path, which picks the variant for it). Under Triton's interpreter (CPU tests) every call
    takes Triton's path.
    """

    MAX_PLANS = 1 << 16  # distinct token counts kept (vLLM's steps have at most max_num_batched_tokens)

    def __init__(self, p: Problem, op: int, is_neox: bool, is_nope_first: bool, positions, q_pe, k_pe, kv_c,
                 cos_sin_cache, slot_mapping, kv_cache, kv_cache_scale, nope, out, out_scale,
                 early_index_loads: bool = False) -> None:  # fmt: skip
        device = q_pe.device
        self.p, self.op, self.device = p, op, device
        self.out_dtype = out.dtype if out is not None else None
        if op == OP_PREFILL.value and out_scale is not None:
            # Its entry point has no output scale (vLLM casts the key without one): never drop one silently.
            raise ValueError("out_scale: the prefill key (op 3) is stored without a scale; pass None")
        self.cache_view, cache_store = _store_mode(p.cache_dtype, kv_cache_scale is not None, device)
        # Op 1 has no output of its own ("plain", unused: its entry point passes none).
        self.out_view, out_store = _store_mode(self.out_dtype, out_scale is not None, device)
        self.base_constexprs = dict(
            H=p.num_heads, L=p.kv_lora_rank, R=p.rope_dim, NOPE=nope.shape[-1] if out is not None else 1,
            IS_NEOX=is_neox, OP=op, NOPE_FIRST=is_nope_first, CACHE_STORE=cache_store, OUT_STORE=out_store,
            BLOCK_SIZE=kv_cache.shape[1],
        )  # fmt: skip
        k_pe2, kv_c2 = _rows_2d(k_pe), _rows_2d(kv_c)
        # The data tensors' strides, one tuple in the kernel's pointer order (op 1: no nope input or output).
        self.strides = (*cos_sin_cache.stride(), *q_pe.stride(), *k_pe2.stride(), *kv_c2.stride(), *kv_cache.stride(),
                        *((*nope.stride(), *out.stride()) if out is not None else ()))  # fmt: skip
        self.kernel, self.constexpr_names = _KERNELS[op], _CONSTEXPR_NAMES[op]
        self.max_pos, self.block_size = cos_sin_cache.shape[0], kv_cache.shape[1]
        self.num_slots = kv_cache.shape[0] * kv_cache.shape[1]
        # The kernel reads the index tensors at unit stride (vLLM's are contiguous); another
        # stride costs a copy of the T entries used, never a wrong read.
        self.copy_index = positions.stride(0) != 1 or slot_mapping.stride(0) != 1
        # Positions, slots and cos/sin read before the grid-dependency wait (with PDL, plan()):
        # only where the caller has declared that no kernel still running when ours starts writes
        # them (binding.BoundOp's early_index_loads: the vLLM plugin's layers), and never after
        # the copy above, which the kernel launched just before ours would be.
        self.early_index_loads = early_index_loads and not self.copy_index
        self.sms, self.pdl = _num_sms(device), _pdl_ok(device)
        # Compiled kernels are launched directly on NVIDIA GPUs. Not under Triton's interpreter
        # (CPU tensors), which has none, nor on ROCm: Triton's AMD backend also specializes a
        # pointer on its allocation's size (buffer loads), which the reuse rule here does not
        # track, so every launch there takes Triton's own path.
        self.compiled = device.type == "cuda" and torch.version.hip is None
        self.device_index = device.index if self.compiled else None
        self.kernels: dict[tuple, object] = {}  # constexpr values -> compiled kernel
        self.plans: dict[int, _Plan] = {}
        if self.compiled:
            # Triton's driver functions, looked up once (the driver object is a lazy proxy).
            self._current_stream = _triton_driver.active.get_current_stream
            self._current_device = _triton_driver.active.get_current_device

    def plan(self, T: int) -> _Plan:
        """The launch for ``T`` tokens (cached per token count unless a configuration is forced)."""
        plan = self.plans.get(T)
        if plan is not None and LAUNCH_CONFIG_OVERRIDE is None:
            return plan
        cfg = _launch_config(dataclasses.replace(self.p, num_tokens=T), self.op, self.device)
        constexprs = dict(self.base_constexprs, BLOCK_T=cfg["BLOCK_T"], BLOCK_ROWS=cfg["BLOCK_ROWS"],
                          BLOCK_H=cfg["BLOCK_H"], USE_PDL=cfg["USE_PDL"],
                          EARLY_INDEX_LOADS=self.early_index_loads and cfg["USE_PDL"])  # fmt: skip
        constexprs = {name: constexprs[name] for name in self.constexpr_names}
        values = tuple(constexprs.values())
        n_cache = _cdiv(T, cfg["BLOCK_T"])
        n_query = _cdiv(T * self.p.num_heads, cfg["BLOCK_ROWS"])
        plan = _Plan(n_cache + n_query, n_cache, cfg["num_warps"], constexprs, values)
        kernel = self.kernels.get(values)
        if kernel is not None:
            plan.compiled = _compiled(kernel)
        if LAUNCH_CONFIG_OVERRIDE is None:
            if len(self.plans) >= self.MAX_PLANS:
                self.plans.clear()
            self.plans[T] = plan
        return plan

    def __call__(self, T: int, positions, q_pe, k_pe, kv_c, cos_sin_cache, slot_mapping, kv_cache, kv_cache_scale,
                 nope, out, out_scale, key_start: int = 0) -> None:  # fmt: skip
        plan = self.plan(T)
        if self.copy_index:
            positions, slot_mapping = positions[:T].contiguous(), slot_mapping[:T].contiguous()
        num_slots = kv_cache.shape[0] * self.block_size
        if plan.compiled is not None and num_slots < 2**31:
            cs = cos_sin_cache.data_ptr()
            data = (cs, q_pe.data_ptr(), k_pe.data_ptr(), kv_c.data_ptr(), kv_cache.data_ptr(),
                    cs if kv_cache_scale is None else kv_cache_scale.data_ptr(),
                    q_pe.data_ptr() if out is None else nope.data_ptr(),
                    q_pe.data_ptr() if out is None else out.data_ptr(),
                    cs if out_scale is None else out_scale.data_ptr())  # fmt: skip
            aligned = not (data[0] | data[1] | data[2] | data[3] | data[4] | data[5] | data[6] | data[7]
                           | data[8]) & _ALIGNMENT_MASK  # every data pointer 16-byte aligned  # fmt: skip
            if aligned:
                device = self.device_index
                if self._current_device() != device:
                    # Launch on the tensors' GPU, not the current one ("an illegal memory access").
                    with torch.cuda.device(device):
                        self._launch(plan, T, num_slots, key_start, positions, slot_mapping, data)
                else:
                    self._launch(plan, T, num_slots, key_start, positions, slot_mapping, data)
                return
        self._launch_through_triton(plan, T, num_slots, key_start, positions, q_pe, k_pe, kv_c, cos_sin_cache,
                                    slot_mapping, kv_cache, kv_cache_scale, nope, out, out_scale)  # fmt: skip

    def arguments(self, T: int, num_slots: int, n_cache: int, key_start: int, positions, slot_mapping, cos_sin,
                  q_pe, k_pe, kv_c, cache, cache_scale, nope, out, out_scale) -> tuple:  # fmt: skip
        """The op's kernel arguments before its constexprs, in its signature's order, for tensors or
        their addresses alike: what the op does not take left out."""
        if self.op == OP_ROPE_CACHE.value:
            return (positions, slot_mapping, cos_sin, q_pe, k_pe, kv_c, cache, cache_scale, T, self.max_pos,
                    num_slots, n_cache, self.strides)  # fmt: skip
        if self.op == OP_DECODE.value:
            return (positions, slot_mapping, cos_sin, q_pe, k_pe, kv_c, cache, cache_scale, nope, out, out_scale, T,
                    self.max_pos, num_slots, n_cache, 0, self.strides)  # fmt: skip
        return (positions, slot_mapping, cos_sin, q_pe, k_pe, kv_c, cache, cache_scale, nope, out, T, self.max_pos,
                num_slots, n_cache, key_start, self.strides)  # fmt: skip

    def _launch(self, plan: _Plan, T: int, num_slots: int, key_start: int, positions, slot_mapping,
                data: tuple) -> None:  # fmt: skip
        cs, q, k, c, cache, cache_scale, nope, out, out_scale = data
        launcher, function, packed_metadata, kernel = plan.compiled
        stream = self._current_stream(self.device_index)
        args = self.arguments(T, num_slots, plan.n_cache, key_start, positions.data_ptr(), slot_mapping.data_ptr(),
                              cs, q, k, c, cache, cache_scale, nope, out, out_scale) + plan.values  # fmt: skip
        if _no_launch_hooks():
            # The compiled kernel's launcher, called as Triton's own launch path calls it; with no
            # launch hook there is no launch metadata to build (docs/performance-history.md, "Host path").
            launcher(plan.grid, 1, 1, stream, function, packed_metadata, None, None, None, *args)
        else:
            kernel[(plan.grid, 1, 1)](*args, stream=stream)  # builds the metadata, calls the hooks

    def _launch_through_triton(self, plan: _Plan, T: int, num_slots: int, key_start: int, positions, q_pe, k_pe, kv_c,
                               cos_sin_cache, slot_mapping, kv_cache, kv_cache_scale, nope, out,
                               out_scale) -> None:  # fmt: skip
        """Triton's own launch: binds and specializes the arguments, compiles or finds the variant."""
        cache = _store_view(kv_cache, self.p.cache_dtype, self.cache_view)
        if out is not None:
            out = _store_view(out, self.out_dtype, self.out_view)
        else:
            out = nope = q_pe  # op 1 takes neither: stand-ins for the alignment check below
        dummy = cos_sin_cache  # scale pointers must be valid tensors even when unused
        gpu = self.device_index
        on_other_gpu = gpu is not None and gpu != self._current_device()
        with torch.cuda.device(gpu) if on_other_gpu else contextlib.nullcontext():
            kernel = self.kernel[(plan.grid,)](
                *self.arguments(T, num_slots, plan.n_cache, key_start, positions, slot_mapping, cos_sin_cache, q_pe,
                                _rows_2d(k_pe), _rows_2d(kv_c), cache,
                                kv_cache_scale if kv_cache_scale is not None else dummy, nope, out,
                                out_scale if out_scale is not None else dummy),
                **plan.constexprs, num_warps=plan.num_warps, **({"launch_pdl": True} if self.pdl else {}),
            )  # fmt: skip
        aligned = all(t.data_ptr() % 16 == 0 for t in (cos_sin_cache, q_pe, k_pe, kv_c, kv_cache, nope, out)
                      if t is not None) and all(s is None or s.data_ptr() % 16 == 0
                                                for s in (kv_cache_scale, out_scale))  # fmt: skip
        # Keep the variant for direct launches only when it is the one the fast path checks for:
        # every data pointer aligned, 32-bit counts. Forced configurations are kept too
        # (prewarm.py compiles exactly the configurations the layer will use).
        if self.compiled and kernel is not None and aligned and num_slots < 2**31:
            self.kernels[plan.values] = kernel
            plan.compiled = _compiled(kernel)


def _compiled(kernel) -> tuple:
    """``(launcher, function, packed metadata, kernel)`` of a compiled kernel, its module loaded."""
    launcher = kernel.run  # loads the binary on first access (CompiledKernel._init_handles)
    return launcher, kernel.function, kernel.packed_metadata, kernel


def _no_launch_hooks() -> bool:
    """No launch hook is installed (profilers such as proton install one): None in Triton 3.6,
    an empty HookChain in Triton 3.8."""
    runtime = _triton_knobs.runtime
    return all(h is None or (type(h).__name__ == "HookChain" and not h.calls)
               for h in (runtime.launch_enter_hook, runtime.launch_exit_hook))  # fmt: skip


def _rows_2d(t: torch.Tensor) -> torch.Tensor:
    """``[T, 1, X]`` -> ``[T, X]`` (a view keeping the row stride); 2-D tensors as they are."""
    return t.select(1, 0) if t.dim() == 3 else t


def bind(p: Problem, op: int, is_neox: bool, is_nope_first: bool, positions, q_pe, k_pe, kv_c, cos_sin_cache,
         slot_mapping, kv_cache, kv_cache_scale, nope, out, out_scale,
         early_index_loads: bool = False) -> BoundLaunch:  # fmt: skip
    """The backend's binding for one validated layout (binding.py); ``early_index_loads``: the
    caller's declaration that no kernel still running when ours starts writes the positions,
    slots or cos/sin (BoundLaunch)."""
    return BoundLaunch(p, op, is_neox, is_nope_first, positions, q_pe, k_pe, kv_c, cos_sin_cache, slot_mapping,
                       kv_cache, kv_cache_scale, nope, out, out_scale, early_index_loads)  # fmt: skip
