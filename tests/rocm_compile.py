"""Ahead-of-time compilation of the Triton kernel for AMD Instinct GPUs, on any machine (no GPU).

Triton's AMD backend runs on a CPU: ``triton.compile`` of the kernel for
``GPUTarget("hip", "gfx942", 64)`` (MI300X) or ``"gfx950"`` (MI355X) yields
AMDGCN assembly and a linked hsaco. This is a compile check, not a run on AMD
hardware: it shows that every op and every store mode the host code can select
there compiles, without register spills, and with the chip's fp8 conversion
instructions where the host code relies on them.

Each variant is compiled from a real launch (tests/aot_compile.py): the
backend's entry point is called with DeepSeek-V3-shaped CPU tensors while the
process looks like a ROCm machine with that chip (``torch.version.hip`` set,
``torch.cuda.get_device_properties`` giving the chip's name and CU count, so
``_native_fp8_ok``, ``_store_mode`` and ``_launch_config`` decide as they would
there), the launch is recorded instead of run, and its arguments go through
Triton's own launch-time specialization into ``triton.compile``.

Run without ``TRITON_INTERPRET`` (tests call it in a subprocess,
``python -m tests.rocm_compile --json ARCH``):

    python -m tests.rocm_compile --markdown        # the table for docs/rocm.md
    python -m tests.rocm_compile --update-docs     # rewrite that table in docs/rocm.md
    python -m tests.rocm_compile --dump DIR        # each variant's AMDGCN in DIR/gfx942/, DIR/gfx950/
"""

from __future__ import annotations

import contextlib
import re
import sys
import types
from pathlib import Path

from . import aot_compile as aot
from .aot_compile import FP8, variants  # noqa: F401  (the test's matrix)

# Compute units of the chips whose launch configuration is reproduced (_launch_config sizes
# tiles by them): MI300X and MI355X.
ARCHS = {"gfx942": ("MI300X", 304), "gfx950": ("MI355X", 256)}


@contextlib.contextmanager
def as_rocm_machine(arch: str):
    """This process seen by the Triton backend's host code as a ROCm machine with ``arch``."""
    import torch

    from vllm_mla_fusion.backends import triton as tb

    cus = ARCHS[arch][1]
    props = types.SimpleNamespace(gcnArchName=f"{arch}:sramecc+:xnack-", multi_processor_count=cus)
    with aot.patched(tb, _native_fp8_ok=aot.on_gpu(tb._native_fp8_ok), _num_sms=lambda device: cus), \
            aot.patched(torch.version, hip="7.0.0"), \
            aot.patched(torch.cuda, get_device_properties=lambda device=None: props):  # fmt: skip
        yield tb


def _asm_int(asm: str, pattern: str) -> int:
    m = re.search(pattern, asm)
    if m is None:
        raise ValueError(f"no {pattern!r} in the AMDGCN listing")
    return int(m.group(1))


# Hardware conversions to fp8/bf8 (gfx942: fnuz formats, gfx950: OCP formats), packed or
# stochastic, scaled (gfx950) or not.
FP8_CVT = re.compile(r"^\s*(v_cvt_(?:scalef32_)?(?:pk|sr)_(?:fp8|bf8)\w*)", re.M)


def report(arch: str, v: aot.Variant, dump: Path | None = None) -> dict:
    from triton.backends.compiler import GPUTarget

    c = aot.compile_variant(as_rocm_machine(arch), GPUTarget("hip", arch, 64), v, "amdgcn", dump)
    asm = c.kernel.asm["amdgcn"]
    return dict(
        c.fields(arch, v),
        vgpr=_asm_int(asm, r"; NumVgprs: (\d+)"),
        agpr=_asm_int(asm, r"; NumAgprs: (\d+)"),
        sgpr=_asm_int(asm, r"; TotalNumSgprs: (\d+)"),
        vgpr_spill=_asm_int(asm, r"\.vgpr_spill_count:\s+(\d+)"),
        sgpr_spill=_asm_int(asm, r"\.sgpr_spill_count:\s+(\d+)"),
        scratch=_asm_int(asm, r"; ScratchSize: (\d+)"),
        occupancy=_asm_int(asm, r"; Occupancy: (\d+)"),
        lds=c.kernel.metadata.shared,
        fp8_cvt=sorted(set(FP8_CVT.findall(asm))),
        hsaco_bytes=len(c.kernel.asm["hsaco"]),
    )


def markdown(results: list[dict]) -> str:
    import triton

    intro = (f"Triton {triton.__version__}, DeepSeek-V3 shapes (L 512, R 64; op 1 and 3: T 4096, H 16; op 2: "
             "T 64, H 128; where the formats name a T and H, those), 4 warps of 64 lanes. VGPR/SGPR: registers per lane / per wave (`NumVgprs`, "
             "`TotalNumSgprs`); LDS: bytes per workgroup (layout conversions); occupancy: waves per SIMD "
             "(LLVM's estimate). Cache and query programs are two branches of one kernel, so the counts are "
             "the kernel's. fp8 cvt: the hardware conversions in the code (none: Triton's bit encoder).")  # fmt: skip
    return aot.table(results, intro, {
        "VGPR": lambda r: r["vgpr"], "SGPR": lambda r: r["sgpr"], "spills": lambda r: r["vgpr_spill"] + r["sgpr_spill"],
        "LDS": lambda r: r["lds"], "occupancy": lambda r: r["occupancy"],
        "fp8 cvt": lambda r: ", ".join(f"`{c}`" for c in r["fp8_cvt"]) or "none",
    })  # fmt: skip


if __name__ == "__main__":
    sys.exit(aot.main(__doc__, list(ARCHS), report, markdown,
                      Path(__file__).resolve().parent.parent / "docs" / "rocm.md", "rocm-compile-table"))  # fmt: skip
