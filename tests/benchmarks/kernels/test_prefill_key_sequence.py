"""The prefill-key sequence benchmark (issue 40): its CPU smoke run writes every row it promises,
and its pre-timing check fails when the two variants disagree."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.kernels import prefill_key_sequence as pks


def test_smoke_run_writes_both_variants_with_and_without_pdl(tmp_path):
    pks.main(["--smoke", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "prefill_key_sequence.json").read_text())
    rows = report["results"]
    assert [r["pdl"] for r in rows] == [True, False]
    for row in rows:
        assert row["max_output_difference"] == 0.0
        for variant in ("fused", "op1+concat"):
            assert row[variant]["wall_ms"] > 0 and row[variant]["host_enqueue_ms"] > 0
        assert row["op 3 alone us"] > 0 and row["op 1 alone us"] > 0
    assert report["environment"]["package_sha256"]


def test_the_check_fails_when_the_variants_disagree():
    gen = torch.Generator().manual_seed(1)
    x = pks._step_tensors(decodes=3, seqs=2, prompt_len=8, layers=1, device=torch.device("cpu"), gen=gen)
    op3, op1 = pks._bound_key_ops("torch")
    assert pks.check_variants_agree(x, 3, 2, 8, op3, op1) == 0.0

    def op1_without_the_cache_write(positions, q_pe, k_pe, kv_c, cos_sin, slots, cache, scale):
        op1(positions, q_pe, k_pe, kv_c, cos_sin, torch.full_like(slots, -1), cache, scale)

    with pytest.raises(AssertionError, match="cache rows"):
        pks.check_variants_agree(x, 3, 2, 8, op3, op1_without_the_cache_write)


def test_the_check_fails_when_the_attention_outputs_differ():
    gen = torch.Generator().manual_seed(2)
    x = pks._step_tensors(decodes=2, seqs=1, prompt_len=8, layers=1, device=torch.device("cpu"), gen=gen)
    op3, op1 = pks._bound_key_ops("torch")

    def op3_with_a_wrong_key(*args):
        op3(*args)
        args[9].mul_(-1)  # k_out: the key the attention reads

    with pytest.raises(AssertionError, match="attention outputs differ"):
        pks.check_variants_agree(x, 2, 1, 8, op3_with_a_wrong_key, op1)


def test_the_pdl_switch_reaches_the_backend_each_time(monkeypatch):
    """The Triton backend reads VLLM_MLA_FUSION_PDL through a per-process cache: each variant's
    setting must reach it (a GPU of compute capability 9.0 simulated)."""
    from vllm_mla_fusion.backends import triton as tb

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu = torch.device("cuda", 0)
    readings = []
    for on in (True, False, True):
        with pks._pdl(on):
            readings.append(tb._pdl_ok(gpu))
    assert readings == [True, False, True]
