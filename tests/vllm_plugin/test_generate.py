"""The demo's generation run (demo/generate.py): vLLM's engine on the tiny model, plugin on and off.

Whole model, real safetensors weights and tokenizer (demo/tiny_model.py),
requests arriving at different steps (prefill-only, decode-only and mixed
steps), greedy, float32 (why: demo/generate.py). One process per setting,
as the demo runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from demo import census as C
from demo import cpu_stand_ins, tiny_model

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]


def generate(model_dir: Path, plugin: bool) -> dict:
    env = {**os.environ, "VLLM_MLA_FUSION": "1" if plugin else "0", "VLLM_PLUGINS": "mla_fusion"}
    proc = subprocess.run(
        [sys.executable, "-m", "demo.generate", str(model_dir)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    output = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0 and lines, f"demo.generate failed ({proc.returncode}):\n{output}"
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict]:
    model_dir = tiny_model.write(tmp_path_factory.mktemp("tiny_dsv3") / "model")
    return generate(model_dir, plugin=True), generate(model_dir, plugin=False)


def test_tokens_identical_with_plugin_on_and_off(runs):
    on, off = runs
    assert [layer["mode"] for layer in on["layers"]] == ["decode"] * tiny_model.NUM_LAYERS  # entry point found
    assert [layer["mode"] for layer in off["layers"]] == [None] * tiny_model.NUM_LAYERS  # vLLM's own wrapper
    for pass_name in ("counted", "timed"):
        outputs_on, outputs_off = on[pass_name]["outputs"], off[pass_name]["outputs"]
        assert set(outputs_on) == set(outputs_off) == {r["name"] for r in on["requests"]}
        for name, got in outputs_on.items():
            want = outputs_off[name]
            assert got["tokens"] == want["tokens"], f"{pass_name}/{name}"
            assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4), f"{pass_name}/{name}"
            assert len(got["tokens"]) == next(r["max_tokens"] for r in on["requests"] if r["name"] == name)
    # Real weights: attention shapes the output, greedy decoding does not just repeat a token.
    for out in on["counted"]["outputs"].values():
        assert len(set(out["tokens"])) > len(out["tokens"]) // 2, out["tokens"]


def test_schedule_has_every_kind_of_step(runs):
    on, _ = runs
    kinds = {(bool(s["batch"]["decodes"]), bool(s["batch"]["prefills"])) for s in on["counted"]["steps"]}
    assert kinds == {(False, True), (True, False), (True, True)}  # prefill-only, decode-only, mixed


def test_census_per_layer_and_step(runs):
    """Plugin off: vLLM's RoPE, cache write and decode concat in every layer; on: only fused ops in their place."""
    on, off = runs
    layer_names = [layer["name"] for layer in on["layers"]]
    assert len(on["counted"]["steps"]) == len(off["counted"]["steps"])
    for i, (step_on, step_off) in enumerate(zip(on["counted"]["steps"], off["counted"]["steps"], strict=True)):
        batch = step_on["batch"]
        assert batch == step_off["batch"], i
        has_decode, has_prefill = batch["decodes"] > 0, batch["prefills"] > 0
        assert step_on["outside_layers"] == step_off["outside_layers"] == {}, i
        assert list(step_on["layers"]) == list(step_off["layers"]) == layer_names, i
        for name in layer_names:
            counts_off, counts_on = step_off["layers"][name], step_on["layers"][name]
            assert counts_off == {
                C.VLLM_ROPE: 1,
                C.VLLM_CACHE_WRITE: 1,
                **({C.VLLM_DECODE_CONCAT: 1} if has_decode else {}),
                **({C.VLLM_PREFILL_KEY_CONCAT: 1} if has_prefill else {}),
            }, (i, name)
            assert not any(site in counts_on for site in C.VLLM_REPLACED), (i, name, counts_on)
            fused = {c: n for c, n in counts_on.items() if C.is_fused(c)}
            # one launch for the decode rows and one for the prefill rows, whichever op takes them
            assert sum(fused.values()) == int(has_decode) + int(has_prefill), (i, name, counts_on)
            if has_decode:
                assert fused.get("mla_fusion::mla_decode_rope_cache_write") == 1, (i, name, counts_on)


def test_cpu_run_reports_what_vllm_changed(runs):
    on, off = runs
    if on["device"] != "CPU":
        pytest.skip("the stand-ins and vLLM's CPU overrides only concern a CPU-only machine")
    assert on["stand_ins"] == off["stand_ins"] == list(cpu_stand_ins.STAND_INS)
    # The demo's process saw the host's AMX as this one does (under test_amx.py's simulation too),
    # and hid it from vLLM.
    assert on["amx"] == off["amx"] == {"host": cpu_stand_ins.host_has_amx(), "vllm": False}
    # vLLM's CPU platform turns both off for MLA models (vllm/platforms/cpu.py), although the run asks for them.
    assert (on["chunked_prefill"], on["prefix_caching"]) == (False, False)
