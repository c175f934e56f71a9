"""Where a step's extra host milliseconds go: two sides' sampled Python stacks, attributed per step.

Reads what ``benchmarks/e2e/host_profile.py`` writes into one folder: per side (plugin ``on`` /
``off``) and mode (``compiled`` / ``eager``) a ``host_profile_<mode>_<side>.json`` listing its
measurement windows (workload, units measured, window length, the timed ``execute_model``
calls, garbage collections) and, per window, the main thread's sampled stacks as a collapsed
file (py-spy's ``raw`` format with ``--threads``: ``thread (TID): NAME;frame;...;frame COUNT``,
each frame ``function (file:line)``).

Per step (or per round of the mixed workload: ``unit``), each side gets

- (a) self time per function: the samples whose innermost frame is that function;
- (b) inclusive time of named regions (``REGIONS``: the plugin's forward_fused, its bound ops,
  validation, dispatch, the Triton backend's _launch/_plan/launcher; vLLM's forward_impl,
  forward_mha, the compiled pieces, Inductor's generated wrapper code, Triton's launcher and
  JIT paths, ...): the samples with at least one frame in the region, each counted once;

converted to milliseconds with the window's own scale (window length / the main thread's
samples in it: py-spy's achieved rate, not the one asked for) and divided by the units the
window ran. Garbage collection runs no Python frame, so it comes from the windows' gc callback
record instead. The markdown lists on - off per region and per function, largest first, and
checks the samples against the timer: the ``execute_model`` region, sampled, against
``execute_model``'s timed host span.

    python -m benchmarks.e2e.host_profile_report OUT_DIR [--mode compiled] [--top 25]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

# ---------------------------------------------------------------------------
# collapsed stacks

# "function (file:line)", split at the last " (" (a path rarely holds one); py-spy 0.4 writes
# class-qualified names (``Class.method``).
_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")
_THREAD = re.compile(r"^thread \((?P<tid>[^)]*)\)(?:: (?P<name>.*))?$")
MAIN_THREAD = "MainThread"


@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int | None = None

    @property
    def label(self) -> str:
        """``function (short path)``: one function, whatever line the sample was on."""
        return f"{self.function} ({short_path(self.file)})"


Stack = tuple[Frame, ...]


def short_path(path: str) -> str:
    """The part of a source path that names it across machines: after the last ``site-packages/``
    or ``dist-packages/``, else after the checkout's folder (``benchmarks/``, ``vllm_mla_fusion/``,
    ``tests/``, ``demo/``), else the path as it is."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    for top in ("vllm_mla_fusion/", "benchmarks/", "tests/", "demo/"):
        i = path.rfind("/" + top)
        if i >= 0:
            return path[i + 1 :]
    return path


def parse_frame(text: str) -> Frame:
    m = _FRAME.match(text)
    if m is None:
        return Frame(text, "")
    line = m.group("line")
    return Frame(m.group("function"), m.group("file"), int(line) if line else None)


def parse_collapsed(lines: Iterable[str]) -> dict[str, Counter]:
    """Thread name (or ``thread TID`` where it has none; ``""`` without thread frames) -> Counter of
    stacks (outermost frame first) -> samples. Identical stacks on several lines add up."""
    threads: dict[str, Counter] = {}
    pending = ""
    for raw in lines:
        line = pending + raw.rstrip("\n")
        if not line.strip():
            pending = ""
            continue
        stack_text, _, count = line.rpartition(" ")
        if not count.isdigit():
            # A frame name with a newline in it: py-spy's --nonblocking reads a frame the process
            # is rewriting and may take source text for the name. The sample goes on in the next line.
            pending = line + " "
            continue
        pending = ""
        if not stack_text:
            raise ValueError(f"not a collapsed-stack line (no count): {line[:200]!r}")
        parts = stack_text.split(";")
        thread = ""
        m = _THREAD.match(parts[0])
        if m is not None:
            thread = m.group("name") or f"thread {m.group('tid')}"
            parts = parts[1:]
        stack = tuple(parse_frame(p) for p in parts if p)
        threads.setdefault(thread, Counter())[stack] += int(count)
    if pending:
        raise ValueError(f"not a collapsed-stack line (no count): {pending[:200]!r}")
    return threads


def main_thread(threads: dict[str, Counter]) -> Counter:
    """The engine's thread: ``MainThread`` (the in-process engine core runs the model there), else
    the thread with the most samples."""
    if MAIN_THREAD in threads:
        return threads[MAIN_THREAD]
    if not threads:
        return Counter()
    return max(threads.values(), key=lambda c: sum(c.values()))


def read_stacks(path: Path) -> Counter:
    with open(path) as f:
        return main_thread(parse_collapsed(f))


# ---------------------------------------------------------------------------
# attribution


@dataclass(frozen=True)
class Pattern:
    """Frames of a source file (a path substring) and, if given, only these functions (a
    qualified name, or its last dotted part)."""

    file: str
    functions: frozenset[str] = frozenset()

    def matches(self, frame: Frame) -> bool:
        if self.file not in frame.file:
            return False
        if not self.functions:
            return True
        return frame.function in self.functions or frame.function.rpartition(".")[2] in self.functions


@dataclass(frozen=True)
class Region:
    name: str
    patterns: tuple[Pattern, ...]

    def contains(self, stack: Stack) -> bool:
        return any(p.matches(f) for f in stack for p in self.patterns)


def region(name: str, file: str, *functions: str, also: tuple[Pattern, ...] = ()) -> Region:
    return Region(name, (Pattern(file, frozenset(functions)), *also))


MLA = "vllm/model_executor/layers/attention/mla_attention.py"
PLUGIN = "vllm_mla_fusion/"
# Inclusive regions, outermost first. A sample counts once in every region it is inside.
REGIONS = (
    region("execute_model (model runner)", "vllm/v1/worker/", "execute_model"),
    region("sample_tokens (model runner)", "vllm/v1/worker/", "sample_tokens"),
    region("scheduler", "vllm/v1/core/sched/"),
    region("output processing", "vllm/v1/engine/output_processor.py"),
    region("CUDA graph wrapper", "vllm/compilation/cuda_graph.py"),
    region("compiled pieces (PiecewiseBackend)", "vllm/compilation/piecewise_backend.py"),
    region("Inductor generated wrapper code", "inductor_cache/", also=(Pattern("torchinductor_"),)),
    region("Inductor runtime (kernel launch wrappers)", "torch/_inductor/runtime/"),
    region("AOTAutograd runtime wrappers", "torch/_functorch/"),
    region("torch._dynamo (guards, frame eval)", "torch/_dynamo/"),
    region("torch custom-op dispatch (torch/_ops.py, torch/_library)", "torch/_ops.py",
           also=(Pattern("torch/_library/"),)),  # fmt: skip
    region("model forward (deepseek_v2.py)", "vllm/model_executor/models/deepseek_v2.py"),
    region("vLLM MLA wrapper forward (layers/mla.py)", "vllm/model_executor/layers/mla.py", "forward"),
    region("vLLM attention op (unified_mla_attention_with_output)", MLA, "unified_mla_attention_with_output"),
    region("vLLM cache write op (unified_mla_kv_cache_update)", MLA, "unified_mla_kv_cache_update"),
    region("MLAAttention.forward_impl", MLA, "forward_impl"),
    region("forward_mha (prefill attention)", MLA, "forward_mha"),
    region("forward_mqa (decode attention)", "vllm/", "forward_mqa"),
    region("_concat_k_nope_k_pe (vLLM's key concat)", MLA, "_concat_k_nope_k_pe"),
    region("attention backends (vllm/v1/attention/)", "vllm/v1/attention/"),
    region("forward context", "vllm/forward_context.py"),
    region("plugin: all code", PLUGIN),
    region("plugin: attention op (mla_attention_with_output)", PLUGIN + "vllm_plugin/custom_ops.py",
           "mla_attention_with_output"),  # fmt: skip
    region("plugin: forward_fused", PLUGIN + "vllm_plugin/attention.py", "forward_fused"),
    region("plugin: assemble_prefill_key", PLUGIN + "vllm_plugin/attention.py", "assemble_prefill_key",
           "concat_k_nope_k_pe"),  # fmt: skip
    region("plugin: assemble_decode_query / forward_mqa hook", PLUGIN + "vllm_plugin/attention.py",
           "assemble_decode_query", "promote.<locals>.forward_mqa"),  # fmt: skip
    region("plugin: write_target", PLUGIN + "vllm_plugin/custom_ops.py", "write_target"),
    region("plugin: eligibility (per step)", PLUGIN + "vllm_plugin/eligibility.py"),
    region("plugin: ops.py (public ops, eager bodies)", PLUGIN + "ops.py"),
    region("plugin: binding.BoundOp (layout check, first-call binding)", PLUGIN + "binding.py"),
    region("plugin: validation.check_*", PLUGIN + "validation.py"),
    region("plugin: dispatch.resolve/load", PLUGIN + "dispatch.py"),
    region("plugin: Triton backend (all)", PLUGIN + "backends/triton.py"),
    region("plugin: Triton bound launch (per call)", PLUGIN + "backends/triton.py", "BoundLaunch.__call__",
           "BoundLaunch._launch", "BoundLaunch.plan"),  # fmt: skip
    region("plugin: Triton's own launch path (first call of a configuration)", PLUGIN + "backends/triton.py",
           "BoundLaunch._launch_through_triton"),  # fmt: skip
    region("plugin: torch reference backend", PLUGIN + "backends/reference.py"),
    region("Triton runtime: launcher / JIT (triton/runtime, triton/backends)", "triton/runtime/",
           also=(Pattern("triton/backends/"), Pattern("triton/compiler/"))),  # fmt: skip
    region("logging", "/logging/"),
    region("in-process sampler's signal handler (--sampler signal)", "benchmarks/e2e/host_profile.py", "on_alarm"),
)


# Issue 20's per-layer measure: the plugin's host time from its attention op's entry to its
# launches, less vLLM's own code that runs inside that op (forward_impl, the attention
# kernels' wrappers), against the host time of the vLLM work the plugin replaces.
PLUGIN_OP = next(r for r in REGIONS if r.name.startswith("plugin: attention op"))
REPLACED = (
    next(r for r in REGIONS if r.name.startswith("vLLM cache write op")),
    next(r for r in REGIONS if r.name.startswith("_concat_k_nope_k_pe")),
    # Where the backend takes an fp8 query: the concat-quant module's forward (a nested function).
    region("vLLM decode query concat-quant", MLA, "_DecodeConcatQuantFP8._make_forward.<locals>.forward"),
)
PLUGIN_OWN = "plugin's own code in its attention op"
VLLM_REPLACED = "vLLM's cache write op, key concat and decode concat"


def owner(stack: Stack) -> str | None:
    """Whose code a sample is in: the innermost frame of the plugin's package or of vLLM (torch,
    Triton and C frames below it count for it); None when neither is on the stack."""
    for f in reversed(stack):
        if PLUGIN in f.file:
            return "plugin"
        if "/vllm/" in f.file or f.file.startswith("vllm/"):
            return "vllm"
    return None


def per_layer_samples(stacks: Counter) -> dict[str, int]:
    """``PLUGIN_OWN``: samples inside the plugin's attention op whose owner is the plugin;
    ``VLLM_REPLACED``: samples inside the vLLM ops and calls the plugin's launch replaces. RoPE
    is not in either: vLLM's runs inside Inductor's generated code, fused with its neighbours,
    where no frame names it (so the vLLM figure is a lower bound of what the plugin replaces)."""
    own = sum(n for s, n in stacks.items() if PLUGIN_OP.contains(s) and owner(s) == "plugin")
    replaced = sum(n for s, n in stacks.items() if any(r.contains(s) for r in REPLACED))
    return {PLUGIN_OWN: own, VLLM_REPLACED: replaced}


def self_samples(stacks: Counter) -> Counter:
    """Function label -> samples whose innermost frame is that function."""
    out: Counter = Counter()
    for stack, n in stacks.items():
        out[stack[-1].label if stack else "(no Python frame)"] += n
    return out


def region_samples(stacks: Counter, regions: Iterable[Region] = REGIONS) -> dict[str, int]:
    """Region name -> samples with at least one frame in the region (each sample once)."""
    regions = list(regions)
    out = {r.name: 0 for r in regions}
    for stack, n in stacks.items():
        for r in regions:
            if r.contains(stack):
                out[r.name] += n
    return out


# ---------------------------------------------------------------------------
# windows and per-unit normalisation


@dataclass
class Window:
    """One measurement window of one side: a workload run ``units`` times while sampling."""

    side: str
    mode: str
    workload: str
    units: int
    unit: str
    window_ms: float
    stacks: Counter
    execute_model_ms: list[float] = field(default_factory=list)
    gc_ms: list[float] = field(default_factory=list)
    threads: dict = field(default_factory=dict)  # name -> {"cpu_ms", "involuntary", ...} over the window
    gil: dict = field(default_factory=dict)  # thread name -> samples holding the GIL (py-spy --gil)

    @property
    def samples(self) -> int:
        return sum(self.stacks.values())

    @property
    def ms_per_sample(self) -> float:
        """The window's length over the main thread's samples in it: py-spy's achieved rate (it can
        fall behind the asked one), so a sample stands for this much wall time."""
        return self.window_ms / self.samples if self.samples else 0.0


def load_side(path: Path) -> list[Window]:
    """The windows of one side's ``host_profile_<mode>_<side>.json`` (collapsed files beside it)."""
    data = json.loads(path.read_text())
    out = []
    for w in data.get("windows", []):
        if w.get("error") or not w.get("collapsed"):
            continue
        host = w.get("host") or {}
        gil = parse_collapsed((path.parent / w["gil_collapsed"]).open()) if w.get("gil_collapsed") else {}
        out.append(Window(
            side=data["side"], mode=data["mode"], workload=w["workload"], units=int(w["units"]),
            unit=w.get("unit", "step"), window_ms=float(w["window_ms"]),
            stacks=read_stacks(path.parent / w["collapsed"]),
            execute_model_ms=list(host.get("execute_model_ms", [])), gc_ms=list(host.get("gc_ms", [])),
            threads=w.get("threads") or {}, gil={t: sum(c.values()) for t, c in gil.items()},
        ))  # fmt: skip
    return out


def per_unit_ms(windows: list[Window], count) -> dict[str, float]:
    """``count(stacks) -> {name: samples}`` over ``windows`` of one side and workload, in ms per
    unit: each window's samples at its own scale, summed, over all the units they ran."""
    units = sum(w.units for w in windows)
    total: Counter = Counter()
    for w in windows:
        for name, n in count(w.stacks).items():
            total[name] += n * w.ms_per_sample
    return {name: ms / units for name, ms in total.items()} if units else {}


@dataclass
class Side:
    """One side's figures for one workload, per unit."""

    units: int
    unit: str
    regions_ms: dict[str, float]
    self_ms: dict[str, float]
    per_layer_ms: dict[str, float]  # per_layer_samples, per unit (all layers)
    window_per_layer_ms: list[dict[str, float]]  # the same, window by window
    sampled_ms: float  # the main thread's whole window, per unit
    timed_execute_model_ms: float | None  # execute_model's host span (timer), per unit
    gc_ms: float  # garbage collection (gc callbacks), per unit
    window_execute_model_ms: list[float]  # the timed figure per window: the spread between windows
    thread_cpu_ms: dict[str, float]  # per thread name, /proc schedstat
    thread_involuntary: dict[str, float]  # involuntary context switches per thread name
    gil_ms: dict[str, float]  # GIL held, per thread name (at the main sampler's scale)


def summarize_side(windows: list[Window]) -> Side:
    units = sum(w.units for w in windows)
    execs = [ms for w in windows for ms in w.execute_model_ms]
    side = Side(
        units=units,
        unit=windows[0].unit,
        regions_ms=per_unit_ms(windows, region_samples),
        self_ms=per_unit_ms(windows, self_samples),
        per_layer_ms=per_unit_ms(windows, per_layer_samples),
        window_per_layer_ms=[per_unit_ms([w], per_layer_samples) for w in windows],
        sampled_ms=sum(w.window_ms for w in windows) / units,
        timed_execute_model_ms=sum(execs) / units if execs else None,
        gc_ms=sum(ms for w in windows for ms in w.gc_ms) / units,
        window_execute_model_ms=[sum(w.execute_model_ms) / w.units for w in windows if w.execute_model_ms],
        thread_cpu_ms=_summed({t: r.get("cpu_ms", 0.0) for t, r in w.threads.items()} for w in windows),
        thread_involuntary=_summed({t: r.get("involuntary", 0) for t, r in w.threads.items()} for w in windows),
        gil_ms=_summed({t: n * w.ms_per_sample for t, n in w.gil.items()} for w in windows),
    )
    for per_thread in (side.thread_cpu_ms, side.thread_involuntary, side.gil_ms):
        for name in per_thread:
            per_thread[name] /= units
    return side


def _summed(per_window: Iterable[dict]) -> dict[str, float]:
    total: Counter = Counter()
    for d in per_window:
        total.update(d)
    return dict(total)


def difference(off: dict[str, float], on: dict[str, float]) -> list[tuple[str, float, float, float]]:
    """(name, off, on, on - off) for every name on either side, largest on - off first."""
    rows = [(k, off.get(k, 0.0), on.get(k, 0.0), on.get(k, 0.0) - off.get(k, 0.0)) for k in set(off) | set(on)]
    return sorted(rows, key=lambda r: (-r[3], r[0]))


def find_sides(folder: Path) -> dict[tuple[str, str], Path]:
    """(mode, side) -> its JSON."""
    out = {}
    for p in sorted(folder.glob("host_profile_*_*.json")):
        m = re.fullmatch(r"host_profile_(?P<mode>[a-z]+)_(?P<side>on|off)\.json", p.name)
        if m:
            out[(m.group("mode"), m.group("side"))] = p
    return out


# ---------------------------------------------------------------------------
# markdown


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _diff_table(title: str, rows, top: int, min_abs_ms: float) -> list[str]:
    shown = [r for r in rows if abs(r[3]) >= min_abs_ms]
    gains, losses = [r for r in shown if r[3] > 0][:top], [r for r in shown if r[3] < 0][-top:]
    lines = [f"{title}", "", "| | off (ms) | on (ms) | on - off (ms) |", "|---|---|---|---|"]
    for name, off, on, d in gains + losses:
        lines.append(f"| `{name}` | {off:.3f} | {on:.3f} | {d:+.3f} |")
    if not gains and not losses:
        lines.append(f"| (no difference of {min_abs_ms} ms or more) | | | |")
    return lines + [""]


def per_layer_lines(off: Side, on: Side, unit: str, layers: int) -> list[str]:
    """The plugin's own host time in its attention op (on) against the vLLM work it replaces
    (off), per layer: issue 20's per-layer target."""
    own, replaced = on.per_layer_ms.get(PLUGIN_OWN, 0.0), off.per_layer_ms.get(VLLM_REPLACED, 0.0)
    windows = ", ".join(f"{s}: " + " ".join(f"{w.get(k, 0.0) * 1e3 / layers:.0f}" for w in side.window_per_layer_ms)
                        for s, side, k in (("on", on, PLUGIN_OWN), ("off", off, VLLM_REPLACED)))  # fmt: skip
    return [
        f"Per layer ({layers} MLA layers), issue 20's measure: the plugin's own code in its attention op "
        "(samples whose innermost plugin-or-vLLM frame is the plugin's) against vLLM's cache write op, key "
        "concat and decode concat (vLLM's RoPE, inside Inductor's code, is in neither):", "",
        f"| per {unit} | ms | us per layer |", "|---|---|---|",
        f"| on: {PLUGIN_OWN} | {own:.2f} | {own * 1e3 / layers:.1f} |",
        f"| off: {VLLM_REPLACED} | {replaced:.2f} | {replaced * 1e3 / layers:.1f} |",
        f"| on - off | {own - replaced:+.2f} | {(own - replaced) * 1e3 / layers:+.1f} |", "",
        f"The same, us per layer, window by window: {windows}", "",
    ]  # fmt: skip


def layer_count(meta: dict) -> int | None:
    """The MLA layers the plugin fused, from a side's facts (``layers``: the first layer, then
    ``{"same_as_first_for": n}``), or None where the side lists none (the off side)."""
    layers = (meta.get("facts") or {}).get("layers") or []
    return sum(x.get("same_as_first_for", 1) if isinstance(x, dict) else 1 for x in layers) or None


def compare_workload(off: Side, on: Side, workload: str, top: int, min_abs_ms: float,
                     layers: int | None = None) -> list[str]:  # fmt: skip
    unit = on.unit
    lines = [f"### {workload}: per {unit} ({off.units} {unit}s off, {on.units} on)", ""]
    lines += [
        f"| per {unit} | off | on | on - off |",
        "|---|---|---|---|",
    ]
    exec_region = "execute_model (model runner)"
    for name, a, b in (
        ("execute_model host span, timed (ms)", off.timed_execute_model_ms, on.timed_execute_model_ms),
        ("execute_model, sampled (ms)", off.regions_ms.get(exec_region), on.regions_ms.get(exec_region)),
        ("main thread, sampled window (ms)", off.sampled_ms, on.sampled_ms),
        ("garbage collection, gc callbacks (ms)", off.gc_ms, on.gc_ms),
    ):
        d = None if a is None or b is None else b - a
        lines.append(f"| {name} | {_f(a)} | {_f(b)} | {_f(d, '{:+.2f}')} |")
    spread = ", ".join(f"{s}: " + " ".join(f"{x:.1f}" for x in side.window_execute_model_ms)
                       for s, side in (("off", off), ("on", on)))  # fmt: skip
    lines += ["", f"execute_model host span per {unit}, timed, window by window (ms): {spread}", ""]
    names = sorted(set(off.thread_cpu_ms) | set(on.thread_cpu_ms) | set(off.gil_ms) | set(on.gil_ms),
                   key=lambda n: -(on.thread_cpu_ms.get(n, 0) + off.thread_cpu_ms.get(n, 0)))  # fmt: skip
    if names:
        lines += [f"Threads, per {unit}: CPU time (/proc schedstat), GIL held (py-spy --gil), involuntary context "
                  "switches; a main thread whose wall time grows more than its CPU time waits (GIL, device, "
                  "launch queue):", "",
                  "| thread | CPU ms off | on | GIL ms off | on | involuntary switches off | on |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for n in names[:12]:
            lines.append(f"| {n} | {_f(off.thread_cpu_ms.get(n))} | {_f(on.thread_cpu_ms.get(n))} | "
                         f"{_f(off.gil_ms.get(n))} | {_f(on.gil_ms.get(n))} | {_f(off.thread_involuntary.get(n), '{:.1f}')} | "
                         f"{_f(on.thread_involuntary.get(n), '{:.1f}')} |")  # fmt: skip
        lines.append("")
    if layers:
        lines += per_layer_lines(off, on, unit, layers)
    lines += _diff_table(f"Inclusive regions, ms per {unit}, largest on - off first (a sample counts in every "
                         "region it is inside):", difference(off.regions_ms, on.regions_ms), top, min_abs_ms)  # fmt: skip
    lines += _diff_table(f"Self time per function, ms per {unit}, largest on - off first:",
                         difference(off.self_ms, on.self_ms), top, min_abs_ms)  # fmt: skip
    return lines


def build_report(folder: Path, modes: list[str] | None = None, top: int = 25, min_abs_ms: float = 0.05) -> str:
    sides = find_sides(folder)
    lines = ["# Host time per step, plugin on - off, from sampled Python stacks", ""]
    for mode in sorted({m for m, _ in sides} if modes is None else modes):
        if (mode, "on") not in sides or (mode, "off") not in sides:
            lines += [f"## {mode}: one side missing ({sorted(s for m, s in sides if m == mode)})", ""]
            continue
        on_windows, off_windows = load_side(sides[(mode, "on")]), load_side(sides[(mode, "off")])
        meta = {s: json.loads(sides[(mode, s)].read_text()) for s in ("on", "off")}
        lines += [f"## {mode}", ""]
        for s in ("off", "on"):
            sampler = meta[s].get("sampler", {})
            cpus = (meta[s].get("process_before") or {}).get("cpu_set")
            probes = " ".join(f"{v:.0f}" for v in probe_values(meta[s].get("host_probe", [])))
            lines.append(f"- {s}: engine {meta[s].get('engine', 'in-process')}, start {_f(meta[s].get('start_s'), '{:.0f}')} s; "
                         f"sampler {sampler.get('kind')} at {sampler.get('rate_hz')} Hz; "
                         f"host probe {meta[s].get('host_probe_summary')} (before and after each block, in order: "
                         f"{probes or '-'}); CPUs {_cpu_ranges(cpus) if cpus else '-'}")  # fmt: skip
        lines.append("")
        for workload in sorted({w.workload for w in on_windows} & {w.workload for w in off_windows}):
            off = summarize_side([w for w in off_windows if w.workload == workload])
            on = summarize_side([w for w in on_windows if w.workload == workload])
            lines += compare_workload(off, on, workload, top, min_abs_ms, layer_count(meta["on"]))
    return "\n".join(lines) + "\n"


def _cpu_ranges(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def probe_values(probes: list[dict]) -> list[float]:
    """The host-speed probes' loop times (us per 1k iterations), in the order they were taken."""
    return [p["python_us_per_1k"] for p in probes if "python_us_per_1k" in p]


def probe_summary(probes: list[dict]) -> str | None:
    """The host-speed probes of one side, as a short range (us per 1k loop iterations)."""
    vals = probe_values(probes)
    if not vals:
        return None
    return f"{min(vals):.1f}-{max(vals):.1f} us/1k loop (median {statistics.median(vals):.1f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--mode", action="append", help="compiled, eager (default: every mode found)")
    ap.add_argument("--top", type=int, default=25, help="rows per direction in each table")
    ap.add_argument("--min-ms", type=float, default=0.05, help="leave out rows whose |on - off| is smaller")
    ap.add_argument("--out", type=Path, help="write the markdown here too")
    args = ap.parse_args(argv)
    md = build_report(args.folder, args.mode, args.top, args.min_ms)
    print(md)
    if args.out:
        args.out.write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
