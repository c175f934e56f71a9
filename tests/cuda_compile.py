"""Ahead-of-time compilation of the Triton kernel for NVIDIA Hopper GPUs, on any machine (no GPU).

Triton's NVIDIA backend runs on a CPU (ptxas ships in the triton wheel):
``triton.compile`` of the kernel for ``GPUTarget("cuda", 90, 32)`` (H100, H200)
yields PTX and a cubin. A compile check, not a run: it shows that every op and
every store mode the host code can select there compiles without register
spills, and gives each variant's registers per thread (ptxas's own report) and
a hash of its PTX, so that a change to the kernel's source can be shown to
change (or not) the code it compiles to.

Each variant is compiled from a real launch (tests/aot_compile.py): the
backend's entry point is called with DeepSeek-V3-shaped CPU tensors while the
process looks like a CUDA machine of that compute capability (no
``torch.version.hip``, ``torch.cuda.get_device_capability`` giving it, the SM
count of an H100/H200, so ``_native_fp8_ok``, ``_store_mode``,
``_launch_config`` and ``_pdl_ok`` decide as they would there: native e4m3fn and
e5m2 conversions, the bit encoder for e4m3fnuz, programmatic dependent launch
unless ``VLLM_MLA_FUSION_PDL=0``), the launch is recorded instead of run, and
its arguments go through Triton's own launch-time specialization into
``triton.compile``.

Run without ``TRITON_INTERPRET`` (tests call it in a subprocess,
``python -m tests.cuda_compile --json``):

    python -m tests.cuda_compile                 # the table: registers, spills, PTX hash
    python -m tests.cuda_compile --dump DIR      # each variant's PTX in DIR/90/

The PTX carries line info (``.loc``, ``.file`` with this checkout's path): compare
hashes of one checkout, or with ``TRITON_DISABLE_LINE_INFO=1``.

Each variant is compiled twice: as the public ops launch it, and as the vLLM plugin's layers
do, bound with binding.py's ``early_index_loads`` promise (label "early index loads"): there
the positions, slots and cos/sin are read before ``griddepcontrol.wait``. Reported for each:
the number of ``griddepcontrol.wait`` (one per kind of program when the loads come early, one
at the entry otherwise) and the global loads the PTX lists before the first of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import re
import sys
from pathlib import Path

from . import aot_compile as aot
from .aot_compile import FP8  # noqa: F401  (the test's matrix)

# Compute capability and SM count of the GPUs whose launch configuration is reproduced
# (_launch_config sizes tiles by the SM count): H100 SXM and H200 both have 132.
ARCHS = {"sm_90": ("H100/H200", (9, 0), 132)}


@contextlib.contextmanager
def as_cuda_machine(arch: str):
    """This process seen by the Triton backend's host code as a CUDA machine with ``arch``."""
    import torch

    from vllm_mla_fusion.backends import triton as tb

    _, capability, sms = ARCHS[arch]
    with aot.patched(tb, _native_fp8_ok=aot.on_gpu(tb._native_fp8_ok), _pdl_ok=aot.on_gpu(tb._pdl_ok),
                     _num_sms=lambda device: sms), \
            aot.patched(torch.version, hip=None), \
            aot.patched(torch.cuda, get_device_capability=lambda device=None: capability):  # fmt: skip
        yield tb


def variants() -> list[aot.Variant]:
    """The compile matrix (aot_compile.variants), as the public ops and as the plugin bind it."""
    base = aot.variants()
    return base + [dataclasses.replace(v, early=True) for v in base]


# Hardware conversions to fp8 (sm_89 on: e4m3fn and e5m2, pairs, saturating), and the PDL
# instructions (griddepcontrol: sm_90 on).
FP8_CVT = re.compile(r"^\s*(cvt\.rn\.satfinite\.e[45]m[23]x2\.f32)", re.M)
GRIDDEP = re.compile(r"^\s*(griddepcontrol\.\w+)", re.M)
GRIDDEP_WAIT = re.compile(r"^\s*griddepcontrol\.wait", re.M)
GLOBAL_LOAD = re.compile(r"^\s*(?:@!?%p\d+\s+)?ld\.global", re.M)
# Triton IR (TTIR) lines: a value's definition with its first operand (a pointer's chain of
# splat / broadcast / addptr goes back through first operands to the kernel argument), and a load.
TTIR_DEF = re.compile(r"^\s*(%\w+) = [\w.]+ (%\w+)")
TTIR_LOAD = re.compile(r"^\s*%\w+ = tt\.load (%\w+)")
# A CTA barrier (tl.debug_barrier): gpu.barrier in Triton 3.6's IR, ttg.barrier in 3.8's; a store.
TTIR_BARRIER = re.compile(r"^\s*(?:gpu\.barrier|ttg\.barrier)\b")
TTIR_STORE = re.compile(r"^\s*tt\.store (%\w+)")


def _split_if(lines: list[str], start: int) -> tuple[list[str], list[str], int]:
    """The then- and else-regions of the ``scf.if`` on ``lines[start]``, and the index after it."""
    depth, then, other, region = 1, [], [], None
    region = then
    i = start + 1
    while i < len(lines):
        line = lines[i]
        if depth == 1 and line.strip() == "} else {":
            region = other
        else:
            depth += line.count("{") - line.count("}")
            if depth == 0:
                return then, other, i + 1
            region.append(line)
        i += 1
    raise ValueError("unbalanced scf.if in the Triton IR")


def load_order(ttir: str) -> dict[str, list[str]]:
    """The kernel argument each ``tl.load`` reads, in program order, ``"barrier"`` where a CTA
    barrier comes, ``"store ARG"`` where a ``tl.store`` into argument ARG does and ``"wait"`` where
    ``griddepcontrol.wait`` comes: before the program kinds split (``entry``), in the cache
    programs (``cache``, the kernel's first ``scf.if``) and in the query programs (``query``, its
    else). A program compiled twice, for a power-of-two scale and for any other (a nested
    ``scf.if`` after the scale's load), counts once: the two copies' orders must be the same."""
    lines = ttir.splitlines()
    first = {}

    def root(name: str) -> str:
        while name in first:
            name = first[name]
        return name.lstrip("%")

    def order(region: list[str]) -> list[str]:
        out, i = [], 0
        while i < len(region):
            line = region[i]
            d = TTIR_DEF.match(line)
            if d:
                first[d.group(1)] = d.group(2)
            if "scf.if" in line and line.rstrip().endswith("{"):
                pow2, other, after = _split_if(region, i)
                a, b = order(pow2), order(other)
                if b and a != b:
                    raise ValueError(f"the two copies of a program load in another order: {a} / {b}")
                out += a
                i += after - i
                continue
            if "griddepcontrol.wait" in line:
                out.append("wait")
            if TTIR_BARRIER.match(line):
                out.append("barrier")
            s = TTIR_STORE.match(line)
            if s:
                out.append(f"store {root(s.group(1))}")
            m = TTIR_LOAD.match(line)
            if m:
                out.append(root(m.group(1)))
            i += 1
        return out

    split = next(i for i, line in enumerate(lines) if "scf.if" in line)
    cache, query, _ = _split_if(lines, split)
    return dict(entry=order(lines[:split]), cache=order(cache), query=order(query))


# ptxas -v (Triton runs it so; TRITON_DUMP_PTXAS_LOG prints the log).
PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
PTXAS_REGS = re.compile(r"Used (\d+) registers")


def triton_version() -> str:
    import triton

    return triton.__version__


def report(arch: str, v: aot.Variant, dump: Path | None = None) -> dict:
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    _, (major, minor), _ = ARCHS[arch]
    log = io.StringIO()
    # Compiled afresh (a cached kernel has no ptxas log), with the log printed, here captured.
    with aot.patched(knobs.compilation, always_compile=True), aot.patched(knobs.nvidia, dump_ptxas_log=True), \
            contextlib.redirect_stdout(log):  # fmt: skip
        c = aot.compile_variant(as_cuda_machine(arch), GPUTarget("cuda", major * 10 + minor, 32), v, "ptx", dump)
    text = log.getvalue()
    frame, regs = PTXAS_FRAME.search(text), PTXAS_REGS.search(text)
    if frame is None or regs is None:
        raise ValueError(f"no register report in ptxas's log:\n{text[-2000:]}")
    stack, spill_stores, spill_loads = map(int, frame.groups())
    ptx = c.kernel.asm["ptx"]
    waits = [m.start() for m in GRIDDEP_WAIT.finditer(ptx)]
    return dict(
        c.fields(arch, v), triton=triton_version(), pdl=c.kwargs["USE_PDL"], early_index_loads=c.kwargs["EARLY_INDEX_LOADS"],
        waits=len(waits), loads_before_wait=len(GLOBAL_LOAD.findall(ptx, 0, waits[0] if waits else len(ptx))),
        load_order=load_order(c.kernel.asm["ttir"]), load_order_ttgir=load_order(c.kernel.asm["ttgir"]),
        regs=int(regs.group(1)), stack=stack, spill_stores=spill_stores, spill_loads=spill_loads,
        shared=c.kernel.metadata.shared,
        fp8_cvt=sorted(set(FP8_CVT.findall(ptx))), griddepcontrol=sorted(set(GRIDDEP.findall(ptx))),
        ptx_sha256=hashlib.sha256(ptx.encode()).hexdigest()[:16],
        cubin_bytes=len(c.kernel.asm["cubin"]),
    )  # fmt: skip


def markdown(results: list[dict]) -> str:
    import triton

    intro = (f"Triton {triton.__version__}, DeepSeek-V3 shapes (L 512, R 64; op 1 and 3: T 4096, H 16; op 2: "
             "T 64, H 128; where the formats name a T and H, those), 4 warps. Registers: per thread (ptxas); spills: bytes stored and loaded; PTX: "
             "the first 16 hex digits of its sha256.")  # fmt: skip
    return aot.table(results, intro, {
        "registers": lambda r: r["regs"], "spills": lambda r: r["spill_stores"] + r["spill_loads"],
        "stack": lambda r: r["stack"], "loads before the wait": lambda r: r["loads_before_wait"],
        "PTX": lambda r: f"`{r['ptx_sha256']}`",
    })  # fmt: skip


if __name__ == "__main__":
    sys.exit(aot.main(__doc__, list(ARCHS), report, markdown, matrix=variants))
