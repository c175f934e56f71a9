"""The GPU integration tests' worker, run on vLLM's CPU platform: same code paths, same checks.

``engine_worker.py --cpu-smoke`` builds two in-process engines (CPU_MLA, eager,
float32, the plain-torch stand-ins for the kernels the CUDA wheel lacks; plugin on,
then off) and runs the whole probe: facts, greedy generation, teacher forcing,
the profiled census, path counters, the JIT hook. This test applies the GPU
tests' checks to what it recorded, so that a broken worker or check is found in
CI rather than on a GPU lease. What the CPU cannot show: CUDA graphs, GPU
kernels (the census counts the ops' CPU events instead), fp8 caches, chunked
prefill (vLLM's CPU platform turns it off for MLA).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import checks
from . import workload as W

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("worker_smoke") / "results.jsonl"
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    for name in ("VLLM_MLA_FUSION", "VLLM_MLA_FUSION_DECODE", "VLLM_PLUGINS", "VLLM_MLA_FUSION_BACKEND"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.vllm_plugin_gpu.engine_worker", "--cpu-smoke", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    recs = checks.load_records([out])
    assert recs and recs[-1].get("kind") == "done", proc.stderr[-4000:]
    return recs


@pytest.fixture(scope="module")
def pair(records):
    eng = checks.engines(records)
    name = W.CPU_GROUPS["CPU_MLA"][0].name
    on, off = eng[(name, "on")], eng[(name, "off")]
    for rec in (on, off):
        assert "error" not in rec, rec.get("traceback")
    return on, off


def test_worker_found_the_plugin_through_vllms_loader(records):
    header = records[0]
    assert header["kind"] == "worker"
    assert header["entry_points"].get("mla_fusion") == "vllm_mla_fusion.vllm_plugin:register"
    assert header["loaded_by_vllm"] == checks.PLUGIN_CLASS
    assert records[-1]["failures"] == 0


def test_sides_graph_mode_and_paths(pair):
    on, off = pair
    checks.check_sides(on, off, W.NUM_LAYERS)
    for rec in pair:
        checks.check_graph_mode(rec)
    checks.check_paths(on, off, chunked_prefill=False)
    assert on["mla_layers_redrawn"] == W.NUM_LAYERS


def test_outputs_match(pair):
    checks.check_bf16_identical(*pair, tol=1e-4)  # float32 on the CPU; reductions may reorder
    # The eager-noise check against itself: zero vLLM noise leaves only eps.
    on, off = pair
    checks.check_eager_noise(on, off, off, eps=1e-4)


def test_census_counts_ops_per_step(pair):
    on, off = pair
    checks.check_census(on, off, W.NUM_LAYERS, gpu=False)
    assert checks.graph_kernels_visible(on) is None  # no CUDA graph on the CPU


def test_checks_catch_a_difference(pair):
    on, off = pair
    bad = {**on, "teacher": {**on["teacher"], "logprobs": [[x + 0.1 for x in row] for row in on["teacher"]["logprobs"]]}}
    with pytest.raises(AssertionError):
        checks.check_bf16_identical(bad, off, tol=1e-4)
    with pytest.raises(AssertionError):
        checks.check_sides(off, on, W.NUM_LAYERS)  # sides swapped
    with pytest.raises(AssertionError):
        checks.check_census(off, on, W.NUM_LAYERS, gpu=False)
    # Layers that claim the opt-in fused prefill key the case did not ask for, and whose steps never ran op 3.
    claims = {**on, "facts": {**on["facts"], "layers": [{**l, "prefill_key_fused": True} for l in on["facts"]["layers"]]}}
    with pytest.raises(AssertionError, match="prefill key is fused"):
        checks.check_sides(claims, off, W.NUM_LAYERS)
    with pytest.raises(AssertionError, match="mla_prefill_rope_cache_write ran 0 times"):
        checks.check_census(claims, off, W.NUM_LAYERS, gpu=False)
    # The same claim where the step totals cannot tell whether MLA had prefill rows (a threshold
    # above every prompt: each may be an MLA decode row, or a prefill where the backend needs
    # uniform decode lengths): 0 or one per layer accepted, so 0 passes.
    decodes = {**claims, "facts": {**claims["facts"], "layers": [
        {**l, "reorder_batch_threshold": 10**6} for l in claims["facts"]["layers"]]}}  # fmt: skip
    checks.check_census(decodes, off, W.NUM_LAYERS, gpu=False)


@pytest.mark.parametrize(("reqs", "tokens", "threshold", "rows"), [
    (0, 0, 128, False), (4, 32, 1, True), (1, 600, 512, True), (2, 1025, 512, True), (3, 97, 32, True),
    (4, 32, 128, None), (1, 512, 512, None), (1, 96, 128, None), (2, 600, 512, None),
])  # fmt: skip
def test_mla_prefill_rows(reqs, tokens, threshold, rows):
    """A context request longer than the backend's threshold is an MLA prefill; a shorter one may
    be either (FLASHMLA's uniform decode lengths), and totals that cannot tell say so."""
    assert checks.mla_prefill_rows({"ctx_reqs": reqs, "ctx_tokens": tokens}, threshold) is rows


def test_compiles_after_warm_up_check():
    """Only the plugin's own kernels count: FLASHMLA's first engine, before the profile run took
    the block size vLLM settles after building the model, compiled op 3's variants here."""
    vllm_kernel = {"kernel": "_topk_log_softmax_kernel", "module": "vllm.v1.worker.gpu.sample.logprob", "compile_ms": 141.0}
    ours = {"kernel": "_mla_rope_cache_kernel_op3", "module": "vllm_mla_fusion.backends.triton", "compile_ms": 660.4}
    checks.check_no_plugin_compiles_after_warmup({"jit_hook": True, "jit_after_warmup": [vllm_kernel]})
    with pytest.raises(AssertionError, match="_mla_rope_cache_kernel_op3"):
        checks.check_no_plugin_compiles_after_warmup({"jit_hook": True, "jit_after_warmup": [vllm_kernel, ours]})
    with pytest.raises(AssertionError, match="hook was not installed"):
        checks.check_no_plugin_compiles_after_warmup({"jit_hook": False, "jit_after_warmup": []})


def test_jit_hook_installed(pair):
    has_triton = importlib.util.find_spec("triton") is not None
    for rec in pair:
        assert rec["jit_hook"] is has_triton
        assert rec["jit_after_warmup"] == []  # the CPU path runs the torch backend: nothing to compile


def test_host_sync_check_is_recorded_and_its_check_fails_on_an_added_sync(pair):
    """vLLM's sync check runs on every engine (armed on CUDA only: nothing recorded here); its check
    names a sync in the plugin's code, an extra sync on the plugin side, and a run without it."""
    on, off = pair
    for rec in pair:
        assert rec["sync_check"] == "warn" and rec["host_syncs"] == [] and rec["sync_check_control"] == 0
    assert "0 on / 0 off" in checks.check_host_syncs(on, off, gpu=False)
    with pytest.raises(AssertionError, match="deliberate sync"):
        checks.check_host_syncs(on, off)  # on a GPU the control must have been recorded
    warning = "called a synchronizing CUDA operation"
    ours = {**on, "host_syncs": [f"/site/vllm_mla_fusion/vllm_plugin/attention.py:300: {warning}"]}
    with pytest.raises(AssertionError, match="the plugin's code synchronized"):
        checks.check_host_syncs(ours, off, gpu=False)
    in_stack = {**on, "host_syncs": [f"[vllm_mla_fusion in the stack] /site/torch/_tensor.py:9: {warning}"]}
    with pytest.raises(AssertionError, match="the plugin's code synchronized"):
        checks.check_host_syncs(in_stack, off, gpu=False)
    extra = {**on, "host_syncs": [f"/site/vllm/v1/worker/gpu_model_runner.py:10: {warning}"]}
    with pytest.raises(AssertionError, match="1 sync warnings with the plugin, 0 without"):
        checks.check_host_syncs(extra, off, gpu=False)
    assert "1 on / 1 off" in checks.check_host_syncs(extra, extra, gpu=False)
    with pytest.raises(AssertionError, match="without vLLM's sync check"):
        checks.check_host_syncs({**on, "sync_check": None}, off, gpu=False)
