"""Ahead-of-time compilation of the Triton kernel for AMD Instinct GPUs, on any machine (no GPU).

Triton's AMD backend runs on a CPU: ``triton.compile`` of the kernel for
``GPUTarget("hip", "gfx942", 64)`` (MI300X) or ``"gfx950"`` (MI355X) yields
AMDGCN assembly and a linked hsaco. This is a compile check, not a run on AMD
hardware: it shows that every op and every store mode the host code can select
there compiles, without register spills, and with the chip's fp8 conversion
instructions where the host code relies on them.

Each variant is compiled from a real launch: the backend's entry point
(``rope_cache_write`` and friends) is called with DeepSeek-V3-shaped CPU
tensors while the process looks like a ROCm machine with that chip
(``torch.version.hip`` set, ``torch.cuda.get_device_properties`` giving the
chip's name and CU count, so ``_native_fp8_ok``, ``_store_meta`` and
``_launch_config`` decide as they would there), and the kernel launch is
recorded instead of run. The recorded arguments then go through Triton's own
launch-time specialization (``create_function_from_signature``,
``JITFunction._pack_args``: the same signature, constexprs and alignment
attributes a launch computes) into ``triton.compile`` for the target.

The kernel must be a real ``JITFunction``, so this runs in a process without
``TRITON_INTERPRET`` (the test suite's conftest sets it): tests call it in a
subprocess, ``python -m tests.rocm_compile --json ARCH``.

    python -m tests.rocm_compile --markdown        # the table for docs/rocm.md
    python -m tests.rocm_compile --update-docs     # rewrite that table in docs/rocm.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path

# Compute units of the chips whose launch configuration is reproduced (_launch_config sizes
# tiles by them): MI300X and MI355X.
ARCHS = {"gfx942": ("MI300X", 304), "gfx950": ("MI355X", 256)}
FP8 = ("float8_e4m3fnuz", "float8_e4m3fn", "float8_e5m2")
# Op, DeepSeek-V3 shape at TP8 (16 heads) or TP1 (128 heads) sizing the largest tiles each op
# launches, and the backend entry point.
OPS = {
    "rope_cache_write": dict(T=4096, H=16),
    "decode": dict(T=64, H=128),
    "prefill": dict(T=4096, H=16),
}
DSV3 = dict(L=512, R=64)


@dataclass
class Variant:
    """One compiled kernel: an op and the element formats of its inputs and outputs."""

    op: str
    act: str  # q_pe/k_pe/kv_c dtype
    cache: str  # kv_cache dtype
    cache_scale: bool
    out: str | None = None  # q_out (op 2) or k_out (op 3) dtype
    out_scale: bool = False  # q_scale (op 2)

    @property
    def label(self) -> str:
        cache = f"{self.cache}{' /scale' if self.cache_scale else ''}"
        if self.out is None:
            return f"cache {cache}"
        name = "q_out" if self.op == "decode" else "k_out"
        return f"cache {cache}, {name} {self.out}{' /scale' if self.out_scale else ''}"


def variants() -> list[Variant]:
    """Every op with every store mode the host selects: bf16/fp16/fp32 activations and caches,
    each fp8 cache format with and without a scale, fp8 and non-fp8 outputs."""
    out = []
    for op in OPS:
        for act in ("bfloat16", "float16", "float32"):
            out.append(Variant(op, act, act, False, None if op == "rope_cache_write" else act))
        for f in FP8:
            if op == "rope_cache_write":
                out += [Variant(op, "bfloat16", f, True), Variant(op, "bfloat16", f, False)]
            elif op == "decode":
                out += [Variant(op, "bfloat16", f, True, f, True), Variant(op, "bfloat16", f, False, f, False),
                        Variant(op, "bfloat16", f, True, "bfloat16")]  # fmt: skip
            else:  # the prefill key has no scale
                out += [Variant(op, "bfloat16", f, True, f), Variant(op, "bfloat16", f, True, "bfloat16")]
    return out


@contextlib.contextmanager
def as_rocm_machine(arch: str):
    """This process seen by the Triton backend's host code as a ROCm machine with ``arch``."""
    import torch

    from vllm_mla_fusion.backends import triton as tb

    cus = ARCHS[arch][1]
    props = types.SimpleNamespace(gcnArchName=f"{arch}:sramecc+:xnack-", multi_processor_count=cus)
    native = tb._native_fp8_ok
    saved = (tb._native_fp8_ok, tb._num_sms, torch.version.hip, torch.cuda.get_device_properties)
    # The CPU tensors stand for GPU tensors: the host's own decision for a GPU device of that chip.
    tb._native_fp8_ok = lambda device, dtype: native.__wrapped__(torch.device("cuda", 0), dtype)
    tb._num_sms = lambda device: cus
    torch.version.hip = "7.0.0"
    torch.cuda.get_device_properties = lambda device=None: props
    try:
        yield tb
    finally:
        tb._native_fp8_ok, tb._num_sms, torch.version.hip, torch.cuda.get_device_properties = saved


def capture_launch(arch: str, v: Variant):
    """``(kernel, args, kwargs, native)``: the launch the backend makes for ``v`` on ``arch``, and
    which of its fp8 formats ``_native_fp8_ok`` says the chip converts in hardware."""
    import torch

    from vllm_mla_fusion import validation

    from .mla_cases import make_case

    dt = {name: getattr(torch, name) for name in ("bfloat16", "float16", "float32", *FP8)}
    kw = dict(OPS[v.op], **DSV3, act_dtype=dt[v.act], cs_dtype=torch.float32, cache_dtype=dt[v.cache],
              scale=0.5 if v.cache_scale else None, seed=0)  # fmt: skip
    if v.op == "decode":
        kw.update(decode=True, q_out_dtype=dt[v.out], q_scale=0.7 if v.out_scale else None)
    elif v.op == "prefill":
        kw.update(prefill=True, nope_dim=128, k_out_dtype=dt[v.out])
    c = make_case(**kw)
    recorded = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: recorded.append((args, kwargs))

    with as_rocm_machine(arch) as tb:
        kernel = tb._mla_rope_cache_kernel
        tb._mla_rope_cache_kernel = Recorder()  # CPU tensors: the launch takes Triton's kernel[grid](...) path
        try:
            if v.op == "decode":
                op, p = 2, validation.check_decode_rope_cache_write(*c.decode_args(), True)
                tensors = (c.positions, c.q_pe, c.k_pe, c.kv_c, c.cos_sin_cache, c.slot_mapping, c.kv_cache,
                           c.kv_cache_scale, c.ql_nope, c.q_out, c.q_scale)  # fmt: skip
            elif v.op == "prefill":
                op, p = 3, validation.check_prefill_rope_cache_write(*c.prefill_args())
                tensors = (c.positions, c.q_pe, c.k_pe, c.kv_c, c.cos_sin_cache, c.slot_mapping, c.kv_cache,
                           c.kv_cache_scale, c.k_nope, c.k_out, None)  # fmt: skip
            else:
                op, p = 1, validation.check_rope_cache_write(*c.rope_args())
                tensors = (c.positions, c.q_pe, c.k_pe, c.kv_c, c.cos_sin_cache, c.slot_mapping, c.kv_cache,
                           c.kv_cache_scale, None, None, None)  # fmt: skip
            tb.bind(p, op, c.is_neox, True, *tensors)(p.num_tokens, *tensors)
        finally:
            tb._mla_rope_cache_kernel = kernel
        formats = {v.cache} | ({v.out} if v.out in FP8 else set())
        native = sorted(f for f in formats if f in FP8 and tb._native_fp8_ok(None, dt[f]))
    (args, kwargs), = recorded
    return kernel, args, kwargs, native


def compile_launch(arch: str, kernel, args, kwargs):
    """The kernel compiled for ``arch`` exactly as a launch with these arguments would specialize it."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("hip", arch, 64)
    backend = make_backend(target)
    # What JITFunction.run adds before binding.
    kwargs = dict(kwargs, debug=kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)  # fmt: skip
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def _asm_int(asm: str, pattern: str) -> int:
    m = re.search(pattern, asm)
    if m is None:
        raise ValueError(f"no {pattern!r} in the AMDGCN listing")
    return int(m.group(1))


# Hardware conversions to fp8/bf8 (gfx942: fnuz formats, gfx950: OCP formats), packed or
# stochastic, scaled (gfx950) or not.
FP8_CVT = re.compile(r"^\s*(v_cvt_(?:scalef32_)?(?:pk|sr)_(?:fp8|bf8)\w*)", re.M)


def report(arch: str, v: Variant) -> dict:
    t0 = time.monotonic()
    kernel, args, kwargs, native = capture_launch(arch, v)
    ck = compile_launch(arch, kernel, args, kwargs)
    asm = ck.asm["amdgcn"]
    cvts = sorted(set(FP8_CVT.findall(asm)))
    return dict(
        arch=arch, **asdict(v), label=v.label,
        tiles={k: kwargs[k] for k in ("BLOCK_T", "BLOCK_ROWS", "BLOCK_L", "BLOCK_N", "BLOCK_H", "num_warps")},
        modes={k: kwargs[k] for k in ("CACHE_MODE", "OUT_MODE")},
        native_fp8=native,
        vgpr=_asm_int(asm, r"; NumVgprs: (\d+)"),
        agpr=_asm_int(asm, r"; NumAgprs: (\d+)"),
        sgpr=_asm_int(asm, r"; TotalNumSgprs: (\d+)"),
        vgpr_spill=_asm_int(asm, r"\.vgpr_spill_count:\s+(\d+)"),
        sgpr_spill=_asm_int(asm, r"\.sgpr_spill_count:\s+(\d+)"),
        scratch=_asm_int(asm, r"; ScratchSize: (\d+)"),
        occupancy=_asm_int(asm, r"; Occupancy: (\d+)"),
        lds=ck.metadata.shared,
        fp8_cvt=cvts,
        hsaco_bytes=len(ck.asm["hsaco"]),
        seconds=round(time.monotonic() - t0, 2),
    )  # fmt: skip


def run(arch: str) -> list[dict]:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run without TRITON_INTERPRET: the kernel must be a JITFunction to be compiled")
    return [report(arch, v) for v in variants()]


OP_NAMES = {"rope_cache_write": "op 1", "decode": "op 2", "prefill": "op 3"}


def markdown(results: list[dict]) -> str:
    import triton

    lines = [
        f"Triton {triton.__version__}, DeepSeek-V3 shapes (L 512, R 64; op 1 and 3: T 4096, H 16; op 2: "
        "T 64, H 128), 4 warps of 64 lanes. VGPR/SGPR: registers per lane / per wave (`NumVgprs`, "
        "`TotalNumSgprs`); LDS: bytes per workgroup (layout conversions); occupancy: waves per SIMD "
        "(LLVM's estimate). Cache and query programs are two branches of one kernel, so the counts are "
        "the kernel's. fp8 cvt: the hardware conversions in the code (none: Triton's bit encoder).",
        "",
        "| arch | op | formats | tiles (T / rows / L / nope / heads) | VGPR | SGPR | spills | LDS | occupancy | fp8 cvt |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        t = r["tiles"]
        tiles = f"{t['BLOCK_T']} / {t['BLOCK_ROWS']} / {t['BLOCK_L']} / {t['BLOCK_N']} / {t['BLOCK_H']}"
        cvt = ", ".join(f"`{c}`" for c in r["fp8_cvt"]) or "none"
        spills = r["vgpr_spill"] + r["sgpr_spill"]
        lines.append(f"| {r['arch']} | {OP_NAMES[r['op']]} | {r['label']} | {tiles} | {r['vgpr']} | {r['sgpr']} | "
                     f"{spills} | {r['lds']} | {r['occupancy']} | {cvt} |")  # fmt: skip
    return "\n".join(lines)


BEGIN, END = "<!-- rocm-compile-table:begin -->", "<!-- rocm-compile-table:end -->"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("arch", nargs="*", default=list(ARCHS), help=f"of {list(ARCHS)} (default: all)")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--json", action="store_true", help="one JSON list of results on stdout")
    what.add_argument("--markdown", action="store_true", help="the docs table on stdout")
    what.add_argument("--update-docs", action="store_true", help="rewrite the table in docs/rocm.md")
    opts = ap.parse_args()
    unknown = set(opts.arch) - set(ARCHS)
    if unknown:
        ap.error(f"unknown arch {sorted(unknown)}; expected some of {list(ARCHS)}")
    results = [r for arch in opts.arch for r in run(arch)]
    if opts.json:
        print(json.dumps(results))
        return 0
    table = markdown(results)
    if opts.update_docs:
        path = Path(__file__).resolve().parent.parent / "docs" / "rocm.md"
        text = path.read_text()
        if BEGIN not in text or END not in text:
            raise SystemExit(f"{path} has no {BEGIN} ... {END} markers")
        head, rest = text.split(BEGIN, 1)
        path.write_text(head + BEGIN + "\n" + table + "\n" + END + rest.split(END, 1)[1])
        print(f"updated {path}")
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
