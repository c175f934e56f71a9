"""Kernel self-check: ``python -m vllm_mla_fusion.selfcheck`` (the last part of ``./scripts/demo.sh``).

Runs the three ops (RoPE + cache write, the decode query, the prefill key) on
every backend available on this machine at DeepSeek-V3 shapes (kv_lora_rank
512, rope dim 64, nope dim 128, TP8 and TP1 head counts), compares each with
an independent float64 evaluation of the ops' specification (below), and
prints a small timing table. On a CPU-only
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

from . import available_backends, mla_decode_rope_cache_write, mla_prefill_rope_cache_write, mla_rope_cache_write
from .fp8 import platform_fp8_e4m3

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
        k_nope=randn(T, H, 128 + 128)[..., :128],  # the nope half of kv_b_proj's output, a view
        # fp8 key: what vLLM's fp8 prefill attention takes (saturate(x), no scale)
        k_out=torch.empty(T, H, 128 + R, dtype=platform_fp8_e4m3(device) if fp8 else torch.bfloat16, device=device),
    )


def _call(op: str, x: dict, backend: str) -> None:
    if op == "rope_cache_write":
        mla_rope_cache_write(x["positions"], x["q_pe"], x["k_pe"], x["kv_c"], x["cos_sin_cache"], x["is_neox"],
                             x["slot_mapping"], x["kv_cache"], x["kv_cache_dtype"], x["kv_cache_scale"],
                             backend=backend)  # fmt: skip
    elif op == "prefill":
        mla_prefill_rope_cache_write(x["positions"], x["q_pe"], x["k_pe"], x["kv_c"], x["k_nope"],
                                     x["cos_sin_cache"], x["is_neox"], x["slot_mapping"], x["kv_cache"], x["k_out"],
                                     x["kv_cache_dtype"], x["kv_cache_scale"], backend=backend)  # fmt: skip
    else:
        mla_decode_rope_cache_write(x["positions"], x["ql_nope"], x["q_pe"], x["k_pe"], x["kv_c"],
                                    x["cos_sin_cache"], x["is_neox"], x["slot_mapping"], x["kv_cache"], x["q_out"],
                                    x["kv_cache_dtype"], x["kv_cache_scale"], x["q_scale"], backend=backend)  # fmt: skip


def _outputs(op: str, x: dict) -> dict:
    names = {"rope_cache_write": ("q_pe", "k_pe", "kv_cache"), "prefill": ("q_pe", "k_pe", "kv_cache", "k_out"),
             "decode": ("q_out", "kv_cache")}[op]  # fmt: skip
    return {n: x[n] for n in names}


# The expected outputs come from a float64 implementation written here from the
# op's specification (README, ops.py docstrings), as complex multiplication per
# rotation pair and a write per slot. Not backends/reference.py: the torch
# backend *is* that file, so comparing with it would compare the torch column
# with itself. Not tests/mla_reference.py either: the installed package cannot
# import the tests.


def _rotate64(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool):
    """float64 RoPE of ``x`` ``[T, ..., R]``: (value, ``|x1 cos| + |x2 sin|`` per element, for float32 error)."""
    T, R = x.shape[0], x.shape[-1]
    pos = positions[:T].long().clamp(0, cos_sin_cache.shape[0] - 1)
    table = cos_sin_cache.double()[pos]
    shape = (T,) + (1,) * (x.dim() - 2) + (R // 2,)
    turn = torch.complex(table[:, : R // 2].reshape(shape), table[:, R // 2 :].reshape(shape))
    x = x.double()
    pairs = x.unflatten(-1, (2, R // 2)).transpose(-1, -2) if is_neox else x.unflatten(-1, (R // 2, 2))
    z = torch.view_as_complex(pairs.contiguous())
    rotated = torch.view_as_real(z * turn)
    x1, x2, cos, sin = z.real, z.imag, turn.real, turn.imag
    magnitude = torch.stack(((x1 * cos).abs() + (x2 * sin).abs(), (x2 * cos).abs() + (x1 * sin).abs()), dim=-1)
    if is_neox:
        return rotated.transpose(-1, -2).flatten(-2), magnitude.transpose(-1, -2).flatten(-2)
    return rotated.flatten(-2), magnitude.flatten(-2)


def _expected(op: str, x: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """Per output: (float64 value before fp8 scaling, float32 error magnitude, fp8 scale), from pristine inputs."""
    T = x["q_pe"].shape[0]
    q_rot, q_mag = _rotate64(x["q_pe"], x["positions"], x["cos_sin_cache"], x["is_neox"])
    k_rot, k_mag = _rotate64(x["k_pe"], x["positions"], x["cos_sin_cache"], x["is_neox"])
    cache = x["kv_cache"]
    fp8 = cache.dtype == torch.uint8
    kv_scale = float(x["kv_cache_scale"]) if fp8 else 1.0
    cache_val = (cache.view(platform_fp8_e4m3(cache.device)) if fp8 else cache).double() * kv_scale
    cache_mag = torch.zeros_like(cache_val)
    block_size = cache.shape[1]
    for t, slot in enumerate(x["slot_mapping"][:T].tolist()):
        if 0 <= slot < cache.shape[0] * block_size:
            row = divmod(slot, block_size)
            cache_val[row] = torch.cat((x["kv_c"][t].double(), k_rot[t]))
            cache_mag[row] = torch.cat((torch.zeros_like(x["kv_c"][t], dtype=torch.float64), k_mag[t]))
    want = {"kv_cache": (cache_val, cache_mag, kv_scale)}
    if op in ("rope_cache_write", "prefill"):
        want["q_pe"] = (q_rot, q_mag, 1.0)
        want["k_pe"] = (k_rot, k_mag, 1.0)
    if op == "prefill":
        # Every head's key: [k_nope | rope(k_pe)], the rope part shared by the heads.
        nope, H = x["k_nope"].double(), x["k_nope"].shape[1]
        rope, rope_mag = (t.reshape(T, 1, R).expand(T, H, R) for t in (k_rot, k_mag))
        want["k_out"] = (torch.cat((nope, rope), -1), torch.cat((torch.zeros_like(nope), rope_mag), -1), 1.0)
    elif op == "decode":
        q_scale = float(x["q_scale"]) if x["q_scale"] is not None else 1.0
        nope = x["ql_nope"].double()
        want["q_out"] = (torch.cat((nope, q_rot), -1), torch.cat((torch.zeros_like(nope), q_mag), -1), q_scale)
    return want


def _error_in_ulps(got: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor, float]) -> float:
    """Worst ``|got - want|`` in units of ``got``'s format spacing at the exact value, float32 error allowed on top.

    0.5 means correctly rounded. The spec rotates in float32 (products and a
    sum, each rounded once), which may move a result across a rounding
    boundary: 2^-22 of ``|x1 cos| + |x2 sin|`` is allowed for that.
    """
    value, magnitude, scale = want
    dtype = platform_fp8_e4m3(got.device) if got.dtype == torch.uint8 else got.dtype  # uint8: the "fp8" cache
    got = (got.view(dtype) if got.dtype == torch.uint8 else got).double()
    info = torch.finfo(dtype)
    exact = value / scale
    if dtype.itemsize == 1:
        exact = exact.clamp(-info.max, info.max)  # fp8 stores saturate
    spacing = torch.where(
        exact.abs() >= info.tiny, torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(info.tiny)))), info.tiny
    ) * info.eps
    slack = (magnitude / scale + exact.abs()) * 2.0**-22
    return float(((got - exact).abs() / (spacing + slack)).max())


def _compare(op: str, x: dict, pristine: dict, want: dict) -> float:
    """Worst error in ulps over the op's outputs; inf if anything it must leave alone changed."""
    cache, before = x["kv_cache"], pristine["kv_cache"]
    T, block_size = x["q_pe"].shape[0], cache.shape[1]
    named = torch.zeros(cache.shape[:2], dtype=torch.bool, device=cache.device)
    slots = x["slot_mapping"][:T]
    slots = slots[(slots >= 0) & (slots < cache.shape[0] * block_size)]
    named[slots // block_size, slots % block_size] = True
    if not torch.equal(cache[~named], before[~named]):
        return float("inf")
    if op == "decode" and not (torch.equal(x["q_pe"], pristine["q_pe"]) and torch.equal(x["k_pe"], pristine["k_pe"])):
        return float("inf")
    return max(_error_in_ulps(x[name], want[name]) for name in _outputs(op, x))


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
        print("Triton runs in its interpreter here: its times are not GPU times, and the interpreter converts")
        print("float32 to bf16 by truncation (triton/runtime/interpreter.py, cast_impl), not to nearest as a GPU")
        print("does, so its bf16 outputs show up to 1 ulp here.")
    print(f"{'op':<18}{'cache':<6}{'T':>6}{'H':>5}  " + "".join(f"{b + ' us':>14}{'err ulp':>9}" for b in backends))
    failures = 0
    for op in ("rope_cache_write", "decode", "prefill"):
        for fp8 in (False, True):
            for T, H in shapes:
                pristine = _inputs(T, H, device, fp8, seed=T + H)
                want = _expected(op, pristine)
                row = f"{op:<18}{'fp8' if fp8 else 'bf16':<6}{T:>6}{H:>5}  "
                for backend in backends:
                    x = _inputs(T, H, device, fp8, seed=T + H)
                    _call(op, x, backend)
                    err = _compare(op, x, pristine, want)
                    ok = err <= 1.0
                    failures += not ok
                    # Re-running on the same inputs rotates q_pe again: fine for timing.
                    us = _time(lambda op=op, x=x, backend=backend: _call(op, x, backend), device, repeats)
                    row += f"{us:>14.1f}{err:>8.2f}{' ' if ok else '!'}"
                print(row, flush=True)
    print("us: median wall time per eager call (host overhead included; benchmarks/ has GPU timings).")
    print("err ulp: worst difference from an independent float64 evaluation of the spec, in units of the stored")
    print("  format's spacing at the exact value (bf16, or fp8 e4m3 after any scaling); 0.5 = correctly rounded,")
    print("  <= 1 passes (float32 arithmetic of the rotation allowed on top); inf: bytes the op must not")
    print("  touch changed.")
    if failures:
        print(f"FAILED: {failures} comparisons outside tolerance (marked !)")
        return 1
    print("all backends agree with the float64 reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
