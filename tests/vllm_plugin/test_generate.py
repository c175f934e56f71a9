"""Whole-model greedy generation with vLLM's engine on the CPU: plugin on and off give the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]


def generate(model_dir: Path, plugin: bool) -> dict:
    env = {**os.environ, "VLLM_MLA_FUSION": "1" if plugin else "0", "HF_HUB_OFFLINE": "1", "VLLM_PLUGINS": "mla_fusion"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.vllm_plugin.generate_worker", str(model_dir)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"generate_worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_greedy_tokens_identical_with_plugin_on_and_off(tmp_path):
    on = generate(tmp_path / "model", plugin=True)
    off = generate(tmp_path / "model", plugin=False)

    assert on["modes"] == ["decode"] * 3  # every MLA layer fused, the entry point found
    assert off["modes"] == []  # vLLM's own wrapper class
    assert on["tokens"] == off["tokens"]
    for lp_on, lp_off in zip(on["logprobs"], off["logprobs"], strict=True):
        assert lp_on == pytest.approx(lp_off, abs=1e-4)
    # One fused launch per layer per engine step, where vLLM wrote the cache once.
    assert on["calls"]["vllm_cache_write"] == 0 and off["calls"]["fused"] == 0
    assert on["calls"]["fused"] == off["calls"]["vllm_cache_write"] > 0
