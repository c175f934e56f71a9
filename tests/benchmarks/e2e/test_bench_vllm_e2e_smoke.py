"""``python -m benchmarks.e2e.bench_vllm_e2e --smoke`` runs end to end on vLLM's CPU platform and writes what it promises.

The smoke mode runs the benchmark's code paths (model directory, engine per side with
the plugin switched on and off, the plugin-mode check, the JIT hook, first request,
decode and prefill timing, one profiling session and its trace parsing, the
prediction from the kernel benchmark's JSON, the summary, markdown) with a tiny model
on CPU_MLA and the test stand-in kernels; its numbers mean nothing. It uses the
in-process engine (``--inproc``): vLLM's CPU platform spawns the engine core and a
worker process per engine, several minutes on a small CI machine. The
multiprocessing path itself (engine core started per engine, callables pickled into
it, plugin switched through the environment in the spawned processes) was checked by
running the smoke without ``--inproc``; docs/performance-history.md says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e_smoke")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    for name in ("VLLM_MLA_FUSION", "VLLM_MLA_FUSION_DECODE", "VLLM_PLUGINS", "VLLM_MLA_FUSION_BACKEND"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.e2e.bench_vllm_e2e", "--smoke", "--inproc", "--no-plot", "--host-regions", "--out", str(out), "--tag", "smoke"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"smoke run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    data = json.loads((out / "bench_vllm_e2e_smoke.json").read_text())
    data["_md"] = (out / "bench_vllm_e2e_smoke.md").read_text()
    data["_stdout"] = proc.stdout
    return data


def test_engines_alternate_and_the_plugin_is_what_was_asked(report):
    engines = report["engines"]
    assert [e["side"] for e in engines] == ["on", "off"]
    for e in engines:
        assert "error" not in e, e.get("traceback")
        modes = {layer["fusion_mode"] for layer in e["facts"]["layers"]}
        assert modes == ({"decode"} if e["side"] == "on" else {None})
        assert e["registered"] == ("FusedMultiHeadLatentAttentionWrapper" if e["side"] == "on" else None)
    env = report["environment"]
    assert env["loaded_by_vllm"] == "FusedMultiHeadLatentAttentionWrapper"
    assert env["entry_points"]["mla_fusion"] == "vllm_mla_fusion.vllm_plugin:register"
    assert env["driver_cuda_initialized"] is False


def test_sections_measured(report):
    cfg = report["config"]
    assert cfg["mode"] == "smoke"
    for e in report["engines"]:
        assert e["start_s"] > 0 and e["first_request"]["first_s"] > 0 and len(e["first_request"]["next_s"]) == 3
        for b in cfg["decode_batches"]:
            d = e["decode"][str(b)]
            assert len(d["t1_s"]) == len(d["tN_s"]) == cfg["repeats"] and d["throughput_tok_s"] > 0
        for length in cfg["prefill_lens"]:
            assert e["prefill"][str(length)]["ttft_ms_median"] > 0
        assert isinstance(e["jit_after_warmup"], list)


def test_profile_steps_found_and_attributed(report):
    cfg = report["config"]
    for e in report["engines"]:
        prof = e["profile"]
        assert prof["trace_bytes"] > 0
        for b in cfg["decode_batches"]:
            row = prof["decode"][str(b)]
            assert row["steps"] >= 1, (b, row)
            # On the CPU the census counts the fused ops' CPU events: once per MLA layer per decode step.
            n_layers = len(e["facts"]["layers"])
            assert n_layers >= 2
            assert row["fused_ops_per_step"] == (n_layers if e["side"] == "on" else 0)
        for length in cfg["prefill_lens"]:
            assert prof["prefill"][str(length)]["steps"] == 1


def test_host_time_recorded(report):
    """The engine's host record of every TTFT request (no profiler), and the profiled steps' host
    span split into the events directly under them."""
    cfg = report["config"]
    attention_op = {"on": "mla_fusion_vllm::mla_attention_with_output", "off": "vllm::unified_mla_attention_with_output"}
    for e in report["engines"]:
        assert e["host_timer"] is True
        # --host-regions: the host-speed probe once per timing pass, on fixed work.
        assert len(e["host_probe"]) == cfg["repeats"]
        assert all(x["python_us_per_1k"] > 0 and x["torch_slice_us"] > 0 for x in e["host_probe"])
        for length in cfg["prefill_lens"]:
            p = e["prefill"][str(length)]
            assert len(p["host"]) == len(p["ttft_s"]) == cfg["repeats"]
            for h, ttft_s in zip(p["host"], p["ttft_s"]):
                # The prompt runs in one step (max_num_batched_tokens >= the prompt) inside the request.
                assert h["execute_model_tokens"] == [length], h
                assert 0 < h["execute_model_ms"][0] < 1e3 * ttft_s and len(h["sample_tokens_ms"]) == 1
                # --host-regions: each layer's attention region once, timed inside the step.
                n_layers = len(e["facts"]["layers"])
                region = "plugin forward_fused" if e["side"] == "on" else "vLLM cache write"
                calls, ms = h["regions_ms"][region]
                assert calls == n_layers and 0 < ms < h["execute_model_ms"][0], h["regions_ms"]
                # The key: vLLM's concat on both sides (op 3 is opt-in: VLLM_MLA_FUSION_PREFILL_KEY=1).
                assert "plugin prefill key (op 3)" not in h["regions_ms"] and "vLLM key concat" in h["regions_ms"]
            assert 0 < p["execute_model_ms_median"] < p["ttft_ms_median"]
        assert all(h["execute_model_tokens"][0] == cfg["prompt_len"] for h in e["first_request"]["host"])
        for length in (cfg["prompt_len"], *cfg["prefill_lens"]):
            row = e["profile"]["prefill"][str(length)]
            assert row["steps"] >= 1 and row["host_span_us_median"] > 0
            children = row["host_children"]
            # Every MLA layer's attention op sits directly under the step (eager on the CPU).
            assert children[attention_op[e["side"]]]["per_step"] == len(e["facts"]["layers"]), children
            covered = sum(c["us_per_step"] for c in children.values()) + row["host_children_other_us"]
            assert row["host_uncovered_us_median"] >= 0 and covered <= row["host_span_us_median"] * 1.001
    h = report["summary"]["auto"]["prefill_host"][str(cfg["prefill_lens"][0])]
    assert h["span_us"]["on"] > 0 and h["span_us"]["off"] > 0 and attention_op["on"] in h["children"]
    assert "Host span of the profiled" in report["_md"] and "execute_model host" in report["_md"]
    # Equal host speed: the off side's median request defines speed 1; the parts add up.
    eq = report["summary"]["auto"]["prefill_host_equal_speed"][str(cfg["prefill_lens"][0])]
    for side in ("on", "off"):
        x = eq[side]
        assert x["requests"] == cfg["repeats"] and x["execute_ms"] > 0 and x["common_ms"] > 0
        lo, hi = x["speed_factor_range"]
        assert 0 < lo <= hi
    assert min(eq["off"]["speed_factor_range"]) <= 1 <= max(eq["off"]["speed_factor_range"])
    assert "at equal host speed" in report["_md"]


def test_mixed_step_measured(report):
    """A prompt joining running decodes: its TTFT, and the host record of the step that admitted it
    (the decoders' rows and the whole prompt in one step), with that step's own regions."""
    cfg = report["config"]
    for e in report["engines"]:
        n_layers = len(e["facts"]["layers"])
        for length in cfg["mixed_lens"]:
            m = e["mixed"][str(length)]
            assert len(m["ttft_s"]) == len(m["host"]) == cfg["repeats"]
            for h, ttft_s in zip(m["host"], m["ttft_s"]):
                assert "mixed_step" not in h, h  # picked out of the request's record
                assert h["execute_model_tokens"] == [length + cfg["mixed_decoders"]], h
                assert 0 < h["execute_model_ms"][0] < 1e3 * ttft_s
                calls, ms = h["regions_ms"]["forward_mha"]
                assert calls == n_layers and 0 < ms < h["execute_model_ms"][0]
                # The key: vLLM's concat on both sides (op 3 is opt-in: VLLM_MLA_FUSION_PREFILL_KEY=1).
                assert "plugin prefill key (op 3)" not in h["regions_ms"] and "vLLM key concat" in h["regions_ms"]
    s = report["summary"]["auto"]
    assert s["mixed"][str(cfg["mixed_lens"][0])]["ttft_ms"]["on"] > 0
    assert set(s["mixed_host_equal_speed"][str(cfg["mixed_lens"][0])]) == {"on", "off"}
    assert f"mixed: {cfg['mixed_decoders']} decodes + a prompt of L" in report["_md"]


def test_prediction_and_summary(report):
    pred = report["prediction"]
    assert "error" not in pred, pred
    for path in ("op2", "op1"):  # the decode-layer section's op 2, the sweep's op 1 (pair-taking backends)
        row = pred["rows"][path]["bf16"]["1"]
        assert row["saving_us_per_step"] == pytest.approx(61 * (row["unfused_us_per_layer"] - row["ours_us_per_layer"]))
    assert report["summary"]["auto"]["backend"]["decode_op"] == "op2"  # CPU_MLA concatenates the query
    summ = report["summary"]["auto"]
    assert set(summ["decode"]) == {"1", "2"}
    for r in summ["decode"].values():
        # A CPU TPOT may even come out negative (t_N - t_1 over N=3 is all noise): only its presence counts.
        assert r["predicted_saving_us"] > 0 and r["tpot_ms"]["on"] is not None and r["tpot_ms"]["off"] is not None
    assert summ["backend"]["backend"] == "CPU_MLA"
    assert "meaningless" in report["_md"] and "| 1 |" in report["_md"]
    assert "E2E SUMMARY" in report["_stdout"]
