"""Ahead-of-time compilation of the Triton kernel for a GPU this machine does not have.

Triton's backends compile on a CPU: ``triton.compile`` for ``GPUTarget("hip", "gfx942", 64)``
yields AMDGCN and a linked hsaco (tests/rocm_compile.py), for ``GPUTarget("cuda", 90, 32)``
PTX and a cubin (tests/cuda_compile.py: ptxas ships in the triton wheel). What this module
shares between them:

- the matrix of variants: every op with every store mode the host code selects
  (``variants``), each at a DeepSeek-V3 shape sizing its largest tiles (``OPS``, ``DSV3``), and
  ops 1 and 3 at the smallest tiles the host picks (``SMALL_BATCH``, op 3 at 128 heads);
- ``capture_launch``: the backend's entry point (``rope_cache_write`` and friends) is called
  with DeepSeek-V3-shaped CPU tensors while the process looks like a machine of the target
  (a context manager of the caller's: ``torch.version.hip``, the device properties, the
  host's decisions for a GPU device, so that ``_native_fp8_ok``, ``_store_mode``,
  ``_launch_config`` and ``_pdl_ok`` decide as they would there), and the kernel launch is
  recorded instead of run;
- ``compile_launch``: the recorded arguments go through Triton's own launch-time
  specialization (``create_function_from_signature``, ``JITFunction._pack_args``: the same
  signature, constexprs and alignment attributes a launch computes) into ``triton.compile``
  for the target;
- ``main``: the command line of both tools (``--json``, ``--markdown``, ``--update-docs``,
  ``--dump DIR`` to write each variant's assembly).

The kernel must be a real ``JITFunction``, so this runs in a process without
``TRITON_INTERPRET`` (the test suite's conftest sets it): tests call the tools in a
subprocess.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

FP8 = ("float8_e4m3fnuz", "float8_e4m3fn", "float8_e5m2")
# Op, DeepSeek-V3 shape at TP8 (16 heads) or TP1 (128 heads) sizing the largest tiles each op
# launches, and the backend entry point.
OPS = {
    "rope_cache_write": dict(T=4096, H=16),
    "decode": dict(T=64, H=128),
    "prefill": dict(T=4096, H=16),
}
DSV3 = dict(L=512, R=64)
SMALL_BATCH = (20, 16)  # (T, H): one token per cache tile, two rows per query tile on an H100
OP_NAMES = {"rope_cache_write": "op 1", "decode": "op 2", "prefill": "op 3"}
BLOCKS = ("BLOCK_T", "BLOCK_ROWS", "BLOCK_H", "num_warps")  # a launch configuration's blocks


@dataclass
class Variant:
    """One compiled kernel: an op and the element formats of its inputs and outputs."""

    op: str
    act: str  # q_pe/k_pe/kv_c dtype
    cache: str  # kv_cache dtype
    cache_scale: bool
    out: str | None = None  # q_out (op 2) or k_out (op 3) dtype
    out_scale: bool = False  # q_scale (op 2)
    early: bool = False  # bound with binding.py's early_index_loads promise (the vLLM plugin's launches)
    shape: tuple[int, int] | None = None  # (T, H) in place of the op's OPS shape
    neox: bool = False  # NeoX rotation (halves) in place of GPT-J's (interleaved pairs), DeepSeek's

    @property
    def label(self) -> str:
        cache = f"{self.cache}{' /scale' if self.cache_scale else ''}"
        rest = ", early index loads" if self.early else ""
        rest += ", NeoX" if self.neox else ""
        rest += ", T={} H={}".format(*self.shape) if self.shape is not None else ""
        if self.out is None:
            return f"cache {cache}{rest}"
        name = "q_out" if self.op == "decode" else "k_out"
        return f"cache {cache}, {name} {self.out}{' /scale' if self.out_scale else ''}{rest}"

    @property
    def slug(self) -> str:
        """The label as a file name."""
        return re.sub(r"[^A-Za-z0-9_]+", "-", f"{self.op} {self.label}").strip("-")


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
    # The smallest tiles the host picks, where several warps hold a whole tile at once (a warp
    # racing ahead could store into what another has yet to load: backends/triton.py,
    # _loads_before_in_place_stores): ops 1 and 3 on few tokens (one token per cache tile, two rows
    # per query tile) and op 3 at 128 heads (one token per cache tile at any batch), with a bf16
    # cache and an e4m3fnuz one (stored through sm_90's bit encoder), and the NeoX rotation's two
    # half-row loads and stores on few tokens.
    for op, shape in (("rope_cache_write", SMALL_BATCH), ("prefill", SMALL_BATCH), ("prefill", (4096, 128))):
        for cache in ("bfloat16", "float8_e4m3fnuz"):
            out.append(Variant(op, "bfloat16", cache, cache in FP8, None if op == "rope_cache_write" else cache,
                               shape=shape))  # fmt: skip
    out += [Variant("rope_cache_write", "bfloat16", "bfloat16", False, shape=SMALL_BATCH, neox=True),
            Variant("prefill", "bfloat16", "bfloat16", False, "bfloat16", shape=SMALL_BATCH, neox=True)]
    return out


@contextlib.contextmanager
def patched(obj, **attrs):
    """``obj``'s attributes set to ``attrs`` for the duration, restored after."""
    saved = {name: getattr(obj, name) for name in attrs}
    for name, value in attrs.items():
        setattr(obj, name, value)
    try:
        yield obj
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


def on_gpu(fn):
    """``fn``'s own decision (an lru-cached host function of the device) for GPU 0, whatever
    device it is asked about: the CPU tensors stand for GPU tensors."""
    import torch

    return lambda device, *args: fn.__wrapped__(torch.device("cuda", 0), *args)


def capture_launch(machine, v: Variant):
    """``(kernel, args, kwargs, native)``: the launch the backend makes for ``v`` inside
    ``machine`` (a context manager yielding the backend module), and which of its fp8 formats
    ``_native_fp8_ok`` says that machine converts in hardware."""
    import torch

    from vllm_mla_fusion import validation

    from .mla_cases import make_case

    dt = {name: getattr(torch, name) for name in ("bfloat16", "float16", "float32", *FP8)}
    shape = OPS[v.op] if v.shape is None else dict(zip("TH", v.shape))
    kw = dict(shape, **DSV3, is_neox=v.neox, act_dtype=dt[v.act], cs_dtype=torch.float32, cache_dtype=dt[v.cache],
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

    with machine as tb:
        kernels = dict(tb._KERNELS)
        # CPU tensors: the launch takes Triton's kernel[grid](...) path, through the op's entry point.
        tb._KERNELS.update({o: Recorder() for o in kernels})
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
            tb.bind(p, op, c.is_neox, True, *tensors, v.early)(p.num_tokens, *tensors)
        finally:
            tb._KERNELS.update(kernels)
        kernel = kernels[op]
        formats = {v.cache} | ({v.out} if v.out in FP8 else set())
        native = sorted(f for f in formats if f in FP8 and tb._native_fp8_ok(None, dt[f]))
    (args, kwargs), = recorded
    return kernel, args, kwargs, native


def compile_launch(target, kernel, args, kwargs):
    """The kernel compiled for ``target`` (a ``GPUTarget``) exactly as a launch with these
    arguments would specialize it."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    # What JITFunction.run adds before binding.
    kwargs = dict(kwargs, debug=kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)  # fmt: skip
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


@dataclass
class Compiled:
    """One variant compiled for a target: the compiled kernel and what the launch said."""

    kernel: object  # triton's CompiledKernel
    kwargs: dict  # the launch's keyword arguments (constexprs, num_warps)
    native: list  # the fp8 formats the host converts in hardware there
    seconds: float

    def fields(self, arch: str, v: Variant) -> dict:
        """The results every tool reports: the variant, its tiles, store formats (and their
        rounding modes) and native formats."""
        from vllm_mla_fusion.backends.triton import _store_params

        # An op's entry point takes only its own: op 1 has no output store, ops 1 and 2 one head per key store.
        stores = {k: self.kwargs.get(k, "plain") for k in ("CACHE_STORE", "OUT_STORE")}
        return dict(arch=arch, **asdict(v), label=v.label, tiles={k: self.kwargs.get(k, 1) for k in BLOCKS},
                    stores=stores,
                    modes={k.replace("STORE", "MODE"): _store_params(f)["MODE"] for k, f in stores.items()},
                    native_fp8=self.native, seconds=self.seconds)  # fmt: skip


def compile_variant(machine, target, v: Variant, asm: str, dump: Path | None = None) -> Compiled:
    """``v`` captured inside ``machine`` and compiled for ``target``; its ``asm`` listing
    (``"ptx"``, ``"amdgcn"``) written to ``dump/<arch>/<slug>.<asm>`` when ``dump`` is given."""
    t0 = time.monotonic()
    kernel, args, kwargs, native = capture_launch(machine, v)
    ck = compile_launch(target, kernel, args, kwargs)
    if dump is not None:
        folder = dump / str(target.arch)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{v.slug}.{asm}").write_text(ck.asm[asm])
    return Compiled(ck, kwargs, native, round(time.monotonic() - t0, 2))


def compile_in_subprocesses(module: str, archs, timeout: float = 900, triton_dir: Path | None = None) -> dict:
    """``python -m module --json ARCH`` for each arch, in parallel processes without
    ``TRITON_INTERPRET`` and with the plugin's own switches at their defaults (no
    ``VLLM_MLA_FUSION_*``: ``VLLM_MLA_FUSION_PDL=0`` would drop PDL): the results by
    ``(arch, op, label)``. ``triton_dir``: a directory holding another Triton
    (``triton_install``), imported instead of the environment's."""
    repo = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("VLLM_MLA_FUSION")}
    if triton_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(triton_dir), env.get("PYTHONPATH")]))
    procs = {
        arch: subprocess.Popen([sys.executable, "-m", module, "--json", arch], cwd=repo, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        for arch in archs
    }
    results = {}
    for arch, proc in procs.items():
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"compiling for {arch} failed:\n{err[-6000:]}"
        for r in json.loads(out):
            results[(r["arch"], r["op"], r["label"])] = r
    return results


# The Triton of the GPU image the kernel must also run on (torch 2.11 / Triton 3.6): its compiler
# differs from 3.8's in what it folds (a branch on a jitted helper's constexpr result is compiled
# on both sides by 3.6), so the sm_90 compile check runs under both (the ROCm one under the
# installed Triton only).
OTHER_TRITON = "3.6.0"


def triton_install(version: str = OTHER_TRITON) -> Path:
    """A directory holding Triton ``version`` (pip's wheel, no dependencies, ~640 MB installed),
    made once per machine beside the test environment (``$XDG_CACHE_HOME`` or ``~/.cache``, under
    vllm-mla-fusion/); put it first on ``PYTHONPATH`` to compile with it.

    Installed into a fresh directory under a lock, checked by importing it, then renamed into
    place: an interrupted install or two test processes at once never leave a partial tree that a
    later run would take for a whole one."""
    import fcntl
    import shutil
    import tempfile

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm-mla-fusion"
    target = base / f"triton-{version}-py{sys.version_info[0]}{sys.version_info[1]}"
    if (target / ".complete").exists():
        return target
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other process's install, if any, finishes first
        if (target / ".complete").exists():
            return target
        staging = Path(tempfile.mkdtemp(dir=base, prefix=f"{target.name}.partial-"))
        staging.chmod(0o755)
        try:
            pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                                  "--target", str(staging), f"triton=={version}"],
                                 capture_output=True, text=True)  # fmt: skip
            if pip.returncode != 0:
                raise RuntimeError(f"installing triton=={version} for the compile check failed (it needs the package "
                                   f"index):\n{pip.stderr[-2000:]}")  # fmt: skip
            probe = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"],
                                   env={**os.environ, "PYTHONPATH": str(staging)}, capture_output=True, text=True)
            if probe.stdout.strip() != version:
                raise RuntimeError(f"triton=={version} installed in {staging} imports as {probe.stdout.strip()!r}: "
                                   f"{probe.stderr[-1000:]}")  # fmt: skip
            (staging / ".complete").write_text(version)
            shutil.rmtree(target, ignore_errors=True)  # a partial tree of an older, unlocked install
            os.rename(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def table(results: list[dict], intro: str, columns: dict) -> str:
    """A markdown table of ``results``: the variant's arch, op, formats and tiles, then
    ``columns`` (heading -> the cell of a result)."""
    lines = [intro, "", "| arch | op | formats | tiles (T / rows / heads) | " + " | ".join(columns) + " |",
             "| --- " * (4 + len(columns)) + "|"]  # fmt: skip
    for r in results:
        t = r["tiles"]
        tiles = f"{t['BLOCK_T']} / {t['BLOCK_ROWS']} / {t['BLOCK_H']}"
        cells = [r["arch"], OP_NAMES[r["op"]], r["label"], tiles, *(str(cell(r)) for cell in columns.values())]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _no_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run without TRITON_INTERPRET: the kernel must be a JITFunction to be compiled")


def main(doc: str, archs: list[str], report, markdown, docs: Path | None = None, table: str = "",
         matrix=variants) -> int:  # fmt: skip
    """The command line of a compile tool: ``report(arch, variant, dump)`` gives one variant's
    results for each variant of ``matrix()``, ``markdown(results)`` their table, which
    ``--update-docs`` (where ``docs`` is given) writes into ``docs`` between the markers
    ``<!-- {table}:begin -->`` and ``<!-- {table}:end -->``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("arch", nargs="*", default=archs, help=f"of {archs} (default: all)")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--json", action="store_true", help="one JSON list of results on stdout")
    what.add_argument("--markdown", action="store_true", help="the docs table on stdout")
    if docs is not None:
        what.add_argument("--update-docs", action="store_true", help=f"rewrite the table in {docs.name}")
    ap.add_argument("--dump", type=Path, metavar="DIR", help="write each variant's assembly to DIR/ARCH/")
    opts = ap.parse_args()
    unknown = set(opts.arch) - set(archs)
    if unknown:
        ap.error(f"unknown arch {sorted(unknown)}; expected some of {archs}")
    _no_interpreter()
    results = [report(arch, v, opts.dump) for arch in opts.arch for v in matrix()]
    if opts.json:
        print(json.dumps(results))
        return 0
    text = markdown(results)
    if getattr(opts, "update_docs", False):
        begin, end = f"<!-- {table}:begin -->", f"<!-- {table}:end -->"
        old = docs.read_text()
        if begin not in old or end not in old:
            raise SystemExit(f"{docs} has no {begin} ... {end} markers")
        head, rest = old.split(begin, 1)
        docs.write_text(head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1])
        print(f"updated {docs}")
    else:
        print(text)
    return 0
