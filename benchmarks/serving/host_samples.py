"""Where the engine's host time goes during a load, sampled by py-spy (a load with ``pyspy=1``).

In configurations whose steps with prompts run eagerly (past the CUDA-graph sizes), those steps are
host-bound, and the torch profiler, which records every host op, slows the host several times over:
it cannot compare two sides' host time. py-spy samples the engine-core process's Python stacks from
outside (``--nonblocking``: the process is never paused), at a fixed rate, for the length of the load.

- ``start``: py-spy attached to the server's engine core (its child whose vLLM process title names
  ``EngineCore``; the server's own process where it has none, as a CPU demo server may), writing
  collapsed stacks (``--format raw``: one ``frame;frame;... count`` line per distinct stack);
- ``stop``: py-spy interrupted, which makes it write its file;
- ``summarize``: the samples per frame, inclusive (a frame anywhere in the stack) and self (the
  innermost frame), as shares of all samples; frames are ``function (file)``, lines dropped so that
  one function is one row;
- ``compare_sides`` and ``markdown``: the sides' pooled shares, the frames whose share differs most.

The sampled load's own latencies are not reported (like a profiled load's): py-spy reads the
process's memory 200 times a second, which costs the host a little.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path

RATE_HZ = 200
FRAME_LINE = re.compile(r"^(?P<function>.*) \((?P<file>.*?)(?::\d+)?\)$")


def engine_pid(server_pid: int) -> int:
    """The engine-core process of the server ``server_pid`` (vLLM names its process title
    ``VLLM::EngineCore_DP0``), else ``server_pid`` itself."""
    try:
        import psutil  # a dependency of vLLM
    except ImportError:
        return server_pid
    try:
        for child in psutil.Process(server_pid).children(recursive=True):
            try:
                title = (child.cmdline() or [child.name()])[0]
            except psutil.Error:
                continue
            if "EngineCore" in title:
                return child.pid
    except psutil.Error:
        pass
    return server_pid


def start(server_pid: int, output: str, rate_hz: int = RATE_HZ) -> tuple[subprocess.Popen | None, dict]:
    """py-spy recording the engine core of ``server_pid`` into ``output``: ``(process, record)``,
    the record saying what was sampled, or why nothing was (process None)."""
    exe = shutil.which("py-spy")
    if exe is None:
        return None, {"error": "py-spy is not on PATH"}
    pid = engine_pid(server_pid)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    cmd = [exe, "record", "--pid", str(pid), "--rate", str(rate_hz), "--nonblocking", "--format", "raw",
           "--output", output]  # fmt: skip
    log = open(output + ".log", "w")  # noqa: SIM115 - closed in stop()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    proc.log = log  # type: ignore[attr-defined]
    return proc, {"output": output, "pid": pid, "engine_core": pid != server_pid, "rate_hz": rate_hz}


def stop(proc: subprocess.Popen | None, record: dict, timeout_s: float = 30.0) -> dict:
    """Interrupt ``proc`` (py-spy writes its file on SIGINT) and wait for it; ``record`` completed
    with its exit code, or the error."""
    if proc is None:
        return record
    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        record["exit"] = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        record["error"] = f"py-spy did not stop within {timeout_s:g} s"
    finally:
        proc.log.close()  # type: ignore[attr-defined]
    if not os.path.exists(record["output"]):
        record.setdefault("error", f"py-spy wrote no {record['output']} (exit {record.get('exit')}; "
                                   f"its log: {record['output']}.log)")  # fmt: skip
    return record


def _frame(text: str) -> str:
    """``function (file)`` of a py-spy frame ``function (file:line)``."""
    m = FRAME_LINE.match(text.strip())
    return f"{m['function']} ({m['file']})" if m else text.strip()


def read_stacks(text: str) -> Counter:
    """Collapsed stacks (``frame;frame;... count`` lines) -> Counter of frame tuples, outermost first."""
    stacks: Counter = Counter()
    for line in text.splitlines():
        stack, sep, count = line.rstrip().rpartition(" ")
        if not sep or not count.isdigit() or not stack:
            continue
        stacks[tuple(_frame(f) for f in stack.split(";"))] += int(count)
    return stacks


def summarize(path: str, top: int = 40) -> dict:
    """The samples of one py-spy file: total, and the ``top`` frames by inclusive and by self share."""
    stacks = read_stacks(Path(path).read_text(errors="replace"))
    total = sum(stacks.values())
    if not total:
        raise ValueError(f"no samples in {path}")
    inclusive: Counter = Counter()
    own: Counter = Counter()
    for frames, n in stacks.items():
        for f in set(frames):
            inclusive[f] += n
        own[frames[-1]] += n
    return {
        "samples": total,
        "inclusive": {f: n / total for f, n in inclusive.most_common(top)},
        "self": {f: n / total for f, n in own.most_common(top)},
    }


def compare_sides(servers: list[dict]) -> dict:
    """Per side, the inclusive share of each frame pooled over its sampled loads (sample-weighted),
    and the frames whose share differs most between the first side and each other one."""
    pooled: dict[str, Counter] = {}
    samples: Counter = Counter()
    for server in servers:
        for entry in server.get("loads") or []:
            summary = entry.get("pyspy_summary")
            if not summary or "error" in summary:
                continue
            side = server["side"]
            samples[side] += summary["samples"]
            pooled.setdefault(side, Counter())
            for f, share in summary["inclusive"].items():
                pooled[side][f] += share * summary["samples"]
    shares = {side: {f: n / samples[side] for f, n in c.items()} for side, c in pooled.items()}
    sides = list(shares)
    diffs = {}
    for other in sides[1:]:
        frames = set(shares[sides[0]]) | set(shares[other])
        delta = {f: shares[sides[0]].get(f, 0.0) - shares[other].get(f, 0.0) for f in frames}
        diffs[f"{sides[0]} - {other}"] = dict(sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:12])
    return {"samples": dict(samples), "inclusive": shares, "differences": diffs}


def markdown(comparison: dict) -> str:
    """The report's section: each side's top inclusive frames, then the largest differences."""
    lines = ["", "## Where the engine's host time goes: py-spy samples of the engine core", "",
             "Share of samples whose stack holds the frame (inclusive), pooled over each side's sampled loads; "
             "a frame that one side never runs, or outside a server's top 40, reads 0.", ""]  # fmt: skip
    for side, shares in comparison["inclusive"].items():
        lines += [f"**{side}** ({comparison['samples'][side]} samples):", "", "```"]
        lines += [f"  {share:6.1%}  {frame}" for frame, share in sorted(shares.items(), key=lambda kv: -kv[1])[:15]]
        lines += ["```", ""]
    for pair, delta in comparison["differences"].items():
        lines += [f"Largest differences, {pair} (share points):", "", "```"]
        lines += [f"  {d * 100:+6.1f}  {frame}" for frame, d in delta.items()]
        lines += ["```", ""]
    return "\n".join(lines) + "\n"
