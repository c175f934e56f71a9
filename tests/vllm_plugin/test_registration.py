"""How vLLM finds the plugin, and what registering it does to vLLM's layer registry."""

from __future__ import annotations

import logging
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

PLUGIN_LOGGER = "vllm.vllm_mla_fusion"


def registered():
    from vllm.model_executor.custom_op import op_registry_oot

    return op_registry_oot.get("MultiHeadLatentAttentionWrapper")


def test_entry_point_is_declared():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("mla_fusion") == "vllm_mla_fusion.vllm_plugin:register", (
        "the vllm_mla_fusion distribution is not installed (pip install -e .), or its entry point changed"
    )


def test_load_general_plugins_builds_the_fused_wrapper(vllm_cpu, plugin_off, monkeypatch):
    import vllm.plugins
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

    from vllm_mla_fusion.vllm_plugin.layer import FusedMultiHeadLatentAttentionWrapper

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)  # once per process otherwise
    monkeypatch.setenv("VLLM_PLUGINS", "mla_fusion")
    vllm.plugins.load_general_plugins()
    assert registered() is FusedMultiHeadLatentAttentionWrapper

    attn = vllm_cpu.build_attention()
    wrapper = attn.mla_attn
    assert type(wrapper) is FusedMultiHeadLatentAttentionWrapper
    assert isinstance(wrapper, MultiHeadLatentAttentionWrapper)
    assert wrapper.fusion_mode == "decode"  # DeepSeek-V3's rope, bf16 cache, CPU_MLA: eligible


def test_register_twice_is_harmless(plugin_off, caplog):
    from vllm_mla_fusion.vllm_plugin import register
    from vllm_mla_fusion.vllm_plugin.layer import FusedMultiHeadLatentAttentionWrapper

    with caplog.at_level(logging.DEBUG, logger=PLUGIN_LOGGER):
        register()
        register()
    assert registered() is FusedMultiHeadLatentAttentionWrapper
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith(PLUGIN_LOGGER)]
    assert not torch.cuda.is_initialized()  # register() must not initialise a GPU


def test_disabled_by_env_leaves_vllms_class(vllm_cpu, plugin_off, monkeypatch):
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

    from vllm_mla_fusion.vllm_plugin import register

    monkeypatch.setenv("VLLM_MLA_FUSION", "0")
    register()
    assert registered() is None
    assert type(vllm_cpu.build_attention().mla_attn) is MultiHeadLatentAttentionWrapper


def test_unsupported_vllm_version_is_refused_with_a_warning(plugin_off, monkeypatch, caplog):
    import vllm

    from vllm_mla_fusion.vllm_plugin import register

    monkeypatch.setattr(vllm, "__version__", "0.34.1")
    with caplog.at_level(logging.WARNING, logger=PLUGIN_LOGGER):
        register()
    assert registered() is None
    assert any("0.34.1" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_missing_vllm_attribute_is_refused_with_a_warning(plugin_off, monkeypatch, caplog):
    from vllm_mla_fusion.vllm_plugin import compat, register

    required = (*compat.REQUIRED_ATTRIBUTES, ("vllm.model_executor.layers.mla", "MultiHeadLatentAttentionWrapper.gone"))
    monkeypatch.setattr(compat, "REQUIRED_ATTRIBUTES", required)
    with caplog.at_level(logging.WARNING, logger=PLUGIN_LOGGER):
        register()
    assert registered() is None
    assert any("MultiHeadLatentAttentionWrapper.gone" in r.getMessage() for r in caplog.records)


def test_another_plugins_wrapper_is_kept(plugin_off, caplog):
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

    from vllm_mla_fusion.vllm_plugin import register

    class OtherWrapper(MultiHeadLatentAttentionWrapper):
        pass

    op_registry_oot["MultiHeadLatentAttentionWrapper"] = OtherWrapper
    with caplog.at_level(logging.WARNING, logger=PLUGIN_LOGGER):
        register()
    assert registered() is OtherWrapper
    assert any("OtherWrapper" in r.getMessage() for r in caplog.records)


def test_register_never_raises(plugin_off, monkeypatch, caplog):
    """vLLM calls general plugins without a guard: a failure must become a warning."""
    from vllm_mla_fusion.vllm_plugin import compat, register

    def broken(fused_wrapper):
        raise RuntimeError("simulated registry failure")

    monkeypatch.setattr(compat, "register_wrapper", broken)
    with caplog.at_level(logging.WARNING, logger=PLUGIN_LOGGER):
        register()
    assert registered() is None
    assert any("registration failed" in r.getMessage() for r in caplog.records)


NO_VLLM = """
import importlib.abc, sys
class NoVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("vllm hidden for this test")
sys.meta_path.insert(0, NoVllm())
import vllm_mla_fusion, vllm_mla_fusion.vllm_plugin as plugin
plugin.register()
print("vllm imported:", "vllm" in sys.modules)
"""


def test_package_and_register_work_without_vllm():
    """The package imports without vLLM, and register() there only warns (a process where vLLM is not importable)."""
    proc = subprocess.run([sys.executable, "-c", NO_VLLM], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "vllm imported: False" in proc.stdout
    assert "vLLM is not installed" in proc.stderr
