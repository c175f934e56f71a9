"""CPUs with AMX: the harness's path does not depend on them, and the plugin on AMX_MLA keeps vLLM's layer.

vLLM 0.33's CPU platform decides differently where torch reports AMX tiles
(Intel Sapphire Rapids and later): AMX_MLA for MLA models, packed bf16 linear
weights, both with kernels vLLM's CUDA wheel lacks. Every process here that
runs vLLM on the CPU hides AMX from it and asks for CPU_MLA by name
(demo/cpu_stand_ins.py says what and why). This file shows

- where vLLM reads AMX, and that the harness keeps it from reading True;
- the vLLM tests and the demo's engine runs passing with AMX reported
  *present*, in a pytest run whose processes, and those vLLM spawns, import
  tests/amx_simulation/sitecustomize.py: so a CI machine without AMX guards
  the path of one with it;
- the plugin on vLLM's AMX path itself (AMX_MLA, run with the plain-torch
  stand-ins of ``cpu_stand_ins.AMX_STAND_INS``): its layer is vLLM's own,
  the reason is logged once per rank, and what it computes equals vLLM's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from demo import cpu_stand_ins, tiny_model

from . import harness as H

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
PLUGIN_LOGGER = "vllm.vllm_mla_fusion"
# Set (to "1") by test_vllm_tests_pass_with_amx_reported_present for the run it starts.
SIMULATED = "MLA_FUSION_TEST_SIMULATED_AMX"
SIMULATION_DIR = REPO / "tests" / "amx_simulation"
AMX_BLOCK_SIZE = 32  # AMX_MLA takes multiples of 32
KEEP_LINE = "vllm-mla-fusion ({}): MLA layers keep vLLM's path: attention backend AMX_MLA has its own KV-cache layout"


def test_vllm_reads_amx_where_the_harness_hides_it(vllm_cpu, monkeypatch):
    """vLLM picks AMX_MLA (unless CPU_MLA is named) and packs bf16 linear weights exactly when torch
    reports AMX; the harness hides it, so here neither happens, whatever the host."""
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as B
    from vllm.v1.attention.selector import AttentionSelectorConfig

    host = cpu_stand_ins.host_has_amx()
    if os.environ.get(SIMULATED) == "1":
        assert host, "the AMX simulation (tests/amx_simulation/sitecustomize.py) did not reach this process"
    selector = AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None,
                                       use_mla=True)  # fmt: skip

    def decisions():
        # (unpinned backend, CPU_MLA named, o_proj's weight [256, 512] packed)
        return (CpuPlatform.get_attn_backend_cls(None, selector), CpuPlatform.get_attn_backend_cls(B.CPU_MLA, selector),
                check_cpu_sgl_kernel(256, 512, torch.bfloat16))  # fmt: skip

    with monkeypatch.context() as m:  # vLLM on this host as it is, without the harness
        m.setattr(torch.cpu, "_is_amx_tile_supported", lambda: host)
        assert decisions() == ((B.AMX_MLA if host else B.CPU_MLA).get_path(), B.CPU_MLA.get_path(), host)
    assert torch.cpu._is_amx_tile_supported() is False
    assert decisions() == (B.CPU_MLA.get_path(), B.CPU_MLA.get_path(), False)
    assert vllm_cpu.config.attention_config.backend == B.CPU_MLA
    assert H.mla_layer(vllm_cpu.build_attention())[1].attn_backend.get_name() == "CPU_MLA"


def amx_mla(vllm_cpu, monkeypatch) -> None:
    """Until ``monkeypatch`` undoes it: vLLM's CPU platform as on a CPU with AMX, AMX_MLA asked for by name,
    and plain-torch stand-ins for the kernels that path calls."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cpu_stand_ins.install(cpu_stand_ins.AMX_STAND_INS)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(vllm_cpu.config.attention_config, "backend", AttentionBackendEnum.AMX_MLA)
    monkeypatch.setattr(vllm_cpu.config.cache_config, "block_size", AMX_BLOCK_SIZE)


def build_on_amx_mla(vllm_cpu, state: dict, count: int, caplog) -> tuple[list, list[str]]:
    """``count`` layers built (with the plugin registered) and loaded with ``state``; the plugin's info lines."""
    from vllm.logger import _print_info_once

    _print_info_once.cache_clear()  # a line another test already logged would be dropped as a repeat
    with caplog.at_level(logging.INFO, logger=PLUGIN_LOGGER):
        layers = [vllm_cpu.build_attention() for _ in range(count)]
    for attn in layers:
        vllm_cpu.finish_weights(attn, state)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name.startswith(PLUGIN_LOGGER)]
    return layers, lines


def assert_vllms_amx_layer(attn, fused_wrapper: bool) -> None:
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLAImpl

    wrapper, mla = H.mla_layer(attn)
    assert type(wrapper).__name__ == ("FusedMultiHeadLatentAttentionWrapper" if fused_wrapper else
                                      "MultiHeadLatentAttentionWrapper")  # fmt: skip
    assert getattr(wrapper, "fusion_mode", None) is None
    assert type(mla) is MLAAttention and type(mla.impl) is AMXMLAImpl and mla.is_amx_bmm_enabled
    assert mla.impl._w_uk_packed is not None  # AMX_MLA's weight loading ran (the packing stand-in)


def run_schedule(vllm_cpu, attns, block_size: int, caches: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each layer's outputs over prefill, decode, mixed, decode + chunked-prefill and padded steps."""
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    backend = AMXMLABackend if block_size == AMX_BLOCK_SIZE else CPUMLABackend
    for attn, cache in zip(attns, caches, strict=True):
        H.mla_layer(attn)[1].bind_kv_cache(cache)
    builder = vllm_cpu.builder([H.mla_layer(a)[1].layer_name for a in attns], backend, block_size)
    requests = {0: H.Request([5, 2, 9]), 1: H.Request([0, 7, 3]), 2: H.Request([1, 10, 4])}
    steps = [
        H.Step("prefill", [(0, 13), (1, 29)]),
        H.Step("decode", [(0, 1), (1, 1)]),
        H.Step("mixed", [(0, 1), (1, 1), (2, 20)]),
        H.Step("decode + chunked prefill", [(0, 1), (1, 1), (2, 15)]),
        H.Step("padded decode", [(0, 1), (1, 1), (2, 1)], pad_to=8),
    ]
    outputs = [[] for _ in attns]
    for step, metadata, hidden in H.step_inputs(vllm_cpu, builder, steps, requests, seed=12, block_size=block_size):
        for out, attn in zip(outputs, attns, strict=True):
            out.append(H.run_step(vllm_cpu, attn, metadata, step, hidden)[: step.num_tokens])
    return outputs


def test_plugin_on_amx_mla_is_vllms_layer(vllm_cpu, plugin_off, monkeypatch, caplog):
    """Plugin on, AMX_MLA: vLLM's own layer, the reason logged once, and the same outputs and cache as
    plugin off, step for step; both within bf16 tolerance of CPU_MLA's (the stand-ins compute attention)."""
    from vllm_mla_fusion.vllm_plugin import register

    reference = vllm_cpu.build_attention()  # CPU_MLA, as the harness runs
    state = vllm_cpu.finish_weights(reference, seed=6)
    with monkeypatch.context() as m:
        amx_mla(vllm_cpu, m)
        off = vllm_cpu.build_attention()
        vllm_cpu.finish_weights(off, state)
        register()
        (on, _), lines = build_on_amx_mla(vllm_cpu, state, 2, caplog)
        assert_vllms_amx_layer(off, fused_wrapper=False)
        assert_vllms_amx_layer(on, fused_wrapper=True)
        assert lines == [KEEP_LINE.format("rank 0, local rank 0")]  # two layers, one line

        amx_cache = (H.NUM_BLOCKS, AMX_BLOCK_SIZE, 576)
        caches = [H.new_kv_cache(seed=5, shape=amx_cache) for _ in range(2)]
        got, want = run_schedule(vllm_cpu, (on, off), AMX_BLOCK_SIZE, caches)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {step}"
    assert torch.equal(caches[0], caches[1])

    # Back to the harness (CPU_MLA, AMX hidden): vLLM's reference path on the same weights and steps.
    (cpu_mla,) = run_schedule(vllm_cpu, (reference,), H.BLOCK_SIZE, [H.new_kv_cache(seed=5)])
    for step, (a, b) in enumerate(zip(got, cpu_mla, strict=True)):
        bound = 2.0**-6 * b.float().abs().max().item()
        torch.testing.assert_close(a.float(), b.float(), rtol=2.0**-6, atol=bound, msg=lambda m, s=step: f"{s}: {m}")


def test_amx_mla_reason_is_logged_on_every_rank(vllm_cpu, plugin_on, as_rank_3, monkeypatch, caplog):
    """Rank 3 says why its layers are not fused, too (vLLM's *_once loggers would log on rank 0 only)."""
    state = vllm_cpu.finish_weights(vllm_cpu.build_attention(), seed=7)
    amx_mla(vllm_cpu, monkeypatch)
    layers, lines = build_on_amx_mla(vllm_cpu, state, 2, caplog)
    for attn in layers:
        assert_vllms_amx_layer(attn, fused_wrapper=True)
    assert lines == [KEEP_LINE.format("rank 3, local rank 3")]


@pytest.mark.slow
def test_generation_on_amx_mla_equals_plugin_off(tmp_path):
    """The whole model on AMX_MLA (tests/vllm_plugin/amx_mla_engine.py, ~1.5 minutes): with the plugin
    registered, every MLA layer is vLLM's own, the reason is logged once, and generation (chunked
    prefill and prefix caching on, as vLLM keeps them on this path) is identical to plugin off."""
    model = tiny_model.write(tmp_path / "model")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_PLUGINS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.vllm_plugin.amx_mla_engine", str(model)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and results, log[-6000:]
    on, off = (json.loads(results[-1].removeprefix("RESULT "))[side] for side in ("on", "off"))
    assert (on["registered"], off["registered"]) == ("FusedMultiHeadLatentAttentionWrapper", None)
    for side in (on, off):
        assert [(x["backend"], x["mode"]) for x in side["layers"]] == [("AMX_MLA", None)] * tiny_model.NUM_LAYERS
        assert side["chunked_prefill"] and side["prefix_caching"]
    assert log.count(KEEP_LINE.format("rank 0, local rank 0")) == 1, log[-6000:]
    assert on["outputs"].keys() == off["outputs"].keys() and len(on["outputs"]) == 5
    for name, got in on["outputs"].items():
        # vLLM's own path on both sides, same weights and steps: the same numbers, bit for bit.
        assert (got["tokens"], got["logprobs"]) == (off["outputs"][name]["tokens"], off["outputs"][name]["logprobs"])
        assert len(set(got["tokens"])) > len(got["tokens"]) // 2, (name, got["tokens"])  # attention shapes them


# The tests that meet vLLM's AMX decisions (the layer harness, the plugin's wiring, the demo's
# engine runs, the end-to-end benchmark's smoke mode): ~3.5 minutes on 2 cores.
SIMULATED_RUN = [
    "tests/vllm_plugin/test_amx.py",
    "tests/vllm_plugin/test_eligibility.py",
    "tests/vllm_plugin/test_registration.py",
    "tests/vllm_plugin/test_layer.py",
    "tests/vllm_plugin/test_fp8_cache.py",
    "tests/vllm_plugin/test_prewarm.py",
    "tests/vllm_plugin/test_census.py",
    "tests/vllm_plugin/test_generate.py",
    "tests/benchmarks/e2e/test_bench_vllm_e2e_smoke.py",
]
# Must pass in the simulated run: the proof that the simulation reached vLLM there, and the
# demo's engine runs (their processes saw AMX too: test_cpu_run_reports_what_vllm_changed).
MUST_PASS = [
    "tests/vllm_plugin/test_amx.py::test_vllm_reads_amx_where_the_harness_hides_it",
    "tests/vllm_plugin/test_generate.py::test_tokens_identical_with_plugin_on_and_off",
    "tests/vllm_plugin/test_generate.py::test_cpu_run_reports_what_vllm_changed",
    "tests/benchmarks/e2e/test_bench_vllm_e2e_smoke.py::test_engines_alternate_and_the_plugin_is_what_was_asked",
]


@pytest.mark.slow
def test_vllm_tests_pass_with_amx_reported_present():
    """The vLLM tests and the demo's engine runs again, with torch reporting AMX tiles in every process
    (tests/amx_simulation/sitecustomize.py): they must pass as on a CPU without AMX, on any machine."""
    if os.environ.get(SIMULATED):
        pytest.fail("started inside the simulated run: the selection below must exclude this test")
    path = os.pathsep.join(filter(None, [str(SIMULATION_DIR), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, SIMULATED: "1"}
    args = ["-q", "-rA", "-p", "no:cacheprovider", "-k", "not amx_reported_present and not generation_on_amx_mla"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args, *SIMULATED_RUN],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    summary = out.strip().splitlines()[-1]
    # Nothing skipped, failed or in error: only passes (and the two tests left out above).
    assert re.fullmatch(r"\d+ passed, 2 deselected(, \d+ warnings?)? in .*", summary), summary
    for test in MUST_PASS:
        assert f"PASSED {test}" in out, test
