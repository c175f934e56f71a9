"""Launches of the kernel at the shapes whose efficiency targets are missed, for Nsight Compute.

Each shape runs twice in vLLM's layouts (q_pe a view of q, k_pe a view of the kv_a
projection, k_nope a view of kv_b's output, random positions and a shuffled slot mapping):
the first launch compiles, the second is the one to read. Run under ncu, which replays
every launch of the kernel it is told to profile:

    ncu --clock-control none -k regex:_mla_rope_cache_kernel --launch-skip-before-match 0 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section WarpStateStats --section LaunchStats python3 -m benchmarks.kernels.ncu_shapes

(scripts/gpu_check.sh ncu does this and keeps the report.) Prints the order of the launches,
so that the report's kernels can be matched to shapes.
"""

from __future__ import annotations

import sys

import torch

import vllm_mla_fusion as mla

L, R, P, V, MAX_POS, BLOCK = 512, 64, 128, 128, 163840, 64
# (op, heads, tokens): issue 10's missed targets.
SHAPES = [("prefill", 128, 4096), ("prefill", 16, 16384), ("rope_cache", 128, 4096), ("rope_cache", 16, 16384),
          ("decode", 128, 16), ("decode", 128, 256)]  # fmt: skip


def launch(op: str, H: int, T: int, gen: torch.Generator) -> None:
    dev = torch.device("cuda")
    bf = dict(dtype=torch.bfloat16, device=dev)
    q = torch.randn(T, H, P + R, **bf)
    kv_a = torch.randn(T, 1536 + L + R, **bf)  # fused q_a / kv_a projection output, as vLLM's
    k_pe = kv_a[:, 1536 + L :].unsqueeze(1)
    kv_c = torch.randn(T, L, **bf)
    cs = torch.randn(MAX_POS, R, device=dev)
    pos = torch.randint(0, MAX_POS, (T,), generator=gen).to(dev)
    num_blocks = (T + BLOCK - 1) // BLOCK + 4
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:T].to(dev)
    cache = torch.empty(num_blocks, BLOCK, L + R, **bf)
    if op == "rope_cache":
        mla.mla_rope_cache_write(pos, q[..., P:], k_pe, kv_c, cs, False, slots, cache)
    elif op == "prefill":
        k_nope = torch.randn(T, H, P + V, **bf)[..., :P]
        k_out = torch.empty(T, H, P + R, **bf)
        mla.mla_prefill_rope_cache_write(pos, q[..., P:], k_pe, kv_c, k_nope, cs, False, slots, cache, k_out)
    else:
        ql_nope = torch.randn(T, H, L, **bf)
        q_out = torch.empty(T, H, L + R, **bf)
        mla.mla_decode_rope_cache_write(pos, ql_nope, q[..., P:], k_pe, kv_c, cs, False, slots, cache, q_out)


def main() -> int:
    gen = torch.Generator().manual_seed(0)
    n = 0
    for op, H, T in SHAPES:
        for run in ("compile", "measure"):
            launch(op, H, T, gen)
            torch.cuda.synchronize()
            print(f"launch {n}: {op} H={H} T={T} ({run})", flush=True)
            n += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
