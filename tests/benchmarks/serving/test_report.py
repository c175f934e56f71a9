"""benchmarks/serving/report.py: vLLM's result files gathered per load and side, compared, written out."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest

from benchmarks.serving import report

from .conftest import vllm_result

VLLM_SERVE = Path(importlib.util.find_spec("vllm").origin).parent / "benchmarks" / "serve.py" if importlib.util.find_spec("vllm") else None


def _two_per_side():
    # on: TTFT 120 and 130, off: 100 and 110; off servers are 1 and 2 (order on, off, off, on)
    return [
        vllm_result(0, "on", "rate4", ttft_ms=120.0, tpot_ms=21.0, req_s=3.9),
        vllm_result(1, "off", "rate4", ttft_ms=100.0, tpot_ms=20.0, req_s=4.0),
        vllm_result(2, "off", "rate4", ttft_ms=110.0, tpot_ms=22.0, req_s=4.0),
        vllm_result(3, "on", "rate4", ttft_ms=130.0, tpot_ms=23.0, req_s=3.9),
        vllm_result(0, "on", "saturate", tok_s=9000.0),
        vllm_result(1, "off", "saturate", tok_s=8000.0),
    ]


def test_each_side_gets_its_own_servers_figures_and_their_spread(write_results):
    results = report.read_results(write_results(_two_per_side()))
    loads = report.summarize(results, ["on", "off"], layers=61)
    on, off = loads["rate4"]["sides"]["on"], loads["rate4"]["sides"]["off"]
    assert [s["server"] for s in on["servers"]] == [0, 3]
    assert [s["server"] for s in off["servers"]] == [1, 2]
    assert on["summary"]["median_ttft_ms"] == {"median": 125.0, "min": 120.0, "max": 130.0, "n": 2}
    assert off["summary"]["median_ttft_ms"] == {"median": 105.0, "min": 100.0, "max": 110.0, "n": 2}
    assert off["summary"]["p99_ttft_ms"]["max"] == pytest.approx(330.0)
    assert on["summary"]["median_tpot_ms"]["median"] == pytest.approx(22.0)
    assert loads["saturate"]["sides"]["on"]["summary"]["output_throughput"]["n"] == 1


def test_the_comparison_is_on_against_off(write_results):
    loads = report.summarize(report.read_results(write_results(_two_per_side())), ["on", "off"], layers=61)
    (row,) = loads["rate4"]["comparisons"]
    assert (row["side"], row["against"]) == ("on", "off")
    assert row["metrics"]["median_ttft_ms"]["ratio"] == pytest.approx(125.0 / 105.0)
    assert row["metrics"]["median_ttft_ms"]["delta"] == pytest.approx(20.0)
    assert row["metrics"]["request_throughput"]["ratio"] == pytest.approx(3.9 / 4.0)
    assert "delta_scaled_to_61_layers" not in row["metrics"]["median_ttft_ms"]  # the full depth: nothing to scale
    assert loads["saturate"]["comparisons"][0]["metrics"]["output_throughput"]["ratio"] == pytest.approx(9 / 8)


def test_a_baseline_checkout_is_compared_with_off_and_with_on():
    assert report.comparison_pairs(["on", "off", "on@/b"]) == [("on", "off"), ("on@/b", "off"), ("on", "on@/b")]
    assert report.comparison_pairs(["on", "on@/b"]) == [("on@/b", "on")]  # no off: against the first side, once


def test_a_switch_variant_is_compared_with_off_and_with_its_own_plugin_side():
    assert report.comparison_pairs(["on", "off", "on+VLLM_MLA_FUSION_DECODE=0"]) == [
        ("on", "off"), ("on+VLLM_MLA_FUSION_DECODE=0", "off"), ("on+VLLM_MLA_FUSION_DECODE=0", "on")]
    # A baseline's variant against that baseline, not as a baseline of its own.
    assert report.comparison_pairs(["on", "off", "on@/b", "on@/b+VLLM_MLA_FUSION_PDL=0"]) == [
        ("on", "off"), ("on@/b", "off"), ("on@/b+VLLM_MLA_FUSION_PDL=0", "off"), ("on", "on@/b"),
        ("on@/b+VLLM_MLA_FUSION_PDL=0", "on@/b")]


def test_a_shorter_model_scales_latency_deltas_to_61_layers(write_results):
    results = report.read_results(write_results(_two_per_side()))
    loads = report.summarize(results, ["on", "off"], layers=20)
    metrics = loads["rate4"]["comparisons"][0]["metrics"]
    assert metrics["median_ttft_ms"]["delta_scaled_to_61_layers"] == pytest.approx(20.0 * 61 / 20)
    assert "delta_scaled_to_61_layers" not in metrics["request_throughput"]  # throughput does not scale per layer


def test_failed_or_missing_requests_are_problems(write_results):
    results = report.read_results(write_results([vllm_result(0, "on", "rate4", completed=97, failed=3),
                                                 vllm_result(1, "off", "rate4")]))  # fmt: skip
    loads = report.summarize(results, ["on", "off"], layers=61)
    assert loads["rate4"]["problems"] == ["server 0 (on): 97 of 100 requests completed, 3 failed"]


def test_files_without_the_benchmarks_metadata_are_not_read(write_results, tmp_path):
    folder = write_results([vllm_result(0, "on", "rate4")])
    stray = vllm_result(5, "off", "rate4")
    del stray["server"]  # a result file of some other vllm bench serve run
    (folder / "other.json").write_text(json.dumps(stray))
    (folder / "broken.json").write_text("{")
    assert [r["_file"] for r in report.read_results(folder)] == ["00-on-rate4.json"]


def test_prefix_cache_share_per_server(write_results):
    results = report.read_results(write_results(_two_per_side()))
    counters = {(0, "rate4"): {"queries": 1000.0, "hits": 250.0}, (1, "rate4"): {"queries": 0.0, "hits": 0.0}}
    loads = report.summarize(results, ["on", "off"], layers=61, prefix_cache=counters)
    servers = {s["server"]: s for side in loads["rate4"]["sides"].values() for s in side["servers"]}
    assert servers[0]["prefix_cache_hit_fraction"] == 0.25
    assert "prefix_cache_hit_fraction" not in servers[1]  # nothing queried: no share


def test_kernels_compiled_during_a_load_are_told_per_server(write_results):
    """A compile inside a measured load is named with its server and side; a load where every counted
    server compiled nothing says so; servers without a count (older runs) are left out, and so is a load
    none of whose servers was counted; the warm-up's counts are listed apart."""
    results = report.read_results(write_results(_two_per_side()))
    compiles = {(0, "rate4"): ["Triton fused_moe_kernel", "Triton fused_moe_kernel", "Triton _quant"],
                (1, "rate4"): [], (2, "rate4"): [], (0, "saturate"): [], (1, "saturate"): []}  # fmt: skip
    loads = report.summarize(results, ["on", "off"], layers=61, compiles=compiles)
    servers = {s["server"]: s for side in loads["rate4"]["sides"].values() for s in side["servers"]}
    assert servers[0]["kernel_compiles"] == compiles[(0, "rate4")] and servers[1]["kernel_compiles"] == []
    assert "kernel_compiles" not in servers[3]
    rep = _report(loads)
    rep["servers"] = [{"index": 0, "side": "on", "loads": [{"load": "warmup", "kernel_compiles": ["Triton a"] * 4},
                                                           {"load": "rate4", "kernel_compiles": []}]}]  # fmt: skip
    md = report.markdown(rep)
    rate4, saturate = md.split("## saturate")
    assert ("server 0 (on): 3 (Triton fused_moe_kernel x2, Triton _quant x1); server 1 (off): 0; "
            "server 2 (off): 0.") in rate4  # fmt: skip
    assert "none on any of the 2 server(s)" in saturate
    assert "Kernels compiled during the warm-up (not measured): server 0 (on) warmup: 4." in md
    plain = report.markdown(_report(report.summarize(results, ["on", "off"], layers=61)))
    assert "compiled" not in plain


def _report(loads, layers=61, sides=("on", "off")):
    return {"config": {"model_description": "stand-in", "server_summary": "defaults", "sides": list(sides),
                       "layers": layers, "loads": {"rate4": "1024 in / 128 out, 4 req/s, 100 prompts"}},
            "servers_measured": 4, "loads": loads, "skipped": ["server 4 (on): budget"], "errors": []}  # fmt: skip


def test_markdown_table_has_a_row_per_metric_and_the_spread(write_results):
    loads = report.summarize(report.read_results(write_results(_two_per_side())), ["on", "off"], layers=61)
    md = report.markdown(_report(loads))
    assert "| metric | on | off | on / off |" in md
    row = next(line for line in md.splitlines() if line.startswith("| TTFT p50 (ms)"))
    assert row == "| TTFT p50 (ms) | 125.0 [120.0-130.0] | 105.0 [100.0-110.0] | 1.190 |"
    assert sum(line.startswith("| ") for line in md.split("## saturate")[0].splitlines()) == 1 + len(report.METRICS)
    assert "server 4 (on): budget" in md
    # The heading says what was sent, not only the preset: --prompts-scale 0.6 sent 60 of rate4's 100.
    assert "## rate4: 1024 in / 128 out, 4 req/s, 100 prompts (sent: 100 prompts per server)" in md
    scaled = [dict(r, num_prompts=60) if r["load"] == "rate4" else r for r in _two_per_side()]
    loads = report.summarize(report.read_results(write_results(scaled)), ["on", "off"], layers=61)
    assert "100 prompts (sent: 60 prompts per server)" in report.markdown(_report(loads))


def test_markdown_of_a_shorter_model_has_the_scaled_column(write_results):
    loads = report.summarize(report.read_results(write_results(_two_per_side())), ["on", "off"], layers=20)
    md = report.markdown(_report(loads, layers=20))
    row = next(line for line in md.splitlines() if line.startswith("| TTFT p50 (ms)"))
    assert row.endswith(f"| {20.0 * 61 / 20:+.2f} |")


def test_plot_or_a_clear_message(write_results, tmp_path):
    loads = report.summarize(report.read_results(write_results(_two_per_side())), ["on", "off"], layers=61)
    got = report.plot(_report(loads), tmp_path / "p.png")
    if importlib.util.find_spec("matplotlib") is None:
        assert got == "no plot: matplotlib is not installed in this environment"
    else:
        assert got == str(tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 10_000


@pytest.mark.skipif(VLLM_SERVE is None, reason="needs vLLM 0.33.0 installed (its benchmark's source)")
def test_the_fields_read_are_the_ones_vllm_writes():
    """The report's fields against vllm/benchmarks/serve.py itself: a rename in vLLM fails here."""
    source = VLLM_SERVE.read_text()
    for name in ("request_throughput", "output_throughput", "completed", "failed", "num_prompts", "duration"):
        assert re.search(rf'"{name}"', source), name
    # Percentile fields are formatted: median_<metric>_ms and p<percentile>_<metric>_ms.
    assert 'result[f"median_{metric_attribute_name}_ms"]' in source
    assert 'result[f"p{p_word}_{metric_attribute_name}_ms"]' in source
    for name, _, _ in report.METRICS:
        m = re.fullmatch(r"(median|p99)_(ttft|tpot|itl)_ms|request_throughput|output_throughput", name)
        assert m, name


def test_each_servers_host_and_its_own_latencies_are_tabled_beside_the_clients(write_results):
    """Issue 40: a busy API server streams several tokens per message, which the client counts as one
    interval. Per server: the cores each process kept busy over the load's wall time, the server's own
    TTFT and ITL beside the client's, the engine's share of TTFT (queue + prefill), and the client's
    mean ITL over its mean TPOT; a server without the client's readings is left out of the table."""
    results = report.read_results(write_results([vllm_result(0, "on", "rate4", tpot_ms=16.0, itl_ms=40.0),
                                                 vllm_result(1, "off", "rate4")]))  # fmt: skip
    entry = {"wall_s": 20.0, "client_cpu_s": 5.0, "server_cpu_s": {"api_server": 19.0, "EngineCore_DP0": 18.0,
                                                                       "EngineCore_DP1": 2.0, "python3": 1.0},
             "server_latency_ms": {"ttft": 90.0, "itl": 9.0, "queue": 30.0, "prefill": 45.0},
             "engine_steps": {"mixed": {"steps": 12, "prompt_tokens_p50": 2048, "decode_tokens_p50": 40,
                                        "ms_p50": 61.25, "ms_p90": 80.0, "ms_sum": 760.0}}}  # fmt: skip
    # server 1: every reading of the server failed; the client's own means alone make no row
    loads = report.summarize(results, ["on", "off"], layers=61, hosts={(0, "rate4"): entry, (1, "rate4"): {"wall_s": 20.0}})
    servers = {s["server"]: s for side in loads["rate4"]["sides"].values() for s in side["servers"]}
    host = servers[0]["host"]
    assert host["cores"] == {"EngineCore_DP0": 0.9, "EngineCore_DP1": 0.1, "api_server": 0.95, "client": 0.25,
                             "python3": 0.05}  # fmt: skip
    assert host["client_ms"] == pytest.approx({"ttft": 110.0, "itl": 40.0, "tpot": 16.0})
    assert host["tokens_per_message"] == 2.5
    assert host["server_ms"] == entry["server_latency_ms"]
    assert set(servers[1]["host"]) == {"client_ms", "tokens_per_message"}
    md = report.markdown(_report(loads))
    assert "| 0 | on | 0.95 | 1.05 | 0.25 | 90.0 / 110.0 | 75.0 | 9.0 / 40.0 | 2.50 |" in md
    assert "| 1 | off |" not in md
    assert "| 0 | on | mixed | 12 | 2048 / 40 | 61.2 / 80.0 | 760 |" in md
    assert "The API server fell behind the engine** on server(s) 0 (on, 2.50)" in md


def test_a_run_whose_api_server_keeps_up_is_not_flagged(write_results):
    results = report.read_results(write_results([vllm_result(0, "on", "rate4", tpot_ms=16.0, itl_ms=16.5)]))
    entry = {"wall_s": 20.0, "server_cpu_s": {"api_server": 8.0}, "server_latency_ms": {"ttft": 90.0, "itl": 9.0}}
    loads = report.summarize(results, ["on"], layers=61, hosts={(0, "rate4"): entry})
    md = report.markdown(_report(loads, sides=["on"]))
    assert "| 0 | on |" in md and "fell behind" not in md


# The on / off TTFT p50 ratios of issue 40's runs 9 and 10 (H100, --interleave, 12 rounds), and
# their geometric mean and 95% interval computed apart from the report (logarithms, their mean and
# sample SD, t(0.975, 11) = 2.201).
RUNS_9_10_TTFT = [1.469, 0.456, 0.405, 1.297, 1.014, 1.141, 1.714, 1.128, 1.349, 0.723, 0.995, 1.056]


def test_the_rounds_give_a_geometric_mean_and_its_interval():
    got = report.geometric_interval(RUNS_9_10_TTFT)
    assert got["geomean"] == pytest.approx(0.98225, abs=1e-4)
    assert (got["low"], got["high"]) == (pytest.approx(0.74095, abs=1e-4), pytest.approx(1.30213, abs=1e-4))
    two = report.geometric_interval([1.0, 1.21])  # logs 0 and 2 ln 1.1: t(0.975, 1) = 12.706
    half = 12.706 * (2 * 0.0953102 / 2**0.5) / 2**0.5
    assert two["geomean"] == pytest.approx(1.1)
    assert (two["low"], two["high"]) == (pytest.approx(1.1 * 2.718281828 ** -half), pytest.approx(1.1 * 2.718281828 ** half))
    assert report.geometric_interval([1.3]) == {"geomean": pytest.approx(1.3), "low": None, "high": None}


def test_paired_rounds_carry_the_interval_into_the_report():
    sides = ["on", "off"]
    servers = {"on": [{"server": 2 * r, "median_ttft_ms": 100.0 * x} for r, x in enumerate(RUNS_9_10_TTFT)],
               "off": [{"server": 2 * r + 1, "median_ttft_ms": 100.0} for r in range(len(RUNS_9_10_TTFT))]}  # fmt: skip
    paired = report._paired(servers["on"], servers["off"], "median_ttft_ms", len(sides), higher=False)
    assert paired["n"] == 12 and paired["worse"] == 8
    assert (paired["geomean"], paired["low"], paired["high"]) == (
        pytest.approx(0.98225, abs=1e-4), pytest.approx(0.74095, abs=1e-4), pytest.approx(1.30213, abs=1e-4))
    comparison = {"side": "on", "against": "off", "metrics": {"median_ttft_ms": {"paired": paired}}}
    row = next(line for line in report._paired_lines([comparison]) if line.startswith("| TTFT p50"))
    assert "geomean 0.982 (0.741-1.302), worse in 8 of 12" in row


def test_a_failed_round_leaves_no_mean_of_the_rounds():
    """A round where the side measured 0 (its load failed) has no log ratio: the report gives no
    geometric mean or interval then, rather than one over the rounds that worked."""
    on = [{"server": 0, "output_throughput": 0.0}, {"server": 2, "output_throughput": 200.0},
          {"server": 4, "output_throughput": 200.0}]  # fmt: skip
    off = [{"server": 1, "output_throughput": 100.0}, {"server": 3, "output_throughput": 100.0},
           {"server": 5, "output_throughput": 100.0}]  # fmt: skip
    paired = report._paired(on, off, "output_throughput", 2, higher=True)
    assert (paired["n"], paired["worse"], paired["min"]) == (3, 1, 0.0)
    assert paired["geomean"] is None and paired["low"] is None
    comparison = {"side": "on", "against": "off", "metrics": {"output_throughput": {"paired": paired}}}
    row = next(line for line in report._paired_lines([comparison]) if line.startswith("| output throughput"))
    assert "geomean" not in row and "worse in 1 of 3" in row


def test_past_31_rounds_the_interval_stays_on_the_safe_side():
    ratios = [1.0, 1.2] * 20  # 40 rounds: t(0.975, 39) = 2.023; the table's last value, 2.042, is wider
    got = report.geometric_interval(ratios)
    sd = (sum((x - sum(map(math.log, ratios)) / 40) ** 2 for x in map(math.log, ratios)) / 39) ** 0.5
    exact_half = 2.023 * sd / 40**0.5
    assert math.log(got["high"] / got["geomean"]) == pytest.approx(2.042 * sd / 40**0.5)
    assert math.log(got["high"] / got["geomean"]) > exact_half


def _round(server: int, value: float, per_message: float | None = None) -> dict:
    record = {"server": server, "median_ttft_ms": value}
    if per_message is not None:
        record["host"] = {"tokens_per_message": per_message}
    return record


def test_host_bound_rounds_are_counted_and_the_others_paired_apart():
    """Issue 40: a round in which either side's API server fell behind (more than 1.05 tokens per
    streamed message) measures the host's lag as much as the plugin. The report counts those rounds
    and pairs the others apart: here round 0 (on behind, ratio 2.0) and round 3 (off behind, 0.5)
    are host-bound, rounds 1 and 2 (1.1 and 0.9) kept up."""
    on = [_round(0, 200.0, 1.5), _round(2, 110.0, 1.0), _round(4, 90.0, 1.01), _round(6, 50.0, 1.0)]
    off = [_round(1, 100.0, 1.0), _round(3, 100.0, 1.0), _round(5, 100.0), _round(7, 100.0, 1.8)]
    paired = report._paired(on, off, "median_ttft_ms", 2, higher=False)
    assert (paired["n"], paired["host_bound"], paired["worse"]) == (4, 2, 2)
    kept = paired["kept_up"]
    assert (kept["n"], kept["worse"], kept["min"], kept["max"]) == (2, 1, pytest.approx(0.9), pytest.approx(1.1))
    assert kept["geomean"] == pytest.approx((1.1 * 0.9) ** 0.5)
    comparison = {"side": "on", "against": "off", "metrics": {"median_ttft_ms": {"paired": paired}}}
    lines = report._paired_lines([comparison])
    text = "\n".join(lines)
    assert "**Host-bound rounds** (on / off: 2 of 4)" in text
    rows = [line for line in lines if line.startswith("| TTFT p50")]
    assert len(rows) == 2 and "worse in 2 of 4" in rows[0] and "worse in 1 of 2" in rows[1]
    assert f"geomean {(1.1 * 0.9) ** 0.5:.3f}" in rows[1]


def test_a_run_with_every_round_host_bound_says_it_cannot_tell():
    on = [_round(0, 120.0, 1.3), _round(2, 90.0, 1.0)]
    off = [_round(1, 100.0, 1.0), _round(3, 100.0, 1.2)]
    paired = report._paired(on, off, "median_ttft_ms", 2, higher=False)
    assert paired["host_bound"] == 2 and "kept_up" not in paired
    comparison = {"side": "on", "against": "off", "metrics": {"median_ttft_ms": {"paired": paired}}}
    text = "\n".join(report._paired_lines([comparison]))
    assert "every round was host-bound; this run cannot tell the plugin from the host" in text


def test_rounds_whose_api_servers_kept_up_are_not_flagged():
    on = [_round(0, 120.0, 1.0), _round(2, 90.0, 1.05)]  # 1.05: at the threshold, not past it
    off = [_round(1, 100.0), _round(3, 100.0, 1.0)]
    paired = report._paired(on, off, "median_ttft_ms", 2, higher=False)
    assert paired["host_bound"] == 0 and "kept_up" not in paired
    comparison = {"side": "on", "against": "off", "metrics": {"median_ttft_ms": {"paired": paired}}}
    assert "Host-bound" not in "\n".join(report._paired_lines([comparison]))
