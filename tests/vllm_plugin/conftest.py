"""Fixtures for the ``vllm``-marked tests: vLLM's CPU platform, the plugin on or off.

vLLM picks its platform when first imported, so VLLM_TARGET_DEVICE is set
here, before any test module imports it. Test modules import vLLM through
``pytest.importorskip`` so that they skip, with a reason, where it is absent.
"""

from __future__ import annotations

import os
import sys

import pytest

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
# The model directory is local; without this, config loading probes the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from demo import cpu_stand_ins  # noqa: E402

from . import harness  # noqa: E402 - after the platform choice

# On a CPU with AMX, vLLM's CPU platform would take paths whose kernels the CUDA wheel lacks:
# AMX is hidden from vLLM before any test builds anything (demo/cpu_stand_ins.py says why).
cpu_stand_ins.hide_amx()

PLUGIN_ENV = ("VLLM_MLA_FUSION", "VLLM_MLA_FUSION_DECODE", "VLLM_MLA_FUSION_DEBUG", "VLLM_MLA_FUSION_BACKEND",
              "VLLM_PLUGINS")  # fmt: skip


@pytest.fixture(autouse=True)
def _clean_plugin_env(monkeypatch):
    for name in PLUGIN_ENV:
        monkeypatch.delenv(name, raising=False)
    # The fused layers' bound ops are shared by every layer of the process (binding.shared_ops):
    # each test starts from none, as a fresh process does, so that what it counts is its own.
    binding = sys.modules.get("vllm_mla_fusion.binding")
    if binding is not None:
        monkeypatch.setattr(binding, "_SHARED", {})


@pytest.fixture(scope="session")
def vllm_cpu(tmp_path_factory) -> harness.VllmCpu:
    """The session's VllmConfig (tiny DeepSeek-V3 config) and gloo process group."""
    pytest.importorskip("vllm")
    cpu_stand_ins.install(["mla_decode_kvcache"])
    cpu_stand_ins.DECODE_QUERIES = []  # test_layer.py compares the queries the decode kernel received
    return harness.VllmCpu(harness.write_model_dir(str(tmp_path_factory.mktemp("dsv3_tiny"))))


def _unregister() -> None:
    from vllm.model_executor.custom_op import op_registry_oot

    from vllm_mla_fusion.vllm_plugin.compat import WRAPPER_KEY

    op_registry_oot.pop(WRAPPER_KEY, None)


@pytest.fixture
def plugin_off():
    """vLLM's registry without the plugin's wrapper (restored afterwards)."""
    pytest.importorskip("vllm")
    _unregister()
    yield
    _unregister()


@pytest.fixture
def as_rank_3(vllm_cpu, monkeypatch):
    """This process as vLLM's world group sees a TP rank other than the first: global rank 3,
    local rank 3. vLLM's *_once loggers (default scope "local") stay silent here."""
    from vllm.distributed import parallel_state as ps

    world = ps.get_world_group()
    monkeypatch.setattr(world, "rank", 3)
    monkeypatch.setattr(world, "local_rank", 3)
    assert not ps.is_local_first_rank() and not ps.is_global_first_rank()


@pytest.fixture
def plugin_on(plugin_off):
    """The plugin registered as vLLM's entry point would; unregistered afterwards."""
    from vllm_mla_fusion.vllm_plugin import register

    register()
    yield
