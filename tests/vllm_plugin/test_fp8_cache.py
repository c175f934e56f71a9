"""The plugin's fused write into an fp8 KV cache stored as uint8, with a k_scale that is not 1.

vLLM's CPU platform refuses fp8 KV caches for MLA (CPU_MLA declares only
"auto"), so no layer with an fp8 cache can run attention here. What can run
is the write itself: the plugin's layer is switched to ``kv_cache_dtype="fp8"``
after construction, gets a uint8 cache and a non-trivial ``_k_scale``, and a
profile-style step (no attention metadata, slot mapping present) makes it
write exactly as in a real step, while attention returns zeros.

What vLLM's own path stores in such a cache is ``saturate(fp8(x / k_scale))``
of the values it hands to ``do_kv_cache_update``; those values are taken from
vLLM's layer (same weights, same inputs) by recording that call.

Tolerance contract: latent part byte-identical (the same bf16 values, divided
in float32 and rounded once); rope part within one e4m3 step plus the bf16
RoPE difference divided by k_scale (vLLM's bf16 RoPE and the op's float32
RoPE may differ by about one bf16 ulp of the rotation pair's norm, as in
test_layer.py); rows no slot names keep their canary bytes.
"""

from __future__ import annotations

import pytest
import torch

from . import harness as H

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

L = 512
K_SCALE = 0.0102  # x / k_scale saturates e4m3 (448) for |x| > ~4.6: both regimes occur
FP8 = torch.float8_e4m3fn  # vLLM's "fp8" on CPU and NVIDIA


def rope_pair_norm(x: torch.Tensor) -> torch.Tensor:
    """Per element, the norm of its GPT-J rotation pair (DeepSeek rotates interleaved pairs)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    return pairs.norm(dim=-1, keepdim=True).expand_as(pairs).flatten(-2)


@pytest.mark.parametrize("mode", ["decode", "rope_cache"])
def test_fused_write_into_uint8_fp8_cache(vllm_cpu, plugin_off, monkeypatch, mode):
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    from vllm_mla_fusion.vllm_plugin import register

    off = vllm_cpu.build_attention()
    state = vllm_cpu.finish_weights(off, seed=1)
    if mode == "rope_cache":
        monkeypatch.setenv("VLLM_MLA_FUSION_DECODE", "0")
    register()
    on = vllm_cpu.build_attention()
    vllm_cpu.finish_weights(on, state)
    assert on.mla_attn.fusion_mode == mode
    mla_on, mla_off = H.mla_layer(on)[1], H.mla_layer(off)[1]

    mla_on.kv_cache_dtype = "fp8"
    mla_on._k_scale.fill_(K_SCALE)
    mla_on._k_scale_float = K_SCALE
    g = torch.Generator().manual_seed(11)
    canary = torch.randint(0, 256, (H.NUM_BLOCKS, 1, H.BLOCK_SIZE, L + 64), generator=g, dtype=torch.uint8)
    mla_on.bind_kv_cache(canary.clone())
    mla_off.bind_kv_cache(H.new_kv_cache(seed=0))

    recorded = []
    vllm_update = CPUMLAImpl.do_kv_cache_update

    def record(self, kv_c_normed, k_pe, *args, **kwargs):
        recorded.append(torch.cat([kv_c_normed, k_pe.squeeze(1)], dim=-1).clone())
        return vllm_update(self, kv_c_normed, k_pe, *args, **kwargs)

    monkeypatch.setattr(CPUMLAImpl, "do_kv_cache_update", record)

    num_tokens = 24
    positions = torch.cat([torch.arange(3, 3 + 20), torch.zeros(4, dtype=torch.int64)])
    slots = torch.cat([torch.randperm(H.NUM_BLOCKS * H.BLOCK_SIZE, generator=g)[:20], torch.full((4,), -1)])
    hidden = torch.randn((num_tokens, H.DSV3_CONFIG["hidden_size"]), generator=g).to(H.DTYPE)
    for attn, mla in ((off, mla_off), (on, mla_on)):
        with vllm_cpu.active(), set_forward_context(None, vllm_cpu.config, slot_mapping={mla.layer_name: slots}):
            out = attn(positions, hidden, None)
        assert torch.count_nonzero(out) == 0  # no metadata: attention is skipped, as in vLLM's profile run
    assert len(recorded) == 1, "vLLM's layer wrote once; the plugin's layer did not call vLLM's cache update"

    x = recorded[0].float()[:20]  # what vLLM stores, before quantization; padding rows skipped
    want = (x / K_SCALE).clamp(-448, 448).to(FP8)
    saturated = (x / K_SCALE).abs() > 448
    assert saturated.any() and (~saturated).any()
    valid = slots[:20]
    cache = mla_on.kv_cache  # [num_blocks, block_size, 576] uint8
    got = cache[valid // H.BLOCK_SIZE, valid % H.BLOCK_SIZE].view(FP8)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got[:, :L].view(torch.uint8), want[:, :L].view(torch.uint8)), "latent part"
    got_pe, want_pe = got[:, L:].float(), want[:, L:].float()
    e4m3_step = 2.0**-3 * torch.maximum(got_pe.abs(), want_pe.abs()) + 2.0**-9
    bf16_rope = 2.0**-6 * rope_pair_norm(x[:, L:]) / K_SCALE
    err = (got_pe - want_pe).abs()
    assert (err <= e4m3_step + bf16_rope).all(), f"rope part: worst error {err.max().item()}"
    assert torch.equal(got[saturated].float().abs(), torch.full((int(saturated.sum()),), 448.0))

    untouched = torch.ones(cache.shape[:2], dtype=torch.bool)
    untouched[valid // H.BLOCK_SIZE, valid % H.BLOCK_SIZE] = False
    assert torch.equal(cache[untouched], canary[:, 0][untouched]), "bytes outside the written rows changed"
