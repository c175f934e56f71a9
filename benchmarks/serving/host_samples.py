"""Where the server's host time goes during a load, sampled by py-spy (a load with ``pyspy=1``).

In configurations whose steps with prompts run eagerly (past the CUDA-graph sizes), those steps are
host-bound, and the torch profiler, which records every host op, slows the host several times over:
it cannot compare two sides' host time. py-spy samples the engine's processes' Python stacks from
outside (``--nonblocking``: a process is never paused), at a fixed rate, for the length of the load.

- ``start``: one py-spy per process of the server (``sampled_processes``: the API server, the engine
  core, whose loop schedules, and the workers, where the model's forward runs when the executor has
  worker processes), each writing collapsed stacks (``--format raw``: one ``frame;frame;... count``
  line per distinct stack);
- ``stop``: every py-spy interrupted, which makes it write its file;
- ``summarize``: the samples per frame, inclusive (a frame anywhere in the stack) and self (the
  innermost frame), as shares of all samples; frames are ``function (file)``, lines dropped so that
  one function is one row;
- ``summarize_record``: each sampled role's summary;
- ``compare_sides`` and ``markdown``: per role, the sides' pooled shares, the frames whose share differs most.

The sampled load's own latencies are not reported (like a profiled load's): py-spy reads the
processes' memory 200 times a second, which costs the host a little.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

RATE_HZ = 200
FRAME_LINE = re.compile(r"^(?P<function>.*) \((?P<file>.*?)(?::\d+)?\)$")


def sampled_processes(server_pid: int) -> dict[str, int]:
    """The server's processes whose Python runs, by role: the API server itself (``APIServer``:
    requests in, detokenized tokens out), then its children that run the engine. vLLM titles those
    ``VLLM::<role>`` (``EngineCore_DP0``, the scheduler's loop; ``Worker...``, where the model's
    forward runs when the executor has worker processes) where ``setproctitle`` is installed;
    without it they are multiprocessing's spawned children (``spawn_main`` in their command line):
    the server's own is the engine core, any below it a worker (with one API server and no data
    parallelism, as the benchmark starts it: extra API servers or a DP coordinator would be named
    EngineCore too). multiprocessing's resource tracker runs no engine and is left out."""
    roles: dict[str, int] = {"APIServer": server_pid}
    try:
        import psutil  # a dependency of vLLM
    except ImportError:
        return roles
    try:
        for child in psutil.Process(server_pid).children(recursive=True):
            try:
                cmdline = child.cmdline() or [child.name()]
                parent = child.ppid()
            except psutil.Error:
                continue
            if cmdline[0].startswith("VLLM::"):
                role = re.sub(r"[^A-Za-z0-9_-]", "_", cmdline[0].split("::", 1)[1])
            elif any("spawn_main" in arg for arg in cmdline):
                role = "EngineCore" if parent == server_pid else "Worker"
            else:
                continue
            roles[role if role not in roles else f"{role}-{child.pid}"] = child.pid
    except psutil.Error:
        pass
    return roles


def unpack_py_spy(wheel_dir: Path, bin_dir: Path) -> Path:
    """py-spy's binary from its wheel in ``wheel_dir``, written to ``bin_dir/py-spy`` (executable).

    ``pip install --target``, the way the GPU scripts install the serving wheels, installs no
    scripts, and py-spy is nothing but its wheel's ``*.data/scripts/py-spy``: on the lent machine
    it was never on PATH until this. Raises FileNotFoundError naming what is missing."""
    wheels = sorted(Path(wheel_dir).glob("py_spy-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"no py_spy-*.whl in {wheel_dir} (scripts/pack_serving_wheels.sh)")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        names = [n for n in wheel.namelist() if re.fullmatch(r"[^/]+\.data/scripts/py-spy", n)]
        if not names:
            raise FileNotFoundError(f"{wheels[-1].name} has no *.data/scripts/py-spy")
        data = wheel.read(names[0])
    Path(bin_dir).mkdir(parents=True, exist_ok=True)
    exe = Path(bin_dir) / "py-spy"
    exe.write_bytes(data)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return exe


def start(server_pid: int, prefix: str, rate_hz: int = RATE_HZ) -> tuple[list[subprocess.Popen], dict]:
    """One py-spy per process of ``server_pid`` (sampled_processes), each recording into
    ``<prefix>-<role>.txt``: ``(processes, record)``, the record saying what is sampled, or why
    nothing is (no process)."""
    exe = shutil.which("py-spy")
    if exe is None:
        return [], {"error": "py-spy is not on PATH"}
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    procs, record = [], {"outputs": {}, "pids": sampled_processes(server_pid), "rate_hz": rate_hz}
    for role, pid in record["pids"].items():
        output = record["outputs"][role] = f"{prefix}-{role}.txt"
        cmd = [exe, "record", "--pid", str(pid), "--rate", str(rate_hz), "--nonblocking", "--format", "raw",
               "--output", output]  # fmt: skip
        log = open(output + ".log", "w")  # noqa: SIM115 - closed in stop()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        proc.log = log  # type: ignore[attr-defined]
        procs.append(proc)
    return procs, record


def stop(procs: list[subprocess.Popen], record: dict, timeout_s: float = 30.0) -> dict:
    """Interrupt every py-spy of ``procs`` (py-spy writes its file on SIGINT) and wait for them;
    ``record`` completed with their exit codes, and an error per role whose file is missing."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    exits = []
    for proc in procs:
        try:
            exits.append(proc.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            proc.kill()
            exits.append(f"killed after {timeout_s:g} s")
        finally:
            proc.log.close()  # type: ignore[attr-defined]
    if procs:
        record["exits"] = exits
    errors = {role: f"py-spy wrote no {out} (its log: {out}.log)"
              for role, out in record.get("outputs", {}).items() if not os.path.exists(out)}  # fmt: skip
    if errors:
        record["errors"] = errors
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


def summarize_record(record: dict) -> dict:
    """Each sampled role's summary (``summarize``), or why it has none; ``{"error": ...}`` when
    nothing was sampled."""
    if "error" in record:
        return {"error": record["error"]}
    out = {}
    for role, path in record["outputs"].items():
        try:
            out[role] = summarize(path)
        except (OSError, ValueError) as e:
            out[role] = {"error": f"{type(e).__name__}: {e}"}
    return out


def compare_sides(servers: list[dict]) -> dict:
    """Per role (engine core, worker) and side, the inclusive share of each frame pooled over the
    sampled loads (sample-weighted), and per role the frames whose share differs most between the
    first side and each other one."""
    pooled: dict[str, dict[str, Counter]] = {}
    samples: dict[str, Counter] = {}
    for server in servers:
        for entry in server.get("loads") or []:
            for role, summary in (entry.get("pyspy_summary") or {}).items():
                if not isinstance(summary, dict) or "samples" not in summary:
                    continue
                role = role.split("-")[0]  # several workers of one role pool together
                side = server["side"]
                samples.setdefault(role, Counter())[side] += summary["samples"]
                c = pooled.setdefault(role, {}).setdefault(side, Counter())
                for f, share in summary["inclusive"].items():
                    c[f] += share * summary["samples"]
    out = {}
    for role, by_side in pooled.items():
        shares = {side: {f: n / samples[role][side] for f, n in c.items()} for side, c in by_side.items()}
        sides = list(shares)
        diffs = {}
        for other in sides[1:]:
            frames = set(shares[sides[0]]) | set(shares[other])
            delta = {f: shares[sides[0]].get(f, 0.0) - shares[other].get(f, 0.0) for f in frames}
            diffs[f"{sides[0]} - {other}"] = dict(sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:12])
        out[role] = {"samples": dict(samples[role]), "inclusive": shares, "differences": diffs}
    return out


def markdown(comparison: dict) -> str:
    """The report's section: per role, each side's top inclusive frames, then the largest differences."""
    lines = ["", "## Where the server's host time goes: py-spy samples of its processes", "",
             "Per process role (`APIServer`: requests in, detokenized tokens out; `EngineCore`: the scheduler's "
             "loop, and the model's forward without worker processes; `Worker`), the share of samples whose stack holds the frame (inclusive), pooled over each side's sampled loads; a frame "
             "that one side never runs, or outside a server's top 40, reads 0.",
             ""]  # fmt: skip
    for role, c in comparison.items():
        lines += [f"### {role}", ""]
        for side, shares in c["inclusive"].items():
            lines += [f"**{side}** ({c['samples'][side]} samples):", "", "```"]
            lines += [f"  {share:6.1%}  {frame}" for frame, share in sorted(shares.items(), key=lambda kv: -kv[1])[:15]]
            lines += ["```", ""]
        for pair, delta in c["differences"].items():
            lines += [f"Largest differences, {pair} (share points):", "", "```"]
            lines += [f"  {d * 100:+6.1f}  {frame}" for frame, d in delta.items()]
            lines += ["```", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    # scripts/gpu_serving.sh: python -m benchmarks.serving.host_samples unpack WHEEL_DIR BIN_DIR
    if len(sys.argv) != 4 or sys.argv[1] != "unpack":
        sys.exit("usage: python -m benchmarks.serving.host_samples unpack WHEEL_DIR BIN_DIR")
    try:
        print(unpack_py_spy(Path(sys.argv[2]), Path(sys.argv[3])))
    except (OSError, zipfile.BadZipFile) as e:  # FileNotFoundError among them: say what, no traceback
        sys.exit(f"py-spy not unpacked: {e}")
