"""vLLM's K3 decode ops as op 2's peer (issue 41): the call built from the benchmark's views (stand-in
ops record what they get: the real ones need a GPU and vLLM's CUDA wheel), and the target that
compares op 2 with them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.kernels import bench_mla_rope_cache as bench
from benchmarks.kernels import peers

T, H, L, R, NB, BS = 3, 4, 16, 8, 2, 16


def _views(fp8: bool) -> SimpleNamespace:
    kv_a = torch.randn(T, L + R)
    ql_store = torch.randn(H, T, L)
    kv_cache = torch.zeros(NB, BS, L + R, dtype=torch.uint8 if fp8 else torch.bfloat16)
    return SimpleNamespace(
        positions=torch.arange(T), slot_mapping=torch.tensor([5, 0, 17]), q_pe=torch.randn(T, H, 32)[..., 24:],
        k_pe=kv_a[:, L:], kv_c=torch.randn(T, L), ql_nope=ql_store.transpose(0, 1),
        kv_cache=kv_cache, typed_cache=kv_cache.view(torch.float8_e4m3fn) if fp8 else kv_cache,
        q_out=torch.zeros(T, H, L + R, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16),
        q_scale=torch.tensor([0.5]) if fp8 else None, kv_cache_scale=torch.tensor([0.25]) if fp8 else None,
    )  # fmt: skip


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def test_bf16_call_passes_the_views_in_k3s_order():
    bf16_op, fp8_op = Recorder(), Recorder()
    v, cos_sin = _views(fp8=False), torch.randn(64, R)
    call = peers.vllm_k3_decode_call((bf16_op, fp8_op), v, cos_sin)
    call()
    call()
    assert not fp8_op.calls and len(bf16_op.calls) == 2
    ql, q_pe, kv_c, k_pe, q_out, cache, slots, bs, pos, cs = bf16_op.calls[0]
    assert ql is v.ql_nope and q_pe is v.q_pe and kv_c is v.kv_c and q_out is v.q_out and cache is v.kv_cache
    assert slots is v.slot_mapping and pos is v.positions and cs is cos_sin and bs == BS
    assert k_pe.shape == (T, R) and k_pe.data_ptr() == v.k_pe.data_ptr()  # a view, not a copy


def test_fp8_call_takes_typed_views_and_the_scales_reciprocals():
    bf16_op, fp8_op = Recorder(), Recorder()
    v = _views(fp8=True)
    peers.vllm_k3_decode_call((bf16_op, fp8_op), v, torch.randn(64, R))()
    assert not bf16_op.calls
    ql, q_pe, kv_c, k_pe, q_out, cache, slots, q_inv, c_inv, bs, pos, cs = fp8_op.calls[0]
    assert cache.dtype == torch.float8_e4m3fn and cache.data_ptr() == v.kv_cache.data_ptr()
    assert q_out.dtype == torch.float8_e4m3fn and q_out.data_ptr() == v.q_out.data_ptr()
    assert q_inv.shape == (1,) and float(q_inv) == 2.0 and float(c_inv) == 4.0 and bs == BS


def _row(impl, cache, H, T, us):
    return {"status": "ok", "section": "sweep", "op": "decode", "impl": impl, "cache": cache, "H": H, "T": T,
            "block_size": 64, "us": us, "bw_term_us": 0.1, "efficiency": 0.5}  # fmt: skip


@pytest.mark.parametrize("k3_fp8_us, status", [(4.0, "met"), (3.9, "NOT MET")])
def test_op2_against_k3_target_is_never_slower_at_any_shape(k3_fp8_us, status):
    results = [_row("triton", "bf16", 16, 256, 5.0), _row("vllm_k3", "bf16", 16, 256, 5.5),
               _row("triton", "fp8", 16, 256, 4.0), _row("vllm_k3", "fp8", 16, 256, k3_fp8_us),
               _row("triton", "fp8", 128, 16, 3.0)]  # no K3 row: not part of the comparison  # fmt: skip
    target = {t["id"]: t for t in bench.issue10_targets(results, launch_us=1.0, smoke=False)}["decode_vs_k3_same_run"]
    assert target["status"] == status
    assert f"slower at {0 if status == 'met' else 1} of 2" in target["detail"]
    assert "bf16 1.100x" in target["detail"]


def test_op2_against_k3_target_not_measured_without_k3_rows():
    results = [_row("triton", "bf16", 16, 256, 5.0)]
    target = {t["id"]: t for t in bench.issue10_targets(results, launch_us=1.0, smoke=False)}["decode_vs_k3_same_run"]
    assert target["status"] == "not measured"
