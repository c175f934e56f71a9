"""The profile run compiles every launch configuration of the layer's ops, and changes nothing.

Runs the Triton kernel in Triton's interpreter (the backend forced to triton),
so "compiling" is a launch here; on a GPU the same launches compile the
kernel's variants (their number is what vLLM's first requests no longer pay).
"""

from __future__ import annotations

import pytest
import torch

from . import harness as H

pytest.importorskip("vllm")
pytest.importorskip("triton")

pytestmark = pytest.mark.vllm


@pytest.fixture
def triton_layer(vllm_cpu, plugin_on, monkeypatch):
    from vllm_mla_fusion.vllm_plugin import prewarm

    monkeypatch.setenv("VLLM_MLA_FUSION_BACKEND", "triton")
    monkeypatch.setenv("VLLM_MLA_FUSION_PREFILL_KEY", "1")  # op 3 (opt-in) too: all three ops compiled ahead
    monkeypatch.setattr(prewarm, "_DONE", {})
    attn = vllm_cpu.build_attention()
    vllm_cpu.finish_weights(attn, seed=4)
    H.mla_layer(attn)[1].bind_kv_cache(H.new_kv_cache(seed=9))
    return attn


def _profile_step(vllm_cpu, attn, num_tokens: int, seed: int):
    """A forward with no attention metadata, as vLLM's profile run makes it."""
    from vllm.forward_context import set_forward_context

    mla = H.mla_layer(attn)[1]
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn((num_tokens, H.DSV3_CONFIG["hidden_size"]), generator=g).to(H.DTYPE)
    positions = torch.randint(0, 1000, (num_tokens,), generator=g)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64)
    with vllm_cpu.active(), set_forward_context({mla.layer_name: None}, vllm_cpu.config,
                                                slot_mapping={mla.layer_name: slots}):  # fmt: skip
        return attn(positions, hidden, None)


def test_profile_run_launches_every_configuration_once(vllm_cpu, triton_layer, monkeypatch):
    from vllm_mla_fusion.backends import triton as tb
    from vllm_mla_fusion.validation import Problem

    launches = []
    original = tb.BoundLaunch.__call__

    def recording(launch, *args):
        launches.append((launch.op, tb.LAUNCH_CONFIG_OVERRIDE and dict(tb.LAUNCH_CONFIG_OVERRIDE)))
        return original(launch, *args)

    monkeypatch.setattr(tb.BoundLaunch, "__call__", recording)
    mla = H.mla_layer(triton_layer)[1]
    cache_before = mla.kv_cache.clone()
    T = 40
    _profile_step(vllm_cpu, triton_layer, T, seed=1)
    assert torch.equal(mla.kv_cache, cache_before), "compiling ahead must not write the cache"

    p = Problem(1, mla.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim, torch.bfloat16,
                nope_dim=mla.qk_nope_head_dim)  # fmt: skip
    forced = [(op, cfg) for op, cfg in launches if cfg is not None]
    for op in (tb.OP_ROPE_CACHE.value, tb.OP_DECODE.value, tb.OP_PREFILL.value):
        want = tb.launch_configs(p, op, torch.device("cpu"), T)
        got = [cfg for o, cfg in forced if o == op]
        assert got == want, (op, got, want)
    assert len(forced) == sum(len(tb.launch_configs(p, op, torch.device("cpu"), T)) for op in (1, 2, 3))
    # The profile run's own work (op 1 over the batch) is not forced.
    assert [op for op, cfg in launches if cfg is None] == [tb.OP_ROPE_CACHE.value]
    assert tb.LAUNCH_CONFIG_OVERRIDE is None

    launches.clear()
    _profile_step(vllm_cpu, triton_layer, T, seed=2)
    assert [cfg for _, cfg in launches if cfg is not None] == [], "done once per process and layer shape"


def test_prewarm_switch(vllm_cpu, plugin_on, monkeypatch):
    monkeypatch.setenv("VLLM_MLA_FUSION_BACKEND", "triton")
    monkeypatch.setenv("VLLM_MLA_FUSION_PREWARM", "0")
    attn = vllm_cpu.build_attention()
    assert H.mla_layer(attn)[1]._prewarm_cache_config is None
    monkeypatch.delenv("VLLM_MLA_FUSION_PREWARM")
    assert H.mla_layer(vllm_cpu.build_attention())[1]._prewarm_cache_config is vllm_cpu.config.cache_config


def test_only_the_ops_a_layer_can_launch_are_compiled(vllm_cpu, plugin_on, monkeypatch):
    """A backend that takes (ql_nope, q_pe) as is never runs op 2; without VLLM_MLA_FUSION_PREFILL_KEY=1
    (op 3 is opt-in) op 3 never runs either: neither is compiled."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    from vllm_mla_fusion.backends import triton as tb
    from vllm_mla_fusion.vllm_plugin import eligibility, prewarm

    monkeypatch.setenv("VLLM_MLA_FUSION_BACKEND", "triton")
    monkeypatch.delenv("VLLM_MLA_FUSION_PREFILL_KEY", raising=False)
    monkeypatch.setattr(prewarm, "_DONE", {})
    monkeypatch.setattr(eligibility, "_DECODE_PAIR_BACKENDS", {(CPUMLAImpl.__module__, CPUMLAImpl.__qualname__)})
    attn = vllm_cpu.build_attention()
    vllm_cpu.finish_weights(attn, seed=5)
    H.mla_layer(attn)[1].bind_kv_cache(H.new_kv_cache(seed=10))
    ops = []
    original = tb.BoundLaunch.__call__
    monkeypatch.setattr(tb.BoundLaunch, "__call__", lambda launch, *a: (ops.append((launch.op, tb.LAUNCH_CONFIG_OVERRIDE)),
                                                                         original(launch, *a))[1])  # fmt: skip
    _profile_step(vllm_cpu, attn, 24, seed=3)
    assert {op for op, forced in ops if forced is not None} == {tb.OP_ROPE_CACHE.value}


def _built_before_the_block_size(vllm_cpu, monkeypatch, manager_block_size=H.BLOCK_SIZE, **switches):
    """A layer built while vLLM's cache config still holds another block size than the cache's.

    vLLM builds the model first and only then settles the block size for the attention backend
    (``Platform.update_block_size_for_backend``, after ``load_model``): FLASHMLA's 64, say,
    where the layers saw the default 16. The profile run comes after that. ``manager_block_size``:
    the size it settles (``--block-size``), of which the cache's kernel blocks may be a divisor
    (vLLM's ``select_common_block_size``). The backend's kernels take 16 or 64 here (CPU_MLA's
    take 16 only, which would make the size at construction, 64, select 16 as well): a layer
    that kept the size it was built with would compile kernels for blocks of 64.
    """
    from vllm_mla_fusion.vllm_plugin import prewarm

    monkeypatch.setenv("VLLM_MLA_FUSION_BACKEND", "triton")
    for name, value in switches.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(prewarm, "_DONE", {})
    cache_config = vllm_cpu.config.cache_config
    monkeypatch.setattr(cache_config, "block_size", 4 * H.BLOCK_SIZE)
    attn = vllm_cpu.build_attention()
    backend = H.mla_layer(attn)[1].attn_backend
    monkeypatch.setattr(backend, "get_supported_kernel_block_sizes",
                        staticmethod(lambda kv_cache_spec=None: [H.BLOCK_SIZE, 4 * H.BLOCK_SIZE]))  # fmt: skip
    cache_config.block_size = manager_block_size  # what vLLM settles before the profile run
    vllm_cpu.finish_weights(attn, seed=4)
    H.mla_layer(attn)[1].bind_kv_cache(H.new_kv_cache(seed=9))
    return attn


@pytest.fixture
def layer_built_before_the_block_size(vllm_cpu, plugin_on, monkeypatch):
    return _built_before_the_block_size(vllm_cpu, monkeypatch, VLLM_MLA_FUSION_PREFILL_KEY="1")


@pytest.fixture
def layer_of_a_larger_manager_block(vllm_cpu, plugin_on, monkeypatch):
    """``--block-size 32`` where the backend's kernels take 16: the cache tensor has blocks of 16."""
    return _built_before_the_block_size(vllm_cpu, monkeypatch, 2 * H.BLOCK_SIZE, VLLM_MLA_FUSION_PREFILL_KEY="1")


@pytest.fixture
def rope_cache_layer(vllm_cpu, plugin_on, monkeypatch):
    """A rope_cache-mode layer (VLLM_MLA_FUSION_DECODE=0: vLLM's own MLAAttention, op 1 run by the
    plugin's rope_kv_cache_update before vLLM's attention), built before vLLM settles the block size."""
    attn = _built_before_the_block_size(vllm_cpu, monkeypatch, VLLM_MLA_FUSION_DECODE="0")
    assert attn.mla_attn.fusion_mode == "rope_cache"
    return attn


def test_a_rope_cache_layer_compiles_op_1_ahead(vllm_cpu, rope_cache_layer, monkeypatch):
    """Without the decode mode the plugin still launches op 1 in every step: its variants are
    compiled in the profile run too, and nothing is written."""
    from vllm_mla_fusion.backends import triton as tb
    from vllm_mla_fusion.validation import Problem

    launches = []
    original = tb.BoundLaunch.__call__
    monkeypatch.setattr(tb.BoundLaunch, "__call__", lambda launch, *a: (launches.append(
        (launch.op, tb.LAUNCH_CONFIG_OVERRIDE and dict(tb.LAUNCH_CONFIG_OVERRIDE))), original(launch, *a))[1])  # fmt: skip
    mla = H.mla_layer(rope_cache_layer)[1]
    cache_before = mla.kv_cache.clone()
    _profile_step(vllm_cpu, rope_cache_layer, 40, seed=1)
    assert torch.equal(mla.kv_cache, cache_before), "compiling ahead must not write the cache"
    p = Problem(1, mla.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim, torch.bfloat16, nope_dim=mla.qk_nope_head_dim)
    assert [cfg for _, cfg in launches if cfg is not None] == tb.launch_configs(p, tb.OP_ROPE_CACHE.value,
                                                                                torch.device("cpu"), 40)  # fmt: skip
    assert {op for op, _ in launches} == {tb.OP_ROPE_CACHE.value}


def test_a_larger_forward_compiles_what_a_smaller_one_did_not(vllm_cpu, triton_layer, monkeypatch):
    """A dummy run before the profile run (fewer tokens) does not stand for it: the profile run
    still compiles the variants only more tokens use; a forward no larger compiles nothing."""
    from vllm_mla_fusion.backends import triton as tb
    from vllm_mla_fusion.validation import Problem

    forced = []
    original = tb.BoundLaunch.__call__
    monkeypatch.setattr(tb.BoundLaunch, "__call__", lambda launch, *a: (forced.append(
        (launch.op, dict(tb.LAUNCH_CONFIG_OVERRIDE))) if tb.LAUNCH_CONFIG_OVERRIDE else None, original(launch, *a))[1])  # fmt: skip
    mla = H.mla_layer(triton_layer)[1]
    p = Problem(1, mla.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim, torch.bfloat16, nope_dim=mla.qk_nope_head_dim)
    small, large = 2, 64
    _profile_step(vllm_cpu, triton_layer, small, seed=1)
    _profile_step(vllm_cpu, triton_layer, large, seed=2)
    for op in (tb.OP_ROPE_CACHE.value, tb.OP_DECODE.value, tb.OP_PREFILL.value):
        wanted = tb.launch_configs(p, op, torch.device("cpu"), large)
        assert any(cfg not in tb.launch_configs(p, op, torch.device("cpu"), small) for cfg in wanted), op  # else no test
        assert [cfg for o, cfg in forced if o == op][-len(wanted):] == wanted, op
    forced.clear()
    _profile_step(vllm_cpu, triton_layer, large, seed=3)
    _profile_step(vllm_cpu, triton_layer, small, seed=4)
    assert forced == []


@pytest.mark.parametrize("layer_fixture", ["triton_layer", "layer_built_before_the_block_size",
                                           "layer_of_a_larger_manager_block", "rope_cache_layer"])
def test_the_variants_compiled_ahead_are_the_ones_the_steps_launch(vllm_cpu, layer_fixture, request, monkeypatch):
    """The profile run compiles through the layer's own bound ops (their early-index-loads
    promise) and a scratch cache of the cache's block size, as vLLM has settled it by then:
    each launch of the steps that follow has exactly the constexprs of a launch forced in the
    profile run (tiles, store formats, ``BLOCK_SIZE``, ``EARLY_INDEX_LOADS``), so it runs a
    binary compiled ahead. As on an sm_90 GPU: programmatic dependent launch on (its wait a
    no-op in the interpreter)."""
    from vllm_mla_fusion.backends import triton as tb

    triton_layer = request.getfixturevalue(layer_fixture)

    from ..test_binding import _no_wait

    monkeypatch.setattr(tb, "_pdl_ok", lambda device: True)
    monkeypatch.setattr(tb, "_wait_for_inputs", _no_wait)
    launches = []
    original = tb.BoundLaunch.__call__

    def recording(launch, T, *args):
        launches.append((tb.LAUNCH_CONFIG_OVERRIDE is not None, launch.op, launch.plan(T).constexprs))
        return original(launch, T, *args)

    monkeypatch.setattr(tb.BoundLaunch, "__call__", recording)
    _profile_step(vllm_cpu, triton_layer, 64, seed=4)
    ahead = [(op, c) for forced, op, c in launches if forced]
    assert ahead and all(c["EARLY_INDEX_LOADS"] and c["BLOCK_SIZE"] == H.BLOCK_SIZE for _, c in ahead)
    launches.clear()

    mla = H.mla_layer(triton_layer)[1]
    builder = vllm_cpu.builder([mla.layer_name])
    requests = {0: H.Request([5, 2, 9, 12]), 1: H.Request([0, 7, 3, 14]), 2: H.Request([1, 10, 4, 6])}
    steps = [H.Step("prefill", [(0, 13), (1, 29)]), H.Step("decode", [(0, 1), (1, 1)]),
             H.Step("mixed", [(0, 1), (1, 1), (2, 20)]), H.Step("padded decode", [(0, 1), (1, 1)], pad_to=8)]  # fmt: skip
    for step, metadata, hidden in H.step_inputs(vllm_cpu, builder, steps, requests, seed=5):
        H.run_step(vllm_cpu, triton_layer, metadata, step, hidden)
    served = [(op, c) for forced, op, c in launches if not forced]
    assert served and not any(forced for forced, _, _ in launches)
    for op, c in served:
        assert (op, c) in ahead, (op, c)
