"""bench_vllm_e2e.py's host-time analysis on synthetic request records (no vLLM, no engine)."""

from __future__ import annotations

import pytest

from benchmarks.e2e import vllm_engine


@pytest.fixture(scope="module")
def B():
    from benchmarks.e2e import bench_vllm_e2e  # sets vLLM's environment defaults when imported

    return bench_vllm_e2e


def _request(side: str, speed: float, common: float, attention: float, pieces: float, rest: float) -> dict:
    """One TTFT request's host record as install_host_timer / install_region_timer report it, for a
    host running ``speed`` times slower than the reference (all Python equally)."""
    s = speed
    if side == "on":
        op3 = 0.4 * attention
        regions = {"forward_mha": [61, s * (common + op3)], "plugin prefill key (op 3)": [61, s * op3],
                   "MLAAttention.forward_impl": [61, s * (common + op3 + 1.0)],
                   "plugin forward_fused": [61, s * (common + attention)]}  # fmt: skip
    else:
        concat, write = 0.3 * attention, 0.2 * attention
        regions = {"forward_mha": [61, s * (common + concat)], "vLLM key concat": [61, s * concat],
                   "MLAAttention.forward_impl": [61, s * (common + attention - write)],
                   "vLLM cache write": [61, s * write]}  # fmt: skip
    regions["compiled piece"] = [62, s * pieces]
    return {"execute_model_ms": [s * (common + attention + pieces + rest), 0.1], "regions_ms": regions}


def test_host_at_equal_speed_removes_the_host_speed(B):
    """Requests of one side differ only by the host's speed: at equal speed they are all the same,
    and each part comes back as built; the factor is measured on vLLM's own code."""
    off = [{"side": "off", "prefill": {"1024": {"host": [_request("off", s, 13.0, 8.0, 18.5, 7.0)
                                                            for s in (0.8, 1.0, 1.5)]}}}]  # fmt: skip
    on = [{"side": "on", "prefill": {"1024": {"host": [_request("on", s, 13.0, 11.4, 15.4, 4.3)
                                                          for s in (1.6, 2.0, 1.9, 1.5)]}}}]  # fmt: skip
    eq = B.host_at_equal_speed(on, off, "1024")
    assert eq["off"]["requests"] == 3 and eq["on"]["requests"] == 4
    assert eq["off"]["speed_factor_range"] == pytest.approx((0.8, 1.5))
    assert eq["on"]["speed_factor_range"] == pytest.approx((1.5, 2.0))
    for side, want in (("off", (13.0, 8.0, 18.5, 7.0)), ("on", (13.0, 11.4, 15.4, 4.3))):
        x = eq[side]
        got = (x["common_ms"], x["attention_ms"], x["pieces_ms"], x["rest_ms"])
        assert got == pytest.approx(want), side
        assert x["execute_ms"] == pytest.approx(sum(want))


def test_host_at_equal_speed_needs_region_records(B):
    plain = [{"side": "off", "prefill": {"1024": {"host": [{"execute_model_ms": [40.0]}]}}}]
    assert B.host_at_equal_speed([], plain, "1024") == {}
    assert B._host_split("off", {"execute_model_ms": [1.0], "regions_ms": {}}) is None


def test_pairs_alternate_which_side_goes_first(B):
    """on, off, off, on, ...: neither side always starts right after the other's teardown; the
    first engine of each pair names its partner (the deadline keeps room for it)."""
    from types import SimpleNamespace

    bench = SimpleNamespace(args=SimpleNamespace(kv_cache_dtypes=["auto", "fp8"], runs=3))
    plan = B.Bench.plan(bench)
    assert [(kv, side) for kv, side, _ in plan] == [
        ("auto", "on"), ("auto", "off"), ("auto", "off"), ("auto", "on"), ("auto", "on"), ("auto", "off"),
        ("fp8", "on"), ("fp8", "off"), ("fp8", "off"), ("fp8", "on"), ("fp8", "on"), ("fp8", "off"),
    ]  # fmt: skip
    for first, second in zip(plan[::2], plan[1::2]):
        assert first[2] == second[1] != first[1] and second[2] is None


def test_host_speed_probe_times_fixed_work():
    probe = vllm_engine.host_speed_probe(None)
    # ~50-300 us per 1000 dict iterations and ~1-10 us per slice on the machines seen so far.
    assert 1 < probe["python_us_per_1k"] < 10_000 and 0.05 < probe["torch_slice_us"] < 1_000
