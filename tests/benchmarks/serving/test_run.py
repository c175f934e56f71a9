"""benchmarks/serving/run.py: options, the plan printed, resuming, and failing loudly on a server of the wrong side."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest

from benchmarks.serving import run

FAKE = Path(__file__).with_name("fake_vllm_serve.py")
# A tiny model against the fake server: the client is never let loose on it (it cannot complete).
FAKE_RUN = ["--model", "tiny", "--cpu", "--no-plot", "--servers-per-side", "1", "--budget-s", "300",
            "--loads", "name=few,in=8,out=2,rate=inf,prompts=2", "--server-launcher", f"{sys.executable} {FAKE}"]


def test_defaults(tmp_path):
    a = run.parse_args(["--out", str(tmp_path)])
    assert (a.model, a.layers, a.sides, a.servers_per_side, a.tag) == ("dense", 61, ["on", "off"], 2, "dense")
    assert [ld.name for ld in a.load_list] == ["warmup", "warmup_decode", "rate4", "rate16", "saturate", "prefill"]
    assert a.work_dir == tmp_path / "work"
    assert run.parse_args(["--out", str(tmp_path), "--model", "fp8-moe", "--layers", "20"]).tag == "fp8-moe20"
    assert run.parse_args(["--out", str(tmp_path), "--model", "tiny"]).layers == 3


@pytest.mark.parametrize("bad", [["--sides", "on"], ["--sides", "on", "sideways"], ["--loads", "nosuch"],
                                 ["--servers-per-side", "0"], ["--model", "gpt"], ["--prompts-scale", "0"]])  # fmt: skip
def test_bad_options_are_refused(tmp_path, bad, capsys):
    with pytest.raises(SystemExit) as e:
        run.parse_args(["--out", str(tmp_path), *bad])
    assert e.value.code == 2


def test_dry_run_prints_each_servers_command_and_loads(tmp_path, capsys):
    assert run.main(["--out", str(tmp_path), "--dry-run", "--layers", "4", "--budget-s", "1000", "--server-arg", "--kv-cache-dtype fp8",
                     "--bench-arg", "--ready-check-timeout-sec 3"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    lines = out.splitlines()
    servers = [ln for ln in lines if ln.startswith("server ")]
    assert [ln.split(":")[0] for ln in servers] == ["server 0 (on)", "server 1 (off)", "server 2 (off)", "server 3 (on)"]
    assert "VLLM_MLA_FUSION=1" in servers[0] and "VLLM_MLA_FUSION=0" in servers[1]
    assert "vllm.entrypoints.cli.main serve" in servers[0] and "--load-format dummy" in servers[0]
    assert servers[0].endswith("--kv-cache-dtype fp8")
    assert "compile-cache/dense4/on " in servers[0] and "compile-cache/dense4/off " in servers[1]  # one per side
    benches = [ln for ln in lines if ln.strip().startswith("vllm bench serve")]
    assert len(benches) == 4 * 6  # two warm-ups and four measured loads per server
    seeds = [shlex.split(b)[shlex.split(b).index("--seed") + 1] for b in benches[:5]]
    assert seeds == ["0", "1", "2", "3", "4"]  # every load its own prompts
    assert all("--ready-check-timeout-sec 3" in b for b in benches)
    config = json.loads((tmp_path / "work" / "model-dense4" / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and (tmp_path / "work" / "model-dense4" / "tokenizer.json").is_file()


def test_resume_continues_only_the_same_configuration(tmp_path):
    argv = ["--out", str(tmp_path), "--resume", "--layers", "4"]
    bench = run.Benchmark(run.parse_args(argv))
    bench.work.mkdir(parents=True)
    bench.state["servers"].append({"index": 0, "side": "on"})
    bench.measured.add_start("on", warm=False, seconds=99.0)
    bench._save_state()
    (bench.results_dir).mkdir()
    (bench.results_dir / "00-on-rate4.json").write_text("{}")
    again = run.Benchmark(run.parse_args(argv))
    assert again.state["servers"] == [{"index": 0, "side": "on"}] and again.measured.start_s == {"cold": [99.0]}
    assert (again.results_dir / "00-on-rate4.json").is_file()
    other = run.Benchmark(run.parse_args([*argv, "--sides", "off", "on"]))  # another comparison: a run of its own
    assert other.state["servers"] == [] and other.work != bench.work
    assert (again.results_dir / "00-on-rate4.json").is_file()  # left alone by the other run
    fresh = run.Benchmark(run.parse_args(argv[:2] + argv[3:]))  # no --resume: a new run
    assert fresh.state["servers"] == []


def test_nothing_fits_the_budget(tmp_path):
    status = run.main(["--out", str(tmp_path), "--budget-s", "60", "--layers", "4", "--no-plot"])
    assert status == 4
    data = json.loads((tmp_path / "serving_dense4.json").read_text())
    assert data["errors"][0].startswith("no server fits") and data["servers"] == []


@pytest.mark.vllm
def test_a_server_of_the_wrong_side_stops_the_benchmark(tmp_path, monkeypatch):
    """The off server logs the plugin's line (a switch that does not switch): exit 3, said in the report."""
    monkeypatch.setenv("FAKE_SERVE_LINE", "always")
    status = run.main(["--out", str(tmp_path), "--sides", "off", "on", *FAKE_RUN])
    assert status == 3
    data = json.loads((tmp_path / "serving_tiny.json").read_text())
    assert [s["index"] for s in data["servers"]] == [0]  # the on server never started
    assert "the server log says the plugin ran" in data["errors"][0]
    assert "## Errors" in (tmp_path / "serving_tiny.md").read_text()
    log = (tmp_path / "serving_tiny_raw" / "logs" / "server-00-off.log").read_text()
    assert "vllm-mla-fusion (rank 0, local rank 0)" in log


@pytest.mark.vllm
def test_a_plugin_that_did_not_load_stops_the_benchmark(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SERVE_LINE", "never")
    status = run.main(["--out", str(tmp_path), *FAKE_RUN])
    assert status == 3
    data = json.loads((tmp_path / "serving_tiny.json").read_text())
    assert data["servers"][0]["side"] == "on" and "is missing from the server log" in data["errors"][0]


def test_the_plugin_package_a_side_imports(tmp_path):
    old = tmp_path / "old"
    (old / "vllm_mla_fusion").mkdir(parents=True)
    (old / "vllm_mla_fusion" / "__init__.py").write_text("")
    (old / "COMMIT").write_text("abc123\n")
    bench = run.Benchmark(run.parse_args(["--out", str(tmp_path), "--sides", "on", f"on@{old}", "--layers", "4"]))
    bench.work.mkdir(parents=True)
    on, baseline = bench.args.side_list
    from benchmarks import provenance

    assert bench.plugin_origin(baseline) == {"package": str(old.resolve() / "vllm_mla_fusion" / "__init__.py"),
                                             "package_sha256": provenance.package_sha256(old / "vllm_mla_fusion"),
                                             "commit": "abc123"}  # fmt: skip
    assert bench.plugin_origin(on)["package"] == str(run.REPO / "vllm_mla_fusion" / "__init__.py")
    # The digest of the package each side imports: the two differ, as the packages do.
    assert bench.plugin_origin(on)["package_sha256"] == provenance.package_sha256(run.REPO / "vllm_mla_fusion")
    assert bench.plugin_origin(on)["package_sha256"] != bench.plugin_origin(baseline)["package_sha256"]
    (bench.work / "vllm_mla_fusion").mkdir()  # a copy in the servers' working directory is never the one found
    (bench.work / "vllm_mla_fusion" / "__init__.py").write_text("")
    assert bench.plugin_origin(baseline)["package"] == str(old.resolve() / "vllm_mla_fusion" / "__init__.py")


def test_servers_late_by_the_measured_times_get_fewer_prompts_or_are_skipped(tmp_path, monkeypatch):
    import time

    from benchmarks.serving.plan import Plan

    bench = run.Benchmark(run.parse_args(["--out", str(tmp_path), "--layers", "4"]))
    calls = []
    monkeypatch.setattr(bench, "run_server", lambda index, side, warm, scale: calls.append((index, side.name, scale)) or {})
    on, off = bench.args.side_list
    loads = bench.args.load_list
    full, half = (bench.estimator.server_s("on", False, loads, s) for s in (1.0, 0.5))
    the_plan = Plan([(0, on), (1, off)], 1.0, [full, full], budget_s=2 * full)
    bench.deadline = time.time() + (full + half) / 2  # later than planned: each fits only with half the prompts
    assert bench.run_plan(the_plan) == 0
    assert calls == [(0, "on", 0.5), (1, "off", 0.5)]
    calls.clear()
    bench.deadline = time.time() + 10  # nothing fits at any scale
    assert bench.run_plan(the_plan) == 0 and calls == []
    assert [s.split(":")[0] for s in bench.skipped] == ["server 0 (on)", "server 1 (off)"]


def test_one_gpu_defaults_are_unchanged_by_the_tp_options(tmp_path):
    """Without --tensor-parallel-size or --probe: the server command and the run keys of before (resumable runs)."""
    a = run.parse_args(["--out", str(tmp_path)])
    assert (a.tensor_parallel_size, a.probe) == (1, False)
    bench = run.Benchmark(a)
    spec = bench.server_spec()
    assert spec.args == [*run.GPU_SERVER_ARGS, "--max-model-len", "8192"]
    assert "VLLM_SERVER_DEV_MODE" not in bench.side_env(a.side_list[0])
    assert bench.model_tag == "dense61" and bench.estimator.probe_s == 0.0
    # The keys of these configurations since the warm-up of varied lengths (a run kept on a machine with the
    # old warm-up must not resume into this one); fixed-length loads keep the keys commit 2146cfd gave them.
    assert run.run_key(a, run.model_config(a)) == "733effea5304207b"
    b = run.parse_args(["--out", str(tmp_path), "--model", "fp8-moe", "--layers", "20"])
    assert run.run_key(b, run.model_config(b)) == "a61a3fa39c9c8b6b"
    c = run.parse_args(["--out", str(tmp_path), "--loads", "rate4", "rate16", "saturate", "prefill"])
    assert run.run_key(c, run.model_config(c)) == "1b55c42be26f07b8"


def test_the_full_model_at_tp8_with_the_probe(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--model", "full", "--tensor-parallel-size", "8", "--probe", "--servers-per-side", "1",
            "--loads", "warmup", "rate4", "saturate", "--budget-s", "430", "--dry-run"]  # fmt: skip
    assert run.main(argv) == 0
    out = capsys.readouterr().out
    (server,) = [ln for ln in out.splitlines() if ln.startswith("server ")]  # one cold TP8 server per call
    words = shlex.split(server.split(": ", 1)[1])
    assert words[words.index("--tensor-parallel-size") + 1] == "8"
    assert words[words.index("--worker-extension-cls") + 1] == "benchmarks.serving.probe.RedrawWeights"
    profiler = json.loads(words[words.index("--profiler-config") + 1])
    assert profiler["profiler"] == "torch" and profiler["torch_profiler_dir"].endswith("/traces")
    assert "VLLM_SERVER_DEV_MODE=1" in server and "compile-cache/full61-tp8/on " in server
    config = json.loads((tmp_path / "work" / "model-full61-tp8" / "config.json").read_text())
    assert config["num_attention_heads"] == 128 and config["moe_intermediate_size"] == 2048
    assert "79.3 GiB per rank" in out
    a = run.parse_args(argv)
    plain = run.parse_args([w for w in argv if w != "--probe"])
    assert run.run_key(a, run.model_config(a)) != run.run_key(plain, run.model_config(plain))
    bench = run.Benchmark(a)
    # The plan's estimate holds the cold start, the probe, the loads, the teardown.
    assert bench.estimator.server_s("on", False, a.load_list, 0.25) > 90 + 3 * 61 + 60


@pytest.mark.parametrize("bad", [["--model", "full"], ["--model", "full", "--tensor-parallel-size", "4"],
                                 ["--tensor-parallel-size", "0"]])  # fmt: skip
def test_a_model_that_does_not_fit_its_gpus_is_refused(tmp_path, bad, capsys):
    with pytest.raises(SystemExit) as e:
        run.parse_args(["--out", str(tmp_path), *bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "per rank" in err or "must be >= 1" in err


def test_the_report_compares_the_probes_of_the_sides(tmp_path):
    bench = run.Benchmark(run.parse_args(["--out", str(tmp_path), "--layers", "4", "--probe", "--no-plot"]))
    bench.work.mkdir(parents=True)
    for d in (bench.results_dir, bench.logs_dir):
        d.mkdir(parents=True)
    greedy = {"lens": [5, 9], "tokens": [[3, 4], [5, 6]], "logprobs": [[-0.5, -0.25], [-1.0, -2.0]]}
    skewed = {**greedy, "logprobs": [[-0.5, -0.25], [-1.0, -2.5]]}
    bench.state["servers"] = [
        {"index": 0, "side": "on", "probe": {"greedy": greedy, "decode_profile": {"gpu_us_median": 900.0}}},
        {"index": 1, "side": "off", "probe": {"greedy": skewed, "decode_profile": {"gpu_us_median": 1000.0}}},
        {"index": 2, "side": "off", "probe": {"error": "OSError: refused"}},
    ]
    out = bench.write_report()
    assert not out["probe"]["on vs off"]["equal"] and out["probe"]["decode_gpu_ratio_vs_off"] == {"on": 0.9}
    assert any("greedy outputs differ" in p for p in out["problems"])
    assert any("server 2 (off): OSError" in p for p in out["problems"])
    assert "on vs off: DIFFERENT" in (tmp_path / "serving_dense4.md").read_text()


def test_a_driver_ended_while_a_server_starts_leaves_no_process(tmp_path, monkeypatch):
    """SIGTERM (the GPU script's timeout) arrives during the minutes a TP8 server takes to start: the server's
    and the client's process groups are stopped before the driver unwinds."""
    import os

    from benchmarks.serving import server as server_module

    started = []

    class Recorded(server_module.Server):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

        def wait_healthy(self, timeout_s):
            raise SystemExit(143)  # what main's SIGTERM handler raises

    clients = []
    bench = run.Benchmark(run.parse_args(["--out", str(tmp_path), *FAKE_RUN]))
    start_client = bench.start_client
    monkeypatch.setattr(run, "Server", Recorded)
    monkeypatch.setattr(bench, "start_client", lambda *a: clients.append(start_client(*a)) or clients[-1])
    bench.work.mkdir(parents=True)
    bench.logs_dir.mkdir(parents=True)
    with pytest.raises(SystemExit):
        bench._start(0, bench.args.side_list[0], False, 1.0, {})
    (server,), (client,) = started, clients
    assert server.proc.returncode is not None and client.returncode is not None
    for pid in (server.proc.pid, client.pid):
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)


def test_the_fp8_models_start_without_deepgemm_on_every_side_and_wait_longer(tmp_path):
    """DeepGEMM's cold warm-up does not fit a device call (models.SERVER_ENV): the fp8 stand-in's
    servers run without it, plugin on and off alike; the dense stand-in's environment is vLLM's."""
    fp8 = run.Benchmark(run.parse_args(["--out", str(tmp_path), "--model", "fp8-moe", "--layers", "20"]))
    envs = [fp8.side_env(side) for side in fp8.args.side_list]
    for env in envs:
        assert (env["VLLM_USE_DEEP_GEMM"], env["VLLM_MOE_USE_DEEP_GEMM"]) == ("0", "0")
    assert [env["VLLM_MLA_FUSION"] for env in envs] == ["1", "0"]
    assert fp8.start_timeout_s() == 560.0
    dense = run.Benchmark(run.parse_args(["--out", str(tmp_path / "d")]))
    assert dense.side_env(dense.args.side_list[0]).get("VLLM_USE_DEEP_GEMM") == os.environ.get("VLLM_USE_DEEP_GEMM")
    assert dense.start_timeout_s() == 420.0
    given = run.Benchmark(run.parse_args(["--out", str(tmp_path / "g"), "--model", "fp8-moe", "--start-timeout-s", "99"]))
    assert given.start_timeout_s() == 99.0


def test_each_load_gets_the_kernels_its_server_compiled_and_the_steps_it_ran_during_it(tmp_path):
    """The client's two readings of the server log's size bound a load's stretch of the log: a compile
    logged there is that load's, one before or after is not; a load without both readings gets none."""
    head = "INFO start-up\n(EngineCore pid=1) WARNING [jit_monitor.py:140] Triton kernel JIT compilation during inference: early. This causes a latency spike\n"
    first = "noise\n(EngineCore pid=1) WARNING [jit_monitor.py:140] Triton kernel JIT compilation during inference: fused_moe_kernel (constexprs={BLOCK_SIZE_M=64}). This causes a latency spike\n"
    first += ("INFO [loggers.py:199] Engine 000: Iteration(3): 1 context requests, 1024 context tokens, 4 generation "
              "requests, 4 generation tokens, iteration elapsed time: 31.50 ms, GPU KV cache usage: 1.0%\n")
    second = "noise only\n"
    log = tmp_path / "server.log"
    log.write_text(head + first + second + "Triton autotuning for function late,\n")
    a, b, c = len(head.encode()), len((head + first).encode()), len((head + first + second).encode())
    loads = [{"load": "warmup", "server_log_bytes": [a, b]}, {"load": "rate4", "server_log_bytes": [b, c]},
             {"load": "rate16"}]  # fmt: skip
    run.attribute_server_log(loads, log)
    assert loads[0]["kernel_compiles"] == ["Triton fused_moe_kernel"]
    assert loads[1]["kernel_compiles"] == []
    assert "kernel_compiles" not in loads[2]
    # and the engine's steps where vLLM logged them (--enable-logging-iteration-details): the first load's only
    assert loads[0]["engine_steps"]["mixed"]["steps"] == 1 and loads[0]["engine_steps"]["mixed"]["ms_p50"] == 31.5
    assert "engine_steps" not in loads[1] and "engine_steps" not in loads[2]
    assert "--jit-monitor-verbose" in run.GPU_SERVER_ARGS  # else vLLM logs each kernel's first compile only


def test_a_configuration_sets_the_server_options_tokenizer_client_and_loads(tmp_path, capsys):
    """Issue 40: "seqs128" is the independent check's set-up, named; the default stays vLLM's defaults."""
    a = run.parse_args(["--out", str(tmp_path), "--config", "seqs128", "--layers", "4",
                        "--server-arg", "--kv-cache-dtype fp8"])  # fmt: skip
    assert a.tag == "dense4-seqs128" and a.max_model_len == 4096
    assert [ld.name for ld in a.load_list] == ["warm1k", "rate16", "saturate"]
    assert not a.load_list[0].measured and (a.load_list[0].input_len, a.load_list[0].prompts) == (1024, 20)
    bench = run.Benchmark(a)
    # The configuration's options, then the command line's: both reach the server.
    assert bench.server_spec().args == [*run.GPU_SERVER_ARGS, "--max-num-seqs", "128", "--no-enable-prefix-caching",
                                        "--max-model-len", "4096", "--kv-cache-dtype", "fp8"]  # fmt: skip
    assert bench.model_dir.name == "model-dense4-tok512"  # the tokenizer is the configuration's
    assert bench.cache_dir(a.side_list[0]) == tmp_path / "work" / "compile-cache" / "dense4" / "on"
    loads = bench.client_spec(0, a.side_list[0], 8000, 1.0)["loads"]
    assert all(ld["args"][ld["args"].index("--backend") + 1] == "vllm" for ld in loads)
    # A run of another configuration never resumes into this one.
    d = run.parse_args(["--out", str(tmp_path), "--layers", "4", "--server-arg", "--kv-cache-dtype fp8",
                        "--max-model-len", "4096", "--loads", "warm1k", "rate16", "saturate"])  # fmt: skip
    assert run.run_key(a, run.model_config(a)) != run.run_key(d, run.model_config(d))
    assert run.main(["--out", str(tmp_path), "--config", "seqs128", "--layers", "4", "--dry-run"]) == 0
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "work" / "model-dense4-tok512" / "tokenizer.json"))
    assert tok.get_vocab_size() == 512  # the model keeps its whole vocabulary (config.json)
    config = json.loads((tmp_path / "work" / "model-dense4-tok512" / "config.json").read_text())
    assert config["vocab_size"] == 129280


def test_the_report_states_the_configuration(tmp_path):
    bench = run.Benchmark(run.parse_args(["--out", str(tmp_path), "--config", "seqs128", "--layers", "4",
                                          "--no-plot"]))  # fmt: skip
    for d in (bench.results_dir, bench.logs_dir):
        d.mkdir(parents=True)
    out = bench.write_report()
    conf = out["config"]["configuration"]
    assert conf["name"] == "seqs128"
    assert conf["vllm serve"] == "--max-num-seqs 128 --no-enable-prefix-caching --max-model-len 4096"
    assert conf["tokenizer"] == "512 words" and conf["vllm bench serve --backend"] == "vllm"
    md = (tmp_path / "serving_dense4-seqs128.md").read_text()
    assert "**Configuration `seqs128`**" in md and "--no-enable-prefix-caching" in md
    assert "- server command: `" in md and "--max-num-seqs 128" in md


def test_a_failing_diagnostic_never_costs_a_load_its_entry(monkeypatch):
    """The client's readings around a load are diagnostics: one that raises is recorded in the load's
    progress entry, which keeps the rest (the server log's stretch here)."""
    from benchmarks.serving import client, server

    def broken(before, after):
        raise RuntimeError("psutil went away")

    monkeypatch.setattr(server, "cpu_by_role", broken)
    before = {"metrics": None, "cpu": {}, "client_cpu": 1.0, "log_bytes": 10}
    after = {"metrics": None, "cpu": {}, "client_cpu": 2.5, "log_bytes": 20}
    entry = {"load": "rate16"}
    client._compare_readings(entry, before, after)
    assert entry == {"load": "rate16", "server_log_bytes": [10, 20], "client_cpu_s": 1.5,
                     "diagnostics_error": "RuntimeError: psutil went away"}  # fmt: skip


# --- --interleave: every side's server up at once, the loads in turns ----------------------------

FAKE_CLIENT = Path(__file__).with_name("fake_client.py")
INTERLEAVED = ["--model", "tiny", "--cpu", "--no-plot", "--budget-s", "300", "--server-launcher", f"{sys.executable} {FAKE}",
               "--loads", "name=warm,in=8,out=2,rate=inf,prompts=2,warmup=1", "name=few,in=8,out=2,rate=inf,prompts=2"]  # fmt: skip


def _fake_clients(monkeypatch, tmp_path):
    """Clients replaced by fake_client.py (the go-file protocol, no vLLM); returns the turns file."""
    turns = tmp_path / "turns.log"
    monkeypatch.setenv("FAKE_CLIENT_TURNS", str(turns))

    def start_client(self, index, side, port, scale, server_pid=None):
        spec = self.client_spec(index, side, port, scale, server_pid)
        for name in ("go_file", "stop_file", "progress"):
            Path(spec[name]).unlink(missing_ok=True)
        path = self.logs_dir / f"client-{index:02d}.json"
        path.write_text(json.dumps(spec))
        return run.subprocess.Popen([sys.executable, str(FAKE_CLIENT), str(path)], env=dict(os.environ),
                                    start_new_session=True)  # fmt: skip

    monkeypatch.setattr(run.Benchmark, "start_client", start_client)
    return turns


def test_interleaved_servers_take_turns_and_the_report_pairs_the_rounds(tmp_path, monkeypatch):
    """Both servers up at once: each one's warm-up first, then the measured load in rounds whose order
    reverses (on off, off on, on off); each round of a side is a record; the pairing round by round
    reads the plugin's fixed factor (1.1) where the medians over rounds mix it with the host's drift."""
    turns = _fake_clients(monkeypatch, tmp_path)
    assert run.main(["--out", str(tmp_path), "--interleave", "3", *INTERLEAVED]) == 0
    lines = turns.read_text().split()
    ports = lines[0::3]
    order = [(p, int(rec), name) for p, rec, name in zip(ports, lines[1::3], lines[2::3])]
    on_port, off_port = order[0][0], order[1][0]
    assert [(p == on_port, rec, name) for p, rec, name in order] == [
        (True, 0, "warm"), (False, 1, "warm"),
        (True, 0, "few"), (False, 1, "few"),  # round 0: on, off
        (False, 3, "few"), (True, 2, "few"),  # round 1: off, on
        (True, 4, "few"), (False, 5, "few"),  # round 2: on, off
    ]  # fmt: skip
    data = json.loads((tmp_path / "serving_tiny.json").read_text())
    assert data["config"]["interleave"] == 3
    assert [(s["index"], s["side"], s["interleaved"]["round"]) for s in data["servers"]] == [
        (0, "on", 0), (2, "on", 1), (4, "on", 2), (1, "off", 0), (3, "off", 1), (5, "off", 2)]  # fmt: skip
    assert [e["load"] for e in data["servers"][0]["loads"]] == ["warm", "few"]
    assert all([e["load"] for e in s["loads"]] == ["few"] for s in data["servers"][1:] if s["index"] > 1)
    ttft = data["loads"]["few"]["comparisons"][0]["metrics"]["median_ttft_ms"]
    assert ttft["ratio"] == pytest.approx(1.1)
    assert ttft["paired"]["median"] == pytest.approx(1.1) and ttft["paired"]["min"] == pytest.approx(1.1)
    assert (ttft["paired"]["n"], ttft["paired"]["worse"]) == (3, 3)
    assert ttft["paired"]["geomean"] == ttft["paired"]["low"] == ttft["paired"]["high"] == pytest.approx(1.1)
    assert "Paired by round" in (tmp_path / "serving_tiny.md").read_text()
    # Each round its own requests, the same on both sides (no prefix-cache hit across rounds)
    seeds = {}
    for position in (0, 1):
        spec = json.loads(next((tmp_path / "work" / "runs").glob("*/logs")).joinpath(f"client-{position:02d}.json").read_text())
        for ld in spec["loads"][1:]:
            seeds[ld["server"]] = ld["args"][ld["args"].index("--seed") + 1]
    assert seeds[0] == seeds[1] != seeds[2] == seeds[3] != seeds[4] == seeds[5] and seeds[0] != seeds[4]
    # Run again in the same directory: the earlier run's turn files must not let the loads go at once
    turns.unlink()
    assert run.main(["--out", str(tmp_path), "--interleave", "3", *INTERLEAVED]) == 0
    again = turns.read_text().split()
    assert [int(rec) for rec in again[1::3]] == [0, 1, 0, 1, 3, 2, 4, 5]


def test_interleave_options(tmp_path, capsys):
    a = run.parse_args(["--out", str(tmp_path), "--interleave", "4", "--layers", "4"])
    assert a.servers_per_side == 1
    bench = run.Benchmark(a)
    options = bench.server_spec().args
    assert options[options.index("--gpu-memory-utilization") + 1] == "0.44"  # two sides share the GPU
    assert "--gpu-memory-utilization" not in run.Benchmark(run.parse_args(["--out", str(tmp_path), "--layers", "4"])).server_spec().args
    assert bench.key != run.Benchmark(run.parse_args(["--out", str(tmp_path), "--layers", "4", "--servers-per-side", "1"])).key
    for bad in (["--resume"], ["--probe"], ["--tensor-parallel-size", "2"]):
        with pytest.raises(SystemExit):
            run.parse_args(["--out", str(tmp_path), "--interleave", "2", *bad])
    with pytest.raises(SystemExit):
        run.parse_args(["--out", str(tmp_path), "--interleave", "2", "--loads", "warmup"])  # nothing measured
    with pytest.raises(SystemExit):
        run.parse_args(["--out", str(tmp_path), "--interleave", "-1"])


def test_interleave_fits_its_rounds_to_the_budget(tmp_path, capsys):
    """Fewer rounds where the time left is short (said in the report); the dry run prints every turn."""
    argv = ["--out", str(tmp_path), "--interleave", "50", "--config", "seqs128", "--layers", "4", "--dry-run",
            "--budget-s", "900"]  # fmt: skip
    assert run.main(argv) == 0
    turns = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("turn:")]
    bench = run.Benchmark(run.parse_args(argv))
    rounds = bench._fit_rounds()
    assert 1 <= rounds < 50
    # warm1k once per server, then rate16 and saturate on each side in every round
    assert len(turns) == 2 + rounds * 2 * 2
    assert turns[2].startswith("turn: server 0 (on) rate16 as record 0") and turns[6].startswith("turn: server 1 (off)")


def test_interleave_stops_every_server_and_reports_when_one_records_fail(tmp_path, monkeypatch):
    """A failure while the first server's records are built (here: reading its host samples) costs
    that server its rounds' records, not the other server's stop, records or the report."""
    _fake_clients(monkeypatch, tmp_path)
    calls = []

    def failing(self, index, side, loads):
        calls.append(index)
        if index == 0:
            raise ValueError("unreadable samples")

    monkeypatch.setattr(run.Benchmark, "read_host_samples", failing)
    assert run.main(["--out", str(tmp_path), "--interleave", "2", *INTERLEAVED]) == 1
    data = json.loads((tmp_path / "serving_tiny.json").read_text())
    assert any("its records: ValueError: unreadable samples" in e for e in data["errors"])
    assert all(s.get("teardown_s") is not None for s in data["servers"] if s["index"] in (0, 1))
    assert sorted(s["index"] for s in data["servers"]) == [0, 1, 3]  # server 1's rounds (1, 3) kept
