"""The benchmark's CPU smoke mode runs end to end and writes the JSON it promises.

``benchmarks/bench_mla_rope_cache.py --smoke`` runs every code path of the GPU
benchmark that a CPU can run (inputs, implementations, output checks against
the torch reference, timing bookkeeping, tables, targets) on tiny shapes,
with Triton's interpreter and no CUDA graphs. Its numbers mean nothing; this
test only checks that the harness works, so that a broken benchmark is found in
CI rather than on a GPU lease.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_mla_rope_cache.py"
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_TRITON_BACKEND = (REPO / "vllm_mla_fusion" / "backends" / "triton.py").exists()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_smoke")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    env.pop("VLLM_MLA_FUSION_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--no-plot", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"smoke run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    path = out / "bench_mla_rope_cache.json"
    assert path.exists(), proc.stdout[-2000:]
    assert (out / "bench_mla_rope_cache.md").exists()
    data = json.loads(path.read_text())
    data["_stdout"] = proc.stdout
    return data


pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="the smoke run needs triton (its interpreter) installed")


def _rows(report, **match):
    return [r for r in report["results"] if all(r.get(k) == v for k, v in match.items())]


def test_header_and_calibration(report):
    env, cfg = report["environment"], report["config"]
    assert env["torch"] and env["triton"] and env["device"]["name"]
    assert cfg["mode"] == "smoke"
    for key in ("heads", "tokens", "cache_dtypes", "block_sizes", "kv_lora_rank", "rope_dim", "rotation"):
        assert key in cfg
    cal = report["calibration"]["start"]
    assert cal["launch"]["floor_us"] > 0 and cal["copy"]["bytes_per_s"] > 0
    out = report["_stdout"]
    assert "SWEEP" in out and "DECODE LAYER" in out and "TARGETS" in out


@pytest.mark.parametrize("op", ["prefill", "decode"])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_sweep_entries(report, op, cache):
    cfg = report["config"]
    for impl in ("torch_ref", "unfused", "triton", "torch_compile"):
        rows = [r for r in _rows(report, section="sweep", op=op, cache=cache, impl=impl) if r["status"] != "n/a"]
        # Every (H, T, block size) is measured; torch rows only at the largest block size.
        n_bs = 1 if impl.startswith("torch") else len(cfg["block_sizes"])
        assert len(rows) == len(cfg["heads"]) * len(cfg["tokens"]) * n_bs, (impl, rows)
        for r in rows:
            if impl == "triton" and not HAS_TRITON_BACKEND:
                assert r["status"] == "error" and "triton" in r["reason"]
                continue
            assert r["status"] == "ok", r
            assert r["us"] > 0 and r["bytes"] > 0 and r["floor_us"] > 0 and r["efficiency"] > 0
            assert r["check"]["ok"], r["check"]
    for peer in ("aiter_triton", "vllm_fused", "flashinfer"):
        for r in _rows(report, section="sweep", op=op, cache=cache, impl=peer):
            assert r["status"] in ("missing", "n/a") and r["reason"]  # reported, never faked


def test_mixed_and_decode_layer(report):
    mixed = _rows(report, section="mixed")
    assert {r["impl"] for r in mixed} >= {"triton", "unfused", "torch_ref"}
    for r in mixed:
        if r["impl"] == "triton" and not HAS_TRITON_BACKEND:
            continue
        assert r["status"] == "ok" and r["check"]["ok"], r
        if r["impl"] in ("triton", "unfused"):
            assert r["launches"] == (2 if r["impl"] == "triton" else 3)  # op 2 + op 1 vs rope, cache, concat
    layer = _rows(report, section="decode-layer", impl="unfused")
    cfg = report["config"]
    assert len(layer) == len(cfg["heads"]) * len(cfg["decode_batches"]) * len(cfg["cache_dtypes"])
    assert all(r["status"] == "ok" and r["op"] == "decode" for r in layer)


def test_epilogue_entries(report):
    """Op 3 and its baselines on every epilogue config, each checked against the torch reference."""
    cfg = report["config"]
    n_bf16 = len(cfg["heads"]) * len(cfg["tokens"])
    for impl, launches in (("triton", 1), ("unfused", 3), ("op1_cat", 2), ("triton_dense", 1), ("torch_ref", None)):
        rows = _rows(report, section="epilogue", impl=impl)
        assert len([r for r in rows if r["key"] == "bf16"]) == n_bf16, (impl, rows)
        assert any(r["key"] == "fp8" for r in rows), impl
        for r in rows:
            if impl in ("triton", "op1_cat", "triton_dense") and not HAS_TRITON_BACKEND:
                continue
            assert r["status"] == "ok" and r["check"]["ok"], r
            assert "k_out" in r["check"]["fields"], r["check"]
            assert r["launches"] == launches, r
    for peer in ("vllm_fused", "vllm_k3"):
        for r in _rows(report, section="epilogue", impl=peer):
            assert r["status"] in ("missing", "n/a") and r["reason"]
    assert "PREFILL EPILOGUE" in report["_stdout"]


def test_targets(report):
    ids = {t["id"] for t in report["targets"]}
    assert ids == {"bandwidth", "launch", "vs_aiter_triton", "vs_vllm_fused", "vs_flashinfer", "decode_vs_unfused",
                   "epilogue_bandwidth", "epilogue_vs_k3_issue", "epilogue_vs_k3_same_run", "op1_large_T",
                   "decode_H128_T16", "decode_H128_T256"}  # fmt: skip
    for t in report["targets"]:
        assert t["status"].startswith(("met", "NOT MET", "not measured")), t
        if t["status"].startswith(("met", "NOT MET")):
            assert "CPU smoke" in t["status"]
