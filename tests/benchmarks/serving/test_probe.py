"""benchmarks/serving/probe.py: greedy on vs off compared, decode-step GPU time, the redraw; against a fake server."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from benchmarks.serving import probe
from benchmarks.serving.server import Server, ServerSpec, confirm_side
from benchmarks.serving.sides import parse_side

FAKE = Path(__file__).with_name("fake_vllm_serve.py")


def outputs(tokens, logprobs=None):
    return {"tokens": tokens, "logprobs": logprobs or [[-0.5 - 0.1 * k for k in range(len(t))] for t in tokens]}


def test_equal_outputs_are_equal():
    on = outputs([[5, 9, 2], [7, 7, 8]])
    c = probe.compare(on, outputs([[5, 9, 2], [7, 7, 8]]))
    assert c["equal"] and c["tokens_equal"] and c["max_logprob_diff"] == 0.0 and c["degenerate"] is None
    assert [p["first_different_token"] for p in c["prompts"]] == [None, None]


def test_a_different_token_is_found_where_it_is():
    c = probe.compare(outputs([[5, 9, 2, 4], [7, 7, 8, 1]]), outputs([[5, 9, 2, 4], [7, 7, 3, 1]]))
    assert not c["equal"] and not c["tokens_equal"]
    assert [p["first_different_token"] for p in c["prompts"]] == [None, 2]


def test_a_logprob_that_differs_where_tokens_agree():
    on = outputs([[5, 9, 2]], [[-0.5, -0.6, -0.7]])
    off = outputs([[5, 9, 2]], [[-0.5, -0.6, -0.7 + 2e-3]])
    c = probe.compare(on, off)
    assert c["tokens_equal"] and not c["equal"] and c["max_logprob_diff"] == pytest.approx(2e-3)
    # After the first different token the logprobs describe different text: not compared.
    c = probe.compare(outputs([[5, 9, 2]], [[-0.5, -0.6, -0.7]]), outputs([[5, 3, 2]], [[-0.5, -0.6, -9.0]]))
    assert c["max_logprob_diff"] == 0.0 and c["prompts"][0]["first_different_token"] == 1


def test_a_shorter_output_differs():
    c = probe.compare(outputs([[5, 9, 2]]), outputs([[5, 9]]))
    assert not c["tokens_equal"] and c["prompts"][0]["first_different_token"] == 2
    with pytest.raises(ValueError):
        probe.compare(outputs([[5, 9, 2]]), outputs([[5, 9, 2], [1, 2, 3]]))


def test_degenerate_outputs_are_named():
    repeat = outputs([[4, 4, 4], [9, 9, 9]])
    assert "repeats one token" in probe.compare(repeat, repeat)["degenerate"]
    same = outputs([[4, 5, 6], [4, 5, 6]])
    assert "same output" in probe.compare(same, same)["degenerate"]
    summary = {"on vs off": probe.compare(repeat, repeat), "errors": []}
    assert any("repeats one token" in p for p in probe.problems(summary))


def test_a_vllm_completion_response_is_read():
    response = {"id": "cmpl-1", "choices": [{"index": 0, "text": "", "logprobs": {
        "text_offset": [0, 10], "token_logprobs": [-0.125, -2.5], "tokens": ["token_id:17", "token_id:129279"],
        "top_logprobs": [{"token_id:17": -0.125}, {"token_id:129279": -2.5}]}, "finish_reason": "length"}]}  # fmt: skip
    assert probe.parse_completion(response) == {"tokens": [17, 129279], "logprobs": [-0.125, -2.5]}
    body = probe.completion_body("m", [3, 4], 16)
    assert body["temperature"] == 0.0 and body["return_tokens_as_token_ids"] and body["ignore_eos"]


def test_decode_steps_at_the_full_batch():
    steps = [("prefill", 0, 900.0), ("decode", 16, 100.0), ("decode", 16, 110.0), ("decode", 16, 130.0),
             ("mixed", 15, 500.0), ("decode", 9, 60.0)]  # fmt: skip
    s = probe.summarize_steps(steps, "t.json")
    assert (s["batch"], s["steps_at_batch"], s["gpu_us_median"], s["gpu_us_min"], s["gpu_us_max"]) == (16, 3, 110.0, 100.0, 130.0)
    assert probe.summarize_steps([("prefill", 0, 9.0)], "t")["error"].startswith("no decode-only step")


def test_sides_compared_and_summarized():
    probes = {"on": {"greedy": outputs([[1, 2], [3, 4]]), "decode_profile": {"gpu_us_median": 990.0}},
              "off": {"greedy": outputs([[1, 2], [3, 4]]), "decode_profile": {"gpu_us_median": 1000.0}}}  # fmt: skip
    s = probe.compare_sides(probes)
    assert s["on vs off"]["equal"] and s["decode_gpu_ratio_vs_off"] == {"on": 0.99}
    assert probe.problems({**s, "errors": []}) == []
    text = probe.markdown(s)
    assert "on vs off: equal" in text and "990 us (0.9900 x off)" in text
    probes["on"]["greedy"] = outputs([[1, 2], [3, 5]])
    s = probe.compare_sides(probes)
    assert any("greedy outputs differ" in p for p in probe.problems({**s, "errors": []}))


def fake_server(tmp_path, side: str, ranks: int = 8) -> Server:
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = {"torch_profiler_dir": str(tmp_path / "traces")}
    spec = ServerSpec([sys.executable, str(FAKE)], str(tmp_path / "model"), "m",
                      ["--tensor-parallel-size", str(ranks), "--profiler-config", json.dumps(config)], str(tmp_path))  # fmt: skip
    env = parse_side(side).server_env(dict(os.environ))
    server = Server(spec, parse_side(side), env, tmp_path / f"{side}.log")
    server.wait_healthy(30)
    return server


@pytest.mark.parametrize("skew", [False, True])
def test_the_probe_against_a_fake_tp8_server_on_and_off(tmp_path, monkeypatch, skew):
    """Both sides of a fake TP8 server: every rank's line, the redraw on every rank, greedy compared, rank 0's trace."""
    if skew:
        monkeypatch.setenv("FAKE_SERVE_SKEW", "1")
    results = {}
    for side in ("on", "off"):
        server = fake_server(tmp_path / side, side)
        try:
            facts = confirm_side(parse_side(side), server.log(), ranks=8)
            if side == "on":
                assert facts["fused_by_rank"] == {r: "triton/decode" for r in range(8)}
            results[side] = probe.run(server.port, "m", 129280, probe.CPU_SHAPE, tmp_path / side / "traces", f"d-{side}")
        finally:
            server.stop(grace_s=5)
    on = results["on"]
    assert [r["tp_rank"] for r in on["redraw"]] == list(range(8))
    assert on["decode_profile"]["trace"].endswith("_rank0.1.pt.trace.json.gz")
    # Rank 0's kernels: 1000 us + the step index; three decode steps of batch 2 (steps 1, 2, 3).
    assert (on["decode_profile"]["steps_at_batch"], on["decode_profile"]["gpu_us_median"]) == (3, 1002.0)
    summary = probe.compare_sides(results)
    assert summary["on vs off"]["tokens_equal"]
    assert summary["on vs off"]["equal"] is (not skew)
    assert summary["on vs off"]["degenerate"] is None


def test_a_redraw_that_misses_a_rank_stops_the_probe(tmp_path, monkeypatch):
    server = fake_server(tmp_path, "on", ranks=2)
    try:
        monkeypatch.setattr(probe, "REDRAW_METHOD", "no_such_method")  # the fake answers 404: urllib raises
        with pytest.raises(OSError):
            probe.run(server.port, "m", 1000, probe.CPU_SHAPE, tmp_path / "traces", "d")
    finally:
        server.stop(grace_s=5)


@pytest.mark.vllm
def test_the_redraw_fills_fp8_blocks_and_seeds_by_rank(monkeypatch):
    """redraw() on a module tree shaped like vLLM's: fp8 weights N(0, 1), their block scales 1/sqrt(fan-in),
    replicated weights equal across ranks, sharded ones not; bf16 weights N(0, 1/fan_in)."""
    import torch

    class Linear(torch.nn.Module):
        def __init__(self, out_f, in_f, tp_size, tp_rank, fp8=True):
            super().__init__()
            self.tp_size, self.tp_rank = tp_size, tp_rank
            dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
            self.weight = torch.nn.Parameter(torch.zeros(out_f, in_f, dtype=dtype), requires_grad=False)
            if fp8:
                self.weight_scale_inv = torch.nn.Parameter(torch.zeros(out_f // 128, in_f // 128), requires_grad=False)

    class RoutedExperts(torch.nn.Module):  # vLLM's: its tensor-parallel rank in moe_config.moe_parallel_config
        def __init__(self, rank):
            super().__init__()
            parallel = type("P", (), {"tp_size": 8, "tp_rank": rank})()
            self.moe_config = type("C", (), {"moe_parallel_config": parallel})()
            self.w2_weight = torch.nn.Parameter(torch.zeros(4, 256, 128, dtype=torch.float8_e4m3fn), requires_grad=False)
            self.w2_weight_scale_inv = torch.nn.Parameter(torch.zeros(4, 2, 1), requires_grad=False)

    def model(rank):
        m = torch.nn.Module()
        m.q_b_proj = Linear(256, 512, tp_size=8, tp_rank=rank)
        m.kv_a_proj = Linear(256, 512, tp_size=1, tp_rank=0)  # replicated (disable_tp)
        m.lm_head = Linear(64, 256, tp_size=8, tp_rank=rank, fp8=False)
        m.experts = RoutedExperts(rank)
        return m

    r0, r1 = model(0), model(1)
    counts = probe.redraw(r0)
    probe.redraw(r1)
    assert counts == {"fp8_weights": 3, "block_scales": 3, "other": 1, "mla_layers": 0, "sharded": 3}
    assert torch.all(r0.experts.w2_weight_scale_inv == 128**-0.5)  # w2's fan-in: the expert's intermediate size
    assert not torch.equal(r0.experts.w2_weight.float(), r1.experts.w2_weight.float())
    assert torch.all(r0.q_b_proj.weight_scale_inv == 512**-0.5)
    w = r0.q_b_proj.weight.float()
    assert 0.9 < w.std() < 1.1 and abs(w.mean()) < 0.05
    assert torch.equal(r0.kv_a_proj.weight.float(), r1.kv_a_proj.weight.float())  # replicated: one draw
    assert not torch.equal(r0.q_b_proj.weight.float(), r1.q_b_proj.weight.float())  # shards differ
    assert 0.9 * 256**-0.5 < r0.lm_head.weight.float().std() < 1.1 * 256**-0.5
    # Drawn in slices (on a GPU: its free memory is small): every slice drawn, the same values every time.
    monkeypatch.setattr(probe, "CHUNK_ELEMENTS", 1000)
    again, other = model(0), model(0)
    probe.redraw(again)
    probe.redraw(other)
    assert torch.equal(again.q_b_proj.weight.float(), other.q_b_proj.weight.float())
    assert (again.q_b_proj.weight.float() != 0).float().mean() > 0.99
    assert 0.9 < again.q_b_proj.weight.float()[-2:].std() < 1.1  # the last slice too
