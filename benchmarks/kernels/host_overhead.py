"""Host time per call of the ops, where nothing captures them (eager vLLM, piecewise-graph steps).

Inside a CUDA graph a call costs only its GPU time; outside one, vLLM's
attention op runs its Python each step, per layer, and the host time of the
fused ops adds up over 61 layers. This script issues many back-to-back calls
of one-token shapes (GPU work far below the host cost) and reports the time to
issue them per call (the GPU synchronized outside the timed span; rows take turns
each round; median and range over the rounds), for:

- ``public``: ``vllm_mla_fusion.mla_*`` (the torch.library custom op, what a
  user calls);
- ``eager``: ``vllm_mla_fusion.ops.eager.*`` (the op's body without the
  dispatcher, what the vLLM plugin calls inside its attention op);
- ``validate``: the argument checks alone;
- ``bound op (plugin)``: a ``binding.BoundOp`` call, what a fused vLLM layer makes per step;
- ``backend``: the Triton backend's bound launch alone (``CompiledKernel[grid]``), the same
  launch through ``CompiledKernel.run`` by position, and through Triton's own
  ``kernel[grid](...)`` path; and the bound launch when its plan must be built first (a token
  count the site has not seen: once per step for all of a model's fused layers, which share
  their sites, where it was once per layer before 2026-12-06);
- vLLM's ``concat_and_cache_mla_rope_fused`` and ``concat_and_cache_mla`` C++
  ops when vLLM is importable, a trivial Triton kernel and ``x.add_(1)``.

    python3 -m benchmarks.kernels.host_overhead --out /tmp/host      # ~20 s on an H200 host
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

import vllm_mla_fusion as mla
from vllm_mla_fusion import validation
from vllm_mla_fusion.backends import triton as tb
from vllm_mla_fusion.binding import BoundOp
from vllm_mla_fusion.opcodes import OP_DECODE, OP_PREFILL
from vllm_mla_fusion.ops import eager

L, R, P, V, MAX_POS = 512, 64, 128, 128, 163840


@triton.jit
def _trivial(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1)


def per_call_us(rows: dict, n: int, rounds: int) -> dict:
    """Host time per call of each row: the median, min and max over ``rounds`` rounds of the
    time to *issue* ``n`` back-to-back calls (the GPU is synchronized after each row, outside
    the timed span, so a row never waits on a full launch queue or on another row's kernels).

    The rows take turns within each round, so a drift of the host's speed over the run (clock,
    another tenant) spreads over all rows instead of landing on the ones measured last."""
    times: dict[str, list] = {name: [] for name in rows}
    for fn in rows.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in rows.items():
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times[name].append((time.perf_counter() - t0) / n * 1e6)
            torch.cuda.synchronize()
    return {name: {"median": statistics.median(v), "min": min(v), "max": max(v)} for name, v in times.items()}


def _raw_run(site, T: int, tensors: tuple):
    """The same launch as ``site``'s, through ``CompiledKernel.run`` (the launcher object a
    compiled kernel holds, called by position as Triton's own JIT path calls it) instead of
    ``CompiledKernel[grid]``: the two ways of launching a compiled kernel, compared."""
    site(T, *tensors)  # compile and keep the kernel
    plan = site.plan(T)
    kernel = site.kernels[plan.values]
    pos, q_pe, k_pe, kv_c, cs, slots, cache, kv_scale, nope, out, out_scale = tensors
    args = site.arguments(T, cache.shape[0] * cache.shape[1], plan.n_cache, 0, pos.data_ptr(), slots.data_ptr(),
                          cs.data_ptr(), q_pe.data_ptr(), k_pe.data_ptr(), kv_c.data_ptr(), cache.data_ptr(),
                          cs.data_ptr(), nope.data_ptr(), out.data_ptr(), cs.data_ptr()) + plan.values  # fmt: skip
    stream = torch.cuda.current_stream().cuda_stream

    def call():
        kernel.run(plan.grid, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *args)

    return call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--calls", type=int, default=200, help="calls per row and round (fewer than the launch queue holds)")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    H, T = args.heads, 1
    bf = dict(dtype=torch.bfloat16, device=dev)
    q = torch.randn(T, H, P + R, **bf)
    kv_a = torch.randn(T, 1536 + L + R, **bf)
    k_pe, kv_c = kv_a[:, 1536 + L :], torch.randn(T, L, **bf)
    q_pe = q[..., P:]
    cs = torch.randn(MAX_POS, R, device=dev)
    pos = torch.zeros(T, dtype=torch.int64, device=dev)
    slots = torch.zeros(T, dtype=torch.int64, device=dev)
    cache = torch.zeros(64, 64, L + R, **bf)
    ql_nope = torch.randn(T, H, L, **bf)
    q_out = torch.empty(T, H, L + R, **bf)
    k_nope = torch.randn(T, H, P + V, **bf)[..., :P]
    k_out = torch.empty(T, H, P + R, **bf)
    scale = torch.ones(1, device=dev)
    dec = (pos, ql_nope, q_pe, k_pe, kv_c, cs, False, slots, cache, q_out, "auto", None, None)
    pre = (pos, q_pe, k_pe, kv_c, k_nope, cs, False, slots, cache, k_out, "auto", None)
    p_dec = validation.check_decode_rope_cache_write(*dec, True)
    p_pre = validation.check_prefill_rope_cache_write(*pre)
    dec_t = (pos, q_pe, k_pe, kv_c, cs, slots, cache, None, ql_nope, q_out, None)
    pre_t = (pos, q_pe, k_pe, kv_c, cs, slots, cache, None, k_nope, k_out, None)
    # What a fused vLLM layer calls per step: its BoundOp (layout validated once), and below it
    # the Triton backend's bound launch alone.
    dec_op = BoundOp(OP_DECODE, is_neox=False, backend="triton")
    pre_op = BoundOp(OP_PREFILL, is_neox=False, backend="triton")
    dec_site = tb.bind(p_dec, OP_DECODE, False, True, *dec_t)
    pre_site = tb.bind(p_pre, OP_PREFILL, False, True, *pre_t)
    rows = {
        "decode public": lambda: mla.mla_decode_rope_cache_write(*dec),
        "decode eager": lambda: eager.mla_decode_rope_cache_write(*dec, True),
        "decode bound op (plugin)": lambda: dec_op(*dec_t),
        "decode validate": lambda: validation.check_decode_rope_cache_write(*dec, True),
        "decode backend": lambda: dec_site(T, *dec_t),
        "decode backend, CompiledKernel.run": _raw_run(dec_site, T, dec_t),
        "decode backend, Triton's launch path": lambda: dec_site._launch_through_triton(
            dec_site.plan(T), T, cache.shape[0] * cache.shape[1], 0, *dec_t),
        "prefill public": lambda: mla.mla_prefill_rope_cache_write(*pre),
        "prefill eager": lambda: eager.mla_prefill_rope_cache_write(*pre),
        "prefill bound op (plugin)": lambda: pre_op(*pre_t),
        "prefill backend": lambda: pre_site(T, *pre_t),
        "prefill backend, CompiledKernel.run": _raw_run(pre_site, T, pre_t),
        "prefill backend, plan built first": lambda: (pre_site.plans.clear(), pre_site(T, *pre_t)),
        "prefill backend, Triton's launch path": lambda: pre_site._launch_through_triton(
            pre_site.plan(T), T, cache.shape[0] * cache.shape[1], 0, *pre_t),
        "trivial triton kernel": lambda: _trivial[(1,)](scale),
        "torch x.add_(1)": lambda: scale.add_(1),
    }
    try:
        from vllm import _custom_ops as ops

        cs_bf = cs.to(torch.bfloat16)
        rows["vllm concat_and_cache_mla_rope_fused"] = lambda: ops.concat_and_cache_mla_rope_fused(
            pos, q_pe, k_pe, kv_c, cs_bf, False, slots, cache, "auto", scale
        )
        rows["vllm concat_and_cache_mla"] = lambda: ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, "auto", scale)
    except Exception as e:  # noqa: BLE001 - vLLM is optional here
        print(f"vLLM ops not measured: {type(e).__name__}: {e}")
    for name, fn in list(rows.items()):  # a row that cannot run is reported, not timed
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            rows.pop(name)
            print(f"{name:40s} failed: {type(e).__name__}: {e}")
    torch.cuda.synchronize()
    stats = per_call_us(rows, args.calls, args.rounds)
    result = {"heads": H, "tokens": T, "calls": args.calls, "rounds": args.rounds, "torch": torch.__version__,
              "triton": triton.__version__, "us_per_call": {k: v["median"] for k, v in stats.items()},
              "us_per_call_range": {k: [v["min"], v["max"]] for k, v in stats.items()}}  # fmt: skip
    for name, v in stats.items():
        print(f"{name:40s} {v['median']:7.2f} us  [{v['min']:.2f}-{v['max']:.2f}]", flush=True)
    (args.out / "host_overhead.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
