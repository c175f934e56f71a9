"""The demo's launch census (demo/census.py) on vLLM's own MLA layer, plugin on and off, both modes."""

from __future__ import annotations

import pytest
import torch

from demo import census as C

from . import harness as H

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

# Replaced in both modes (rope_cache leaves the decode query to vLLM).
REPLACED_IN_BOTH_MODES = (C.VLLM_ROPE, C.VLLM_CACHE_WRITE, C.VLLM_FUSED_ROPE_CACHE)


@pytest.fixture(params=["decode", "rope_cache"])
def counted_layers(request, vllm_cpu, plugin_off, monkeypatch):
    """(census, vLLM's layer, the plugin's layer), both built with the census installed."""
    from vllm_mla_fusion.vllm_plugin import register

    census = C.Census().install()
    try:
        off = vllm_cpu.build_attention()
        state = vllm_cpu.finish_weights(off, seed=0)
        if request.param == "rope_cache":
            monkeypatch.setenv("VLLM_MLA_FUSION_DECODE", "0")
        register()
        on = vllm_cpu.build_attention()
        vllm_cpu.finish_weights(on, state)
    finally:
        census.uninstall()
    assert H.mla_layer(on)[0].fusion_mode == request.param
    for attn in (off, on):
        H.mla_layer(attn)[1].bind_kv_cache(H.new_kv_cache(seed=7))
    return census, off, on


def test_census_counts_what_each_layer_ran(vllm_cpu, counted_layers):
    census, off, on = counted_layers
    mode = H.mla_layer(on)[0].fusion_mode
    names = {tag: H.mla_layer(a)[0].prefix for tag, a in (("off", off), ("on", on))}
    builder = vllm_cpu.builder([H.mla_layer(a)[1].layer_name for a in (off, on)])
    requests = {0: H.Request([5, 2, 9, 12]), 1: H.Request([0, 7, 3, 14]), 2: H.Request([1, 10, 4, 6]),
                3: H.Request([8, 11, 13, 15]), 4: H.Request([16, 17, 18, 19]), 5: H.Request([20, 21, 22, 23])}
    steps = [
        H.Step("prefill", [(0, 13), (1, 29)]),
        H.Step("decode", [(0, 1), (1, 1)]),
        H.Step("mixed", [(0, 1), (1, 1), (2, 20)]),
        # Issue 40's slow steps carry several prompts beside the decodes: the launches stay one
        # per layer and kind, whatever the number of prompts (nothing per prefill sequence).
        H.Step("mixed, three prompts", [(0, 1), (1, 1), (2, 1), (3, 21), (4, 9), (5, 17)]),
        H.Step("decode + chunked prefill", [(0, 1), (1, 1), (2, 15)]),
    ]
    for step, metadata, hidden in H.step_inputs(vllm_cpu, builder, steps, requests, seed=3):
        recorded = {}
        for tag, attn in (("off", off), ("on", on)):
            with census.step():
                H.run_step(vllm_cpu, attn, metadata, step, hidden)
            recorded[tag] = census.steps[-1]
            assert list(recorded[tag].layers) == [names[tag]], step.name
            assert recorded[tag].outside_layers == {}, step.name
        has_decode, has_prefill = metadata.num_decode_tokens > 0, metadata.num_prefills > 0
        with_context = step.name.endswith("chunked prefill")
        assert recorded["on"].batch == recorded["off"].batch == {
            "decodes": metadata.num_decodes,
            "prefills": metadata.num_prefills,
            "decode_tokens": metadata.num_decode_tokens,
            "prefill_tokens": step.num_tokens - metadata.num_decode_tokens,
            "prefill_with_context": with_context,
        }, step.name

        counts_off, counts_on = recorded["off"].layers[names["off"]], recorded["on"].layers[names["on"]]
        # The prefill key is built once for the new tokens and once per chunk of cached context.
        key_concats = int(has_prefill) + int(with_context)
        assert counts_off == {
            C.VLLM_ROPE: 1,
            C.VLLM_CACHE_WRITE: 1,
            **({C.VLLM_DECODE_CONCAT: 1} if has_decode else {}),
            **({C.VLLM_PREFILL_KEY_CONCAT: key_concats} if has_prefill else {}),
        }, step.name
        assert not any(site in counts_on for site in REPLACED_IN_BOTH_MODES), (step.name, counts_on)
        fused = sum(n for c, n in counts_on.items() if C.is_fused(c))
        if mode == "decode":
            assert fused == int(has_decode) + int(has_prefill), (step.name, counts_on)
            assert C.VLLM_DECODE_CONCAT not in counts_on, (step.name, counts_on)
        else:  # one op over the whole batch; vLLM still assembles the decode query
            assert counts_on.get("mla_fusion::mla_rope_cache_write") == fused == 1, (step.name, counts_on)
            assert counts_on.get(C.VLLM_DECODE_CONCAT, 0) == int(has_decode), (step.name, counts_on)
