"""A profiled load (``profile=N`` in its spec): where a server's time goes, engine step by engine step.

Issue 21's step for a missed target: the profiler's per-kernel GPU time and the host spans per
step, plugin on and off, under the load that missed. The client opens one torch-profiler session
of the server's workers around the load (``/start_profile`` with vLLM's per-session bounds: skip
the first ``skip`` engine steps, the ramp-up, then record ``N``; the worker stops by itself after
them); the driver reads rank 0's trace with ``benchmarks/e2e/vllm_trace.py`` once the server's
loads are done. Per kind of step (decode-only, mixed, prefill-only), from the steps that have a
successor:

- ``interval_us``: from this step's start to the next one's, the engine's cycle; a decoding
  request gets one token per step, so under an arrival-rate load this is what TPOT is made of;
- ``host_us``: the host span of ``execute_model`` (its annotation), and ``host_top``: what
  directly under it took that time (Inductor's compiled pieces, the attention ops, Python);
- ``gpu_busy_us``: the union of the GPU work the step launched; ``host_bound``: the share of
  steps whose host span exceeds it (with async scheduling the next step's host work overlaps
  this one's GPU work, so a host span above the GPU time is what the GPU waits for);
- ``kernels``: per kernel, launches and microseconds per step; on against off, the kernels that
  differ (``vllm_trace.kernel_diff``).

A profiled load's own latency figures are not reported: the profiler records every host op and
slows both sides (unequally, where one side has fewer ops), so the comparison here is of where
time goes, not of how long requests took. Name it after the measured loads, which then run
unprofiled before it (the export stalls the engine).

No torch or vLLM needed (the CPU tests feed synthetic traces).
"""

from __future__ import annotations

import statistics

from benchmarks.e2e import vllm_trace

from . import probe  # post(): the server's routes, as the probe calls them

KINDS = ("decode", "mixed", "prefill")
TOP_HOST_CHILDREN = 6
TOP_DIFF_ROWS = 10


def prefix(index: int, slug: str, load: str) -> str:
    """The session's ``profile_prefix``: the trace files' names start with it."""
    return f"load-{index:02d}-{slug}-{load}"


def start(port: int, session: dict) -> None:
    """One profiling session of the server's workers: ``session`` is the client spec's ``profile``."""
    probe.post(port, "/start_profile", {"profile_prefix": session["prefix"], "delay_iterations": session["skip"],
                                   "max_iterations": session["steps"]})  # fmt: skip


def stop(port: int) -> None:
    """Ends the session where its steps did not (a load shorter than skip + steps); a no-op otherwise."""
    probe.post(port, "/stop_profile", None)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(trace_path: str) -> dict:
    """Rank 0's trace of one session -> per kind of step: counts, intervals, host spans, GPU time, kernels."""
    trace = vllm_trace.load(trace_path)
    steps = vllm_trace.parse_steps(trace)
    host = vllm_trace.host_breakdown(trace, steps)
    out: dict = {"trace": trace_path.rsplit("/", 1)[-1], "steps": len(steps), "kinds": {}}
    for kind in KINDS:
        idx = [i for i, s in enumerate(steps) if s.kind == kind and s.closed]
        if not idx:
            continue
        chosen = [steps[i] for i in idx]
        busy = [s.gpu_time_us()["busy"] for s in chosen]
        spans = [s.dur for s in chosen]
        children: dict[str, float] = {}
        for i in idx:
            for name, (_count, us) in host[i]["children"].items():
                children[name] = children.get(name, 0.0) + us / len(idx)
        children["(Python between them)"] = sum(host[i]["uncovered"] for i in idx) / len(idx)
        top = sorted(children.items(), key=lambda kv: -kv[1])[:TOP_HOST_CHILDREN]
        out["kinds"][kind] = {
            "steps": len(chosen),
            "tokens_p50": statistics.median(s.ctx_tokens + s.gen_tokens for s in chosen),
            "decodes_p50": statistics.median(s.gen_reqs for s in chosen),
            "interval_us_p50": statistics.median(steps[i + 1].ts - steps[i].ts for i in idx),
            "host_us_p50": statistics.median(spans),
            "host_us_p90": _pct(spans, 0.9),
            "gpu_busy_us_p50": statistics.median(busy),
            "host_bound": sum(1 for s, b in zip(spans, busy) if s > b) / len(chosen),
            "fused_launches_per_step": sum(s.count_matching(vllm_trace.FUSED_KERNEL) for s in chosen) / len(chosen),
            "chain_launches_per_step": sum(s.count_matching(p) for s in chosen for p in vllm_trace.VLLM_CHAIN_PATTERNS)
            / len(chosen),
            "host_top": {name: round(us, 1) for name, us in top},
            "kernels": vllm_trace.per_step_kernel_table(chosen),
        }
    return out


def _pooled_table(profiles: list[dict], kind: str) -> dict:
    """Per kernel, launches and us per step averaged over servers (each server's table is per step already)."""
    tables = [p["kinds"][kind]["kernels"] for p in profiles if kind in p.get("kinds", {})]
    names = {k for t in tables for k in t}
    zero = {"per_step": 0.0, "us_per_step": 0.0}
    return {k: {f: statistics.fmean(t.get(k, zero)[f] for t in tables) for f in zero} for k in names}


def compare_sides(servers: list[dict], reference: str = "off") -> dict:
    """Every server's profiled loads (their ``profile`` entries) per load; each side's kernels against ``reference``'s."""
    out: dict = {}
    for s in servers:
        for entry in s.get("loads", []):
            prof = entry.get("profile")
            if prof is None:
                continue
            load = out.setdefault(entry["load"], {"servers": [], "diff": {}})
            load["servers"].append({"server": s["index"], "side": s["side"], **prof})
    for load in out.values():
        good = [p for p in load["servers"] if "kinds" in p]
        sides = list(dict.fromkeys(p["side"] for p in good))
        if reference not in sides:
            continue
        ref = [p for p in good if p["side"] == reference]
        for side in sides:
            if side == reference:
                continue
            mine = [p for p in good if p["side"] == side]
            for kind in KINDS:
                if any(kind in p["kinds"] for p in mine) and any(kind in p["kinds"] for p in ref):
                    diff = vllm_trace.kernel_diff(_pooled_table(mine, kind), _pooled_table(ref, kind))
                    load["diff"].setdefault(f"{side} vs {reference}", {})[kind] = diff
    return out


def _cell(value, fmt: str = ".0f") -> str:
    return "-" if value is None else format(value, fmt)


def markdown(summary: dict) -> str:
    lines = []
    for name, load in summary.items():
        lines += ["", f"## Where the time goes: profiled load `{name}` (rank 0's torch-profiler trace)", "",
                  "Per kind of engine step, medians over the recorded steps; the load's own latencies are not "
                  "reported (the profiler slows both sides).", "",
                  "| server | side | step | steps | tokens | decodes | interval us | host span us (p90) | GPU busy us "
                  "| host > GPU | fused / chain launches |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for p in load["servers"]:
            if "kinds" not in p:
                lines.append(f"| {p['server']} | {p['side']} | {p.get('error', 'no trace')} |||||||||")
                continue
            for kind, k in p["kinds"].items():
                lines.append(
                    f"| {p['server']} | {p['side']} | {kind} | {k['steps']} | {_cell(k['tokens_p50'])} "
                    f"| {_cell(k['decodes_p50'])} | {_cell(k['interval_us_p50'])} | {_cell(k['host_us_p50'])} "
                    f"({_cell(k['host_us_p90'])}) | {_cell(k['gpu_busy_us_p50'])} | {k['host_bound']:.0%} "
                    f"| {k['fused_launches_per_step']:.1f} / {k['chain_launches_per_step']:.1f} |")
        for p in load["servers"]:
            for kind, k in p.get("kinds", {}).items():
                top = ", ".join(f"{n[:60]} {us:.0f}" for n, us in k["host_top"].items())
                lines.append(f"- server {p['server']} ({p['side']}), {kind} steps, host span per step (us): {top}")
        for pair, kinds in load["diff"].items():
            for kind, diff in kinds.items():
                lines += ["", f"Kernels per {kind} step, {pair} (pooled over each side's servers):", "", "```",
                          *vllm_trace.format_diff(diff, top=TOP_DIFF_ROWS), "```"]  # fmt: skip
    return "\n".join(lines) + "\n" if lines else ""
