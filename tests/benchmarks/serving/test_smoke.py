"""The serving benchmark for real on the CPU: `vllm serve` (demo.serve) loaded by vLLM's own `vllm bench serve`.

Both sides, one server each, the demo's 3-layer model on vLLM's CPU platform with the stand-in kernels,
a warm-up and two small loads: the driver, the client process, vLLM's result files and the report,
end to end. Its figures mean nothing. Marked slow like tests/vllm_plugin/test_serve.py: each server takes
~1-1.5 minutes to start on 2 cores (three processes import vLLM), ~3-4 minutes in all.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.serving import run

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LOADS = ["name=warm,in=16,out=2,rate=inf,prompts=2,warmup=1", "name=burst,in=64,out=8,rate=inf,concurrency=4,prompts=6",
         "name=paced,in=32,out=6,rate=8,prompts=4", "name=prof,in=32,out=8,rate=inf,concurrency=2,prompts=4,profile=6,skip=2"]  # fmt: skip


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("serving_smoke")
    status = run.main(["--out", str(out), "--cpu", "--model", "tiny", "--servers-per-side", "1", "--budget-s", "560",
                       "--probe", "--server-arg=--enable-logging-iteration-details", "--loads", *LOADS])  # fmt: skip
    return status, out, json.loads((out / "serving_tiny.json").read_text())


def test_both_sides_ran_and_were_what_they_say(smoke):
    status, _, data = smoke
    assert status == 0, (data["errors"], data["problems"])
    on, off = data["servers"]
    assert (on["index"], on["side"], off["index"], off["side"]) == (0, "on", 1, "off")
    assert on["plugin"]["fused_lines"] == [{"rank": "rank 0, local rank 0", "backend": "torch", "mode": "decode"}]
    assert off["plugin"]["fused_lines"] == [] and off["plugin_origin"] is None
    assert on["plugin_origin"]["package"] == str(run.REPO / "vllm_mla_fusion" / "__init__.py")
    assert data["servers_per_side_measured"] == {"on": 1, "off": 1}
    for server in data["servers"]:
        assert [ld["load"] for ld in server["loads"]] == ["warm", "burst", "paced", "prof"]
        assert all("prefix_cache" in ld and "error" not in ld for ld in server["loads"])
        # vLLM took --jit-monitor-verbose, and each load's stretch of the server log was read for compiles
        assert all(isinstance(ld["kernel_compiles"], list) for ld in server["loads"])
        assert all(0 < ld["server_log_bytes"][0] <= ld["server_log_bytes"][1] for ld in server["loads"])
        assert server["start_s"] > 0 and server["teardown_s"] >= 0
        # Issue 40's host figures: every process of the server by role, the server's own latencies
        for ld in server["loads"]:
            assert ld["server_cpu_s"]["api_server"] > 0 and ld["client_cpu_s"] > 0, ld
            assert sum(cpu for role, cpu in ld["server_cpu_s"].items() if role != "api_server") > 0, ld  # the engine
            assert {"ttft", "itl", "queue", "prefill"} <= ld["server_latency_ms"].keys(), ld
            assert all(v >= 0 for v in ld["server_latency_ms"].values()), ld
            # vLLM's iteration log, read per load: every load ran prompt-carrying steps
            assert sum(k["steps"] for kind, k in ld["engine_steps"].items() if kind != "decode") > 0, ld


def test_the_report_holds_vllms_figures_per_side(smoke):
    _, out, data = smoke
    assert set(data["loads"]) == {"burst", "paced"}  # the warm-up is sent, not reported
    for name, prompts in (("burst", 6), ("paced", 4)):
        load = data["loads"][name]
        assert load["problems"] == []
        for side in ("on", "off"):
            (server,) = load["sides"][side]["servers"]
            assert (server["completed"], server["failed"], server["num_prompts"]) == (prompts, 0, prompts)
            vllm_file = json.loads((out / "serving_tiny_raw" / "results" / server["file"]).read_text())
            assert vllm_file["side"] == side and vllm_file["load"] == name
            for field in ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
                          "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms"):  # fmt: skip
                assert server[field] == vllm_file[field] > 0, field
        (row,) = load["comparisons"]
        assert (row["side"], row["against"]) == ("on", "off")
        on, off = (load["sides"][s]["summary"]["median_tpot_ms"]["median"] for s in ("on", "off"))
        assert row["metrics"]["median_tpot_ms"]["ratio"] == pytest.approx(on / off)
    md = (out / "serving_tiny.md").read_text()
    assert md.count("| metric | on | off | on / off |") == 2
    assert md.count("| server | side | API server cores |") == 2  # burst and paced, each server a row
    for load in data["loads"].values():
        assert all(server["host"]["server_ms"]["ttft"] > 0 for side in load["sides"].values()
                   for server in side["servers"])  # fmt: skip
    assert data["plot"].endswith(".png") or data["plot"].startswith("no plot: matplotlib")


def test_the_probe_redrew_the_weights_and_on_equals_off(smoke):
    """--probe through vLLM's own server: the worker extension reached the model's 3 MLA layers through
    /collective_rpc, greedy outputs are not degenerate and equal on and off (float32 on the CPU), and the
    profiler wrote rank 0's trace (no GPU kernels on a CPU: no decode-step time)."""
    _, out, data = smoke
    for server in data["servers"]:
        p = server["probe"]
        assert "error" not in p, p
        assert [(r["tp_rank"], r["mla_layers"], r["sharded"]) for r in p["redraw"]] == [(0, 3, 0)]
        assert p["decode_profile"]["trace"].startswith(f"decode-{server['index']:02d}-")
        assert p["decode_profile"]["decode_steps"] > 0
    c = data["probe"]["on vs off"]
    assert c["equal"] and c["degenerate"] is None, c
    assert (out / "serving_tiny_raw" / "results" / "probe-00-on.json").is_file()
    assert "on vs off: equal" in (out / "serving_tiny.md").read_text()


def test_the_profiled_load_recorded_its_steps_through_vllms_own_routes(smoke):
    """step_profile.py's session against vLLM's server: /start_profile's prefix and step bounds reached the
    worker, which stopped by itself after its steps; the driver read rank 0's trace into the report (a CPU has
    no GPU kernels: step kinds and host spans only). The profiled load's latencies are not reported."""
    _, out, data = smoke
    assert "prof" not in data["loads"]
    profiles = data["step_profile"]["prof"]["servers"]
    assert [(p["server"], p["side"]) for p in profiles] == [(0, "on"), (1, "off")]
    for p in profiles:
        assert "error" not in p, p
        assert p["trace"].startswith(f"load-{p['server']:02d}-{p['side']}-prof_")
        # skip=2, steps=6: vLLM records at most 7 (it stops after the step past the bound).
        assert 2 <= p["steps"] <= 7, p["steps"]
        assert sum(k["steps"] for k in p["kinds"].values()) >= 1
        assert all(k["host_us_p50"] > 0 for k in p["kinds"].values())
    assert (out / "serving_tiny_raw" / "results" / "step-profile-00-on-prof.json").is_file()
    assert "profiled load `prof`" in (out / "serving_tiny.md").read_text()


@pytest.fixture(scope="module")
def interleaved(tmp_path_factory):
    out = tmp_path_factory.mktemp("serving_interleaved")
    status = run.main(["--out", str(out), "--cpu", "--model", "tiny", "--interleave", "2", "--budget-s", "600",
                       "--loads", LOADS[0], LOADS[2]])  # fmt: skip
    return status, json.loads((out / "serving_tiny.json").read_text())


def test_interleaved_servers_for_real(interleaved):
    """--interleave against demo servers with vLLM's own client: both servers up together, the warm-up
    once each, the paced load in two rounds on each in turn; every round a record holding vLLM's
    result file, and the sides paired round by round."""
    status, data = interleaved
    assert status == 0, (data["errors"], data["problems"], data["skipped"])
    assert data["config"]["interleave"] == 2
    assert [(s["index"], s["side"], [e["load"] for e in s["loads"]]) for s in data["servers"]] == [
        (0, "on", ["warm", "paced"]), (2, "on", ["paced"]), (1, "off", ["warm", "paced"]), (3, "off", ["paced"])]  # fmt: skip
    assert all("error" not in e and e["server_cpu_s"]["api_server"] > 0 for s in data["servers"] for e in s["loads"])
    paced = data["loads"]["paced"]
    assert {side: sorted(v["server"] for v in s["servers"]) for side, s in paced["sides"].items()} == {"on": [0, 2], "off": [1, 3]}
    assert paced["comparisons"][0]["metrics"]["median_ttft_ms"]["paired"]["n"] == 2
