"""A mixed step's prefill-key sequence, eager, as vLLM 0.33's ``forward_mha`` runs it (issue 40).

Per layer, with the plugin's ops bound as the plugin binds them (``BoundOps``, the early-index-loads
promise) and a step of ``decodes`` decode rows followed by ``seqs`` prompts of ``prompt_len``:

- ``fused``: the ``kv_b_proj`` GEMM, op 3 (``key_start`` = the decode rows: they get op 1's work in
  the same launch) building the key, then causal attention per prompt;
- ``op1+concat``: op 1 over every row before the GEMM, then vLLM's key concat (two copies into a
  fresh key), then the same attention (``VLLM_MLA_FUSION_PREFILL_KEY`` unset).

Attention is torch's SDPA (v padded to the key's width, as vLLM pads it for FlashAttention), not
vLLM's varlen kernel; ``layers`` such layers make a step. Each variant runs with programmatic
dependent launch on and off (``VLLM_MLA_FUSION_PDL``, read when an op is bound). Reported per step:
wall time (launch to sync), GPU time between events, and the host time to enqueue it; and each
key op alone, back to back. Eager, so host-bound shapes read the host's speed: compare variants
only within one run.

    python -m benchmarks.kernels.prefill_key_sequence --out /tmp/pks          # a GPU
    python -m benchmarks.kernels.prefill_key_sequence --smoke --out /tmp/pks  # CPU: the code paths only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.provenance import source_facts
from vllm_mla_fusion.backends import triton as triton_backend
from vllm_mla_fusion.binding import BoundOps
from vllm_mla_fusion.opcodes import OP_PREFILL, OP_ROPE_CACHE

H, L, R, P, V = 16, 512, 64, 128, 128  # DeepSeek-V3 at TP8: heads, latent, rope, nope, value widths
Q_LORA = 1536  # kv_c and k_pe are column slices of the fused q/kv down-projection's output, as in vLLM
MAX_POS, BLOCK = 8192, 64


@contextlib.contextmanager
def _pdl(on: bool):
    """``VLLM_MLA_FUSION_PDL`` as ``on`` says while the block runs: the Triton backend reads it when
    a launch is bound (an op's first call), through a per-process cache that is cleared here."""
    saved = os.environ.get("VLLM_MLA_FUSION_PDL")
    os.environ["VLLM_MLA_FUSION_PDL"] = "1" if on else "0"
    triton_backend._pdl_ok.cache_clear()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("VLLM_MLA_FUSION_PDL")
        else:
            os.environ["VLLM_MLA_FUSION_PDL"] = saved
        triton_backend._pdl_ok.cache_clear()


def _bound_key_ops(backend: str):
    """(op 3, op 1) bound as the plugin binds them (the early-index-loads promise); each binds its
    launch on its first call."""
    ops = BoundOps(backend, False, early_index_loads=True)
    return ops.get(OP_PREFILL, "auto", False), ops.get(OP_ROPE_CACHE, "auto", False)


def _launched_with_pdl(op) -> list:
    """Whether each launch ``op`` has bound uses programmatic dependent launch (Triton's sites)."""
    return [getattr(site, "pdl", None) for site, _ in op.sites.values()]


def _step_tensors(decodes: int, seqs: int, prompt_len: int, layers: int, device, gen) -> dict:
    T = decodes + seqs * prompt_len
    num_blocks = T * layers // BLOCK + 64
    kv_lora = torch.randn(T, Q_LORA + L + R, device=device, generator=gen).to(torch.bfloat16)
    inv = 1.0 / (10000 ** (torch.arange(0, R, 2, device=device, dtype=torch.float32) / R))
    freqs = torch.outer(torch.arange(MAX_POS, device=device, dtype=torch.float32), inv)
    return dict(
        q=torch.randn(T, H, P + R, device=device, generator=gen).to(torch.bfloat16),
        kv_c=kv_lora[:, Q_LORA:Q_LORA + L],
        k_pe=kv_lora[:, Q_LORA + L:].unsqueeze(1),
        positions=torch.randint(0, MAX_POS, (T,), device=device, generator=gen),
        slots=torch.randperm(num_blocks * BLOCK, device=device, generator=gen)[:T].contiguous(),
        cache=torch.randn(num_blocks, BLOCK, L + R, device=device, generator=gen).to(torch.bfloat16),
        cos_sin=torch.cat([freqs.cos(), freqs.sin()], -1).to(torch.bfloat16),
        w_kv_b=(torch.randn(L, H * (P + V), device=device, generator=gen) * 0.05).to(torch.bfloat16),
        scale=torch.ones((), device=device, dtype=torch.float32),
    )


def _layers(x: dict, decodes: int, seqs: int, prompt_len: int, op3, op1):
    """The two variants of one layer's prefill-key sequence, as callables."""
    Tp = seqs * prompt_len
    q_pe = x["q"][..., P:]
    index = (x["positions"], q_pe, x["k_pe"], x["kv_c"], x["cos_sin"], x["slots"], x["cache"], x["scale"])

    def attention(k, v):
        rows = lambda t: t.reshape(seqs, prompt_len, H, P + R).transpose(1, 2)  # noqa: E731
        return F.scaled_dot_product_attention(rows(x["q"][decodes:]), rows(k), rows(F.pad(v, (0, P + R - V))),
                                              is_causal=True)  # fmt: skip

    def kv_b_proj():
        return (x["kv_c"][decodes:] @ x["w_kv_b"]).view(Tp, H, P + V).split([P, V], -1)

    def fused():
        k_nope, v = kv_b_proj()
        k = torch.empty(Tp, H, P + R, dtype=k_nope.dtype, device=k_nope.device)
        op3(*index, k_nope, k, None, decodes)
        return attention(k, v)

    def op1_concat():
        op1(*index)
        k_nope, v = kv_b_proj()
        k = torch.empty(Tp, H, P + R, dtype=k_nope.dtype, device=k_nope.device)
        k[..., :P] = k_nope
        k[..., P:] = x["k_pe"][decodes:]
        return attention(k, v)

    def op3_alone():
        op3(*index, key_nope, key_out, None, decodes)

    key_nope = kv_b_proj()[0]
    key_out = torch.empty(Tp, H, P + R, dtype=key_nope.dtype, device=key_nope.device)
    return {"fused": fused, "op1+concat": op1_concat}, {"op 3": op3_alone, "op 1": lambda: op1(*index)}


def check_variants_agree(x: dict, decodes: int, seqs: int, prompt_len: int, op3, op1) -> float:
    """Run each variant once on its own copy of the step's tensors; raise unless their attention
    outputs and caches agree. Returns the largest output difference."""
    results = []
    for name in ("fused", "op1+concat"):
        mine = dict(x, q=x["q"].clone(), cache=x["cache"].clone())
        kv_lora = torch.empty(x["kv_c"].shape[0], Q_LORA + L + R, dtype=x["kv_c"].dtype, device=x["kv_c"].device)
        kv_lora[:, Q_LORA:Q_LORA + L], kv_lora[:, Q_LORA + L:] = x["kv_c"], x["k_pe"][:, 0]
        mine["kv_c"], mine["k_pe"] = kv_lora[:, Q_LORA:Q_LORA + L], kv_lora[:, Q_LORA + L:].unsqueeze(1)
        out = _layers(mine, decodes, seqs, prompt_len, op3, op1)[0][name]()
        results.append((out.float(), mine["cache"].float()))
    (out_a, cache_a), (out_b, cache_b) = results
    if not torch.equal(cache_a, cache_b):
        raise AssertionError("the two variants wrote different cache rows")
    diff = (out_a - out_b).abs().max().item()
    if diff > 1e-2 * out_b.abs().max().item():
        raise AssertionError(f"the two variants' attention outputs differ by {diff}")
    return diff


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_step(layer, layers: int, steps: int, device) -> dict:
    """Median over ``steps`` of one step (``layers`` calls of ``layer``): wall, GPU (events), host enqueue."""
    for _ in range(2):
        for _ in range(layers):
            layer()
    _sync(device)
    wall, gpu, host = [], [], []
    for _ in range(steps):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else None
        t0 = time.perf_counter()
        if events:
            events[0].record()
        for _ in range(layers):
            layer()
        if events:
            events[1].record()
        host.append((time.perf_counter() - t0) * 1e3)
        _sync(device)
        wall.append((time.perf_counter() - t0) * 1e3)
        if events:
            gpu.append(events[0].elapsed_time(events[1]))
    med = lambda v: round(statistics.median(v), 3) if v else None  # noqa: E731
    return {"wall_ms": med(wall), "wall_min_ms": round(min(wall), 3), "wall_max_ms": round(max(wall), 3),
            "gpu_ms": med(gpu), "host_enqueue_ms": med(host)}  # fmt: skip


def _time_alone(call, n: int, device) -> float:
    """Microseconds per call, ``n`` back-to-back calls (events on a GPU, wall time on a CPU)."""
    for _ in range(3):
        call()
    _sync(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        return round((time.perf_counter() - t0) / n * 1e6, 1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        call()
    end.record()
    _sync(device)
    return round(start.elapsed_time(end) / n * 1e3, 1)


def run(args) -> dict:
    device = torch.device("cpu" if args.smoke else "cuda")
    backend = "torch" if args.smoke else "triton"
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = [(4, 2, 16)] if args.smoke else [(args.decodes, s, args.prompt_len) for s in args.seqs]
    rows = []
    for decodes, seqs, prompt_len in shapes:
        x = _step_tensors(decodes, seqs, prompt_len, args.layers, device, gen)
        for pdl in (True, False):
            with _pdl(pdl):
                ops = _bound_key_ops(backend)
                diff = check_variants_agree(x, decodes, seqs, prompt_len, *ops)  # binds the launches
                variants, alone = _layers(x, decodes, seqs, prompt_len, *ops)
                row = {"decodes": decodes, "prompts": seqs, "prompt_len": prompt_len, "pdl": pdl,
                       "launched_with_pdl": _launched_with_pdl(ops[0]) + _launched_with_pdl(ops[1]),
                       "max_output_difference": diff}
                for name, layer in variants.items():
                    row[name] = _time_step(layer, args.layers, args.steps, device)
                for name, call in alone.items():
                    row[f"{name} alone us"] = _time_alone(call, args.calls, device)
            rows.append(row)
            print(json.dumps(row), flush=True)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           **source_facts()}
    return {"environment": env, "config": {k: v for k, v in vars(args).items() if k != "out"},
            "results": rows}  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="writes prefill_key_sequence.json there")
    ap.add_argument("--smoke", action="store_true", help="CPU, the torch backend, one tiny shape: code paths only")
    ap.add_argument("--layers", type=int, default=61, help="layers per step (DeepSeek-V3: 61)")
    ap.add_argument("--decodes", type=int, default=32, help="decode rows before the prompts")
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 2, 8], help="prompts per step")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=15, help="timed steps per variant")
    ap.add_argument("--calls", type=int, default=200, help="back-to-back calls of a key op alone")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.steps, args.calls = 2, 2, 2
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill_key_sequence.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
