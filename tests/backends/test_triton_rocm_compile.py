"""The Triton kernel compiles for MI300X (gfx942) and MI355X (gfx950), on a CPU, in CI.

A compile check, not a run on AMD hardware: every op and every store mode the
host code selects on those chips goes through Triton's AMD backend to AMDGCN and
a linked hsaco (tests/rocm_compile.py: the launch arguments are recorded from a
real call of the backend on a simulated ROCm machine). Asserted: it compiles
(a CUDA-only intrinsic outside its constexpr guard would fail here), no register
spills and no scratch memory, and the chip's hardware fp8 conversion exactly
where ``_native_fp8_ok`` says the chip has it (the bit encoder elsewhere). The
numbers go into docs/rocm.md (``python -m tests.rocm_compile --update-docs``).
~45 s: one subprocess per chip, in parallel.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="compiles the Triton kernel")

from ..aot_compile import compile_in_subprocesses  # noqa: E402
from ..rocm_compile import ARCHS, FP8, variants  # noqa: E402

# The e4m3 flavour (and e5m2) each chip converts in hardware, as this project documents it
# (docs/rocm.md): gfx942 the fnuz type, gfx950 the OCP ones.
NATIVE = {"gfx942": {"float8_e4m3fnuz"}, "gfx950": {"float8_e4m3fn", "float8_e5m2"}}
# The instructions that prove it: packed fp8 (e4m3) / bf8 (e5m2) conversions; gfx950 emits the
# scaled forms (scale 1).
CVT = {
    "gfx942": {"float8_e4m3fnuz": ("v_cvt_pk_fp8_f32",)},
    "gfx950": {"float8_e4m3fn": ("v_cvt_scalef32_pk_fp8_f32", "v_cvt_pk_fp8_f32"),
               "float8_e5m2": ("v_cvt_scalef32_pk_bf8_f32", "v_cvt_pk_bf8_f32")},
}  # fmt: skip
FP8_CLAMPED, FP8_BITS = 3, 2  # the store modes of backends/triton.py (_FP8_CLAMPED, _FP8_BITS)
VARIANTS = variants()


@pytest.fixture(scope="module")
def compiled() -> dict:
    return compile_in_subprocesses("tests.rocm_compile", ARCHS)


def _result(compiled, arch, v):
    r = compiled.get((arch, v.op, v.label))
    assert r is not None, f"{arch} {v.op} {v.label}: not compiled"
    return r


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: f"{v.op}-{v.label}")
@pytest.mark.parametrize("arch", list(ARCHS))
def test_compiles_without_spills(compiled, arch, v):
    r = _result(compiled, arch, v)
    assert r["hsaco_bytes"] > 0
    assert (r["vgpr_spill"], r["sgpr_spill"], r["scratch"]) == (0, 0, 0), r
    assert 0 < r["vgpr"] <= 512 and r["occupancy"] >= 1, r


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: f"{v.op}-{v.label}")
@pytest.mark.parametrize("arch", list(ARCHS))
def test_hardware_fp8_conversion_exactly_where_the_chip_has_it(compiled, arch, v):
    r = _result(compiled, arch, v)
    formats = {v.cache} | ({v.out} if v.out in FP8 else set())
    used = formats & set(FP8)
    # The host's choice (_native_fp8_ok) is the documented one for this chip ...
    assert set(r["native_fp8"]) == used & NATIVE[arch], r["native_fp8"]
    # ... the store modes follow it (hardware conversion after a clamp, or the bit encoder) ...
    if v.cache in FP8:
        assert r["modes"]["CACHE_MODE"] == (FP8_CLAMPED if v.cache in NATIVE[arch] else FP8_BITS)
    if v.out in FP8:
        assert r["modes"]["OUT_MODE"] == (FP8_CLAMPED if v.out in NATIVE[arch] else FP8_BITS)
    # ... and the code has the chip's conversion instruction for each native format, and no
    # hardware fp8 conversion at all when every fp8 store goes through the bit encoder.
    for f in used & NATIVE[arch]:
        assert any(c in r["fp8_cvt"] for c in CVT[arch][f]), (f, r["fp8_cvt"])
    if not used & NATIVE[arch]:
        assert r["fp8_cvt"] == [], r["fp8_cvt"]


def test_every_op_and_mode_is_in_the_matrix():
    """Three ops; bf16/fp16/fp32; each fp8 format for the cache, with and without a scale (op 1),
    and as q_out (scaled and not) and k_out."""
    ops = {v.op for v in VARIANTS}
    assert ops == {"rope_cache_write", "decode", "prefill"}
    for f in FP8:
        assert {(v.op, v.cache_scale) for v in VARIANTS if v.cache == f} >= {("rope_cache_write", True),
                                                                              ("rope_cache_write", False)}
        assert any(v.op == "decode" and v.out == f and v.out_scale for v in VARIANTS)
        assert any(v.op == "prefill" and v.out == f for v in VARIANTS)
