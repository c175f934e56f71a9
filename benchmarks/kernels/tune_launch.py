"""Coordinate search over the Triton kernel's launch configuration, per shape class.

Not part of the regular benchmark: it informs the heuristic in
``vllm_mla_fusion/backends/triton.py::_launch_config`` (docs/performance-history.md
records what it found). For each shape it starts from the current heuristic and
varies one knob at a time (rows per query program, tokens per cache program,
warps, programmatic dependent launch), timing each variant as a CUDA graph of
back-to-back calls on rotated inputs (benchmarks/kernels/timing.py).

    python -m benchmarks.kernels.tune_launch --out /tmp/tune            # H200: ~3 minutes
    python -m benchmarks.kernels.tune_launch --focus --out /tmp/tune    # issue 10's shapes only (~1 minute)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import vllm_mla_fusion as mla
from vllm_mla_fusion.backends import triton as tb

from . import timing

L, R, NOPE, MAX_POS = 512, 64, 128, 163840
SHAPES = [  # (op, H, T, fp8)
    *[("prefill", H, T, False) for H in (16, 128) for T in (1, 16, 256, 4096, 16384)],
    *[("decode", H, T, False) for H in (16, 128) for T in (1, 16, 64, 256, 4096)],
    ("decode", 128, 4096, True),
    ("decode", 16, 4096, True),
    ("prefill", 16, 4096, True),
    *[("epilogue", H, T, False) for H in (16, 128) for T in (1, 64, 1024, 4096, 16384)],
]
# Issue 10's shapes: op 3 where it is bandwidth-bound, op 1 at large T, two decode shapes.
FOCUS = [("epilogue", H, T, False) for H in (16, 128) for T in (1024, 4096, 16384)] + [
    ("prefill", 16, 16384, False), ("prefill", 128, 4096, False), ("decode", 128, 16, False),
    ("decode", 128, 256, False),
]  # fmt: skip
OPS = {"prefill": tb.OP_ROPE_CACHE.value, "decode": tb.OP_DECODE.value, "epilogue": tb.OP_PREFILL.value}


def triton_next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def make_sets(op, H, T, fp8, n_sets, device):
    sets = []
    for _ in range(n_sets):
        q = torch.randn(T, H, NOPE + R, device=device, dtype=torch.bfloat16)
        kv_a = torch.randn(T, L + R, device=device, dtype=torch.bfloat16)
        nb = T // 64 + 2
        s = dict(
            positions=torch.randint(0, MAX_POS, (T,), device=device),
            q_pe=q[..., NOPE:],
            k_pe=kv_a[:, L:],
            kv_c=torch.randn(T, L, device=device, dtype=torch.bfloat16),
            slot_mapping=torch.randperm(nb * 64, device=device)[:T],
            kv_cache=torch.zeros(nb, 64, L + R, device=device, dtype=torch.uint8 if fp8 else torch.bfloat16),
        )
        if op == "decode":
            s["ql_nope"] = torch.randn(H, T, L, device=device, dtype=torch.bfloat16).transpose(0, 1)
            s["q_out"] = torch.empty(T, H, L + R, device=device, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
        if op == "epilogue":
            s["k_nope"] = torch.randn(T, H, 2 * NOPE, device=device, dtype=torch.bfloat16)[..., :NOPE]
            s["k_out"] = torch.empty(T, H, NOPE + R, device=device, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
        sets.append(s)
    return sets


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--focus", action="store_true", help="issue 10's shapes only")
    ap.add_argument("--grid", action="store_true", help="also a small joint grid of (BLOCK_ROWS, BLOCK_H or BLOCK_T, "
                    "num_warps) for op 3 and op 1 at T >= 1024")  # fmt: skip
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    cs = torch.randn(MAX_POS, R, device=device)
    scale = torch.tensor([0.05], device=device)
    floor = timing.launch_floor(device)
    print(f"trivial kernel {floor}", flush=True)
    results = []
    for op, H, T, fp8 in FOCUS if args.focus else SHAPES:
        per_set = T * H * (L + R) * 4 + T * (L + R) * 4
        n_sets = int(max(2, min(32, 256e6 // max(per_set, 1))))
        sets = make_sets(op, H, T, fp8, n_sets, device)
        n_calls = max(n_sets, 40 if T <= 256 else 8)
        kvd = "fp8" if fp8 else "auto"

        def call(i, op=op, sets=sets, kvd=kvd, fp8=fp8):
            s = sets[i % len(sets)]
            if op == "prefill":
                mla.mla_rope_cache_write(s["positions"], s["q_pe"], s["k_pe"], s["kv_c"], cs, False, s["slot_mapping"],
                                         s["kv_cache"], kvd, scale if fp8 else None, backend="triton")  # fmt: skip
            elif op == "epilogue":
                mla.mla_prefill_rope_cache_write(s["positions"], s["q_pe"], s["k_pe"], s["kv_c"], s["k_nope"], cs,
                                                 False, s["slot_mapping"], s["kv_cache"], s["k_out"], kvd,
                                                 scale if fp8 else None, backend="triton")  # fmt: skip
            else:
                mla.mla_decode_rope_cache_write(s["positions"], s["ql_nope"], s["q_pe"], s["k_pe"], s["kv_c"], cs,
                                                False, s["slot_mapping"], s["kv_cache"], s["q_out"], kvd,
                                                scale if fp8 else None, scale if fp8 else None,
                                                backend="triton")  # fmt: skip

        p = tb.Problem(T, H, L, R, torch.uint8 if fp8 else torch.bfloat16, nope_dim=NOPE)
        tb.LAUNCH_CONFIG_OVERRIDE = None
        base = tb._launch_config(p, OPS[op], device)

        def measure(cfg):
            tb.LAUNCH_CONFIG_OVERRIDE = cfg
            try:
                return timing.cuda_graph_time(call, n_calls, 9, device).us
            except Exception as e:  # a config that does not compile or launch is just skipped
                print(f"   config {cfg} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                return float("inf")
            finally:
                tb.LAUNCH_CONFIG_OVERRIDE = None

        best, best_us = dict(base), measure(base)
        tried = [(dict(base), best_us)]
        row_elems = {"decode": L + R, "prefill": R, "epilogue": NOPE + R}[op]
        rows = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b * row_elems <= 32768]
        knobs = [("BLOCK_ROWS", rows), ("BLOCK_T", [1, 2, 4, 8, 16, 32]), ("num_warps", [1, 2, 4, 8]),
                 ("USE_PDL", [False, True]), ("BLOCK_ROWS", rows)]  # fmt: skip
        if op == "epilogue":
            knobs.insert(2, ("BLOCK_H", [b for b in (8, 16, 32, 64, 128) if b <= triton_next_pow2(H)]))
        for knob, values in knobs:
            for v in values:
                if v == best[knob]:
                    continue
                cfg = dict(best, **{knob: v})
                us = measure(cfg)
                tried.append((cfg, us))
                if us < best_us * 0.98:
                    best, best_us = cfg, us
        if args.grid and op in ("epilogue", "prefill") and T >= 1024:
            # The knobs interact through registers (occupancy): a small joint grid around the best.
            second = ("BLOCK_H", (16, 32, 64)) if op == "epilogue" else ("BLOCK_T", (2, 4, 8))
            for br in ((8, 16, 32) if op == "epilogue" else (16, 32, 64)):
                for v in second[1]:
                    for nw in (4, 8):
                        cfg = dict(best, BLOCK_ROWS=br, num_warps=nw, **{second[0]: v})
                        if op == "epilogue":
                            cfg["BLOCK_H"] = min(v, triton_next_pow2(H))
                        if any(c == cfg for c, _ in tried):
                            continue
                        us = measure(cfg)
                        tried.append((cfg, us))
                        if us < best_us * 0.98:
                            best, best_us = cfg, us
        base_us = tried[0][1]
        print(f"{op:8s} H={H:4d} T={T:6d} {'fp8 ' if fp8 else 'bf16'} heuristic {base_us:8.2f} us {base}  "
              f"best {best_us:8.2f} us {best}", flush=True)
        results.append(dict(op=op, H=H, T=T, fp8=fp8, heuristic=base, heuristic_us=base_us, best=best,
                            best_us=best_us, tried=[dict(cfg=c, us=u) for c, u in tried]))  # fmt: skip
        del sets
        torch.cuda.empty_cache()
    (args.out / "tune_launch.json").write_text(json.dumps(dict(floor=floor, results=results), indent=1))


if __name__ == "__main__":
    main()
