"""vLLM's own benchmark client, ``vllm bench serve``, run for one server's loads in one process.

``python -m benchmarks.serving.client SPEC.json`` parses each load's arguments with
``vllm bench serve``'s own parser and calls its ``main`` (what the ``vllm bench serve``
command does): one import of vLLM per server instead of one per load (~15-20 s each on
the GPU machine), started while the server starts. It waits for the driver's go-file
(written once the server is healthy and its side confirmed), then runs the loads in order; a load
with a ``go_file`` of its own also waits for that one (``--interleave``: the driver takes the
servers' loads in turns).

Per load it appends one line to the spec's ``progress`` file (JSON lines, so that a
kill leaves what was done): the load, the seconds it took, the server's prefix-cache
counters and latency histograms before and after (from /metrics), the CPU time of the
server's processes and its own, the size of the server's log before and after
(the driver reads which kernels compiled during the load from the bytes between), and any
error. A load whose estimate no longer fits the deadline is recorded as skipped and not
started. A profiled load (its spec has ``profile``) runs inside one profiling session of the
server's workers (step_profile.py); the entry names the session's prefix, or why it failed. A
sampled load (``pyspy``) runs with py-spy attached to the server's engine processes
(host_samples.py); the entry says what was sampled, or why nothing was.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path


def _record(progress: Path, entry: dict) -> None:
    with progress.open("a") as f:
        f.write(json.dumps(entry) + "\n")


def _size(path: str | None) -> int | None:
    try:
        return os.path.getsize(path) if path else None
    except OSError:
        return None


def _readings(spec: dict) -> dict:
    """What the server and this process have counted so far: /metrics, the CPU time of the
    server's processes (server.process_cpu_s) and of this one, the size of the server's log."""
    from .server import metrics_text, process_cpu_s

    pid = spec.get("server_pid")
    return {"metrics": metrics_text(spec["port"]), "cpu": process_cpu_s(pid) if pid else None,
            "client_cpu": time.process_time(), "log_bytes": _size(spec.get("server_log"))}  # fmt: skip


def _compare_readings(entry: dict, before: dict, after: dict) -> None:
    """The load's share of each reading, into its progress entry: the server log's stretch, the
    prefix-cache counters, the server's own latencies (server.LATENCY_HISTOGRAMS), and where the
    host's time went (CPU seconds per process role and of this client; the load's ``wall_s``
    divides them into cores kept busy). These are diagnostics: one that fails is recorded as
    such and never costs the load its figures or the next load its run."""
    from .server import cpu_by_role, latency_means_ms, parse_latency_sums, parse_prefix_cache_counters

    if before["log_bytes"] is not None and after["log_bytes"] is not None:
        entry["server_log_bytes"] = [before["log_bytes"], after["log_bytes"]]
    try:
        entry["client_cpu_s"] = after["client_cpu"] - before["client_cpu"]
        if before["cpu"] is not None and after["cpu"] is not None:
            entry["server_cpu_s"] = cpu_by_role(before["cpu"], after["cpu"])
        if before["metrics"] is not None and after["metrics"] is not None:
            hits_before = parse_prefix_cache_counters(before["metrics"])
            hits_after = parse_prefix_cache_counters(after["metrics"])
            entry["prefix_cache"] = {k: hits_after[k] - hits_before[k] for k in hits_after}
            entry["server_latency_ms"] = latency_means_ms(parse_latency_sums(before["metrics"]),
                                                          parse_latency_sums(after["metrics"]))  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a diagnostic, recorded
        entry["diagnostics_error"] = f"{type(e).__name__}: {e}"


def _wait_for(go: Path, stop: Path, deadline: float) -> bool:
    """Whether ``go`` appeared before the stop file or the deadline."""
    while not go.exists():
        if stop.exists() or time.time() > deadline:
            return False
        time.sleep(0.05)
    return True


def run(spec: dict) -> int:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from . import host_samples, step_profile

    progress = Path(spec["progress"])
    go, stop = Path(spec["go_file"]), Path(spec["stop_file"])
    _record(progress, {"event": "imported", "time": time.time()})
    if not _wait_for(go, stop, spec["deadline"]):
        _record(progress, {"event": "never started"})
        return 1
    failures = 0
    for load in spec["loads"]:
        if "go_file" in load and not _wait_for(Path(load["go_file"]), stop, spec["deadline"]):
            _record(progress, {"event": "stopped", "load": load["name"]})
            return 1
        entry = {"event": "load", "load": load["name"], "prompts": load["prompts"]}
        if "server" in load:  # --interleave: the round's record this load belongs to
            entry["server"] = load["server"]
        if time.time() + load["estimate_s"] > spec["deadline"]:
            entry["skipped"] = f"~{load['estimate_s']:.0f} s needed, {spec['deadline'] - time.time():.0f} s left"
            _record(progress, entry)
            continue
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        args = parser.parse_args(load["args"])
        before = _readings(spec)
        t = time.monotonic()
        session, sampled = load.get("profile"), load.get("pyspy")
        samplers: list = []
        try:
            if session:
                step_profile.start(spec["port"], session)
                entry["profile_prefix"] = session["prefix"]
            if sampled:
                samplers, entry["pyspy"] = host_samples.start(spec["server_pid"], sampled["prefix"])
            try:
                result = main(args)
            finally:
                if session:
                    step_profile.stop(spec["port"])
                if sampled:
                    entry["pyspy"] = host_samples.stop(samplers, entry["pyspy"])
            entry["completed"] = result.get("completed")
        except Exception as e:  # noqa: BLE001 - recorded; the next load may still run
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["traceback"] = traceback.format_exc()[-3000:]
            failures += 1
        entry["wall_s"] = time.monotonic() - t
        _compare_readings(entry, before, _readings(spec))
        _record(progress, entry)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(run(json.loads(Path(sys.argv[1]).read_text())))
