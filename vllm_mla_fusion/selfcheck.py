"""Self-check and demo: ``python -m vllm_mla_fusion.selfcheck``.

Runs both ops on every backend available on this machine at DeepSeek-V3 shapes
(kv_lora_rank 512, rope dim 64, TP8 and TP1 head counts), compares each with
the torch reference backend, and prints a small timing table. On a CPU-only
machine the Triton kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``),
which checks it but is slow: those timings say nothing about GPU speed (the
benchmark in ``benchmarks/`` does).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from . import available_backends, mla_decode_rope_cache_write, mla_rope_cache_write

L, R = 512, 64


def _inputs(T: int, H: int, device: torch.device, fp8: bool, seed: int) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    block_size = 64
    num_blocks = T // block_size + 2
    q = randn(T, H, 128 + R)
    kv_a = randn(T, L + R)
    angles = torch.rand(4096, R // 2, generator=gen) * 6.28
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[::5] = -1  # padding
    cache_dtype = torch.uint8 if fp8 else torch.bfloat16
    return dict(
        positions=torch.randint(0, 4096, (T,), generator=gen).to(device),
        q_pe=q[..., 128:],  # strided, as vLLM hands it over
        k_pe=kv_a[:, L:],
        kv_c=randn(T, L),
        cos_sin_cache=torch.cat((angles.cos(), angles.sin()), -1).to(device),
        is_neox=False,
        slot_mapping=slots.to(device),
        kv_cache=torch.zeros(num_blocks, block_size, L + R, dtype=cache_dtype, device=device),
        kv_cache_dtype="fp8" if fp8 else "auto",
        kv_cache_scale=torch.tensor([0.5], device=device) if fp8 else None,
        ql_nope=randn(T, H, L),
        q_out=torch.empty(T, H, L + R, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=device),
        q_scale=torch.tensor([0.25], device=device) if fp8 else None,
    )


def _call(op: str, x: dict, backend: str) -> None:
    if op == "rope_cache_write":
        mla_rope_cache_write(x["positions"], x["q_pe"], x["k_pe"], x["kv_c"], x["cos_sin_cache"], x["is_neox"],
                             x["slot_mapping"], x["kv_cache"], x["kv_cache_dtype"], x["kv_cache_scale"],
                             backend=backend)  # fmt: skip
    else:
        mla_decode_rope_cache_write(x["positions"], x["ql_nope"], x["q_pe"], x["k_pe"], x["kv_c"],
                                    x["cos_sin_cache"], x["is_neox"], x["slot_mapping"], x["kv_cache"], x["q_out"],
                                    x["kv_cache_dtype"], x["kv_cache_scale"], x["q_scale"], backend=backend)  # fmt: skip


def _outputs(op: str, x: dict) -> dict:
    names = ("q_pe", "k_pe", "kv_cache") if op == "rope_cache_write" else ("q_out", "kv_cache")
    return {n: x[n] for n in names}


def _max_error(a: torch.Tensor, b: torch.Tensor, fp8: bool) -> float:
    if a.dtype == torch.uint8:
        a, b = a.view(torch.float8_e4m3fn), b.view(torch.float8_e4m3fn)
    a, b = a.double(), b.double()
    # Relative to the value's magnitude: one bf16 rounding is ~4e-3, one fp8 e4m3 rounding ~6e-2.
    return float(((a - b).abs() / (b.abs() + 1e-3)).max())


def _time(fn, device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per case (median reported)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    backends = [b for b in available_backends(device) if b != "aiter" or device.type == "cuda"]
    on_cpu = device.type == "cpu"
    repeats = args.repeats or (2 if on_cpu else 50)
    # The interpreter runs every program in Python: keep CPU shapes small.
    shapes = [(1, 16), (4, 128), (64, 16)] if on_cpu else [(1, 16), (64, 128), (1024, 16), (4096, 128)]
    print(f"device: {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"torch {torch.__version__}, backends: {', '.join(backends)}")  # fmt: skip
    if on_cpu and "triton" in backends:
        print("Triton runs in its interpreter here: correct, but its times are not GPU times.")
    print(f"{'op':<18}{'cache':<6}{'T':>6}{'H':>5}  " + "".join(f"{b + ' us':>14}{'max rel err':>12}" for b in backends))
    failures = 0
    for op in ("rope_cache_write", "decode"):
        for fp8 in (False, True):
            for T, H in shapes:
                ref = _inputs(T, H, device, fp8, seed=T + H)
                _call(op, ref, "torch")
                row = f"{op:<18}{'fp8' if fp8 else 'bf16':<6}{T:>6}{H:>5}  "
                for backend in backends:
                    x = _inputs(T, H, device, fp8, seed=T + H)
                    _call(op, x, backend)
                    err = max(_max_error(x[n], ref[n], fp8) for n in _outputs(op, x))
                    ok = err <= (0.13 if fp8 else 1.6e-2)  # two roundings: backends may fuse multiply-adds differently
                    failures += not ok
                    # Re-running on the same inputs rotates q_pe again: fine for timing.
                    us = _time(lambda op=op, x=x, backend=backend: _call(op, x, backend), device, repeats)
                    row += f"{us:>14.1f}{err:>11.1e}{' ' if ok else '!'}"
                print(row, flush=True)
    print("timings: median wall time per eager call (host overhead included; see benchmarks/ for GPU timings).")
    if failures:
        print(f"FAILED: {failures} comparisons outside tolerance (marked !)")
        return 1
    print("all backends agree with the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
