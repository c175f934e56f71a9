"""Reading the torch-profiler traces vLLM's workers write: engine steps and what each launched.

vLLM 0.33 (``vllm/v1/worker/gpu_worker.py``, ``Worker.annotate_profile``) wraps
every ``execute_model`` of a profiled session in a ``record_function`` named
``execute_context_<R>(<T>)_generation_<R>(<T>)``: R requests and T new tokens
still in their prompt ("context") or generating. The trace is the Chrome trace
torch.profiler exports (``<prefix>_dp0_pp0_tp0_..._rank0.<ns>.pt.trace.json.gz``
in ``torch_profiler_dir``).

A GPU kernel belongs to the step during whose *launch window* its launch call
(``cudaLaunchKernel``, ``cuLaunchKernelEx``, ``cudaGraphLaunch``, ...) was
issued: from the step's annotation start to the next step's. The kernel and
its launch share ``args.correlation``; kernels replayed from a CUDA graph carry
the correlation of the ``cudaGraphLaunch``. Attribution by launch, not by GPU
timestamp, because with async scheduling the GPU still runs step i while the
host already prepares step i+1. The last step has no successor: its window is
closed at its annotation's end, so the sampler kernels launched after it are
missed; measurements use steps that have a successor (``Step.closed``).

CPU ops (torch.library custom ops appear as ``namespace::op`` cpu_op events)
are attributed to the step whose annotation contains them.

A step's *host span* is its annotation's duration: the time the host spends in
``execute_model``. ``host_breakdown`` splits it into the host events directly
under the annotation (on its thread): Inductor's compiled pieces (``## Call
CompiledFxGraph <key> ##``), the attention-region ops, launches and aten ops
called between them, and the rest, Python with no event of its own.

No vLLM, torch or GPU needed: the CPU tests feed synthetic traces.
"""

from __future__ import annotations

import bisect
import glob
import gzip
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

STEP_RE = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$")
# Launch APIs, as kineto names them (runtime and driver API).
LAUNCH_NAMES = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cudaLaunchCooperativeKernel",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
    "cuGraphLaunch",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
)
GRAPH_LAUNCH_NAMES = ("cudaGraphLaunch", "cuGraphLaunch")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
# Host events that can sit directly under a step annotation.
HOST_CATEGORIES = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function")
COMPILED_PIECE_RE = re.compile(r"^## Call CompiledFxGraph .* ##$")
COMPILED_PIECE = "compiled pieces (## Call CompiledFxGraph ##)"

# The prefix of the project's kernels (vllm_mla_fusion/backends/triton.py: one entry point per op,
# _mla_rope_cache_kernel_op1 / _op2 / _op3); every fused op launches one of them.
FUSED_KERNEL = "_mla_rope_cache_kernel"
# Kernels of the chain the plugin replaces, as vLLM 0.33 names them: its RoPE CUDA kernel
# (custom op rotary_embedding), its MLA cache write (concat_and_cache_mla), the decode
# query concat (_C concat_mla_q, or torch.cat's CatArrayBatchedCopy) and the fp8 query
# quantisation of _DecodeConcatQuantFP8's CUDA path. Inductor-generated kernels that do
# RoPE have no stable name; the on/off kernel diff shows them.
VLLM_CHAIN_PATTERNS = (
    "rotary_embedding",
    "concat_and_cache_mla",
    "concat_mla_q",
    "CatArrayBatchedCopy",
    "scaled_fp8_quant",
)


@dataclass
class GpuEvent:
    name: str
    cat: str  # kernel | gpu_memcpy | gpu_memset
    ts: float  # us
    dur: float  # us
    graph: bool  # launched by a CUDA graph replay


@dataclass
class Step:
    """One ``execute_model`` of the profiled session."""

    index: int
    name: str
    ts: float
    dur: float  # the host span of execute_model
    ctx_reqs: int
    ctx_tokens: int
    gen_reqs: int
    gen_tokens: int
    closed: bool = False  # a later step bounds its launch window
    thread: tuple = ()  # (pid, tid) of the annotation: the host thread that ran the step
    gpu: list[GpuEvent] = field(default_factory=list)
    cpu_ops: Counter = field(default_factory=Counter)
    cpu_op_us: Counter = field(default_factory=Counter)  # host time inside each counted op (its event's dur)
    launches: Counter = field(default_factory=Counter)  # launch API name -> count
    host: dict = field(default_factory=dict)  # host_breakdown's entry, where the caller keeps it

    @property
    def kind(self) -> str:
        if self.ctx_tokens and self.gen_tokens:
            return "mixed"
        if self.ctx_tokens:
            return "prefill"
        if self.gen_tokens:
            return "decode"
        return "empty"

    @property
    def kernels(self) -> list[GpuEvent]:
        return [e for e in self.gpu if e.cat == "kernel"]

    def kernel_counts(self, short: bool = True) -> Counter:
        return Counter(short_name(e.name) if short else e.name for e in self.kernels)

    def count_matching(self, pattern: str) -> int:
        return sum(1 for e in self.kernels if pattern in e.name)

    def gpu_time_us(self) -> dict:
        """``sum``: kernel durations added up; ``busy``: the union of all GPU intervals
        (kernels, copies, memsets; overlapping kernels, e.g. under programmatic dependent
        launch, count once); ``span``: first start to last end; ``memcpy``/``memset`` sums."""
        kernels = self.kernels
        out = {
            "sum": sum(e.dur for e in kernels),
            "memcpy": sum(e.dur for e in self.gpu if e.cat == "gpu_memcpy"),
            "memset": sum(e.dur for e in self.gpu if e.cat == "gpu_memset"),
            "busy": union_length((e.ts, e.ts + e.dur) for e in self.gpu),
            "span": 0.0,
            "kernels": len(kernels),
        }
        if self.gpu:
            out["span"] = max(e.ts + e.dur for e in self.gpu) - min(e.ts for e in self.gpu)
        return out

    def summary(self) -> dict:
        return {
            "index": self.index,
            "name": self.name,
            "kind": self.kind,
            "closed": self.closed,
            "ctx_reqs": self.ctx_reqs,
            "ctx_tokens": self.ctx_tokens,
            "gen_reqs": self.gen_reqs,
            "gen_tokens": self.gen_tokens,
            "graph_launches": sum(self.launches[n] for n in GRAPH_LAUNCH_NAMES),
            "gpu_us": self.gpu_time_us(),
        }


def short_name(name: str, limit: int = 200) -> str:
    """A kernel's name without ``void``, anonymous namespaces and its parameter list; template
    arguments stay (``vectorized_elementwise_kernel<4, CUDAFunctor_add<...>>`` and
    ``<..., mul>`` are different kernels)::

        void vllm::concat_and_cache_mla_kernel<bf16, (Fp8KVCacheDataType)0>(const bf16*, ...)
        -> vllm::concat_and_cache_mla_kernel<bf16, (Fp8KVCacheDataType)0>
    """
    s = name.strip()
    if s.startswith("void "):
        s = s[5:]
    s = s.replace("(anonymous namespace)::", "")
    depth = 0
    for i, ch in enumerate(s):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(depth - 1, 0)
        elif ch == "(" and depth == 0 and i > 0:
            s = s[:i]
            break
    return s.strip()[:limit]


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, None
    start = None
    for a, b in sorted(intervals):
        if end is None or a > end:
            if end is not None:
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    if end is not None:
        total += end - start
    return total


def find_traces(directory: str, prefix: str = "") -> list[str]:
    """Trace files a vLLM profiling session with ``profile_prefix=prefix`` wrote, oldest first."""
    paths = glob.glob(os.path.join(directory, f"{glob.escape(prefix)}*.pt.trace.json*"))
    return sorted(paths, key=os.path.getmtime)


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _correlation(ev: dict):
    args = ev.get("args") or {}
    return args.get("correlation", args.get("correlation id"))


def _events(trace) -> list:
    """The trace's events: Chrome's trace format is an object with ``traceEvents`` or a bare list."""
    return trace if isinstance(trace, list) else trace.get("traceEvents", [])


def parse_steps(trace: dict, cpu_op_names: Iterable[str] | None = None) -> list[Step]:
    """The session's engine steps, each with the GPU work it launched and the CPU ops it ran.

    ``cpu_op_names``: count only these cpu_op names (None: none; counting every aten op
    of a long trace costs time and nothing here needs it).
    """
    events = _events(trace)
    wanted = set(cpu_op_names or ())
    steps: list[Step] = []
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") != "user_annotation":
            continue
        m = STEP_RE.match(ev.get("name", ""))
        if m:
            cr, ct, gr, gt = (int(g) for g in m.groups())
            steps.append(Step(0, ev["name"], float(ev["ts"]), float(ev.get("dur", 0.0)), cr, ct, gr, gt,
                              thread=(ev.get("pid"), ev.get("tid"))))  # fmt: skip
    steps.sort(key=lambda s: s.ts)
    for i, s in enumerate(steps):
        s.index = i
        s.closed = i + 1 < len(steps)
    if not steps:
        return steps
    starts = [s.ts for s in steps]

    def window(ts: float) -> Step | None:
        i = bisect.bisect_right(starts, ts) - 1
        if i < 0:
            return None
        s = steps[i]
        if not s.closed and ts > s.ts + s.dur:
            return None
        return s

    launch_step: dict = {}
    graph_corr: set = set()
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat = ev.get("cat")
        if cat in LAUNCH_CATEGORIES:
            name = ev.get("name", "")
            corr = _correlation(ev)
            s = window(float(ev["ts"]))
            if s is not None and name in LAUNCH_NAMES:
                s.launches[name] += 1
            if corr is not None and s is not None:
                launch_step[corr] = s
                if name in GRAPH_LAUNCH_NAMES:
                    graph_corr.add(corr)
        # A dispatcher op is a cpu_op; the plugin calls the ops' bodies directly (ops.eager),
        # which name themselves with a record_function range (a user_annotation) instead.
        elif cat in ("cpu_op", "user_annotation") and wanted and ev.get("name") in wanted:
            ts = float(ev["ts"])
            i = bisect.bisect_right(starts, ts) - 1
            if i >= 0 and ts <= steps[i].ts + steps[i].dur:
                steps[i].cpu_ops[ev["name"]] += 1
                steps[i].cpu_op_us[ev["name"]] += float(ev.get("dur", 0.0))
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") not in GPU_CATEGORIES:
            continue
        corr = _correlation(ev)
        s = launch_step.get(corr)
        if s is not None:
            s.gpu.append(GpuEvent(ev.get("name", ""), ev["cat"], float(ev["ts"]), float(ev.get("dur", 0.0)),
                                  corr in graph_corr))  # fmt: skip
    return steps


def host_breakdown(trace: dict, steps: list[Step]) -> list[dict]:
    """Per step, where its host span goes: the host events directly under its annotation.

    Each entry: ``span`` (us), ``children`` (name -> [count, us]; Inductor's compiled pieces,
    whatever their cache key, are one name, ``COMPILED_PIECE``) and ``uncovered`` (us of the
    span inside no child: Python between the ops). Events on other threads (vLLM's output
    thread, the profiler's) are not children.
    """
    events = _events(trace)
    threads: dict = {}
    for ev in events:
        if ev.get("ph") == "X" and ev.get("cat") in HOST_CATEGORIES and not STEP_RE.match(ev.get("name", "")):
            threads.setdefault((ev.get("pid"), ev.get("tid")), []).append(
                (float(ev["ts"]), float(ev.get("dur", 0.0)), ev.get("name", "")))
    for evs in threads.values():
        evs.sort(key=lambda e: (e[0], -e[1]))  # a parent before the children that start with it
    out = []
    for s in steps:
        evs = threads.get(s.thread, [])
        end = s.ts + s.dur
        i = bisect.bisect_left(evs, (s.ts, float("-inf")))
        children: dict = {}
        covered, child_end = 0.0, s.ts
        for ts, dur, name in evs[i:]:
            if ts > end:
                break
            if ts < child_end:  # inside the previous child: a grandchild
                continue
            if COMPILED_PIECE_RE.match(name):
                name = COMPILED_PIECE
            row = children.setdefault(name, [0, 0.0])
            d = min(dur, end - ts)
            row[0] += 1
            row[1] += d
            covered += d
            child_end = ts + dur
        out.append({"span": s.dur, "children": children, "uncovered": s.dur - covered})
    return out


def unattributed_gpu_events(trace: dict, steps: list[Step]) -> int:
    """GPU events whose launch lies in no step's window (profiler start/stop, other threads)."""
    events = _events(trace)
    total = sum(1 for ev in events if ev.get("ph") == "X" and ev.get("cat") in GPU_CATEGORIES)
    return total - sum(len(s.gpu) for s in steps)


def per_step_kernel_table(steps: list[Step]) -> dict:
    """Per kernel (short name): launches and microseconds per step, averaged over ``steps``."""
    if not steps:
        return {}
    n = len(steps)
    count: Counter = Counter()
    time_us: Counter = Counter()
    for s in steps:
        for e in s.kernels:
            k = short_name(e.name)
            count[k] += 1
            time_us[k] += e.dur
    return {k: {"per_step": count[k] / n, "us_per_step": time_us[k] / n} for k in count}


def kernel_diff(on: dict, off: dict) -> dict:
    """Kernels (short names) per step of an on-table minus an off-table (``per_step_kernel_table``).

    ``added``: only with the plugin; ``removed``: only without; ``changed``: in both,
    with a different launch count or time. Each entry: launches and us per step, both sides.
    """
    out: dict = {"added": {}, "removed": {}, "changed": {}}
    for k in sorted(set(on) | set(off)):
        a, b = on.get(k), off.get(k)
        row = {
            "on_per_step": a["per_step"] if a else 0.0,
            "off_per_step": b["per_step"] if b else 0.0,
            "on_us": a["us_per_step"] if a else 0.0,
            "off_us": b["us_per_step"] if b else 0.0,
        }
        if a and not b:
            out["added"][k] = row
        elif b and not a:
            out["removed"][k] = row
        elif a["per_step"] != b["per_step"] or abs(a["us_per_step"] - b["us_per_step"]) > 0.05 * max(
            a["us_per_step"], b["us_per_step"], 1e-9
        ):
            out["changed"][k] = row
    return out


def format_diff(diff: dict, top: int = 12) -> list[str]:
    """Text lines of a ``kernel_diff``, largest time first."""
    lines = []
    for part in ("removed", "added", "changed"):
        rows = sorted(diff[part].items(), key=lambda kv: -max(kv[1]["on_us"], kv[1]["off_us"]))
        lines.append(f"  {part} ({len(rows)}):")
        for k, r in rows[:top]:
            lines.append(
                f"    {k[:90]:90s} launches/step on {r['on_per_step']:7.2f} off {r['off_per_step']:7.2f}"
                f"   us/step on {r['on_us']:9.2f} off {r['off_us']:9.2f}"
            )
        if len(rows) > top:
            lines.append(f"    ... {len(rows) - top} more")
    return lines
