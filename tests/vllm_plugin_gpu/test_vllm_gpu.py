"""The plugin inside real vLLM 0.33 on an NVIDIA GPU: plugin on vs off, three MLA backends.

Not under tests/vllm_plugin/, whose conftest forces vLLM's CPU platform at import.
The engines run in worker processes (engine_worker.py), one per backend, side by
side on the one GPU; this module starts them once per session, and its tests check
what they recorded (checks.py). ``MLA_FUSION_GPU_OUT`` names a folder for the
combined results, the workers' logs and a readable report (scripts/gpu_vllm_check.sh
sets it to $OUT); ``MLA_FUSION_GPU_BUDGET_S`` bounds the whole run (default 300 s):
workers start no case (an on/off pair) past it less a reserve, and are killed at it. A case that did
not run within the budget is skipped with that reason.

| test | checks |
|---|---|
| test_vllm_loads_the_plugin | each worker: the entry point is installed and vLLM's own loader registers the fused wrapper |
| test_plugin_on_and_off | on: every MLA layer is the plugin's wrapper in mode decode; off: vLLM's; the asked backend and cache dtype |
| test_cuda_graph_mode | eager: no graph; compiled: the CUDA-graph mode vLLM resolved has FULL decode graphs, and decode steps replayed them |
| test_attention_paths | the prefill path ran, also with chunked context from the cache; multi-token batches took the decode path where the backend allows; identical on/off |
| test_bf16_compiled_bit_identical | compiled, bf16: greedy tokens, their logprobs and teacher-forced logprobs equal bit for bit |
| test_switch_cases_compiled_bit_identical | the same for cases with a plugin switch (FLASH_ATTN_MLA with VLLM_MLA_FUSION_GRAPH_ROPE=1; FLASH_ATTN_MLA and FLASHMLA with the opt-in fused prefill key, VLLM_MLA_FUSION_PREFILL_KEY=1) |
| test_bf16_eager_within_vllms_own_noise | eager: teacher-forced logprobs on vs off within 1.5x vLLM's own eager-vs-compiled difference |
| test_fp8_error_no_larger_than_vllms | fp8 cache (FLASHMLA: fp8 query; TRITON_MLA: bf16 query): mean error vs the bf16-cache engine at most 1.1x vLLM's own + 1e-3 |
| test_no_host_sync_added | vLLM's own sync check (`VLLM_GPU_SYNC_CHECK=warn`, armed after warm-up) over the probe's steps: no GPU<->CPU sync in the plugin's code, no more than without the plugin (issue 40) |
| test_launch_census | per profiled step: our kernel once per layer (twice in mixed steps where op 2 assembles the decode query), none of vLLM's RoPE / cache-write / query-concat kernels |
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from . import checks
from . import workload as W

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
# Seconds kept back from the budget: an engine started just before the workers' own
# cut-off must still finish its probe and teardown.
RESERVE_S = 100.0


def _skip_reason() -> str | None:
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is None:
        return "needs vLLM 0.33.0 installed"
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return "needs an NVIDIA GPU (the cases use FLASH_ATTN_MLA, FLASHMLA, TRITON_MLA)"
    if torch.cuda.get_device_capability() < (9, 0):
        return "FLASHMLA and FLASH_ATTN_MLA (FlashAttention 3) need sm_90 or newer"
    return None


class Run:
    def __init__(self, records, logs, timed_out, out):
        self.records = records
        self.engines = checks.engines(records)
        self.logs = logs
        self.timed_out = timed_out
        self.out = out

    def rec(self, name: str, side: str) -> dict:
        r = self.engines.get((name, side))
        if r is None:
            why = "its worker timed out" if self.timed_out else "its worker died or never reached it"
            pytest.fail(f"{name} plugin {side}: no record ({why}); see {self.out}/vllm_gpu_workers.log")
        if "skipped" in r:
            pytest.skip(f"{name} plugin {side} not run: {r['skipped']}")
        if "error" in r:
            pytest.fail(f"{name} plugin {side} failed: {r['error']}\n{r.get('traceback', '')}")
        return r

    def pair(self, name: str) -> tuple[dict, dict]:
        return self.rec(name, "on"), self.rec(name, "off")


def _report(run: Run) -> str:
    """Every check's reading, pass or fail, and the per-step kernel lists: the lead reads this."""
    lines = []
    for r in run.records:
        if r.get("kind") == "worker":
            lines.append(f"worker {r['groups']}: vLLM {r.get('vllm')} import {r.get('import_vllm_s', 0):.1f} s, "
                         f"loaded by vLLM: {r.get('loaded_by_vllm')}, entry point {r['entry_points'].get('mla_fusion')}")
        elif r.get("kind") == "done":
            lines.append(f"worker done in {r['elapsed_s']:.0f} s, {r['failures']} failed engines")
        elif "error" in r or "skipped" in r:
            lines.append(f"{r['case']['name']} {r['side']}: {r.get('error') or 'skipped: ' + r['skipped']}")
        else:
            lines.append(f"{r['case']['name']} {r['side']}: build {r['build_s']:.1f} s, probe {r['probe_s']:.1f} s, "
                         f"shutdown {r['shutdown_s']:.1f} s; JIT compiles after warm-up: "
                         f"{[(j['kernel'], round(j['compile_ms'], 1)) for j in r['jit_after_warmup']]}")  # fmt: skip

    def attempt(title, fn, *args, **kwargs):
        try:
            lines.append(f"  [ok]   {title}: {fn(*args, **kwargs)}")
        except AssertionError as e:
            lines.append(f"  [FAIL] {title}: {e}")
        except Exception as e:  # noqa: BLE001 - a report line, not a test
            lines.append(f"  [n/a]  {title}: {type(e).__name__}: {e}")

    ok = lambda n, s: (n, s) in run.engines and not ({"error", "skipped"} & set(run.engines[(n, s)]))  # noqa: E731
    for name, c in W.ALL_CASES.items():
        if not (ok(name, "on") and ok(name, "off")):
            continue
        on, off = run.engines[(name, "on")], run.engines[(name, "off")]
        lines.append(f"== {name}")
        attempt("sides", checks.check_sides, on, off, W.NUM_LAYERS)
        attempt("graph mode (on)", checks.check_graph_mode, on)
        attempt("graph mode (off)", checks.check_graph_mode, off)
        attempt("paths", checks.check_paths, on, off)
        if c.kv_cache_dtype == "auto" and c.compiled:
            attempt("bf16 compiled bit-identical", checks.check_bf16_identical, on, off)
        if not c.compiled and ok(W.case(c.backend, True).name, "off"):
            attempt("eager noise", checks.check_eager_noise, on, off, run.engines[(W.case(c.backend, True).name, "off")])
        if c.kv_cache_dtype != "auto" and ok(W.case(c.backend, True).name, "off"):
            attempt("fp8 error", checks.check_fp8, on, off, run.engines[(W.case(c.backend, True).name, "off")])
        lines.append(f"  graph kernels visible to the profiler: {checks.graph_kernels_visible(on)}")
        attempt("host syncs", checks.check_host_syncs, on, off)
        attempt("compiled ahead", checks.check_no_plugin_compiles_after_warmup, on)
        attempt("census", checks.check_census, on, off, W.NUM_LAYERS)
        for kind in ("decode", "prefill", "mixed"):
            lines.append(checks.kernel_reading(on, off, kind))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def run() -> Run:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    budget = float(os.environ.get("MLA_FUSION_GPU_BUDGET_S", "300"))
    out = Path(os.environ.get("MLA_FUSION_GPU_OUT") or tempfile.mkdtemp(prefix="vllm_gpu_out_"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vllm_gpu_work_"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    # The workers pick vLLM's CUDA platform and the compiled Triton kernel.
    for name in ("VLLM_TARGET_DEVICE", "TRITON_INTERPRET", "VLLM_MLA_FUSION", "VLLM_MLA_FUSION_DECODE",
                 "VLLM_MLA_FUSION_BACKEND", "VLLM_PLUGINS"):  # fmt: skip
        env.pop(name, None)
    procs, logs, results = {}, {}, []
    for group in W.GROUPS:
        logs[group] = work / f"worker-{group}.log"
        results.append(work / f"results-{group}.jsonl")
        cmd = [sys.executable, "-m", "tests.vllm_plugin_gpu.engine_worker", "--group", group, "--out", str(results[-1]),
               "--work-dir", str(work / group), "--budget-s", str(max(budget - RESERVE_S, 0.0))]  # fmt: skip
        with open(logs[group], "w") as log:
            procs[group] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + budget - 15.0
    timed_out = False
    for group, p in procs.items():
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    records = checks.load_records(results)
    with open(out / "vllm_gpu_results.jsonl", "w") as f:
        for p in results:
            if p.exists():
                f.write(p.read_text())
    with open(out / "vllm_gpu_workers.log", "w") as f:
        for group, path in logs.items():
            f.write(f"===== worker {group} (exit {procs[group].returncode})\n")
            f.write(path.read_text(errors="replace"))
    result = Run(records, logs, timed_out, out)
    (out / "vllm_gpu_report.txt").write_text(_report(result))
    return result


def test_vllm_loads_the_plugin(run):
    headers = [r for r in run.records if r.get("kind") == "worker"]
    assert len(headers) == len(W.GROUPS), f"{len(headers)} of {len(W.GROUPS)} workers started"
    for h in headers:
        assert h["entry_points"].get("mla_fusion") == "vllm_mla_fusion.vllm_plugin:register", h["entry_points"]
        assert h["loaded_by_vllm"] == checks.PLUGIN_CLASS, h


@pytest.mark.parametrize("name", list(W.ALL_CASES))
def test_plugin_on_and_off(run, name):
    on, off = run.pair(name)
    print(checks.check_sides(on, off, W.NUM_LAYERS))
    assert on["mla_layers_redrawn"] == off["mla_layers_redrawn"] == W.NUM_LAYERS


@pytest.mark.parametrize("name", list(W.ALL_CASES))
def test_cuda_graph_mode(run, name):
    for rec in run.pair(name):
        print(rec["side"], checks.check_graph_mode(rec))


@pytest.mark.parametrize("name", list(W.ALL_CASES))
def test_attention_paths(run, name):
    print(checks.check_paths(*run.pair(name)))


@pytest.mark.parametrize("backend", list(W.GROUPS))
def test_bf16_compiled_bit_identical(run, backend):
    print(checks.check_bf16_identical(*run.pair(W.case(backend, True).name)))


@pytest.mark.parametrize("name", [n for n, c in W.ALL_CASES.items() if c.plugin_env and c.compiled])
def test_switch_cases_compiled_bit_identical(run, name):
    """With a plugin switch set (the graph-rope case: op 1 inside piecewise graphs; the opt-in fused
    prefill key, op 3), still bit for bit."""
    print(checks.check_bf16_identical(*run.pair(name)))


@pytest.mark.parametrize("backend", list(W.GROUPS))
def test_bf16_eager_within_vllms_own_noise(run, backend):
    on, off = run.pair(W.case(backend, False).name)
    off_compiled = run.rec(W.case(backend, True).name, "off")
    print(checks.check_eager_noise(on, off, off_compiled))


@pytest.mark.parametrize("backend,fp8_query", [("FLASHMLA", True), ("TRITON_MLA", False)])
def test_fp8_error_no_larger_than_vllms(run, backend, fp8_query):
    on, off = run.pair(W.case(backend, True, "fp8").name)
    ref = run.rec(W.case(backend, True).name, "off")
    for rec in (on, off):
        assert rec["facts"]["layers"][0]["fp8_query"] is fp8_query, rec["facts"]["layers"][0]
    print(checks.check_fp8(on, off, ref))


@pytest.mark.parametrize("name", list(W.ALL_CASES))
def test_no_host_sync_added(run, name):
    print(checks.check_host_syncs(*run.pair(name)))


@pytest.mark.parametrize("name", list(W.ALL_CASES))
def test_plugin_compiles_nothing_after_warm_up(run, name):
    print(checks.check_no_plugin_compiles_after_warmup(run.pair(name)[0]))


@pytest.mark.parametrize("name", list(W.ALL_CASES))
def test_launch_census(run, name):
    on, off = run.pair(name)
    if on["case"]["compiled"] and checks.graph_kernels_visible(on) is False:
        pytest.skip("the profiler reported no kernels inside CUDA-graph replays; the eager census is the reading")
    print(checks.check_census(on, off, W.NUM_LAYERS))
    print(checks.kernel_reading(on, off, "decode"))
