"""benchmarks/e2e/e2e_pool.py: the exact Mann-Whitney test and the pooling of engines over runs."""

from __future__ import annotations

import gzip
import itertools
import json
import random
import sys

import pytest

from benchmarks.e2e import e2e_pool


def _u(xs, ys):
    return sum((x > y) + 0.5 * (x == y) for x in xs for y in ys)


def _permutation_p(xs, ys):
    """Two-sided p by relabelling every split of the pooled values (the definition)."""
    pooled, m = xs + ys, len(xs)
    centre = len(xs) * len(ys) / 2
    observed = abs(_u(xs, ys) - centre)
    hits = total = 0
    for idx in itertools.combinations(range(len(pooled)), m):
        chosen = set(idx)
        a = [pooled[i] for i in idx]
        b = [pooled[i] for i in range(len(pooled)) if i not in chosen]
        hits += abs(_u(a, b) - centre) >= observed - 1e-9
        total += 1
    return hits / total


def _permutation_p_greater(xs, ys):
    """One-sided p (xs larger) by relabelling every split: the share of splits whose U is at least
    the observed one."""
    pooled, m = xs + ys, len(xs)
    observed = _u(xs, ys)
    hits = total = 0
    for idx in itertools.combinations(range(len(pooled)), m):
        chosen = set(idx)
        a = [pooled[i] for i in idx]
        b = [pooled[i] for i in range(len(pooled)) if i not in chosen]
        hits += _u(a, b) >= observed - 1e-9
        total += 1
    return hits / total


@pytest.mark.parametrize("m,n", [(1, 1), (1, 4), (2, 3), (3, 3), (4, 5), (5, 5), (7, 7)])
def test_mann_whitney_matches_the_permutation_definition(m, n):
    rng = random.Random(1000 * m + n)
    for _ in range(3):
        xs = [rng.uniform(40, 90) for _ in range(m)]
        ys = [rng.uniform(40, 90) + rng.choice([0, 8]) for _ in range(n)]
        got = e2e_pool.mann_whitney(xs, ys)
        assert got["u"] == pytest.approx(_u(xs, ys))
        assert got["pairs"] == m * n
        assert got["p_two_sided"] == pytest.approx(_permutation_p(xs, ys))
        assert got["p_x_greater"] == pytest.approx(_permutation_p_greater(xs, ys))


def test_the_one_sided_p_says_which_side_is_larger():
    """The plugin's engines slower than every off engine: small p for "on is larger"; the same
    values the other way round: p near 1 (a one-sided test is not symmetric)."""
    slow, fast = [60.0, 61.0, 62.0, 63.0], [50.0, 51.0, 52.0, 53.0]
    assert e2e_pool.mann_whitney(slow, fast)["p_x_greater"] == pytest.approx(1 / 70)
    assert e2e_pool.mann_whitney(fast, slow)["p_x_greater"] == pytest.approx(1.0)
    assert e2e_pool.mann_whitney(slow, fast)["p_two_sided"] == pytest.approx(2 / 70)


# (xs, ys, U, p): p as the hand-written exact test computed it (the recurrence on whether the
# largest value is an x or a y, every U at least as far from m*n/2 as the observed one) before
# e2e_pool.py used scipy: its values on these samples, computed with benchmarks/e2e_pool.py of
# commit aab42ee.
OLD_P = {
    "1k-TTFT-like 7 vs 7": ([60.4, 58.1, 71.2, 55.0, 63.3, 49.8, 66.7], [51.0, 47.9, 58.6, 44.2, 53.3, 61.5, 49.1],
                            40.0, 0.05303030303030303),
    "one each": ([2.0], [1.0], 1.0, 1.0),
    "2 vs 3": ([3.1, 7.4], [1.2, 5.5, 9.9], 3.0, 1.0),
    "at the centre": ([1.0, 4.0, 5.0, 8.0], [2.0, 3.0, 6.0, 7.0], 8.0, 1.0),
    "separated 4 vs 4": ([10.0, 11.0, 12.0, 13.0], [1.0, 2.0, 3.0, 4.0], 16.0, 0.02857142857142857),
    "lower 5 vs 6": ([40.2, 41.7, 43.9, 45.0, 52.3], [44.1, 47.5, 49.0, 50.6, 53.8, 55.2], 5.0, 0.08225108225108226),
    "9 vs 10": ([12.0, 15.0, 17.0, 21.0, 22.0, 25.0, 26.0, 30.0, 33.0],
                [14.0, 16.0, 18.0, 19.0, 20.0, 23.0, 24.0, 27.0, 28.0, 29.0], 47.0, 0.9048258243304683),
    "two ties, whole U": ([1.0, 2.0, 3.0], [2.0, 3.0, 4.0], 2.0, 0.4),
}


@pytest.mark.parametrize("case", list(OLD_P))
def test_mann_whitney_gives_the_hand_written_tests_p_values(case):
    xs, ys, u, p = OLD_P[case]
    got = e2e_pool.mann_whitney(xs, ys)
    assert got["u"] == u and got["pairs"] == len(xs) * len(ys)
    assert got["p_two_sided"] == pytest.approx(p, rel=1e-12)
    assert e2e_pool.mann_whitney(ys, xs)["p_two_sided"] == pytest.approx(p, rel=1e-12)  # two-sided: symmetric


def test_mann_whitney_half_integral_u_takes_the_tail_towards_the_centre():
    """One tie leaves U = 3.5 of 9 pairs. scipy's exact test takes the no-ties tail from U = 5
    (max(U, 9 - U) = 5.5, rounded down): p = 2 P(U >= 5) = 1.0. The hand-written test counted every
    U at least as far from 4.5 (U <= 3 or U >= 6): p = 0.7 (its value at commit aab42ee). The
    permutation count over the tied values themselves gives 0.8."""
    xs, ys = [1.0, 2.0, 5.0], [2.0, 3.0, 4.0]
    got = e2e_pool.mann_whitney(xs, ys)
    assert got["u"] == 3.5 and got["p_two_sided"] == pytest.approx(1.0)
    assert _permutation_p(xs, ys) == pytest.approx(0.8)


def test_mann_whitney_extremes_and_empty_samples():
    got = e2e_pool.mann_whitney([10.0, 11.0, 12.0, 13.0], [1.0, 2.0, 3.0, 4.0])
    # 2 of the C(8, 4) = 70 splits are as extreme: counted by brute force here.
    assert got["u"] == 16 and got["p_two_sided"] == pytest.approx(2 / 70)
    assert _permutation_p([10.0, 11.0, 12.0, 13.0], [1.0, 2.0, 3.0, 4.0]) == pytest.approx(2 / 70)
    assert e2e_pool.mann_whitney([], [1.0]) is None and e2e_pool.mann_whitney([1.0], []) is None


def _engine(index, side, kv, ttft_ms, common_ms=None, error=False):
    e = {"index": index, "side": side, "kv_cache_dtype": kv, "prefill": {"1024": {"ttft_s": [t / 1e3 for t in ttft_ms]}}}
    if common_ms is not None:
        # --host-regions records: forward_mha minus the side's own part is the common code.
        own = "plugin prefill key (op 3)" if side == "on" else "vLLM key concat"
        e["prefill"]["1024"]["host"] = [
            {"execute_model_ms": [50.0 + c, 0.2], "regions_ms": {"forward_mha": [61, c + 3.0], own: [61, 3.0],
                                                            "MLAAttention.forward_impl": [61, c + 5.0],
                                                            "plugin forward_fused": [61, c + 9.0]}}
            for c in common_ms
        ]  # fmt: skip
    if error:
        e["error"] = "start: RuntimeError: boom"
    return e


def _report(engines, decode):
    return {"config": {"mode": "full"}, "engines": engines, "summary": {"auto": {"decode": decode}}}


def _decode_row(saved, predicted, engines_on=2):
    return {"saving_busy_us": saved, "predicted_saving_us": predicted, "measured_over_predicted": saved / predicted,
            "tpot_delta_ms": -0.1, "tpot_noise_ms": 0.2, "engines_on": engines_on}  # fmt: skip


def test_pool_takes_every_engines_median_and_each_runs_ratio():
    rng = random.Random(7)
    on_a, off_a = [[rng.uniform(45, 80) for _ in range(5)] for _ in range(2)], [[rng.uniform(40, 70) for _ in range(5)]]
    on_b, off_b = [[rng.uniform(45, 80) for _ in range(5)]], [[rng.uniform(40, 70) for _ in range(5)] for _ in range(2)]
    common = [rng.uniform(12, 20) for _ in range(4)]
    run_a = _report(
        [_engine(0, "on", "auto", on_a[0], common), _engine(1, "off", "auto", off_a[0], common[::-1]),
         _engine(2, "on", "auto", on_a[1]), _engine(3, "on", "fp8", [999.0] * 3),
         _engine(4, "off", "auto", [1.0] * 3, error=True)],
        {"1": _decode_row(120.0, 100.0), "64": _decode_row(150.0, 200.0)},
    )  # fmt: skip
    run_b = _report(
        [_engine(0, "on", "auto", on_b[0]), _engine(1, "off", "auto", off_b[0]), _engine(2, "off", "auto", off_b[1])],
        {"1": _decode_row(90.0, 100.0, engines_on=1), "64": _decode_row(-10.0, 200.0, engines_on=1)},
    )  # fmt: skip
    pooled = e2e_pool.pool({"a": run_a, "b": run_b})["auto"]

    def medians(runs):
        return sorted(e2e_pool.med(r) for r in runs)

    ttft = pooled["prefill"][1024]["ttft_ms"]
    assert sorted(ttft["on"]) == pytest.approx(medians(on_a + on_b))  # the fp8 engine stays out
    assert sorted(ttft["off"]) == pytest.approx(medians(off_a + off_b))  # the failed engine too
    assert ttft["median"]["on"] == pytest.approx(e2e_pool.med(medians(on_a + on_b)))
    assert ttft["mann_whitney"]["pairs"] == 3 * 3
    # execute_model's host time of the prefill step (the first call of each TTFT request):
    # 50 + c per request in _engine, so the engine's median is 50 + the median of c.
    execs = pooled["prefill"][1024]["execute_model_host_ms"]
    assert execs["on"] == pytest.approx([50.0 + e2e_pool.med(common)])
    assert execs["off"] == pytest.approx([50.0 + e2e_pool.med(common[::-1])])
    assert "p_x_greater" in execs["mann_whitney"]
    # The attention region over vLLM's forward_mha code, per request (9 / c on, 5 / c off in _engine).
    ratio = pooled["prefill"][1024]["attention_per_forward_mha"]
    assert ratio["on"] == pytest.approx([e2e_pool.med([9.0 / c for c in common])])
    assert ratio["off"] == pytest.approx([e2e_pool.med([5.0 / c for c in common])])
    common_ms = pooled["prefill"][1024]["forward_mha_host_ms"]
    assert common_ms["on"] == pytest.approx([e2e_pool.med(common)]) and common_ms["off"] == pytest.approx(
        [e2e_pool.med(common)]
    )
    d1, d64 = pooled["decode"][1], pooled["decode"][64]
    assert d1["ratio_median"] == pytest.approx(1.05) and d1["ratio_min"] == pytest.approx(0.9)
    assert d64["ratio_min"] == pytest.approx(-0.05) and d64["runs_lower"] == 1 and d64["runs_measured"] == 2
    assert d1["runs"]["b"]["tpot_noise_ms"] is None  # one engine per side: no spread to call noise
    assert d1["runs"]["a"]["tpot_noise_ms"] == 0.2
    text = e2e_pool.markdown(e2e_pool.pool({"a": run_a, "b": run_b}), ["a", "b"])
    assert "| 64 | 0.75 | -0.05 | 0.35 | -0.05 | 1 of 2 |" in text


def test_pool_keeps_the_mixed_steps_apart_from_the_prefills():
    """An engine's "mixed" section (a prompt joining running decodes) pools under "mixed", keyed by
    the prompt's length, with its own TTFT and host figures; the prefill rows stay as they were."""
    engines = []
    for i, side in enumerate(["on", "off", "off", "on"]):
        e = _engine(i, side, "auto", [50.0 + i], [14.0])
        e["mixed"] = {"1024": {"ttft_s": [0.070 + 0.001 * i], "host": [dict(h) for h in e["prefill"]["1024"]["host"]]}}
        engines.append(e)
    pooled = e2e_pool.pool({"a": _report(engines, {})})["auto"]
    mixed = pooled["mixed"][1024]
    assert sorted(mixed["ttft_ms"]["on"]) == pytest.approx([70.0, 73.0])
    assert sorted(mixed["ttft_ms"]["off"]) == pytest.approx([71.0, 72.0])
    assert mixed["attention_per_forward_mha"]["on"] == pytest.approx([9.0 / 14.0] * 2)
    assert mixed["execute_model_host_ms"]["off"] == pytest.approx([64.0, 64.0])
    assert sorted(pooled["prefill"][1024]["ttft_ms"]["on"]) == pytest.approx([50.0, 53.0])
    text = e2e_pool.markdown(e2e_pool.pool({"a": _report(engines, {})}), ["a"])
    assert "| mixed 1024 | ttft_ms | 2 | 2 |" in text
    assert "| mixed 1024 | attention_per_forward_mha | 2 | 2 | 0.643 | 0.357 |" in text


def test_main_reads_gzipped_runs_and_refuses_smoke_only_input(tmp_path, capsys):
    rng = random.Random(3)
    report = _report([_engine(0, "on", "auto", [rng.uniform(40, 60) for _ in range(3)]),
                      _engine(1, "off", "auto", [rng.uniform(40, 60) for _ in range(3)])],
                     {"1": _decode_row(110.0, 100.0)})  # fmt: skip
    path = tmp_path / "bench_vllm_e2e_h200_x.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(report, f)
    out = tmp_path / "pool.md"
    sys_argv = sys.argv
    try:
        sys.argv = ["e2e_pool", str(path), "--out", str(out)]
        assert e2e_pool.main() == 0
        assert "`h200_x`" in out.read_text() and "| 1 | 1.10 |" in out.read_text()
        smoke = tmp_path / "bench_vllm_e2e_smoke.json"
        smoke.write_text(json.dumps({**report, "config": {"mode": "smoke"}}))
        sys.argv = ["e2e_pool", str(smoke)]
        assert e2e_pool.main() == 2
    finally:
        sys.argv = sys_argv
    assert "CPU smoke run" in capsys.readouterr().err


def test_pool_takes_each_engines_median_host_probe():
    rng = random.Random(11)
    engines = []
    expected = {"on": [], "off": []}
    for i, side in enumerate(["on", "off", "off", "on"]):
        e = _engine(i, side, "auto", [50.0, 51.0])
        e["host_probe"] = [{"python_us_per_1k": rng.uniform(50, 120), "torch_slice_us": rng.uniform(1, 4)}
                           for _ in range(3)]  # fmt: skip
        expected[side].append(e2e_pool.med([x["python_us_per_1k"] for x in e["host_probe"]]))
        engines.append(e)
    engines.append(_engine(9, "on", "auto", [50.0]))  # no probe (an older run): left out
    pooled = e2e_pool.pool({"a": _report(engines, {})})["auto"]
    slot = pooled["engine"]["probe_python_us_per_1k"]
    assert slot["on"] == pytest.approx(expected["on"]) and slot["off"] == pytest.approx(expected["off"])
    assert slot["mann_whitney"]["pairs"] == 4
    assert "| all | probe_python_us_per_1k | 2 | 2 |" in e2e_pool.markdown(e2e_pool.pool({"a": _report(engines, {})}), ["a"])
