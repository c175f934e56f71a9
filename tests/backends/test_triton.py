"""The Triton backend's scaled fp8 rounding, proved exact over millions of values.

``_round_for_store`` divides by the scale without a division per element:
``q = x * (1/scale)`` (clamped to twice the fp8 range), then one residual step
through fused multiply-adds, ``r = fma(q, scale, -x)``, ``x / scale ~ fma(r,
-(1/scale), q)``. The kernel
tests run it (test_ops.py in the interpreter with an exact fma, test_gpu.py
on a GPU), but only on thousands of values. Here the same three operations
are evaluated with an exact fma (tests/exact_interpreter.py, itself checked
against rational arithmetic below) on millions of values, near-ties of every
fp8 format included, and compared bit for bit with torch's float32 division:
first the quotient itself, then the stored fp8 code. A program whose scale is a
power of two with a normal reciprocal (``_scale_is_pow2``; vLLM's default 1.0)
takes the bare product instead, exact there: checked at the edges of that rule
against a float64 reference.
"""

from __future__ import annotations

import os
from fractions import Fraction

import numpy as np
import pytest
import torch

from ..exact_interpreter import exact_fma32, rne_bf16_bits
from ..mla_cases import FP8_DTYPES, fp8_near_ties

try:  # the kernel's helpers, for probes run by Triton (a global: jitted functions see no closures)
    from vllm_mla_fusion.backends import triton as tb
except ImportError:  # no Triton: the numpy checks still run
    tb = None

F32_MIN_NORMAL = 2.0**-126


def f32_of_fraction(q: Fraction) -> float:
    """The float32 nearest to the rational ``q`` (ties to even), by integer arithmetic only."""
    if q == 0:
        return 0.0
    sign, a = (-1.0 if q < 0 else 1.0), abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()  # 2**(e-1) < a < 2**(e+1)
    if a >= Fraction(2) ** e:
        e += 1
    exp = max(e - 24, -149)  # scale so that the significand has 24 bits (fewer when subnormal)
    m, rem = divmod(a / Fraction(2) ** exp, 1)
    m = int(m)
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and m % 2 == 1):
        m += 1
    value = m * 2.0**exp
    return sign * (value if value < 2.0**128 * (1 - 2.0**-25) else float("inf"))


def test_exact_fma_matches_rational_arithmetic():
    """exact_fma32 (the interpreter's fma in these tests) is the correctly rounded x * y + z,
    including the cases a double rounding gets wrong: z cancelling x * y, and sums within a
    float64 ulp of a float32 tie."""
    g = np.random.default_rng(0)
    n = 4000
    x = (g.standard_normal(n) * 2.0 ** g.integers(-30, 30, n)).astype(np.float32)
    y = (g.standard_normal(n) * 2.0 ** g.integers(-30, 30, n)).astype(np.float32)
    z = (g.standard_normal(n) * 2.0 ** g.integers(-60, 60, n)).astype(np.float32)
    z[: n // 4] = -(x[: n // 4].astype(np.float64) * y[: n // 4]).astype(np.float32)  # cancellation
    # Exact ties at float32 precision plus a tiny product that decides the rounding.
    z[n // 4 : n // 2] = np.float32(1.0) + np.float32(2.0**-23) * g.integers(0, 8, n // 4).astype(np.float32)
    x[n // 4 : n // 2] = np.float32(2.0**-24)
    y[n // 4 : n // 2] = (1 + g.integers(-2, 3, n // 4) * 2.0**-23).astype(np.float32)
    got = exact_fma32(x, y, z)
    for i in range(n):
        want = f32_of_fraction(Fraction(float(x[i])) * Fraction(float(y[i])) + Fraction(float(z[i])))
        assert np.float32(want).view(np.uint32) == got[i].view(np.uint32), (x[i], y[i], z[i], got[i], want)
    # The naive x * y + z in float32 (what Triton's interpreter computes) is wrong on many of these.
    naive = x * y + z
    assert (naive.view(np.uint32) != got.view(np.uint32)).sum() > n // 10


def test_bf16_rounding_is_to_nearest_even():
    x = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-8 + 2.0**-20, -(1 + 2.0**-8), 3.0e38, 1e-40], np.float32)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(rne_bf16_bits(x), want)
    assert rne_bf16_bits(x)[0] == 0x3F80 and rne_bf16_bits(x)[1] == 0x3F82  # ties to even, not up


def test_kernel_fma_and_bf16_cast_are_exact():
    """Through a real kernel: on a GPU its own fma and cvt.rn; in the interpreter, the patched ones
    (a Triton upgrade that bypasses the patch fails here, not silently in the op tests)."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def probe(x_ptr, y_ptr, z_ptr, fma_ptr, bf16_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        m = i < n
        x = tl.load(x_ptr + i, mask=m)
        y = tl.load(y_ptr + i, mask=m)
        z = tl.load(z_ptr + i, mask=m)
        tl.store(fma_ptr + i, tl.fma(x, y, z), mask=m)
        tl.store(bf16_ptr + i, (x * y).to(tl.bfloat16), mask=m)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    n = 256
    x = torch.randn(n, generator=g)
    y = torch.randn(n, generator=g)
    z = -(x.double() * y.double()).float()  # cancellation: the naive result is 0 or one rounding
    z[n // 2 :] = torch.randn(n // 2, generator=g)
    fma_out, bf16_out = torch.empty(n, device=device), torch.empty(n, dtype=torch.bfloat16, device=device)
    args = [t.to(device) for t in (x, y, z)]
    probe[(1,)](*args, fma_out, bf16_out, n, BLOCK=n)
    want = exact_fma32(x.numpy(), y.numpy(), z.numpy())
    assert np.array_equal(fma_out.cpu().numpy().view(np.uint32), want.view(np.uint32))
    assert torch.equal(bf16_out.cpu().view(torch.int16), (x * y).to(torch.bfloat16).view(torch.int16))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks the interpreter's emulation of Triton 3.6")
def test_the_interpreter_negates_as_triton_3_6_compiles():
    """Through a real kernel in the interpreter: ``-x`` is ``0 - x`` (tests/exact_interpreter.py),
    +0 for both zeros, as Triton 3.6 compiles it; a Triton whose unary minus bypasses the patched
    hook fails here, not silently in the op tests."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def probe(x_ptr, out_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(out_ptr + i, -tl.load(x_ptr + i))

    x = torch.tensor([0.0, -0.0, 1.5, -2.0, 0.0, -0.0, 3.0, -4.0])
    out = torch.full_like(x, 7.0)
    probe[(1,)](x, out, BLOCK=8)
    want = torch.tensor([0.0, 0.0, -1.5, 2.0, 0.0, 0.0, -3.0, 4.0])
    assert torch.equal(out.view(torch.int32), want.view(torch.int32)), out.tolist()


def exact_reciprocal(scale: np.float32) -> bool:
    """``_scale_is_pow2``: a positive power of two whose reciprocal is a normal float32 too."""
    bits = int(np.float32(scale).view(np.uint32))
    return bits & 0x7FFFFF == 0 and 1 <= bits >> 23 <= 253


def kernel_quotient(x: np.ndarray, scale: np.float32, fp8_max: float) -> np.ndarray:
    """``_round_for_store``'s scaled step (backends/triton.py), operation for operation, in float32
    with an exact fma, in the program the scale selects. Kept in step with the kernel by hand: a
    change there must change this."""
    inv = np.float32(1.0) / scale  # tl.fdiv(1.0, scale, ieee_rounding=True): correctly rounded
    with np.errstate(over="ignore", invalid="ignore"):
        if exact_reciprocal(scale):
            return x * inv  # the POW2_SCALE store
        q = np.clip(x * inv, -2 * fp8_max, 2 * fp8_max)
        r = exact_fma32(q, np.minimum(scale, np.finfo(np.float32).max), -x)
        return exact_fma32(r, inv * np.float32(-1.0), q)


def _scales() -> list[float]:
    g = np.random.default_rng(2)
    random = (2.0 ** g.uniform(-20, 20, 40)).astype(np.float32).tolist()
    return [0.37, 1 / 3, 0.1, 2.5, 3.7, 0.05, 1e-3, 448.0 / 3, 1.0, 7.0] + random


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
def test_reciprocal_with_residual_is_division_bit_for_bit(dtype):
    """Over 50 scales x ~40k values per format (random magnitudes across and beyond the fp8 range,
    plus the near-tie set of each scale): the quotient equals torch's float32 x / scale bit for bit
    wherever it is a normal float32 below twice the fp8 max, and the saturated fp8 code is
    identical everywhere: ~1.7 million values per format, in a second or two."""
    fmax = torch.finfo(dtype).max
    g = np.random.default_rng(3)
    checked = 0
    for scale in _scales():
        s = np.float32(scale)
        rand = (g.standard_normal(32768) * 2.0 ** g.uniform(-24, 12, 32768) * s).astype(np.float32)
        x = np.concatenate([fp8_near_ties(dtype, float(s)).numpy(), rand])
        got = kernel_quotient(x, s, fmax)
        want = (torch.from_numpy(x) / torch.tensor(s)).numpy()
        normal = (np.abs(want) >= F32_MIN_NORMAL) & (np.abs(want) < 2 * fmax)
        bad = normal & (got.view(np.uint32) != want.view(np.uint32))
        assert not bad.any(), f"scale {s}: x={x[bad][:4]} got {got[bad][:4]} want {want[bad][:4]}"
        to_fp8 = lambda v: torch.from_numpy(v).clamp(-fmax, fmax).to(dtype).view(torch.uint8)  # noqa: E731
        assert torch.equal(to_fp8(got), to_fp8(want)), f"scale {s}: fp8 codes differ"
        checked += x.size
    assert checked > 1_500_000


def test_the_residual_step_is_what_makes_it_exact():
    """Without the residual step (the bare reciprocal product) the same check fails: the values
    above are discriminating, so the exactness is the algorithm's, not the data's."""
    dtype = torch.float8_e4m3fn
    s = np.float32(0.37)
    x = fp8_near_ties(dtype, float(s)).numpy()
    bare = x * (np.float32(1.0) / s)
    want = (torch.from_numpy(x) / torch.tensor(s)).numpy()
    fmax = torch.finfo(dtype).max
    codes = lambda v: torch.from_numpy(v).clamp(-fmax, fmax).to(dtype).view(torch.uint8)  # noqa: E731
    assert not torch.equal(codes(bare), codes(want))
    assert torch.equal(codes(kernel_quotient(x, s, fmax)), codes(want))


# Scales on both sides of the rule (_scale_is_pow2): powers of two with normal reciprocals, 2**127
# (subnormal reciprocal), a subnormal power of two and a subnormal scale, non-powers of two next
# to 1; a negative power of two, zero, infinity and NaN for the reciprocal alone.
EDGE_SCALES = {1.0: True, 0.5: True, 2.0: True, 2.0**-126: True, 2.0**-125: True, 2.0**126: True,
               2.0**127: False, 2.0**-127: False, 1.5 * 2.0**-127: False, 1 - 2.0**-24: False, 1 + 2.0**-23: False,
               0.75: False, 3.0: False}  # fmt: skip


def test_scale_is_pow2_only_at_powers_of_two_with_normal_reciprocals():
    """Through the kernel's own ``_scale_is_pow2`` (GPU, or the interpreter): true at the powers of
    two whose reciprocals are normal, false at every other scale, negative, zero, infinite and NaN
    ones included; and the model's rule (``exact_reciprocal``) says the same."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def probe(scale_ptr, out_ptr, STORE: tl.constexpr):
        i = tl.program_id(0)
        tl.store(out_ptr + i, tb._scale_is_pow2(scale_ptr + i, STORE).to(tl.int32))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    scales = {**EDGE_SCALES, -4.0: False, -1.0: False, 0.0: False, float("inf"): False, float("nan"): False}
    s = torch.tensor(list(scales), dtype=torch.float32, device=device)
    got = torch.full(s.shape, -1, dtype=torch.int32, device=device)
    probe[(s.numel(),)](s, got, STORE="float8_e4m3fn/bits/scaled")
    assert got.cpu().tolist() == [int(v) for v in scales.values()], list(zip(scales, got.tolist()))
    assert all(exact_reciprocal(np.float32(v)) == exact for v, exact in scales.items())


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
def test_power_of_two_scales_skip_the_step_and_stay_exact(dtype):
    """At the edge scales, against the float64 reference (x / scale in float64 rounded to float32:
    53 >= 2 * 24 + 2 bits, so the correctly rounded float32 quotient): the quotient bit for bit
    everywhere for the powers of two (the bare reciprocal product: zeros, subnormals, overflows
    included), wherever it is normal and below twice the fp8 max for the others (the residual
    step), and the saturated fp8 code everywhere; the bare product stores other codes next to 1."""
    fmax = torch.finfo(dtype).max
    g = np.random.default_rng(5)
    for scale, exact in EDGE_SCALES.items():
        s = np.float32(scale)
        with np.errstate(over="ignore"):  # 2**126 and 2**127: some overflow to infinity
            rand = (g.standard_normal(32768) * 2.0 ** g.uniform(-24, 12, 32768) * np.float64(s)).astype(np.float32)
        special = np.array([0.0, -0.0, 1e-45, -1e30, np.inf, -np.inf], np.float32)
        x = np.concatenate([fp8_near_ties(dtype, float(s)).numpy(), rand, special])
        got = kernel_quotient(x, s, fmax)
        with np.errstate(over="ignore", under="ignore"):
            want = (x.astype(np.float64) / np.float64(s)).astype(np.float32)
        # The residual step's exactness needs a normal scale (with a subnormal one the residual
        # underflows, and the quotient may be an ulp off): there the codes alone are compared.
        normal = (np.abs(want) >= F32_MIN_NORMAL) & (np.abs(want) < 2 * fmax) & (abs(s) >= F32_MIN_NORMAL)
        compared = np.ones(x.shape, bool) if exact else normal
        bad = compared & (got.view(np.uint32) != want.view(np.uint32))
        assert not bad.any(), f"scale {s}: x={x[bad][:4]} got {got[bad][:4]} want {want[bad][:4]}"
        to_fp8 = lambda v: torch.from_numpy(v).clamp(-fmax, fmax).to(dtype).view(torch.uint8)  # noqa: E731
        assert torch.equal(to_fp8(got), to_fp8(want)), f"scale {s}: fp8 codes differ"
        if scale == 1 - 2.0**-24:
            with np.errstate(over="ignore"):
                bare = x * (np.float32(1.0) / s)
            assert (to_fp8(bare) != to_fp8(want)).sum() >= 100


def test_an_infinite_scale_stores_signed_zeros():
    """x / inf is +-0 for finite x (torch): the residual step stays finite there (its scale is
    clamped to the largest float32), rather than making 0 * inf = NaN."""
    x = np.array([1.0, -3.0, 1e30, -1e-30, 0.0, -0.0, 448.0], np.float32)
    got = kernel_quotient(x, np.float32(np.inf), 448.0)
    assert np.array_equal(got.view(np.uint32), (x / np.float32(np.inf)).view(np.uint32)), got
