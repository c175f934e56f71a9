"""The package's VLLM_MLA_FUSION* variables are known to vLLM: no "unknown variable" warning; compile cache keys."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
UNKNOWN = "Unknown vLLM environment variable detected"
# A value for each variable that keeps a normal start normal.
SETTINGS = {
    "VLLM_MLA_FUSION": "1",
    "VLLM_MLA_FUSION_DECODE": "1",
    "VLLM_MLA_FUSION_PREFILL_KEY": "1",
    "VLLM_MLA_FUSION_PREWARM": "1",
    "VLLM_MLA_FUSION_GRAPH_ROPE": "0",
    "VLLM_MLA_FUSION_BACKEND": "torch",
    "VLLM_MLA_FUSION_DEBUG": "0",
    "VLLM_MLA_FUSION_PDL": "1",
    "VLLM_MLA_FUSION_AITER_FP8": "0",
    "VLLM_MLA_FUSION_ENV": "/nowhere/env",
    "VLLM_MLA_FUSION_AITER_TRITON_PATH": "/nowhere/aiter",
}
# Not a variable of the package: vLLM must still warn about it (shows the check is live).
UNDECLARED = "VLLM_MLA_FUSION_NOT_A_SWITCH"


def declared() -> tuple[str, ...]:
    from vllm_mla_fusion.vllm_plugin import ENVIRONMENT_VARIABLES, LOCATION_VARIABLES

    return ENVIRONMENT_VARIABLES + LOCATION_VARIABLES


def test_every_variable_the_checkout_reads_is_declared():
    used = set()
    for folder in ("vllm_mla_fusion", "benchmarks", "scripts", "demo"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".sh"):
                used |= set(re.findall(r"\bVLLM_MLA_FUSION\w*", path.read_text()))
    assert used == set(declared()) == set(SETTINGS)


def test_register_declares_the_variables_even_when_switched_off(plugin_off, monkeypatch):
    from vllm import envs
    from vllm.platforms import current_platform

    from vllm_mla_fusion.vllm_plugin import register

    for name in declared():
        monkeypatch.delitem(envs.environment_variables, name, raising=False)
    for name, value in {**SETTINGS, "VLLM_MLA_FUSION": "0"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="VLLM_MLA_FUSION"):
        current_platform.validate_environ(hard_fail=True)  # before register(): unknown
    register()
    assert set(declared()) <= set(envs.environment_variables)
    current_platform.validate_environ(hard_fail=True)  # --fail-on-environ-validation would start
    monkeypatch.setitem(os.environ, UNDECLARED, "1")
    with pytest.raises(ValueError, match=UNDECLARED):
        current_platform.validate_environ(hard_fail=True)


def test_compile_cache_key_separates_plugin_settings(plugin_off, monkeypatch, vllm_cpu):
    """vLLM hashes every declared variable (envs.compile_factors) into its torch.compile and AOT cache keys."""
    from vllm import envs
    from vllm.compilation.caching import aot_compile_hash_factors

    from vllm_mla_fusion.vllm_plugin import register

    register()

    def key(**env):
        for name in declared():
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return tuple(aot_compile_hash_factors(vllm_cpu.config))

    on = key()
    assert key(VLLM_MLA_FUSION="0") != on
    assert key(VLLM_MLA_FUSION_DECODE="0") != on
    assert key(VLLM_MLA_FUSION_BACKEND="triton") != on
    # where the checkout's environment or AITER's sources live does not change what is compiled
    assert key(VLLM_MLA_FUSION_ENV="/a", VLLM_MLA_FUSION_AITER_TRITON_PATH="/b") == on
    assert set(declared()) <= set(envs.compile_factors())


START = """
import logging, sys
sys.path.insert(0, sys.argv[3])
from demo import cpu_stand_ins
cpu_stand_ins.hide_amx()  # as in every process here that runs vLLM on the CPU (demo/cpu_stand_ins.py)
from vllm.engine.arg_utils import EngineArgs
args = EngineArgs(model=sys.argv[1], skip_tokenizer_init=True, fail_on_environ_validation=sys.argv[2] == "strict")
args.create_engine_config()
print("ENGINE CONFIG CREATED", flush=True)
"""


@pytest.mark.parametrize("strict", [False, True], ids=["warn", "fail-on-environ-validation"])
def test_normal_start_does_not_warn_about_the_variables(tmp_path, strict):
    """A fresh process, as `vllm serve` or `LLM(...)` starts: plugins from the entry point, then vLLM's check."""
    from demo import tiny_model

    model = tiny_model.write(tmp_path / "model", weights=False)
    env = {**os.environ, **SETTINGS, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_PLUGINS", None)
    if not strict:
        env[UNDECLARED] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", START, str(model), "strict" if strict else "warn", str(REPO)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ENGINE CONFIG CREATED" in log, log[-3000:]
    warned = set(re.findall(UNKNOWN + r": (\w+)", log))
    assert warned == (set() if strict else {UNDECLARED}), log[-3000:]
