"""Which layers take the fused path, and what an ineligible or failing layer does instead."""

from __future__ import annotations

import logging
import uuid

import pytest
import torch

from . import harness as H

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

PLUGIN_LOGGER = "vllm.vllm_mla_fusion"


ROPES = [
    # (label, get_rope args, expected reason substring or None)
    ("neox default", (64, 4096, True, {"rope_type": "default"}), None),
    (
        "gptj yarn",
        (64, 4096, False, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
        None,
    ),
    ("partial rotary", (64, 4096, True, {"rope_type": "default", "partial_rotary_factor": 0.5}), "partial rotary"),
    ("mrope", (64, 4096, True, {"rope_type": "default", "mrope_section": [8, 12, 12]}), "not a plain"),
    ("rotary dim 128", (128, 4096, True, {"rope_type": "default"}), "qk_rope_head_dim 64"),
]


@pytest.mark.parametrize(("label", "args", "reason"), ROPES, ids=[r[0] for r in ROPES])
def test_rope_rules(vllm_cpu, label, args, reason):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from vllm_mla_fusion.vllm_plugin.eligibility import rope_reason

    with vllm_cpu.active():
        rope = get_rope(*args)
    got = rope_reason(rope, 64, H.DTYPE)
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got, got


def test_deepseek_rope_and_no_rope(vllm_cpu, plugin_off):
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import DeepseekScalingRotaryEmbedding

    from vllm_mla_fusion.vllm_plugin.eligibility import rope_reason

    rope = vllm_cpu.build_attention().rotary_emb
    assert type(rope) is DeepseekScalingRotaryEmbedding and rope.is_neox_style is False
    assert rope_reason(rope, 64, H.DTYPE) is None
    assert "no rotary" in rope_reason(None, 64, H.DTYPE)


LAYER_RULES = [
    # (object path from the wrapper, attribute, value, reason substring)
    ("mla_attn", "kv_cache_dtype", "fp8_ds_mla", "kv_cache_dtype 'fp8_ds_mla'"),
    ("mla_attn", "kv_cache_dtype", "nvfp4_ds_mla", "kv_cache_dtype 'nvfp4_ds_mla'"),
    ("", "is_sparse", True, "sparse MLA"),
    ("", "dcp_q_replicate", True, "DCP query replication"),
    ("mla_attn.impl", "dcp_world_size", 2, "decode context parallelism"),
    ("mla_attn", "use_pcp", True, "prefill context parallelism"),
    ("mla_attn", "use_direct_call", True, "opaque attention op"),
]


@pytest.mark.parametrize(("path", "attr", "value", "reason"), LAYER_RULES, ids=[f"{r[1]}={r[2]}" for r in LAYER_RULES])
def test_layer_rules(vllm_cpu, plugin_off, monkeypatch, path, attr, value, reason):
    from vllm_mla_fusion.vllm_plugin.eligibility import layer_reason

    wrapper = vllm_cpu.build_attention().mla_attn
    assert layer_reason(wrapper, vllm_cpu.config) is None
    target = wrapper
    for part in filter(None, path.split(".")):
        target = getattr(target, part)
    monkeypatch.setattr(target, attr, value)
    got = layer_reason(wrapper, vllm_cpu.config)
    assert got is not None and reason in got, got


DECODE_RULES = [
    ("q_pad_num_heads", 128, "pads query heads"),
    ("is_amx_bmm_enabled", True, "BMM"),
    ("is_aiter_triton_fp8_bmm_enabled", True, "BMM"),
]


@pytest.mark.parametrize(("attr", "value", "reason"), DECODE_RULES, ids=[r[0] for r in DECODE_RULES])
def test_decode_rules(vllm_cpu, plugin_off, monkeypatch, attr, value, reason):
    from vllm_mla_fusion.vllm_plugin.eligibility import decode_reason

    attn = vllm_cpu.build_attention().mla_attn.mla_attn
    config = vllm_cpu.config
    assert decode_reason(attn, config) is None
    monkeypatch.setattr(attn, attr, value)
    got = decode_reason(attn, config)
    assert got is not None and reason in got, got


def test_decode_rules_from_config(vllm_cpu, plugin_off, monkeypatch):
    from vllm_mla_fusion.vllm_plugin.eligibility import decode_reason

    attn = vllm_cpu.build_attention().mla_attn.mla_attn
    config = vllm_cpu.config
    monkeypatch.setattr(config.compilation_config.pass_config, "fuse_attn_quant", True)
    assert "fuse_attn_quant" in decode_reason(attn, config)
    monkeypatch.setattr(config.compilation_config.pass_config, "fuse_attn_quant", False)
    monkeypatch.setenv("VLLM_MLA_FUSION_DECODE", "0")
    assert "VLLM_MLA_FUSION_DECODE=0" in decode_reason(attn, config)


def test_graph_rope_is_opt_in_and_needs_piecewise_graphs(vllm_cpu, monkeypatch):
    from vllm.config import CUDAGraphMode

    from vllm_mla_fusion.vllm_plugin.eligibility import graph_rope_reason

    cc = vllm_cpu.config.compilation_config
    monkeypatch.setattr(cc, "cudagraph_mode", CUDAGraphMode.FULL_AND_PIECEWISE)
    monkeypatch.delenv("VLLM_MLA_FUSION_GRAPH_ROPE", raising=False)
    assert "VLLM_MLA_FUSION_GRAPH_ROPE is not set" in graph_rope_reason(vllm_cpu.config)
    monkeypatch.setenv("VLLM_MLA_FUSION_GRAPH_ROPE", "1")
    assert graph_rope_reason(vllm_cpu.config) is None
    monkeypatch.setattr(cc, "cudagraph_mode", CUDAGraphMode.PIECEWISE)
    assert graph_rope_reason(vllm_cpu.config) is None
    for mode in (CUDAGraphMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY):
        monkeypatch.setattr(cc, "cudagraph_mode", mode)
        assert "replays no piecewise graphs" in graph_rope_reason(vllm_cpu.config)


def _two_steps(vllm_cpu, attns):
    """Outputs and caches of a prefill then a decode step, for each layer in ``attns``."""
    builder = vllm_cpu.builder([H.mla_layer(a)[1].layer_name for a in attns])
    results = [[] for _ in attns]
    requests = {0: H.Request([3, 1]), 1: H.Request([0, 2])}
    steps = [H.Step("prefill", [(0, 5), (1, 9)]), H.Step("decode", [(0, 1), (1, 1)])]
    for step, metadata, hidden in H.step_inputs(vllm_cpu, builder, steps, requests, seed=9):
        for out, attn in zip(results, attns, strict=True):
            out.append(H.run_step(vllm_cpu, attn, metadata, step, hidden))
    return results


def test_ineligible_layer_is_vllms_layer(vllm_cpu, plugin_off, monkeypatch, caplog):
    """A model config with llama_4_scaling: the plugin's wrapper runs vLLM's forward, bit for bit."""
    from vllm_mla_fusion.vllm_plugin import register

    monkeypatch.setattr(vllm_cpu.model_config.hf_text_config, "llama_4_scaling", {"beta": 0.1}, raising=False)
    off = vllm_cpu.build_attention()
    state = vllm_cpu.finish_weights(off, seed=2)
    register()
    with caplog.at_level(logging.DEBUG, logger=PLUGIN_LOGGER):
        on = vllm_cpu.build_attention()
    vllm_cpu.finish_weights(on, state)
    assert type(on.mla_attn).__name__ == "FusedMultiHeadLatentAttentionWrapper"
    assert on.mla_attn.fusion_mode is None
    assert type(H.mla_layer(on)[1]).__name__ == "MLAAttention"
    reasons = [r for r in caplog.records if r.levelno == logging.DEBUG and "llama_4_scaling" in r.getMessage()]
    assert len(reasons) == 1 and H.mla_layer(on)[0].prefix in reasons[0].getMessage()

    for attn in (off, on):
        H.mla_layer(attn)[1].bind_kv_cache(H.new_kv_cache(seed=4))
    outs_off, outs_on = _two_steps(vllm_cpu, (off, on))
    for got, want in zip(outs_on, outs_off, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(H.mla_layer(on)[1].kv_cache, H.mla_layer(off)[1].kv_cache)


def _build_two_with_failing_setup(vllm_cpu, monkeypatch, caplog) -> tuple[list, list]:
    """Two layers built while the plugin's setup raises; (layers, the warnings naming the failure)."""
    from vllm_mla_fusion.vllm_plugin import eligibility, register

    marker = f"simulated setup failure {uuid.uuid4().hex}"

    def broken(*args):
        raise RuntimeError(marker)

    monkeypatch.setattr(eligibility, "decode_reason", broken)
    register()
    with caplog.at_level(logging.WARNING, logger=PLUGIN_LOGGER):
        layers = [vllm_cpu.build_attention() for _ in range(2)]
    return layers, [r for r in caplog.records if marker in r.getMessage()]


def test_setup_failure_falls_back_with_one_warning(vllm_cpu, plugin_off, monkeypatch, caplog):
    layers, warnings = _build_two_with_failing_setup(vllm_cpu, monkeypatch, caplog)
    for attn in layers:
        assert attn.mla_attn.fusion_mode is None
        assert type(H.mla_layer(attn)[1]).__name__ == "MLAAttention"  # never half-fused
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING


def test_llama_4_scaling_at_forward_is_refused(vllm_cpu, plugin_on):
    attn = vllm_cpu.build_attention()
    vllm_cpu.finish_weights(attn)
    assert attn.mla_attn.fusion_mode == "decode"
    positions = torch.arange(3)
    hidden = torch.zeros((3, H.DSV3_CONFIG["hidden_size"]), dtype=H.DTYPE)
    with pytest.raises(ValueError, match="llama_4_scaling"):
        attn.mla_attn(positions, hidden, torch.ones(3, 1, 1, dtype=H.DTYPE))


def test_unrunnable_backend_falls_back_with_a_warning(vllm_cpu, plugin_on, monkeypatch, caplog):
    """VLLM_MLA_FUSION_BACKEND naming a backend that cannot run here is reported, not silently ignored."""
    monkeypatch.setenv("VLLM_MLA_FUSION_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # Triton runs CPU tensors only in its interpreter
    with caplog.at_level(logging.WARNING, logger=PLUGIN_LOGGER):
        attn = vllm_cpu.build_attention()
    assert attn.mla_attn.fusion_mode is None
    assert type(H.mla_layer(attn)[1]).__name__ == "MLAAttention"
    assert any("interpreter" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_setup_failure_on_another_rank_is_logged_there(vllm_cpu, plugin_off, as_rank_3, monkeypatch, caplog):
    """A setup failure on rank 3 alone (rank 0 fine) must be visible: the warning comes from every
    rank, once per process, naming the rank."""
    layers, warnings = _build_two_with_failing_setup(vllm_cpu, monkeypatch, caplog)
    assert all(attn.mla_attn.fusion_mode is None for attn in layers)
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "(rank 3, local rank 3)" in warnings[0].getMessage()


def test_every_rank_logs_its_backend_and_mode(vllm_cpu, plugin_on, as_rank_3, caplog):
    """The info line with the chosen backend and mode comes from this rank too (once), so a rank
    that chose differently from rank 0 shows up in the log."""
    with caplog.at_level(logging.INFO, logger=PLUGIN_LOGGER):
        for _ in range(2):
            assert vllm_cpu.build_attention().mla_attn.fusion_mode == "decode"
    lines = [r.getMessage() for r in caplog.records if "use the fused RoPE" in r.getMessage()]
    assert lines == ["vllm-mla-fusion (rank 3, local rank 3): MLA layers use the fused RoPE + KV-cache write "
                     "(backend torch, mode decode)"], lines  # fmt: skip
@pytest.mark.parametrize(("switches", "mode"), [
    ({"VLLM_MLA_FUSION_GRAPH_ROPE": "1"}, "decode-graph-rope"),
    ({"VLLM_MLA_FUSION_PREFILL_KEY": "1"}, "decode-prefill-key"),
    ({"VLLM_MLA_FUSION_GRAPH_ROPE": "1", "VLLM_MLA_FUSION_PREFILL_KEY": "1"}, "decode-graph-rope-prefill-key"),
])  # fmt: skip
def test_the_info_line_names_the_opt_in_switches_that_took_effect(vllm_cpu, plugin_on, as_rank_3, monkeypatch,
                                                                  caplog, switches, mode):  # fmt: skip
    """VLLM_MLA_FUSION_GRAPH_ROPE=1 (the RoPE inside piecewise graphs, configured here) and
    VLLM_MLA_FUSION_PREFILL_KEY=1 (op 3) show in the mode the line names where the layer took them,
    so a log (and the serving benchmark's side check) tells whether a switch took effect. As rank 3:
    a line is logged once per process and arguments, and other tests build such layers as rank 0."""
    from vllm.config import CUDAGraphMode

    for name, value in switches.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(vllm_cpu.config.compilation_config, "cudagraph_mode", CUDAGraphMode.FULL_AND_PIECEWISE)
    with caplog.at_level(logging.INFO, logger=PLUGIN_LOGGER):
        attn = vllm_cpu.build_attention()
    mla = attn.mla_attn.mla_attn
    assert attn.mla_attn.fusion_mode == "decode"
    assert (mla._graph_rope, mla._prefill_key_fused) == ("graph-rope" in mode, "prefill-key" in mode)
    lines = [r.getMessage() for r in caplog.records if "use the fused RoPE" in r.getMessage()]
    assert lines == ["vllm-mla-fusion (rank 3, local rank 3): MLA layers use the fused RoPE + KV-cache write "
                     f"(backend torch, mode {mode})"], lines  # fmt: skip


def test_debug_mode_is_warned_once_at_start_up(vllm_cpu, plugin_on, as_rank_3, monkeypatch, caplog):
    """VLLM_MLA_FUSION_DEBUG syncs every fused call: a server started with it says so, once per rank,
    beside the backend line (a serving comparison's plugin side would otherwise measure it unseen)."""
    from vllm.logger import _print_warning_once

    _print_warning_once.cache_clear()  # a line an earlier test logged would be dropped as a repeat
    monkeypatch.setenv("VLLM_MLA_FUSION_DEBUG", "1")
    with caplog.at_level(logging.INFO, logger=PLUGIN_LOGGER):
        for _ in range(2):
            assert vllm_cpu.build_attention().mla_attn.fusion_mode == "decode"
    warnings = [r for r in caplog.records if "VLLM_MLA_FUSION_DEBUG" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING, warnings
    assert warnings[0].getMessage().startswith("vllm-mla-fusion (rank 3, local rank 3): VLLM_MLA_FUSION_DEBUG is set")


@pytest.mark.parametrize("debug", [None, "0", "1"])
@pytest.mark.parametrize("requested", [None, "torch", "auto"])
@pytest.mark.parametrize("backend, device", [("torch", "cpu"), ("torch", "cuda"), ("torch", "xpu"), ("triton", "cuda"),
                                             ("aiter", "cuda")])  # fmt: skip
def test_slow_settings_name_debug_mode_and_the_reference_asked_for_on_a_gpu(monkeypatch, debug, requested, backend,
                                                                            device):  # fmt: skip
    """Said: VLLM_MLA_FUSION_DEBUG when on; the reference backend when the user asked for it by name
    and it runs on a device other than the CPU (not the automatic choice, e.g. XPU's)."""
    from vllm_mla_fusion.vllm_plugin.layer import slow_settings

    for name, value in (("VLLM_MLA_FUSION_DEBUG", debug), ("VLLM_MLA_FUSION_BACKEND", requested)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    said = slow_settings(backend, torch.device(device))
    debug_said = [s for s in said if s.startswith("VLLM_MLA_FUSION_DEBUG is set")]
    backend_said = [s for s in said if s.startswith("VLLM_MLA_FUSION_BACKEND=torch")]
    assert len(debug_said) == (debug == "1") and len(said) == len(debug_said) + len(backend_said), said
    assert len(backend_said) == (backend == "torch" and device != "cpu" and requested == "torch"), said


def test_decode_pair_backends_are_recognised_by_name_and_subclass():
    """FLASH_ATTN_MLA and CUTLASS_MLA (and subclasses, e.g. XPU's) take (ql_nope, q_pe) as it is: op 1
    for the decode rows; every other backend, and any fp8 query, gets op 2's assembled query."""
    from vllm_mla_fusion.vllm_plugin import eligibility

    def impl(module, name, base=object):
        return type(name, (base,), {"__module__": module, "__qualname__": name})

    fa = impl("vllm.v1.attention.backends.mla.flashattn_mla", "FlashAttnMLAImpl")
    xpu = impl("vllm.v1.attention.backends.mla.flashattn_mla", "XPUFlashAttnMLAImpl", fa)
    cutlass = impl("vllm.v1.attention.backends.mla.cutlass_mla", "CutlassMLAImpl")
    flashmla = impl("vllm.v1.attention.backends.mla.flashmla", "FlashMLAImpl")
    for cls in (fa, xpu, cutlass):
        assert "without concatenating" in eligibility.decode_pair_reason(cls(), fp8_query=False)
        assert eligibility.decode_pair_reason(cls(), fp8_query=True) is None
    assert eligibility.decode_pair_reason(flashmla(), fp8_query=False) is None
    # The names are vLLM 0.33's: the modules exist where the table says.
    import importlib.util

    for module, _ in eligibility._DECODE_PAIR_BACKENDS:
        assert importlib.util.find_spec(module) is not None, module


def test_prefill_key_step_rule_reads_the_step_and_the_layers_aiter_switches():
    """The per-step rule a fused layer binds: no prefill metadata or an fp8 prefill query keeps vLLM's
    key; on ROCM_AITER_MLA, its fused FP8 prefill (switched on in the impl, the step's FP8 indptr set,
    no chunked context) does too; any other step gets op 3. Each condition alone flips the answer."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.rocm_aiter_mla import AiterMLAImpl

    from vllm_mla_fusion.vllm_plugin import eligibility

    def step(q_dtype=torch.bfloat16, chunked=None, indptr=None, prefill=True):
        pre = SimpleNamespace(q_data_type=q_dtype, chunked_context=chunked) if prefill else None
        return SimpleNamespace(prefill=pre, fp8_prefill_qo_indptr=indptr)

    def aiter(enabled, fused):
        impl = object.__new__(AiterMLAImpl)  # the switches AiterMLAImpl.__init__ sets, without a ROCm device
        impl._fp8_prefill_enabled, impl._fused_prefill_qkv = enabled, fused
        return impl

    indptr = torch.arange(3)
    common = eligibility.prefill_key_step_rule(object())
    assert common(step()) is None
    assert common(step(indptr=indptr)) is None  # the AITER branch is AITER's alone
    assert "no prefill metadata" in common(step(prefill=False))
    assert "no prefill metadata" in common(SimpleNamespace())
    assert "reads q" in common(step(q_dtype=current_platform.fp8_dtype()))

    rule = eligibility.prefill_key_step_rule(aiter(True, True))
    assert "fused_mla_prefill_qkv_fp8" in rule(step(indptr=indptr))
    assert rule(step()) is None  # the step does not take the FP8 path
    assert rule(step(indptr=indptr, chunked=object())) is None  # chunked context: the common path
    assert "reads q" in rule(step(q_dtype=current_platform.fp8_dtype()))
    for enabled, fused in ((True, False), (False, True)):
        assert eligibility.prefill_key_step_rule(aiter(enabled, fused))(step(indptr=indptr)) is None


def _prefill_step(q_dtype, indptr=None):
    from types import SimpleNamespace

    return SimpleNamespace(prefill=SimpleNamespace(q_data_type=q_dtype, chunked_context=None),
                           fp8_prefill_qo_indptr=indptr)  # fmt: skip


def test_fused_layer_asks_its_bound_step_rule_and_logs_each_reason_once(vllm_cpu, plugin_on, caplog, monkeypatch):
    """A fused layer's per-step choice of the prefill key comes from the rule bound when it was built:
    an fp8 prefill query keeps vLLM's key (logged once per layer and reason, not per step), a bf16 one
    gets op 3."""
    from vllm.platforms import current_platform

    monkeypatch.setenv("VLLM_MLA_FUSION_PREFILL_KEY", "1")
    attn = H.mla_layer(vllm_cpu.build_attention())[1]
    assert attn._prefill_key_fused and attn._prefill_key_step_rule is not None
    with caplog.at_level(logging.DEBUG, logger=PLUGIN_LOGGER):
        assert [attn._fuse_prefill_key(_prefill_step(current_platform.fp8_dtype())) for _ in range(3)] == [False] * 3
        assert attn._fuse_prefill_key(_prefill_step(torch.bfloat16))
    logged = [r.getMessage() for r in caplog.records if "keeps vLLM's prefill key" in r.getMessage()]
    assert len(logged) == 1 and "reads q" in logged[0] and attn.layer_name in logged[0], logged


@pytest.mark.parametrize("setting", [None, "0", "off"], ids=["default", "0", "off"])
def test_a_layer_built_with_the_key_unfused_binds_no_rule_and_never_fuses(vllm_cpu, plugin_on, monkeypatch, setting):
    """Op 3 is opt-in (issue 40): unset, or set off, the layer's prefill rows keep vLLM's key."""
    if setting is None:
        monkeypatch.delenv("VLLM_MLA_FUSION_PREFILL_KEY", raising=False)
    else:
        monkeypatch.setenv("VLLM_MLA_FUSION_PREFILL_KEY", setting)
    attn = H.mla_layer(vllm_cpu.build_attention())[1]
    assert not attn._prefill_key_fused and attn._prefill_key_step_rule is None
    assert not attn._fuse_prefill_key(_prefill_step(torch.bfloat16))


def test_promote_binds_the_rule_of_the_layers_own_impl(vllm_cpu, plugin_on, monkeypatch):
    """The AITER branch is decided from the impl promote was given: with the layer's impl class
    standing in for AiterMLAImpl and its FP8-prefill switches on, the layer's bound rule keeps
    vLLM's key for a step on AITER's fused FP8 path; a layer built before the switches were on
    does not."""
    from vllm_mla_fusion.vllm_plugin import eligibility

    monkeypatch.setenv("VLLM_MLA_FUSION_PREFILL_KEY", "1")
    before = H.mla_layer(vllm_cpu.build_attention())[1]
    impl_cls = type(before.impl)
    monkeypatch.setattr(eligibility, "_aiter_mla_impl", lambda: impl_cls)
    monkeypatch.setattr(impl_cls, "_fp8_prefill_enabled", True, raising=False)
    monkeypatch.setattr(impl_cls, "_fused_prefill_qkv", True, raising=False)
    after = H.mla_layer(vllm_cpu.build_attention())[1]
    on_aiter_path = _prefill_step(torch.bfloat16, indptr=torch.arange(3))
    assert "fused_mla_prefill_qkv_fp8" in after._prefill_key_step_rule(on_aiter_path)
    assert not after._fuse_prefill_key(on_aiter_path)
    assert before._fuse_prefill_key(on_aiter_path)
