"""The benchmark's CPU smoke mode runs end to end and writes the JSON it promises.

``python -m benchmarks.kernels.bench_mla_rope_cache --smoke`` runs every code path of the GPU
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

REPO = Path(__file__).resolve().parents[3]
HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_smoke")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("VLLM_MLA_FUSION_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels.bench_mla_rope_cache", "--smoke", "--no-plot", "--out", str(out)],
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
            assert r["status"] == "ok", r
            assert r["us"] > 0 and r["bytes"] > 0 and r["floor_us"] > 0 and r["efficiency"] > 0
            assert r["check"]["ok"], r["check"]
    for peer in ("aiter_triton", "vllm_fused", "flashinfer", "vllm_k3"):
        for r in _rows(report, section="sweep", op=op, cache=cache, impl=peer):
            assert r["status"] in ("missing", "n/a") and r["reason"]  # reported, never faked
    if op == "decode":  # K3's decode ops are op 2's peer (issue 41): a row per shape, never dropped
        k3 = _rows(report, section="sweep", op=op, cache=cache, impl="vllm_k3")
        assert len(k3) == len(cfg["heads"]) * len(cfg["tokens"]) * len(cfg["block_sizes"]), k3
        # The smoke run's tiny latent and rope widths are not K3's (it compiles L 512, R 64 only).
        assert all(r["status"] == "n/a" and "L 512 and R 64" in r["reason"] for r in k3), k3


def test_mixed_and_decode_layer(report):
    mixed = _rows(report, section="mixed")
    assert {r["impl"] for r in mixed} >= {"triton", "unfused", "torch_ref"}
    for r in mixed:
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
            assert r["status"] == "ok" and r["check"]["ok"], r
            assert "k_out" in r["check"]["fields"], r["check"]
            assert r["launches"] == launches, r
    for peer in ("vllm_fused", "vllm_k3"):
        for r in _rows(report, section="epilogue", impl=peer):
            assert r["status"] in ("missing", "n/a") and r["reason"]
    assert "PREFILL EPILOGUE" in report["_stdout"]


def test_targets(report):
    """Each target is measured exactly where the run has rows for it, over all of them; a measured
    target is marked meaningless in the smoke run, an unmeasured one says why."""
    targets = {t["id"]: t for t in report["targets"]}
    assert set(targets) == {"bandwidth", "launch", "vs_aiter_triton", "vs_vllm_fused", "vs_flashinfer",
                            "decode_vs_unfused", "epilogue_bandwidth", "epilogue_vs_k3_issue",
                            "epilogue_vs_k3_same_run", "decode_vs_k3_same_run", "op1_large_T", "decode_H128_T16",
                            "decode_H128_T256"}  # fmt: skip
    ok = [r for r in report["results"] if r["status"] == "ok"]
    sweep = [r for r in ok if r["section"] == "sweep" and r["impl"] == "triton"]
    launch_bound = [r for r in sweep if r["T"] <= 16]
    decode_pairs = [r for r in ok if r["impl"] == "unfused" and r["op"] == "decode" and r["T"] <= 64]
    # Bandwidth-bound rows: none, unless the copy calibration came out slow (a loaded machine).
    bandwidth_bound = [r for r in sweep if r["bw_term_us"] >= 5.0]
    epilogue_bound = [r for r in ok if r["section"] == "epilogue" and r["impl"] == "triton" and r["bw_term_us"] >= 5.0]
    assert launch_bound and decode_pairs
    measured = {"launch": f"/{len(launch_bound)} shapes;", "decode_vs_unfused": f" over {len(decode_pairs)} shapes"}
    if bandwidth_bound:
        measured["bandwidth"] = f"/{len(bandwidth_bound)} shapes;"
    if epilogue_bound:
        measured["epilogue_bandwidth"] = f"/{len(epilogue_bound)} shapes;"
    for tid, t in targets.items():
        if tid in measured:
            assert t["status"].startswith(("met", "NOT MET")) and t["status"].endswith("(CPU smoke: meaningless)"), t
            assert measured[tid] in t["detail"], t
        else:
            assert t["status"] == "not measured", t
    for peer in ("aiter_triton", "vllm_fused", "flashinfer"):
        reason = next(r["reason"] for r in report["results"] if r["impl"] == peer and r["status"] != "n/a")
        assert targets[f"vs_{peer}"]["detail"] == f"not measured ({reason})"


def _row(impl: str, op: str, T: int, us: float, efficiency: float = 0.95) -> dict:
    return {"section": "sweep", "impl": impl, "op": op, "cache": "bf16", "H": 16, "block_size": 64, "T": T,
            "decode_tokens": 0, "status": "ok", "us": us, "efficiency": efficiency, "bw_term_us": 6.0,
            "floor_us": 1.0}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "verdicts"),
    [
        (None, {"bandwidth": "met", "launch": "met", "vs_vllm_fused": "met", "decode_vs_unfused": "met"}),
        ({"triton prefill efficiency": 0.89}, {"bandwidth": "NOT MET", "launch": "met"}),
        ({"triton decode us": 3.1}, {"launch": "NOT MET", "decode_vs_unfused": "NOT MET"}),
        ({"vllm_fused decode us": 1.9}, {"vs_vllm_fused": "NOT MET"}),  # geomean 1.19x, but slower at one shape
    ],
    ids=["all met", "bandwidth", "launch", "peer slower once"],
)
def test_target_verdicts_on_known_rows(change, verdicts):
    """The targets' arithmetic on hand-made rows (the smoke run's numbers never meet any): launch time
    2 us, so 3 us is the launch bound; decode 2x the unfused chain; a peer 1.15x in geomean, never faster."""
    from benchmarks.kernels import bench_mla_rope_cache as B

    values = {"triton prefill efficiency": 0.95, "triton decode us": 2.0, "vllm_fused decode us": 2.2}
    values.update(change or {})
    rows = [
        _row("triton", "prefill", 8, 2.5, values["triton prefill efficiency"]),
        _row("triton", "decode", 8, values["triton decode us"]),
        _row("unfused", "decode", 8, 4.2),
        _row("vllm_fused", "prefill", 8, 3.75),
        _row("vllm_fused", "decode", 8, values["vllm_fused decode us"]),
    ]
    got = {t["id"]: t["status"] for t in B.evaluate_targets(rows, launch_us=2.0, smoke=False)}
    for tid, verdict in verdicts.items():
        assert got[tid] == verdict, (tid, got[tid])
    assert got["vs_flashinfer"] == got["op1_large_T"] == "not measured"
