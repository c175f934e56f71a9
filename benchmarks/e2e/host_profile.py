"""The engine's host time per step, plugin on and off, from sampled Python stacks (issue 20).

One process per side and mode (plugin ``on`` / ``off`` x ``compiled`` / ``eager``), each an
in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core, and so the model
runner, is that process's main thread; ``--engine-process``: vLLM's default layout instead, the
engine core a child process with its own input and output threads, sampled by its pid) on DeepSeek-V3 at TP8-rank shapes (61 dense layers,
bf16, dummy weights, the attention backend vLLM picks, vLLM's defaults: torch.compile +
CUDA graphs; ``eager``: ``enforce_eager``). The side processes start together (compilation
and capture overlap), warm up, then measure one at a time, in an order the driver alternates
(off first in even rounds, on first in odd ones), so that no measurement shares the host with
another engine's start-up. Per block, each workload runs in a window sampled by py-spy:

- ``prefill_N``: K requests of N prompt tokens x 1 output token, one after another (one
  prefill step each);
- ``mixed``: D requests decoding while a prefill of N tokens arrives, per round (one mixed
  step, plus the decode steps until the prefill's token is out).

Sampling: ``py-spy record --pid <own pid> --nonblocking --idle --threads --function
--full-filenames --format raw`` started as a subprocess around each window, stopped by
SIGINT, and beside it a second one with ``--gil`` (which thread holds the GIL: a busy thread
of the plugin's process would slow down all its Python). Per window, each thread's CPU time
and context switches come from /proc (``schedstat``, ``status``): a main thread whose wall
time grows but not its CPU time waits (for the GIL, the device, a full launch queue). Why this way: attaching per window gives one collapsed file per workload (normalised
by the steps it ran), where ``py-spy record -- python ...`` would sample start-up and
compilation too; ``--nonblocking`` reads the stacks without stopping the process (the paused
variant adds exactly the kind of host time measured here); ``--idle`` keeps samples where the
thread waits (a device sync, a lock), so that the main thread's samples cover the window's wall
time. Before spawning py-spy the process allows any process of its user to trace it
(``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``): under Yama's ptrace_scope 1 a child may
otherwise not read its parent. Where py-spy is missing or cannot read the process (checked on a
warm-up window), an in-process SIGALRM sampler takes over (``--sampler signal``; its handler
costs the sampled thread a few us per sample, alike on both sides).

Per window the JSON records the units run, the window's length, the execute_model / sample_tokens
host spans and garbage collections (vllm_engine.py ``install_host_timer``), the
host-speed probe, gc counters; per side, process-wide facts before and after (gc thresholds,
threads, profile/trace hooks, torch dispatch modes and TLS keys, dynamo config, Triton hooks,
vLLM's splitting ops and compiled pieces) and a sync check (``torch.cuda.set_sync_debug_mode``
over one request per workload: the Python stacks of every synchronising call). The driver
then writes ``host_profile.md`` (host_profile_report.py: per-step on - off per
region and per function).

py-spy travels to the GPU machine as a wheel in ``.whl/`` (git-ignored; found there and
installed into /tmp/py-spy when no ``py-spy`` is on PATH)::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl py-spy==0.4.3

On the H200 (after ``scripts/gpu_session.sh install``; ~3.5 minutes for compiled on + off, cold
compile caches; ``--modes compiled eager`` adds the eager pair in the same time where the
compiled engines' start-up dominates)::

    PYTHONPATH=/tmp/site python3 -m benchmarks.e2e.host_profile --out $OUT --deadline-s 225

On this CPU machine (vLLM's CPU platform, CPU_MLA, stand-in kernels, eager; a smaller model)::

    python -m benchmarks.e2e.host_profile --cpu --out /tmp/hp --modes eager

(from the repository root; the side processes run the same module with ``-m`` there).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import glob
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

# Importing the benchmark sets vLLM's environment defaults (callables pickled into the engine,
# no usage stats, no Hub), before vLLM is imported.
from . import bench_vllm_e2e as B
from . import host_profile_report as report
from . import vllm_engine as E

REPO = B.REPO

SIDES = ("off", "on")
MODES = ("compiled", "eager")
PY_SPY_VERSION = "0.4.3"
PY_SPY_INSTALL_DIR = Path("/tmp/py-spy")
# Decode requests of the mixed workload: prompt tokens, and enough output tokens to outlive the window.
DECODE_PROMPT = 64


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------
# samplers


def find_py_spy() -> str | None:
    """py-spy on PATH, beside this interpreter, in /tmp/py-spy, or installed there from a wheel in .whl/."""
    found = shutil.which("py-spy") or next(
        (str(p) for p in (Path(sys.executable).parent / "py-spy", PY_SPY_INSTALL_DIR / "bin" / "py-spy") if p.exists()),
        None,
    )  # fmt: skip
    if found:
        return found
    wheels = sorted(glob.glob(str(REPO / ".whl" / "py_spy-*.whl")))
    if not wheels:
        return None
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                    str(PY_SPY_INSTALL_DIR), wheels[-1]], check=False, capture_output=True, timeout=120)  # fmt: skip
    exe = PY_SPY_INSTALL_DIR / "bin" / "py-spy"
    return str(exe) if exe.exists() else None


def allow_tracing_by_any_process() -> bool:
    """``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``: Yama (ptrace_scope 1) lets only ancestors trace a
    process unless it names its tracer; py-spy runs as this process's child. False where it failed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_ptracer, pr_set_ptracer_any = 0x59616D61, ctypes.c_ulong(-1)
        return libc.prctl(pr_set_ptracer, pr_set_ptracer_any, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class PySpySampler:
    """``py-spy record --pid <this process>`` around a window (see the module docstring), and a
    second py-spy with ``--gil`` beside it: which thread holds the GIL, sample by sample (a thread
    that holds it for long makes every Python line of the main thread wait)."""

    kind = "py-spy"

    def __init__(self, exe: str, rate_hz: int):
        self.exe, self.rate_hz = exe, rate_hz

    def _start(self, path: Path, pid: int, *flags: str) -> subprocess.Popen:
        cmd = [self.exe, "record", "--pid", str(pid), "--rate", str(self.rate_hz), "--format", "raw",
               "--nonblocking", "--threads", "--function", "--full-filenames", *flags, "-o", str(path)]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # py-spy prints "Sampling process N times a second" once it is attached.
        ready, _, _ = select.select([proc.stdout], [], [], 30.0)
        first = proc.stdout.readline() if ready else ""
        if "Sampling process" not in first:
            proc.kill()
            raise RuntimeError(f"py-spy did not start sampling: {first.strip()!r} {proc.communicate()[0][-500:]!r}")
        return proc

    @staticmethod
    def _stop(proc: subprocess.Popen) -> dict:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            out = proc.communicate(timeout=60)[0] or ""
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0] or ""
        m = re.search(r"Samples: (\d+) Errors: (\d+)", out)
        return {"returncode": proc.returncode, "samples_reported": int(m.group(1)) if m else None,
                "errors": int(m.group(2)) if m else None, "output_tail": out[-400:]}  # fmt: skip

    @contextlib.contextmanager
    def window(self, path: Path, gil_path: Path | None = None, pid: int | None = None):
        """Samples process ``pid`` (default: this one) into ``path`` (every thread, idle or not) and, given ``gil_path``,
        the GIL's holder into it, while the body runs; the dict it yields gets the window's length
        (``window_ms``: from py-spy's first sample to the stop signal) and py-spy's own counts."""
        info: dict = {"sampler": self.kind}
        procs = {}
        try:
            # The main sampler starts last and stops first: its samples span the window alone,
            # not the other py-spy's start-up and stop (its scale is window_ms / its samples).
            pid = pid or os.getpid()
            if gil_path is not None:
                procs["gil"] = self._start(gil_path, pid, "--gil")
            procs["main"] = self._start(path, pid, "--idle")
            t0 = time.perf_counter()
            yield info
            info["window_ms"] = 1e3 * (time.perf_counter() - t0)
        finally:
            if "main" in procs:
                info.update(self._stop(procs["main"]))
            if "gil" in procs:
                info["gil_sampler"] = self._stop(procs["gil"])


class SignalSampler:
    """In-process fallback: a SIGALRM handler (wall-clock interval timer) records the main thread's
    stack at ``rate_hz``, written in py-spy's raw format. The handler runs between bytecodes, so
    time inside one C call lands on the Python frame that made it, as with py-spy."""

    kind = "signal"

    def __init__(self, rate_hz: int):
        self.rate_hz = rate_hz

    @contextlib.contextmanager
    def window(self, path: Path, gil_path: Path | None = None, pid: int | None = None):
        """As PySpySampler.window, for this process only; no GIL record (``gil_path`` is ignored)."""
        if pid not in (None, os.getpid()):
            raise RuntimeError("the in-process sampler samples its own process only")
        counts: Counter = Counter()

        def on_alarm(signum, frame):
            codes = []
            while frame is not None:
                codes.append(frame.f_code)
                frame = frame.f_back
            counts[tuple(codes)] += 1

        previous = signal.signal(signal.SIGALRM, on_alarm)
        info: dict = {"sampler": self.kind}
        interval = 1.0 / self.rate_hz
        t0 = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, interval, interval)
        try:
            yield info
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0, 0)
            info["window_ms"] = 1e3 * (time.perf_counter() - t0)
            signal.signal(signal.SIGALRM, previous)
            head = f"thread ({threading.main_thread().native_id}): MainThread"
            with open(path, "w") as f:
                for codes, n in counts.items():
                    frames = [f"{c.co_qualname} ({c.co_filename}:{c.co_firstlineno})" for c in reversed(codes)]
                    f.write(";".join([head, *frames]) + f" {n}\n")
            info.update(samples_reported=sum(counts.values()), errors=0)


def make_sampler(kind: str, rate_hz: int):
    if kind == "signal":
        return SignalSampler(rate_hz)
    exe = find_py_spy()
    if exe is None:
        if kind == "py-spy":
            raise RuntimeError("py-spy not found (PATH, beside python, /tmp/py-spy, .whl/)")
        return SignalSampler(rate_hz)
    allow_tracing_by_any_process()
    return PySpySampler(exe, rate_hz)


# ---------------------------------------------------------------------------
# process-wide state


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _plain(value) -> str:
    """A value as comparable text across processes: sets sorted (string hashing differs per
    process), object addresses dropped."""
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(map(repr, value)))[:160] + "}"
    return _ADDRESS.sub("", repr(value))[:160]


def _safe(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a fact that cannot be read is reported as such
        return f"unavailable: {type(e).__name__}: {e}"


def _dynamo_config() -> dict:
    import torch._dynamo

    return {k: _plain(v) for k, v in sorted(torch._dynamo.config.get_config_copy().items())}


def _triton_hooks() -> dict:
    from triton import knobs

    rt = knobs.runtime
    names = ("jit_cache_hook", "jit_post_compile_hook", "launch_enter_hook", "launch_exit_hook", "add_stages_inspection_hook")  # fmt: skip
    return {n: _plain(getattr(rt, n, None)) for n in names}


def process_facts() -> dict:
    """What could make every piece of Python in this process slower or busier: compared side by side."""
    import torch

    cpus = sorted(os.sched_getaffinity(0))
    facts = {
        "gc_enabled": gc.isenabled(),
        "gc_threshold": gc.get_threshold(),
        "gc_count": gc.get_count(),
        "gc_freeze_count": gc.get_freeze_count(),
        "gc_callbacks": [_plain(c) for c in gc.callbacks],
        "gc_tracked_objects": len(gc.get_objects()),
        "threads": sorted(t.name for t in threading.enumerate()),
        "sys_getprofile": _plain(sys.getprofile()),
        "sys_gettrace": _plain(sys.gettrace()),
        "switch_interval_s": sys.getswitchinterval(),
        "modules_loaded": len(sys.modules),
        "cpu_affinity": len(cpus),
        "cpu_set": cpus,
        "torch_num_threads": torch.get_num_threads(),
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "autograd_profiler_enabled": torch.autograd._profiler_enabled(),
        "torch_function_modes": _safe(lambda: torch._C._len_torch_function_stack()),
        "dispatch_modes": _safe(lambda: [_plain(m) for m in torch.utils._python_dispatch._get_current_dispatch_mode_stack()]),
        "dispatch_tls_include": _safe(lambda: str(torch._C._dispatch_tls_local_include_set())),
        "dispatch_tls_exclude": _safe(lambda: str(torch._C._dispatch_tls_local_exclude_set())),
        "dynamo_config": _safe(_dynamo_config),
        "triton_hooks": _safe(_triton_hooks),
    }  # fmt: skip
    try:
        import dataclasses

        from vllm.compilation.counter import compilation_counter

        facts["compilation_counter"] = {k: v for k, v in dataclasses.asdict(compilation_counter).items() if isinstance(v, int)}
    except Exception:  # noqa: BLE001 - optional
        pass
    return facts


def allow_tracing_in_worker(worker) -> bool:
    """(remote, collective_rpc) ``allow_tracing_by_any_process`` in the process that runs the model."""
    return allow_tracing_by_any_process()


def process_facts_in_worker(worker) -> dict:
    """(remote, collective_rpc) ``process_facts`` of the process that runs the model."""
    return process_facts()


def thread_times(pid: int | None = None) -> dict[str, list[int]]:
    """Per thread of process ``pid`` (default: this one), from /proc: name -> [threads, CPU ns,
    voluntary and involuntary context switches], threads of one name summed; the main thread is
    ``MainThread``."""
    pid = pid or os.getpid()
    out: dict[str, list[int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = "MainThread" if task.name == str(pid) else (task / "comm").read_text().strip()
            cpu_ns = int((task / "schedstat").read_text().split()[0])
            status = (task / "status").read_text()
            switches = [int(re.search(rf"^{k}_ctxt_switches:\s+(\d+)", status, re.M).group(1))
                        for k in ("voluntary", "nonvoluntary")]  # fmt: skip
        except (OSError, AttributeError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
        row = out.setdefault(name, [0, 0, 0, 0])
        for i, v in enumerate([1, cpu_ns, *switches]):
            row[i] += v
    return out


def thread_times_delta(before: dict, after: dict) -> dict[str, dict]:
    """What each thread name did between two ``thread_times``: CPU ms and context switches."""
    out = {}
    for name, (n, cpu, vol, inv) in after.items():
        b = before.get(name, [0, 0, 0, 0])
        out[name] = {"threads": n, "cpu_ms": (cpu - b[1]) / 1e6, "voluntary": vol - b[2], "involuntary": inv - b[3]}
    return out


def facts_difference(a: dict, b: dict, prefix: str = "") -> dict:
    """Keys whose values differ between two ``process_facts`` (nested dicts flattened): name -> [a, b]."""
    out = {}
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out.update(facts_difference(x, y, f"{prefix}{k}."))
        elif x != y:
            out[f"{prefix}{k}"] = [x, y]
    return out


# ---------------------------------------------------------------------------
# one side


class Side:
    """One engine (side, mode) in this process: start, warm up, measure blocks on the driver's word."""

    def __init__(self, args):
        self.args = args
        self.name = f"{args.mode}_{args.side}"
        self.out = Path(args.out)
        self.control = Path(args.control)
        self.json_path = self.out / f"host_profile_{self.name}.json"
        self.prompts = B.Prompts(args.vocab, seed=1000 * MODES.index(args.mode) + SIDES.index(args.side))
        self.record: dict = {"side": args.side, "mode": args.mode, "pid": os.getpid(), "windows": [], "argv": sys.argv,
                             "engine": "engine-core process" if args.engine_process else "in-process"}  # fmt: skip
        self.engine_pid = os.getpid()
        self.jit_seen = 0  # entries of the engine's Triton JIT log already attributed

    def save(self) -> None:
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.record, indent=1, default=str))
        tmp.replace(self.json_path)

    def signal_driver(self, what: str) -> None:
        (self.control / f"{self.name}.{what}").touch()

    def wait_for_driver(self) -> str:
        """The driver's next word: ``go.<round>`` or ``exit``."""
        while True:
            for p in sorted(self.control.glob(f"{self.name}.go.*")):
                p.unlink()
                return p.name.split(".", 1)[1]
            if (self.control / f"{self.name}.exit").exists() or (self.control / "all.exit").exists():
                return "exit"
            time.sleep(0.05)

    # -- engine ------------------------------------------------------------------

    def engine_kwargs(self) -> dict:
        a = self.args
        longest = max([*a.prefill_lens, a.mixed_prefill])
        kw = dict(
            model=a.model_dir, load_format="dummy", skip_tokenizer_init=True, seed=0, dtype="bfloat16",
            max_model_len=max(longest, DECODE_PROMPT + a.mixed_decode_tokens) + 256,
            max_num_batched_tokens=max(longest, a.mixed_prefill + a.mixed_decoders, 512),
            max_num_seqs=max(8, a.mixed_decoders + 1), kv_cache_memory_bytes=int(a.kv_cache_gib * 2**30),
        )  # fmt: skip
        if a.attention_backend:
            kw["attention_backend"] = a.attention_backend
        if a.cpu:
            kw.update(attention_backend=a.attention_backend or "CPU_MLA", enforce_eager=True)
        else:
            # Several engines share the GPU while they start: each asks for its share only.
            kw["gpu_memory_utilization"] = a.gpu_memory_utilization
            if a.mode == "eager":
                kw["enforce_eager"] = True
            else:
                # vLLM's defaults otherwise; only the CUDA graph sizes are cut to what the
                # workloads' decode batches use (capture time).
                kw["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8]}
        return kw

    def start(self):
        from vllm import LLM

        a = self.args
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if a.engine_process else "0"
        # One compile cache per side and mode (bench_vllm_e2e.py: the AOT key does not cover the plugin).
        os.environ["VLLM_CACHE_ROOT"] = str(Path(a.work_dir) / f"vllm-cache-{self.name}")
        self.record["registered"] = E.set_plugin(a.side == "on")
        t = time.perf_counter()
        llm = LLM(**self.engine_kwargs())
        self.record["start_s"] = time.perf_counter() - t
        facts = {**llm.apply_model(E.mla_facts)[0], **llm.collective_rpc(E.runner_facts)[0]}
        self.engine_pid = facts["pid"]  # the process that runs the model: this one, or the engine core's
        modes = {layer["fusion_mode"] for layer in facts["layers"]}
        want = {"decode"} if a.side == "on" else {None}
        facts["layers"] = facts["layers"][:1] + [{"same_as_first_for": len(facts["layers"]) - 1}]
        self.record["facts"] = facts
        if modes != want:
            raise RuntimeError(f"plugin {a.side}: MLA layers in modes {modes}, expected {want}")
        llm.collective_rpc(E.install_host_timer)
        llm.collective_rpc(E.install_jit_hook)
        return llm

    # -- workloads ---------------------------------------------------------------

    def prefill(self, llm, length: int, requests: int) -> None:
        for _ in range(requests):
            llm.generate(self.prompts.take(1, length), B.sampling(1), use_tqdm=False)

    def decoders(self, llm):
        """``mixed_decoders`` requests decoding for the body's duration (vllm_engine.running_decoders)."""
        a = self.args
        return E.running_decoders(llm, self.prompts.take(a.mixed_decoders, DECODE_PROMPT),
                                  B.sampling(a.mixed_decode_tokens), prefix="hp-dec")  # fmt: skip

    def mixed_round(self, llm) -> None:
        """A prefill of ``mixed_prefill`` tokens joins the decoders; steps until its token is out."""
        rid = E.add_request(llm, self.prompts.take(1, self.args.mixed_prefill)[0], B.sampling(1), prefix="hp")
        E.engine_steps(llm, until=lambda finished: rid in finished)

    def workloads(self) -> list[tuple[str, str, int]]:
        """(name, unit, units per window)."""
        a = self.args
        out = [(f"prefill_{n}", "prefill step", a.prefill_requests) for n in a.prefill_lens]
        if a.mixed_rounds:
            out.append((f"mixed_{a.mixed_decoders}dec_{a.mixed_prefill}", "round", a.mixed_rounds))
        return out

    def run_workload(self, llm, name: str, units: int) -> None:
        if name.startswith("prefill_"):
            self.prefill(llm, int(name.split("_")[1]), units)
        else:
            for _ in range(units):
                self.mixed_round(llm)

    # -- measuring ---------------------------------------------------------------

    def window(self, llm, sampler, name: str, unit: str, units: int, tag: str) -> dict:
        path = self.out / f"host_profile_{self.name}_{name}_{tag}.collapsed"
        gil_path = path.with_name(path.stem + "_gil.collapsed")
        llm.collective_rpc(E.read_host_timer)  # drop what came before
        rec: dict = {"workload": name, "unit": unit, "units": units, "tag": tag, "collapsed": path.name}
        ctx = self.decoders(llm) if name.startswith("mixed") else contextlib.nullcontext()
        with ctx:
            # /proc is read outside the sampled window (a few ms on a busy machine); the main
            # thread only waits on py-spy meanwhile, so its CPU time is the workload's.
            threads_before = thread_times(self.engine_pid)
            with sampler.window(path, gil_path, self.engine_pid) as info:
                self.run_workload(llm, name, units)
            rec["threads"] = thread_times_delta(threads_before, thread_times(self.engine_pid))
        rec.update(info)
        if "gil_sampler" in info:
            rec["gil_collapsed"] = gil_path.name
        rec["host"] = E.host_summary(llm.collective_rpc(E.read_host_timer)[0])
        rec["gc_collections"] = dict(Counter(rec["host"].get("gc_generations", [])))
        # Triton compilations (or cache loads) the window triggered: the JIT log only grows.
        jit = llm.collective_rpc(E.read_jit_log)[0]
        rec["jit_compilations"] = [{k: e.get(k) for k in ("kernel", "module", "compile_ms")} for e in jit[self.jit_seen:]]
        self.jit_seen = len(jit)
        return rec

    def engine_facts(self, llm) -> dict:
        return process_facts() if self.engine_pid == os.getpid() else llm.collective_rpc(process_facts_in_worker)[0]

    def check_sampler(self, llm, sampler):
        """A warm-up window through the sampler: py-spy that cannot read this process (no samples,
        only errors) gives way to the in-process sampler."""
        name, unit, _ = self.workloads()[0]
        try:
            rec = self.window(llm, sampler, name, unit, 1, "check")
            stacks = report.read_stacks(self.out / rec["collapsed"])
            ok = sum(stacks.values()) > 0
            self.record["sampler_check"] = {k: rec.get(k) for k in ("samples_reported", "errors", "window_ms", "output_tail")}
        except Exception as e:  # noqa: BLE001 - any failure: the fallback
            ok = False
            self.record["sampler_check"] = {"error": f"{type(e).__name__}: {e}"}
        if ok or self.args.sampler == "py-spy" or self.engine_pid != os.getpid():
            return sampler  # (the in-process sampler cannot sample another process)
        log(f"{self.name}: py-spy failed ({self.record['sampler_check']}); sampling in-process instead")
        return SignalSampler(self.args.rate)

    def sync_check(self, llm) -> dict:
        """One request per workload under ``torch.cuda.set_sync_debug_mode("warn")``: where the
        host waited for the device (Python stacks of every synchronising call, counted)."""
        import warnings

        import torch

        if not torch.cuda.is_available():
            return {"skipped": "no CUDA"}
        origins: Counter = Counter()

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                frames = traceback.extract_stack()[:-2]
                origins[" <- ".join(f"{report.short_path(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-6:]))] += 1

        out = {}
        for name, _, _ in self.workloads():
            origins.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    ctx = self.decoders(llm) if name.startswith("mixed") else contextlib.nullcontext()
                    with ctx:
                        self.run_workload(llm, name, 1)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            out[name] = {"syncs": sum(origins.values()),
                         "plugin_syncs": sum(n for o, n in origins.items() if "vllm_mla_fusion/" in o),
                         "origins": dict(origins.most_common(12))}  # fmt: skip
        return out

    def run(self) -> int:
        a = self.args
        try:
            llm = self.start()
            log(f"{self.name}: engine up in {self.record['start_s']:.1f} s")
            self.record["process_before"] = self.engine_facts(llm)
            for name, _, _ in self.workloads():  # warm-up: each shape twice, unsampled
                for _ in range(2):
                    self.run_workload(llm, name, 1)
            if self.engine_pid != os.getpid():
                self.record["engine_allows_tracing"] = llm.collective_rpc(allow_tracing_in_worker)[0]
            sampler = self.check_sampler(llm, make_sampler(a.sampler, a.rate))
            self.record["sampler"] = {"kind": sampler.kind, "rate_hz": a.rate, "exe": getattr(sampler, "exe", None)}
            if a.sync_check and not a.engine_process:
                self.record["sync_check"] = self.sync_check(llm)
            self.save()
        except Exception as e:  # noqa: BLE001 - reported to the driver through the JSON
            self.record["error"] = f"start: {type(e).__name__}: {e}"
            self.record["traceback"] = traceback.format_exc()[-6000:]
            self.save()
            self.signal_driver("failed")
            log(f"{self.name}: {self.record['error']}")
            return 1
        self.signal_driver("ready")
        status = 0
        while (word := self.wait_for_driver()) != "exit":
            tag = f"r{word.split('.')[-1]}"
            try:
                self.record.setdefault("host_probe", []).append(llm.collective_rpc(E.host_speed_probe)[0])
                for name, unit, units in self.workloads():
                    rec = self.window(llm, sampler, name, unit, units, tag)
                    self.record["windows"].append(rec)
                    execs = rec["host"].get("execute_model_ms") or []
                    log(f"{self.name} {tag} {name}: {units} {unit}s in {rec.get('window_ms', 0):.0f} ms, "
                        f"execute_model {sum(execs) / max(units, 1):.2f} ms per {unit}, "
                        f"{rec.get('samples_reported')} samples")  # fmt: skip
                self.record["host_probe"].append(llm.collective_rpc(E.host_speed_probe)[0])
            except Exception as e:  # noqa: BLE001
                self.record.setdefault("errors", []).append(f"{tag}: {type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")
                status = 1
            self.record["host_probe_summary"] = report.probe_summary(self.record.get("host_probe", []))
            self.save()
            self.signal_driver(f"done.{word.split('.')[-1]}")
        self.record["process_after"] = self.engine_facts(llm)
        self.record["process_changed_while_measuring"] = facts_difference(
            self.record["process_before"], self.record["process_after"]
        )
        self.save()
        if self.engine_pid != os.getpid():
            E.shutdown(llm)  # the engine core is a child: it must not outlive this process
        # No other teardown: the driver is waiting, and the process's exit frees the GPU.
        sys.stdout.flush()
        os._exit(status)


# ---------------------------------------------------------------------------
# driver


def write_model(args) -> str:
    if args.cpu:
        from demo import tiny_model

        cfg = dict(tiny_model.CONFIG, num_hidden_layers=args.layers or tiny_model.CONFIG["num_hidden_layers"])
    else:
        cfg = dict(B.DSV3_TP8_CONFIG)
        if args.layers:
            cfg.update(num_hidden_layers=args.layers, first_k_dense_replace=args.layers)
    cfg["first_k_dense_replace"] = cfg["num_hidden_layers"]
    d = Path(args.work_dir) / ("model-cpu" if args.cpu else "model")
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(d)


def side_env(args) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_ENABLE_V1_MULTIPROCESSING="1" if args.engine_process else "0")
    if args.cpu:
        env.update(VLLM_TARGET_DEVICE="cpu", MLA_FUSION_E2E_CPU_STANDINS="1")
        # One torch thread: on a shared 2-core machine OpenMP's spinning threads made the same
        # layer call vary 5-50x between rounds (plugin_host_calls.py).
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def physical_cores(cpus: set[int] | None = None) -> list[list[int]]:
    """The CPUs this process may use, grouped by physical core (SMT siblings together, from sysfs;
    one CPU per group where the topology cannot be read), in CPU order."""
    cpus = set(os.sched_getaffinity(0) if cpus is None else cpus)
    groups: set[tuple[int, ...]] = set()
    for cpu in cpus:
        try:
            text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
            groups.add(tuple(sorted(cpus & _cpu_list(text))) or (cpu,))
        except OSError:
            groups.add((cpu,))
    return [list(g) for g in sorted(groups)]


def _cpu_list(text: str) -> set[int]:
    """A sysfs CPU list such as ``0-3,8,10-11``."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def cpu_sets(names: list[str], cores: list[list[int]]) -> dict[str, list[int]]:
    """Disjoint CPU sets of whole physical cores, one per side process, as many cores each as fit.

    Why: the first H200 profile (2026-12-02) found the same interpreter loop taking 90 us in some
    blocks and 140-176 us in others, in both processes, with the slow readings falling mostly on
    the plugin's side. Unpinned, a side's main thread may share a physical core with the other
    engine's threads or with its py-spy; pinned, each side owns its cores (py-spy, started by the
    side, inherits them)."""
    per = len(cores) // len(names)
    if per < 1:
        raise ValueError(f"{len(cores)} physical cores cannot give {len(names)} side processes one each")
    return {name: sorted(c for core in cores[i * per:(i + 1) * per] for c in core) for i, name in enumerate(names)}


def drive(args) -> int:
    """Start every (mode, side) process, wait until all are warm, hand out the measuring blocks one
    at a time, then write the report. Keeps inside ``--deadline-s``."""
    t0 = time.monotonic()
    out, control = Path(args.out), Path(args.work_dir) / "control"
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(control, ignore_errors=True)
    control.mkdir(parents=True)
    for p in out.glob("host_profile_*"):
        p.unlink()
    args.model_dir = write_model(args)
    names = [f"{m}_{s}" for m in args.modes for s in SIDES]
    procs = {}
    pins = cpu_sets(names, physical_cores()) if args.pin_cpus else {}
    base = [sys.executable, "-m", "benchmarks.e2e.host_profile"] + [x for x in sys.argv[1:] if x != "--cpu"] + (["--cpu"] if args.cpu else [])
    for name in names:
        mode, side = name.split("_")
        logf = open(out / f"host_profile_{name}.log", "w")
        cmd = base + ["--side", side, "--mode", mode, "--control", str(control), "--model-dir", args.model_dir]
        # Pinned before exec: every thread the side starts, and its py-spy, inherit the set.
        pin = (lambda cpus=pins[name]: os.sched_setaffinity(0, cpus)) if name in pins else None
        procs[name] = subprocess.Popen(cmd, cwd=REPO, env=side_env(args), stdout=logf, stderr=subprocess.STDOUT,
                                       preexec_fn=pin)  # fmt: skip
    log(f"started {names} (pids {[p.pid for p in procs.values()]}; CPUs {pins or 'not pinned'})")

    def left() -> float:
        return args.deadline_s - (time.monotonic() - t0)

    def state(name: str, word: str) -> bool:
        return (control / f"{name}.{word}").exists()

    while left() > 0 and not all(state(n, "ready") or state(n, "failed") or procs[n].poll() is not None for n in names):
        time.sleep(0.2)
    ready = [n for n in names if state(n, "ready")]
    log(f"warm after {time.monotonic() - t0:.0f} s: {ready}; not: {sorted(set(names) - set(ready))}")
    summary = {"started": names, "cpu_sets": pins, "ready": ready, "ready_s": time.monotonic() - t0, "blocks": [], "skipped": []}
    block_s = 0.0
    for r in range(args.rounds):
        order = [f"{m}_{s}" for m in args.modes for s in (SIDES if r % 2 == 0 else SIDES[::-1])]
        for name in [n for n in order if n in ready]:
            if left() < block_s + args.exit_reserve_s:
                summary["skipped"].append(f"{name} r{r}: {left():.0f} s left, a block took {block_s:.0f} s")
                continue
            t = time.monotonic()
            (control / f"{name}.go.{r}").touch()
            while not state(name, f"done.{r}") and procs[name].poll() is None and left() > 5:
                time.sleep(0.05)
            took = time.monotonic() - t
            block_s = max(block_s, took)
            summary["blocks"].append({"name": name, "round": r, "s": took, "done": state(name, f"done.{r}")})
    (control / "all.exit").touch()
    for name, p in procs.items():
        try:
            p.wait(timeout=max(5.0, min(60.0, left())))
        except subprocess.TimeoutExpired:
            p.kill()  # a process this driver started, by its handle
            summary["skipped"].append(f"{name}: killed at exit")
    summary["elapsed_s"] = time.monotonic() - t0
    (out / "host_profile_run.json").write_text(json.dumps(summary, indent=1))
    md = report.build_report(out)
    md += "\n" + process_section(out)
    (out / "host_profile.md").write_text(md)
    print(md)
    log(f"done in {summary['elapsed_s']:.0f} s; {out / 'host_profile.md'}")
    return 0 if all(b["done"] for b in summary["blocks"]) and summary["blocks"] else 1


def process_section(out: Path) -> str:
    """Process-wide facts that differ between the sides of a mode, and the sync checks."""
    lines = ["## Process-wide state, on vs off", ""]
    for mode in MODES:
        paths = {s: out / f"host_profile_{mode}_{s}.json" for s in SIDES}
        if not all(p.exists() for p in paths.values()):
            continue
        data = {s: json.loads(p.read_text()) for s, p in paths.items()}
        for s in SIDES:
            if data[s].get("error"):
                lines.append(f"- {mode} {s}: {data[s]['error']}")
        before = {s: data[s].get("process_before", {}) for s in SIDES}
        diff = facts_difference(before["off"], before["on"])
        lines.append(f"- {mode}: facts that differ (off, on): " + (json.dumps(diff)[:3000] if diff else "none"))
        for s in SIDES:
            if data[s].get("process_changed_while_measuring"):
                lines.append(f"- {mode} {s}: changed while measuring: {json.dumps(data[s]['process_changed_while_measuring'])[:1500]}")
            jit = [(w["workload"], w["tag"], c["kernel"], round(c["compile_ms"] or 0, 1))
                   for w in data[s].get("windows", []) for c in w.get("jit_compilations", [])]  # fmt: skip
            lines.append(f"- {mode} {s}: Triton JIT compilations inside measured windows: {jit or 'none'}")
            if data[s].get("sync_check"):
                sc = {k: (v.get("syncs"), v.get("plugin_syncs")) if isinstance(v, dict) else v
                      for k, v in data[s]["sync_check"].items()}  # fmt: skip
                lines.append(f"- {mode} {s}: syncs per request (all, from the plugin): {sc}")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="collapsed stacks, per-side JSON, logs, host_profile.md")
    ap.add_argument("--work-dir", default=None, help="model dir, compile caches, control files (default: /tmp/host_profile_work)")
    ap.add_argument("--modes", nargs="+", default=None, choices=MODES, help="default: compiled (--cpu: eager)")
    ap.add_argument("--rounds", type=int, default=3, help="measuring blocks per engine; sides alternate which goes first")
    ap.add_argument("--prefill-lens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--prefill-requests", type=int, default=10, help="prefill steps per window")
    ap.add_argument("--mixed-decoders", type=int, default=4)
    ap.add_argument("--mixed-prefill", type=int, default=1024)
    ap.add_argument("--mixed-rounds", type=int, default=5, help="prefills arriving per mixed window (0: no mixed workload)")
    ap.add_argument("--mixed-decode-tokens", type=int, default=256, help="output tokens a decoder asks for (aborted at the window's end)")
    ap.add_argument("--rate", type=int, default=1000, help="samples per second")
    ap.add_argument("--sampler", default="auto", choices=["auto", "py-spy", "signal"],
                    help="auto: py-spy, or the in-process sampler where py-spy cannot read the process")
    ap.add_argument("--no-sync-check", dest="sync_check", action="store_false")
    ap.add_argument("--engine-process", action="store_true",
                    help="vLLM's default layout instead: the engine core in a process of its own (with its input "
                    "and output threads), sampled by pid; no sync check, no in-process fallback sampler")
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache per engine (default 4; CPU 0.25)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="per engine (default 0.9 / number of engines)")
    ap.add_argument("--pin-cpus", action="store_true",
                    help="give each side process its own physical cores (cpu_sets: why)")
    ap.add_argument("--deadline-s", type=float, default=225.0, help="the driver hands out no block that would end later")
    ap.add_argument("--exit-reserve-s", type=float, default=15.0)
    ap.add_argument("--cpu", action="store_true", help="vLLM's CPU platform, CPU_MLA, stand-in kernels, the tiny model")
    # Set by the driver for its side processes.
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--control", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.out = str(Path(args.out).resolve())
    args.work_dir = str(Path(args.work_dir or "/tmp/host_profile_work").resolve())
    if args.cpu:
        # Compiled on vLLM's CPU platform needs a kernel the stand-ins lack (the dummy sampler
        # run's fused_gumbel_argmax): the CPU run is eager.
        args.modes = ["eager"]
    elif args.modes is None:
        args.modes = ["compiled"]
    if args.kv_cache_gib is None:
        args.kv_cache_gib = 0.25 if args.cpu else 4.0
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = round(0.9 / (2 * len(args.modes)), 3)
    cfg = json.loads((Path(args.model_dir) / "config.json").read_text()) if args.model_dir else {}
    args.vocab = cfg.get("vocab_size", 0)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu:
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
        from demo import cpu_stand_ins

        cpu_stand_ins.install()
    if args.side:
        return Side(args).run()
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
