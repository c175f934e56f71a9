"""benchmarks/serving/step_profile.py: a profiled load's trace read per kind of step, the sides' kernels compared,
the session the client opens, and the driver reading it; synthetic traces and the fake server."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks.serving import run, step_profile
from tests.benchmarks.e2e.test_vllm_trace import Trace
from tests.benchmarks.serving.test_probe import fake_server

FUSED = "_mla_rope_cache_kernel"
CACHE = "void vllm::concat_and_cache_mla_kernel<__nv_bfloat16>(...)"
ROPE = "void vllm::rotary_embedding_kernel<__nv_bfloat16>(...)"


def server_trace(plugin: bool, host_us: float = 300.0) -> Trace:
    """Three mixed steps (1 prompt of 600 tokens + 4 decodes), then two decode steps replayed from a graph and a
    last, unclosed one. Each mixed step: one compiled piece, the attention region's kernels, a GEMM of 100 us."""
    tr = Trace()
    t = 1000.0
    for i in range(3):
        tr.step(t, host_us + 10 * i, ctx=(1, 600), gen=(4, 4))
        tr.events.append({"ph": "X", "cat": "cpu_op", "name": "## Call CompiledFxGraph abc ##", "ts": t + 5, "dur": 50,
                          "pid": 1, "tid": 7})  # fmt: skip
        if plugin:
            tr.launch(t + 60, [(FUSED, 4.0)], api="cuLaunchKernelEx")
        else:
            tr.launch(t + 60, [(ROPE, 3.0)])
            tr.launch(t + 70, [(CACHE, 2.0)])
        tr.launch(t + 80, [("gemm", 100.0)])
        t += 1000.0
    for _ in range(3):
        tr.step(t, 20.0, gen=(5, 5))
        tr.launch(t + 5, [(FUSED if plugin else CACHE, 1.0), ("gemm", 50.0)], api="cudaGraphLaunch")
        t += 200.0
    return tr


def write(tmp_path, name: str, tr: Trace) -> str:
    path = tmp_path / f"{name}_dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(tr.dict(), f)
    return str(path)


def test_each_kind_of_step_read_from_the_trace(tmp_path):
    out = step_profile.summarize(write(tmp_path, "on", server_trace(plugin=True)))
    assert out["steps"] == 6 and list(out["kinds"]) == ["decode", "mixed"]  # the last decode step has no successor
    mixed, decode = out["kinds"]["mixed"], out["kinds"]["decode"]
    assert (mixed["steps"], mixed["tokens_p50"], mixed["decodes_p50"]) == (3, 604, 4)
    # The third mixed step's successor is the first decode step: intervals 1000, 1000, 1000.
    assert mixed["interval_us_p50"] == 1000.0 and decode["interval_us_p50"] == 200.0
    assert (mixed["host_us_p50"], mixed["host_us_p90"]) == (310.0, 320.0)
    assert mixed["gpu_busy_us_p50"] == 104.0 and mixed["host_bound"] == 1.0
    assert decode["gpu_busy_us_p50"] == 51.0 and decode["host_bound"] == 0.0  # 20 us of host, 51 of GPU
    assert mixed["fused_launches_per_step"] == 1.0 and mixed["chain_launches_per_step"] == 0.0
    assert mixed["kernels"]["gemm"] == {"per_step": 1.0, "us_per_step": 100.0}
    assert mixed["host_top"]["compiled pieces (## Call CompiledFxGraph ##)"] == 50.0
    # Python between the host events: the span less the compiled piece and the launches (2 us each).
    assert mixed["host_top"]["(Python between them)"] == pytest.approx(310.0 - 50 - 2 * 2)


def test_the_sides_kernels_compared_and_written_out(tmp_path):
    profiles = {side: step_profile.summarize(write(tmp_path, side, server_trace(plugin=side != "off")))
                for side in ("on", "off")}  # fmt: skip
    servers = [{"index": 0, "side": "on", "loads": [{"load": "p16", "profile": profiles["on"]}, {"load": "rate4"}]},
               {"index": 1, "side": "off", "loads": [{"load": "p16", "profile": profiles["off"]}]},
               {"index": 2, "side": "off", "loads": [{"load": "p16", "profile": {"error": "no rank-0 trace"}}]}]  # fmt: skip
    summary = step_profile.compare_sides(servers)
    assert list(summary) == ["p16"] and [p["server"] for p in summary["p16"]["servers"]] == [0, 1, 2]
    mixed = summary["p16"]["diff"]["on vs off"]["mixed"]
    short = step_profile.vllm_trace.short_name
    assert set(mixed["added"]) == {FUSED} and set(mixed["removed"]) == {short(ROPE), short(CACHE)}
    assert "gemm" not in mixed["changed"]
    md = step_profile.markdown(summary)
    assert "profiled load `p16`" in md
    assert "| 0 | on | mixed | 3 | 604 | 4 | 1000 | 310 (320) | 104 | 100% | 1.0 / 0.0 |" in md
    assert "| 1 | off | mixed | 3 | 604 | 4 | 1000 | 310 (320) | 105 | 100% | 0.0 / 2.0 |" in md
    assert "| 2 | off | no rank-0 trace |" in md
    assert "Kernels per mixed step, on vs off" in md and "removed (2)" in md and "added (1)" in md


def test_no_reference_side_no_diff():
    prof = {"kinds": {"mixed": {"kernels": {"gemm": {"per_step": 1.0, "us_per_step": 1.0}}}}}
    summary = step_profile.compare_sides([{"index": 0, "side": "on", "loads": [{"load": "p", "profile": prof}]}])
    assert summary["p"]["diff"] == {}


def test_the_session_the_client_opens_on_a_server(tmp_path):
    """start() asks vLLM for the session's prefix and step bounds; stop() ends it; the driver then finds
    rank 0's trace by the prefix and reads it into the load's entry and a results file."""
    server = fake_server(tmp_path / "srv", "on", ranks=2)
    prefix = step_profile.prefix(3, "on", "p16")
    try:
        step_profile.start(server.port, {"prefix": prefix, "skip": 50, "steps": 150})
        step_profile.stop(server.port)
    finally:
        server.stop(grace_s=5)
    traces = tmp_path / "srv" / "traces"
    assert json.loads((traces / f"{prefix}.start.json").read_text()) == {
        "profile_prefix": prefix, "delay_iterations": 50, "max_iterations": 150}
    bench = run.Benchmark(run.parse_args(["--out", str(tmp_path / "out"), "--layers", "4", "--no-plot",
                                          "--loads", "rate4", "profile16"]))  # fmt: skip
    bench.results_dir.mkdir(parents=True)
    bench.trace_dir = lambda: traces
    loads = [{"load": "rate4"}, {"load": "profile16", "profile_prefix": prefix},
             {"load": "profile16", "profile_prefix": "load-09-on-gone", "error": "refused"}]  # fmt: skip
    bench.read_profiles(3, bench.args.side_list[0], loads)
    assert "profile" not in loads[0] and "profile" not in loads[2]  # an errored load's session is not read
    prof = loads[1]["profile"]
    assert prof["trace"].startswith(prefix) and "_rank0." in prof["trace"]
    # The fake's rank 0: a prefill step, three decode steps (the last without a successor).
    assert (prof["kinds"]["prefill"]["steps"], prof["kinds"]["decode"]["steps"]) == (1, 2)
    saved = json.loads((bench.results_dir / "step-profile-03-on-profile16.json").read_text())
    assert saved["kinds"] == prof["kinds"]


def test_a_missing_trace_is_said(tmp_path):
    bench = run.Benchmark(run.parse_args(["--out", str(tmp_path), "--layers", "4", "--loads", "rate4", "profile16"]))
    bench.results_dir.mkdir(parents=True)
    bench.trace_dir = lambda: tmp_path / "none"
    (tmp_path / "none").mkdir()
    bench.deadline = 0.0  # no time left to wait for a trace
    loads = [{"load": "profile16", "profile_prefix": "load-00-on-profile16"}]
    bench.read_profiles(0, bench.args.side_list[0], loads)
    assert loads[0]["profile"]["error"].startswith("no rank-0 trace load-00-on-profile16")


def test_the_client_closes_the_session_when_the_load_fails(tmp_path, monkeypatch):
    """A profiled load inside start/stop; stop also after vLLM's main raised; the entry names the prefix."""
    import vllm.benchmarks.serve as serve

    from benchmarks.serving import client

    calls = []
    monkeypatch.setattr(step_profile, "start", lambda port, session: calls.append(("start", port, session["prefix"])))
    monkeypatch.setattr(step_profile, "stop", lambda port: calls.append(("stop", port)))
    monkeypatch.setattr(client, "_size", lambda path: None)

    def main(args):
        calls.append(("main", args.num_prompts))
        raise ConnectionError("server gone")

    monkeypatch.setattr(serve, "main", main)
    monkeypatch.setattr("benchmarks.serving.server.metrics_text", lambda port: None)
    (tmp_path / "go").touch()
    args = ["--model", "m", "--num-prompts", "3", "--port", "9"]
    spec = {"port": 9, "go_file": str(tmp_path / "go"), "stop_file": str(tmp_path / "stop"),
            "progress": str(tmp_path / "progress.jsonl"), "deadline": 1e12,
            "loads": [{"name": "plain", "prompts": 2, "estimate_s": 1, "args": [*args[:3], "2", *args[4:]]},
                      {"name": "p16", "prompts": 3, "estimate_s": 1, "args": args,
                       "profile": {"prefix": "load-00-on-p16", "skip": 1, "steps": 2}}]}  # fmt: skip
    assert client.run(spec) == 1
    assert calls == [("main", 2), ("start", 9, "load-00-on-p16"), ("main", 3), ("stop", 9)]
    entries = [json.loads(ln) for ln in (tmp_path / "progress.jsonl").read_text().splitlines()][1:]
    assert "profile_prefix" not in entries[0]
    assert entries[1]["profile_prefix"] == "load-00-on-p16" and "ConnectionError" in entries[1]["error"]


def test_a_profiled_run_starts_its_servers_with_the_workers_profiler(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--layers", "4", "--budget-s", "2000", "--dry-run", "--loads", "rate4", "profile16"]
    assert run.main(argv) == 0
    servers = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("server ")]
    words = run.shlex.split(servers[0].split(": ", 1)[1])
    profiler = json.loads(words[words.index("--profiler-config") + 1])
    assert profiler["ignore_frontend"] is True and profiler["torch_profiler_dir"].endswith("/traces")
    assert "--worker-extension-cls" not in words and "VLLM_SERVER_DEV_MODE" not in servers[0]  # the probe's only
    bench = run.Benchmark(run.parse_args(argv))
    spec = bench.client_spec(2, bench.args.side_list[1], 8000, 1.0)
    assert "profile" not in spec["loads"][0]
    assert spec["loads"][1]["profile"] == {"prefix": "load-02-off-profile16", "skip": 50, "steps": 150}
    plain = run.parse_args(["--out", str(tmp_path), "--layers", "4", "--dry-run", "--loads", "rate4"])
    assert "--profiler-config" not in run.Benchmark(plain).server_spec().args
