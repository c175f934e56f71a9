"""The Triton kernel compiles for H100/H200 (sm_90), on a CPU, in CI.

A compile check, not a run: every op and every store mode the host code selects
on a Hopper GPU, bound as the public ops bind it and as the vLLM plugin does (the
early-index-loads promise), goes through Triton's NVIDIA backend to PTX and a cubin
(tests/cuda_compile.py: the launch arguments are recorded from a real call of
the backend on a simulated CUDA machine; ptxas ships in the triton wheel).
Asserted: it compiles, no register spills and no stack frame, the hardware fp8
conversion exactly where ``_native_fp8_ok`` says sm_90 has it (e4m3fn, e5m2; the
bit encoder for e4m3fnuz), and programmatic dependent launch's instructions in
every variant (``_pdl_ok``), and the order of the loads around its wait (issue 41,
S2). Registers per thread and a hash of each variant's PTX: ``python -m
tests.cuda_compile``. ~90 s per Triton on 2 cores (76 variants): one subprocess each.

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


# The loads each kind of program makes before its rope table: the index tensors (issue 41, S2).
INDEX = {"cache": {"pos_ptr", "slot_ptr"}, "query": {"pos_ptr"}}
ROPE_INPUT = {"cache": "k_pe_ptr", "query": "q_pe_ptr"}


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: f"{v.op}-{v.label}")
@pytest.mark.parametrize("arch", list(ARCHS))
def test_index_and_table_loads_come_before_the_wait_only_where_promised(compiled, arch, v):
    """As the public ops bind it, the kernel waits for the previous kernel before any load; as
    the vLLM plugin binds it (binding.py's ``early_index_loads`` promise), each kind of program
    loads its positions (and slots) and its rope-table rows, then waits, then loads its data.
    Either way the data a rotation takes (k_pe, q_pe) is loaded before the rope table, whose
    address waits for the position (Triton IR, load by load; PTX: the waits and the global
    loads before the first)."""
    r = compiled[(arch, v.op, v.label)]
    order = r["load_order"]
    assert r["early_index_loads"] is v.early
    if not v.early:
        assert order["entry"] == ["wait"] and (r["waits"], r["loads_before_wait"]) == (1, 0), r
    else:
        # One wait per program kind, twice for a kind compiled for a power-of-two scale too.
        assert order["entry"] == [] and r["waits"] >= 2 and r["loads_before_wait"] > 0, r
    for program in ("cache", "query"):
        loads = order[program]
        # A scaled store's program first reads its scale's bits, which pick the power-of-two
        # copy (backends/triton.py, _scale_is_pow2): under the promise, before the wait too.
        if loads and loads[0] in ("cache_scale_ptr", "q_scale_ptr"):  # op 2's output scale: its query's
            loads = loads[1:]
        early = INDEX[program] | {"cos_sin_ptr"}
        assert loads[: len(INDEX[program])] == sorted(INDEX[program]), loads  # pos_ptr, then slot_ptr
        if v.early:
            k = loads.index("wait")
            assert set(loads[:k]) == early and not early & set(loads[k + 1 :]), loads
            assert loads.count("wait") == 1
        else:
            assert "wait" not in loads and loads.index(ROPE_INPUT[program]) < loads.index("cos_sin_ptr"), loads


# What each op rotates in place: ops 1 and 3 k_pe in their cache programs and q_pe in their query
# programs; op 2 neither (it writes q_out and the cache from inputs it leaves as they are).
IN_PLACE = {"rope_cache_write": {"cache": "k_pe_ptr", "query": "q_pe_ptr"}, "decode": {},
            "prefill": {"cache": "k_pe_ptr", "query": "q_pe_ptr"}}  # fmt: skip


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: f"{v.op}-{v.label}")
@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_warp_loads_before_any_warp_stores_in_place(compiled, arch, v):
    """A program that stores into a tensor it reads (the in-place rotations) loads its whole
    tile, then waits at a CTA barrier, then stores: several warps hold a small tile at once, and
    one that ran ahead would otherwise rotate in place what a slower one has yet to load
    (backends/triton.py, _loads_before_in_place_stores; op 3's key came out rotated twice on an
    H100 without it). A program that writes only what it does not read pays for no barrier.

    Checked in Triton's first IR (TTIR) and in its GPU IR (TTGIR), where the compiler may copy a
    load into another layout: the copy of the k_pe tile that every warp held whole, and raced on,
    is one of those."""
    r = compiled[(arch, v.op, v.label)]
    for ir in ("load_order", "load_order_ttgir"):
        order = r[ir]
        assert "barrier" not in order["entry"], (ir, order)
        for program in ("cache", "query"):
            steps = order[program]
            stored = {s.split()[1] for s in steps if s.startswith("store ")}
            loaded = {s for s in steps if s not in ("wait", "barrier") and not s.startswith("store ")}
            in_place = IN_PLACE[v.op].get(program)
            assert stored & loaded == ({in_place} if in_place else set()), (ir, steps)
            if in_place is None:
                assert "barrier" not in steps, (ir, steps)
                continue
            # Every load of the in-place tensor (and the one wait), the barrier, then the stores; loads
            # of other tensors may follow (latent or nope columns past the first 512, stored as loaded).
            assert steps.count("barrier") == 1, (ir, steps)
            k = steps.index("barrier")
            assert not any(s.startswith("store ") for s in steps[:k]), (ir, steps)
            assert in_place not in steps[k + 1 :] and "wait" not in steps[k + 1 :], (ir, steps)
            assert any(s.startswith("store ") for s in steps[k + 1 :]), (ir, steps)
