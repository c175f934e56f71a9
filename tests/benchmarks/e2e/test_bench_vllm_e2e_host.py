"""bench_vllm_e2e.py's host-time analysis on synthetic request records (no vLLM, no engine)."""

from __future__ import annotations

import pytest

from benchmarks.e2e import vllm_engine


@pytest.fixture(scope="module")
def B():
    from benchmarks.e2e import bench_vllm_e2e  # sets vLLM's environment defaults when imported

    return bench_vllm_e2e


def _request(side: str, speed: float, common: float, attention: float, pieces: float, rest: float,
             op3: bool = True) -> dict:  # fmt: skip
    """One TTFT request's host record as install_host_timer / install_region_timer report it, for a
    host running ``speed`` times slower than the reference (all Python equally). ``op3``: the
    plugin side builds the key with op 3 (opt-in), else vLLM's concat does, inside forward_mha."""
    s = speed
    if side == "on":
        key = 0.4 * attention
        regions = {"forward_mha": [61, s * (common + key)],
                   "plugin prefill key (op 3)" if op3 else "vLLM key concat": [61, s * key],
                   "MLAAttention.forward_impl": [61, s * (common + key + 1.0)],
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


def test_host_split_of_the_plugin_side_with_either_key(B):
    """The plugin side's forward_mha holds op 3 where it is opted in, vLLM's key concat otherwise:
    either is the key, taken out of vLLM's common code the same way."""
    for op3 in (True, False):
        split = B._host_split("on", _request("on", 1.0, 13.0, 11.4, 15.4, 4.3, op3=op3))
        assert (split["common"], split["attention"], split["pieces"], split["rest"]) == pytest.approx(
            (13.0, 11.4, 15.4, 4.3)), op3


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


class _Runner:
    """A model runner whose execute_model calls a region function ``regions_per_call`` times."""

    def __init__(self, region_fn):
        self.region_fn = region_fn

    def execute_model(self, scheduler_output, calls: int = 1):
        for _ in range(calls):
            self.region_fn()

    def sample_tokens(self, *args):
        return None


def test_each_execute_model_call_gets_the_regions_timed_inside_it(monkeypatch):
    """The host timer keeps, per execute_model call, the region calls and seconds of that call
    alone: a request of three steps (one running the region twice, one not at all) gives three
    records whose counts are 2, 0 and 1, and host_summary lists them beside execute_model_ms."""
    import types

    totals: dict = {}

    def region():
        row = totals.setdefault("forward_mha", [0, 0.0])
        row[0] += 1
        row[1] += 0.001

    monkeypatch.setattr(vllm_engine, "_REGION_TOTALS", totals)
    worker = types.SimpleNamespace(model_runner=_Runner(region))
    assert vllm_engine.install_host_timer(worker)
    worker._mla_host_log["regions"] = totals  # what install_region_timer does, without vLLM's classes
    step = types.SimpleNamespace(total_num_scheduled_tokens=1028)
    worker.model_runner.execute_model(step, calls=2)
    worker.model_runner.execute_model(types.SimpleNamespace(total_num_scheduled_tokens=4), calls=0)
    worker.model_runner.execute_model(types.SimpleNamespace(total_num_scheduled_tokens=5), calls=1)
    host = vllm_engine.host_summary(vllm_engine.read_host_timer(worker))
    assert host["execute_model_tokens"] == [1028, 4, 5]
    per_call = host["execute_model_regions_ms"]
    assert [r.get("forward_mha", [0, 0.0])[0] for r in per_call] == [2, 0, 1]
    assert per_call[0]["forward_mha"][1] == pytest.approx(2.0) and per_call[2]["forward_mha"][1] == pytest.approx(1.0)
    assert host["regions_ms"]["forward_mha"] == [3, pytest.approx(3.0)]
    # The read cleared everything: the next request starts from zero.
    worker.model_runner.execute_model(step, calls=1)
    again = vllm_engine.host_summary(vllm_engine.read_host_timer(worker))
    assert again["execute_model_regions_ms"] == [{"forward_mha": [1, pytest.approx(1.0)]}]


def test_mixed_step_host_picks_the_call_that_admitted_the_prompt(B):
    regions = [{"forward_mha": [61, 1.0]}, {"forward_mha": [61, 9.0], "plugin forward_fused": [61, 20.0]}, {}]
    host = {"execute_model_ms": [5.0, 48.0, 0.4], "execute_model_tokens": [4, 1028, 5],
            "execute_model_regions_ms": regions, "regions_ms": {"forward_mha": [122, 10.0]}}  # fmt: skip
    got = B.mixed_step_host(host, 1024)
    assert got["execute_model_ms"] == [48.0] and got["execute_model_tokens"] == [1028]
    assert got["regions_ms"] == regions[1]  # that step's own regions, not the request's totals
    assert got["request_execute_model_ms"] == [5.0, 48.0, 0.4]
    assert B.mixed_step_host({**host, "execute_model_tokens": [4, 600, 5]}, 1024) is None  # the prompt was split
    assert B.mixed_step_host({k: v for k, v in host.items() if k != "execute_model_regions_ms"}, 1024) is None
    # The equal-speed analysis reads the mixed section like the prefill one.
    on = [{"side": "on", "mixed": {"1024": {"host": [_request("on", s, 13.0, 11.0, 15.0, 4.0) for s in (1.0, 2.0)]}}}]
    off = [{"side": "off", "mixed": {"1024": {"host": [_request("off", s, 13.0, 12.0, 17.0, 6.0) for s in (0.8, 1.0, 1.5)]}}}]
    eq = B.host_at_equal_speed(on, off, "1024", "mixed")
    assert eq["on"]["attention_ms"] == pytest.approx(11.0) and eq["off"]["attention_ms"] == pytest.approx(12.0)
    assert B.host_at_equal_speed(on, off, "1024") == {}  # no prefill records in these engines
