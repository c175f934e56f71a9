"""Census counting (demo/census.py) on hand-made profiles: what counts, where, and how often."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from demo import census as C
from vllm_mla_fusion import mla_rope_cache_write


def call_fused_op() -> None:
    """One real ``mla_fusion::mla_rope_cache_write`` call (torch backend), two tokens."""
    T, H, L, R = 2, 1, 4, 4
    mla_rope_cache_write(
        torch.arange(T), torch.randn(T, H, R), torch.randn(T, R), torch.randn(T, L),
        torch.randn(8, R), False, torch.tensor([0, 1]), torch.zeros(1, 4, L + R), backend="torch",
    )  # fmt: skip


def test_categories():
    assert C.category("mla_fusion::mla_prefill_rope_cache_write") == "mla_fusion::mla_prefill_rope_cache_write"
    assert C.category("mla_fusion_vllm::mla_attention_with_output") is None  # the plugin's dispatching op
    assert C.category("_C::concat_and_cache_mla") == C.VLLM_CACHE_WRITE
    assert C.category(C.VLLM_ROPE) == C.VLLM_ROPE
    assert C.category("aten::cat") is None


def test_counts_per_layer_once_per_category():
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(C.LAYER_PREFIX + "layer.0"):
            call_fused_op()
            with record_function(C.VLLM_CACHE_WRITE), record_function("_C::concat_and_cache_mla"):
                pass  # a kernel inside the counted function: the same launch
            with record_function(C.VLLM_ROPE):
                pass
            with record_function(C.VLLM_ROPE):
                pass
        with record_function(C.LAYER_PREFIX + "layer.1"):
            with record_function("_C::concat_and_cache_mla"):  # a kernel reached another way
                pass
        with record_function(C.LAYER_PREFIX + "layer.2"):
            pass
        call_fused_op()

    layers, outside = C.count(prof.events())

    assert layers == {
        "layer.0": {"mla_fusion::mla_rope_cache_write": 1, C.VLLM_CACHE_WRITE: 1, C.VLLM_ROPE: 2},
        "layer.1": {C.VLLM_CACHE_WRITE: 1},
        "layer.2": {},  # ran, launched nothing counted
    }
    assert outside == {"mla_fusion::mla_rope_cache_write": 1}
