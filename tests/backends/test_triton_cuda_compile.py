"""The Triton kernel compiles for H100/H200 (sm_90), on a CPU, in CI.

A compile check, not a run: every op and every store mode the host code selects
on a Hopper GPU goes through Triton's NVIDIA backend to PTX and a cubin
(tests/cuda_compile.py: the launch arguments are recorded from a real call of
the backend on a simulated CUDA machine; ptxas ships in the triton wheel).
Asserted: it compiles, no register spills and no stack frame, the hardware fp8
conversion exactly where ``_native_fp8_ok`` says sm_90 has it (e4m3fn, e5m2; the
bit encoder for e4m3fnuz), and programmatic dependent launch's instructions in
every variant (``_pdl_ok``). Registers per thread and a hash of each variant's
PTX: ``python -m tests.cuda_compile``. ~40 s per Triton: one subprocess each.

The same checks run under the GPU image's Triton (``aot_compile.OTHER_TRITON``, 3.6,
installed once per machine from pip, ~640 MB; every result says which Triton compiled
it): its compiler folds less than 3.8's, and a kernel that compiles only under 3.8
fails on that GPU before it runs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="compiles the Triton kernel")

from ..aot_compile import OTHER_TRITON, compile_in_subprocesses, triton_install  # noqa: E402
from ..cuda_compile import ARCHS, FP8, triton_version, variants  # noqa: E402

# The fp8 formats sm_89 and later convert in hardware, and the instruction that does.
CVT = {"float8_e4m3fn": "cvt.rn.satfinite.e4m3x2.f32", "float8_e5m2": "cvt.rn.satfinite.e5m2x2.f32"}
FP8_SATURATING, FP8_BITS = 1, 2  # the store modes of backends/triton.py (_FP8_SATURATING, _FP8_BITS)
VARIANTS = variants()


@pytest.fixture(scope="module", params=["installed", OTHER_TRITON], ids=lambda t: f"triton-{t}")
def compiled(request) -> dict:
    triton_dir = None if request.param == "installed" else triton_install(request.param)
    results = compile_in_subprocesses("tests.cuda_compile", ARCHS, triton_dir=triton_dir)
    # Compiled by the Triton asked for: the environment's, or OTHER_TRITON from its directory.
    versions = {r["triton"] for r in results.values()}
    assert versions == ({triton_version()} if triton_dir is None else {request.param}), versions
    return results


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: f"{v.op}-{v.label}")
@pytest.mark.parametrize("arch", list(ARCHS))
def test_compiles_without_spills(compiled, arch, v):
    r = compiled[(arch, v.op, v.label)]
    assert r["cubin_bytes"] > 0
    assert (r["spill_stores"], r["spill_loads"], r["stack"]) == (0, 0, 0), r
    assert 0 < r["regs"] <= 255, r


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: f"{v.op}-{v.label}")
@pytest.mark.parametrize("arch", list(ARCHS))
def test_hardware_fp8_conversion_exactly_where_the_gpu_has_it(compiled, arch, v):
    r = compiled[(arch, v.op, v.label)]
    used = ({v.cache} | {v.out}) & set(FP8)
    assert set(r["native_fp8"]) == used & set(CVT), r["native_fp8"]
    if v.cache in FP8:
        assert r["modes"]["CACHE_MODE"] == (FP8_SATURATING if v.cache in CVT else FP8_BITS)
    if v.out in FP8:
        assert r["modes"]["OUT_MODE"] == (FP8_SATURATING if v.out in CVT else FP8_BITS)
    assert set(r["fp8_cvt"]) == {CVT[f] for f in used & set(CVT)}, r["fp8_cvt"]
    # Programmatic dependent launch on sm_90: the kernel waits for its inputs, then lets the next one start.
    assert r["pdl"] is True
    assert r["griddepcontrol"] == ["griddepcontrol.launch_dependents", "griddepcontrol.wait"]
