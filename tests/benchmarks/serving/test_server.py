"""benchmarks/serving/server.py: the plugin's log line decides whether a server is the side it should be."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from benchmarks.serving.server import (
    PortTaken,
    Server,
    ServerFailed,
    ServerSpec,
    confirm_side,
    cpu_by_role,
    engine_steps,
    kernel_compiles,
    latency_means_ms,
    notable_lines,
    parse_latency_sums,
    parse_prefix_cache_counters,
    process_cpu_s,
)
from benchmarks.serving.sides import parse_side

FAKE = Path(__file__).with_name("fake_vllm_serve.py")
LINE = ("(Worker pid=8133) INFO 12-02 05:44:09 [layer.py:110] vllm-mla-fusion (rank 0, local rank 0): MLA layers "
        "use the fused RoPE + KV-cache write (backend triton, mode decode)")  # fmt: skip
OLD_LINE = "INFO vllm-mla-fusion: MLA layers use the fused RoPE + KV-cache write (backend torch, mode rope_cache)"
FALLBACK = ("WARNING vllm-mla-fusion (rank 0, local rank 0): setting up the fused MLA path failed (ValueError: x); "
            "layers fall back to vLLM's path")  # fmt: skip


def test_on_needs_the_line():
    facts = confirm_side(parse_side("on"), f"start\n{LINE}\nmore\n")
    assert facts["fused_lines"] == [{"rank": "rank 0, local rank 0", "backend": "triton", "mode": "decode"}]
    with pytest.raises(ServerFailed, match="missing"):
        confirm_side(parse_side("on"), "INFO Using FLASH_ATTN_MLA backend.\n")


def test_an_older_checkouts_line_counts():
    facts = confirm_side(parse_side("on"), OLD_LINE)
    assert facts["fused_lines"] == [{"rank": None, "backend": "torch", "mode": "rope_cache"}]


def test_a_fallback_fails_the_on_side():
    with pytest.raises(ServerFailed, match="fell back"):
        confirm_side(parse_side("on"), f"{LINE}\n{FALLBACK}\n")


def test_a_switch_side_needs_the_mode_it_asks_for():
    rope_cache = LINE.replace("mode decode", "mode rope_cache")
    side = parse_side("on+VLLM_MLA_FUSION_DECODE=0")
    assert confirm_side(side, rope_cache)["fused_lines"][0]["mode"] == "rope_cache"
    with pytest.raises(ServerFailed, match="ask for mode rope_cache, the plugin's line says decode"):
        confirm_side(side, LINE)
    assert confirm_side(parse_side("on+VLLM_MLA_FUSION_PDL=0"), LINE)  # a switch that leaves the mode alone
    graph = parse_side("on+VLLM_MLA_FUSION_GRAPH_ROPE=1")
    assert confirm_side(graph, LINE.replace("mode decode", "mode decode-graph-rope"))
    with pytest.raises(ServerFailed, match="did not take effect"):
        confirm_side(graph, LINE)  # set but not eligible there, or not passed on
    key = parse_side("on+VLLM_MLA_FUSION_PREFILL_KEY=1")  # op 3: a side measured as op 3 must have run it
    assert confirm_side(key, LINE.replace("mode decode", "mode decode-prefill-key"))
    with pytest.raises(ServerFailed, match="did not take effect"):
        confirm_side(key, LINE)


def test_a_checkouts_op_3_side_may_log_the_mode_without_op_3(tmp_path):
    """A checkout from before the line named op 3 logs plain decode with it on: accepted there only."""
    (tmp_path / "vllm_mla_fusion").mkdir()
    (tmp_path / "vllm_mla_fusion" / "__init__.py").write_text("")
    at = parse_side(f"on@{tmp_path}+VLLM_MLA_FUSION_PREFILL_KEY=1")
    assert confirm_side(at, LINE) and confirm_side(at, LINE.replace("mode decode", "mode decode-prefill-key"))
    with pytest.raises(ServerFailed, match="did not take effect"):
        confirm_side(at, LINE.replace("mode decode", "mode rope_cache"))


def test_off_must_not_have_the_line():
    assert confirm_side(parse_side("off"), "INFO Using FLASH_ATTN_MLA backend.\n")["fused_lines"] == []
    with pytest.raises(ServerFailed, match="switched off"):
        confirm_side(parse_side("off"), LINE)


def test_notable_lines():
    log = "\n".join(["noise", LINE, "INFO Using FLASH_ATTN_MLA backend.", "GPU KV cache size: 1,000 tokens", "noise"])
    assert notable_lines(log) == [LINE, "INFO Using FLASH_ATTN_MLA backend.", "GPU KV cache size: 1,000 tokens"]


def test_kernel_compiles_as_vllms_jit_monitor_logs_them():
    """vLLM 0.33's lines (jit_monitor.py), verbose and not, a qualified kernel name, CuTeDSL, Triton's
    autotuning print (three lines of its own); other warnings are not compiles."""
    log = "\n".join([
        "(EngineCore pid=2255) WARNING 12-02 22:18:00 [jit_monitor.py:140] Triton kernel JIT compilation during "
        "inference: fused_moe_kernel. This causes a latency spike; consider extending warmup to cover this shape/config.",
        "(EngineCore pid=2255) WARNING 12-02 22:18:01 [jit_monitor.py:140] Triton kernel JIT compilation during "
        "inference: make.<locals>._quant (constexprs={BLOCK=128}; signature={x_ptr='*bf16'}). This causes a latency spike",
        "WARNING [jit_monitor.py:140] CuTeDSL JIT compilation during inference: gemm_rs. This causes a latency spike",
        "Triton autotuning for function _fwd_kernel,", "with key as (1, 64),", "finished after 0.52s,",
        "WARNING [core.py:1] something during inference: not a compile",
    ])  # fmt: skip
    assert kernel_compiles(log) == ["Triton fused_moe_kernel", "Triton make.<locals>._quant", "CuTeDSL gemm_rs",
                                    "Triton autotuning _fwd_kernel"]  # fmt: skip
    assert kernel_compiles("INFO Using FLASH_ATTN_MLA backend.\n") == []


def test_prefix_cache_counters_are_summed_over_engines():
    text = "\n".join([
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
        "# TYPE vllm:prefix_cache_queries_total counter",
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 2048.0',
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 1024.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 512.0',
        "vllm:prefix_cache_hits_created 1.7e9",
    ])  # fmt: skip
    assert parse_prefix_cache_counters(text) == {"queries": 3072.0, "hits": 512.0}


def _iteration(index: int, ctx_reqs: int, ctx: int, gen: int, ms: float, dummy: bool = False) -> str:
    # vLLM 0.33's LoggingStatLogger line under --enable-logging-iteration-details
    return (f"(APIServer pid=7) INFO 12-05 16:29:41 [loggers.py:199] Engine 000: Iteration({index}): {ctx_reqs} "
            f"context requests, {ctx} context tokens, {gen} generation requests, {gen} generation tokens, "
            f"iteration elapsed time: {ms:.2f} ms{' (dummy)' if dummy else ''}, GPU KV cache usage: 3.6%")  # fmt: skip


def test_the_engine_steps_are_read_from_vllms_iteration_lines_by_kind():
    """Decode-only, mixed and prefill-only steps apart; medians, p90 and sums of each kind; dummy
    iterations (data-parallel padding) and other lines are not steps; no lines, no kinds."""
    log = "\n".join([
        "INFO 12-05 16:29:40 [loggers.py:335] Engine 000: Avg prompt throughput: 11019.3 tokens/s",
        *(_iteration(i, 0, 0, 40, 8.0 + i) for i in range(10)),  # decode: 8.0 .. 17.0 ms
        _iteration(10, 2, 2048, 40, 60.0), _iteration(11, 3, 3072, 38, 90.0), _iteration(12, 1, 1024, 41, 30.0),
        _iteration(13, 1, 1024, 0, 20.0), _iteration(14, 0, 0, 0, 0.0, dummy=True),
    ])  # fmt: skip
    steps = engine_steps(log)
    assert set(steps) == {"decode", "mixed", "prefill"}
    assert steps["decode"] == {"steps": 10, "prompt_tokens_p50": 0, "decode_tokens_p50": 40, "ms_p50": 12.5,
                               "ms_p90": 16.0, "ms_sum": pytest.approx(125.0)}  # fmt: skip
    assert steps["mixed"] == {"steps": 3, "prompt_tokens_p50": 2048, "decode_tokens_p50": 40, "ms_p50": 60.0,
                              "ms_p90": 90.0, "ms_sum": 180.0}  # fmt: skip
    assert steps["prefill"]["steps"] == 1 and steps["prefill"]["ms_p50"] == 20.0
    assert engine_steps("INFO nothing here\n") == {}


def _histogram(name: str, engine: int, total: float, count: int) -> list[str]:
    labels = f'engine="{engine}",model_name="m"'
    return [f"# TYPE vllm:{name} histogram", f'vllm:{name}_bucket{{{labels},le="0.1"}} {count}',
            f"vllm:{name}_sum{{{labels}}} {total}", f"vllm:{name}_count{{{labels}}} {count}.0",
            f"vllm:{name}_created{{{labels}}} 1.7e9"]  # fmt: skip


def test_the_servers_own_latencies_are_means_over_the_load_summed_over_engines():
    """Sums and counts of vLLM's latency histograms, engines added; a load's mean is the difference of
    two readings' sums over that of their counts (ms); buckets, _created and other metrics are not read;
    a histogram without new observations has no mean."""
    before = "\n".join([*_histogram("time_to_first_token_seconds", 0, 1.0, 10),
                        *_histogram("request_queue_time_seconds", 0, 0.5, 10),
                        *_histogram("inter_token_latency_seconds", 0, 2.0, 100),
                        *_histogram("request_prefill_time_seconds", 0, 0.25, 10),
                        "vllm:iteration_tokens_total_sum 99.0", "vllm:iteration_tokens_total_count 3.0"])  # fmt: skip
    after = "\n".join([*_histogram("time_to_first_token_seconds", 0, 2.0, 15),
                       *_histogram("time_to_first_token_seconds", 1, 1.5, 5),
                       *_histogram("request_queue_time_seconds", 0, 0.5, 10),
                       *_histogram("inter_token_latency_seconds", 0, 2.9, 190),
                       *_histogram("request_prefill_time_seconds", 0, 0.85, 20)])  # fmt: skip
    assert parse_latency_sums(after) == {"ttft_sum": 3.5, "ttft_count": 20.0, "queue_sum": 0.5, "queue_count": 10.0,
                                         "itl_sum": 2.9, "itl_count": 190.0, "prefill_sum": 0.85,
                                         "prefill_count": 20.0}  # fmt: skip
    means = latency_means_ms(parse_latency_sums(before), parse_latency_sums(after))
    assert means == pytest.approx({"ttft": 250.0, "itl": 10.0, "prefill": 60.0})


def test_the_cpu_time_of_a_server_and_its_children_is_read_by_role(tmp_path):
    """The root process is the API server; a child is named by its vLLM process title (``VLLM::NAME``)
    or its name; each process's CPU seconds are its own, keyed by pid and start time; a process that is
    gone reads None."""
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < {}: pass\n"
    child = f"import setproctitle\nsetproctitle.setproctitle('VLLM::EngineCore_DP0')\n{busy.format(0.6)}import time; time.sleep(30)"
    parent = (f"import subprocess, sys, time\np = subprocess.Popen([sys.executable, '-c', {child!r}])\n"
              f"{busy.format(0.3)}print('ready', flush=True)\ntime.sleep(30)")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 20
        while True:
            # Until each process has spun its share (the sum alone can be reached while the child
            # is still spinning: the parent overshoots its 0.3 s on a loaded machine).
            cpu = process_cpu_s(proc.pid)
            roles = {role: c for role, c in cpu.values()}
            if (roles.get("api_server", 0) >= 0.28 and roles.get("EngineCore_DP0", 0) >= 0.55) or (
                time.monotonic() > deadline
            ):
                break
            time.sleep(0.1)
        assert set(roles) == {"api_server", "EngineCore_DP0"}, cpu
        assert roles["api_server"] >= 0.28 and roles["EngineCore_DP0"] >= 0.55, cpu
        assert {pid for pid, _ in cpu} == {proc.pid, *(c.pid for c in psutil.Process(proc.pid).children())}
    finally:
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()
        proc.kill()
        proc.wait()
    assert process_cpu_s(proc.pid) is None


def test_cpu_by_role_pairs_the_same_processes_of_two_readings():
    """A process's seconds are its own difference; one started in between counts from zero; one gone
    by the second reading is not counted (never a negative share for its role); roles add up."""
    before = {(1, 10.0): ("api_server", 5.0), (2, 11.0): ("python3", 7.0), (3, 12.0): ("python3", 3.0)}
    after = {(1, 10.0): ("api_server", 6.5), (2, 11.0): ("python3", 9.0), (4, 20.0): ("python3", 0.5),
             (3, 30.0): ("python3", 0.25)}  # pid 3 reused by a new process  # fmt: skip
    assert cpu_by_role(before, after) == {"api_server": 1.5, "python3": 2.75}


def _spec(tmp_path):
    return ServerSpec([sys.executable, str(FAKE)], str(tmp_path / "model"), "m", ["--load-format", "dummy"], str(tmp_path))


def test_a_server_starts_answers_and_stops_with_its_group(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SERVE_DELAY_S", "1.5")
    env = parse_side("off").server_env(dict(os.environ))
    server = Server(_spec(tmp_path), parse_side("off"), env, tmp_path / "s.log")
    try:
        assert server.wait_healthy(30) >= 1.5
        assert server.command[-2:] == ["--load-format", "dummy"] and "--port" in server.command
        from benchmarks.serving.server import metrics_text

        assert parse_prefix_cache_counters(metrics_text(server.port)) == {"queries": 10.0, "hits": 4.0}
        assert confirm_side(parse_side("off"), server.log())["fused_lines"] == []
    finally:
        server.stop(grace_s=5)
    assert server.proc.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(server.proc.pid, 0)


def test_a_taken_port_is_told_apart_from_a_crash(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        server = Server(_spec(tmp_path), parse_side("on"), dict(os.environ), tmp_path / "s.log", port=port)
        with pytest.raises(PortTaken):
            server.wait_healthy(30)
        server.stop(grace_s=5)


def test_a_server_that_never_gets_healthy(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SERVE_DELAY_S", "100")
    server = Server(_spec(tmp_path), parse_side("on"), dict(os.environ), tmp_path / "s.log")
    try:
        with pytest.raises(ServerFailed, match="not healthy after 2 s"):
            server.wait_healthy(2)
    finally:
        server.stop(grace_s=5)


def tp_log(ranks=range(8), mode=lambda r: "decode", backend=lambda r: "triton") -> str:
    """A TP8 server's log: each worker's line, as vLLM prefixes a worker's output, interleaved with others."""
    lines = [f"(Worker_TP{r} pid={100 + r}) INFO 12-02 05:44:09 [layer.py:119] vllm-mla-fusion (rank {r}, local rank {r}): "
             f"MLA layers use the fused RoPE + KV-cache write (backend {backend(r)}, mode {mode(r)})\nINFO other {r}"
             for r in ranks]  # fmt: skip
    return "\n".join(lines)


def test_every_rank_of_eight_fused_alike():
    facts = confirm_side(parse_side("on"), tp_log(ranks=[3, 0, 7, 1, 2, 6, 5, 4]), ranks=8)
    assert facts["fused_by_rank"] == {r: "triton/decode" for r in range(8)}
    assert len(facts["fused_lines"]) == 8


def test_a_missing_rank_fails():
    with pytest.raises(ServerFailed, match=r"no plugin line from rank\(s\) \[5\] of 8"):
        confirm_side(parse_side("on"), tp_log(ranks=[0, 1, 2, 3, 4, 6, 7]), ranks=8)


def test_a_rank_that_fell_back_fails():
    log = tp_log(ranks=[0, 1, 2, 4, 5, 6, 7]) + "\n(Worker_TP3 pid=103) " + FALLBACK.replace("rank 0, local rank 0", "rank 3, local rank 3")
    with pytest.raises(ServerFailed, match="fell back.*rank 3"):
        confirm_side(parse_side("on"), log, ranks=8)


def test_ranks_that_chose_differently_fail():
    with pytest.raises(ServerFailed, match="chose differently.*rank 6 triton/rope_cache"):
        confirm_side(parse_side("on"), tp_log(mode=lambda r: "rope_cache" if r == 6 else "decode"), ranks=8)
    with pytest.raises(ServerFailed, match="chose differently.*rank 0 torch/decode"):
        confirm_side(parse_side("on"), tp_log(backend=lambda r: "torch" if r == 0 else "triton"), ranks=8)


def test_doubled_unnamed_or_surplus_ranks_fail():
    with pytest.raises(ServerFailed, match="rank 2 wrote the plugin's line twice"):
        confirm_side(parse_side("on"), tp_log(ranks=[0, 1, 2, 2, 3, 4, 5, 6, 7]), ranks=8)
    with pytest.raises(ServerFailed, match="names no rank"):
        confirm_side(parse_side("on"), tp_log() + "\n" + OLD_LINE, ranks=8)
    with pytest.raises(ServerFailed, match=r"beyond tensor-parallel size 8"):
        confirm_side(parse_side("on"), tp_log(ranks=range(9)), ranks=8)
    # One GPU: one line, however it names its rank (the check before tensor parallelism, unchanged).
    assert len(confirm_side(parse_side("on"), OLD_LINE, ranks=1)["fused_lines"]) == 1


def test_off_at_tp8_must_have_no_rank_line():
    with pytest.raises(ServerFailed, match="switched off"):
        confirm_side(parse_side("off"), tp_log(ranks=[4]), ranks=8)
    assert confirm_side(parse_side("off"), "INFO nothing\n", ranks=8)["fused_lines"] == []
