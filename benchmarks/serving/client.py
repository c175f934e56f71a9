"""vLLM's own benchmark client, ``vllm bench serve``, run for one server's loads in one process.

``python -m benchmarks.serving.client SPEC.json`` parses each load's arguments with
``vllm bench serve``'s own parser and calls its ``main`` (what the ``vllm bench serve``
command does): one import of vLLM per server instead of one per load (~15-20 s each on
the GPU machine), started while the server starts. It waits for the driver's go-file
(written once the server is healthy and its side confirmed), then runs the loads in order.

Per load it appends one line to the spec's ``progress`` file (JSON lines, so that a
kill leaves what was done): the load, the seconds it took, the server's prefix-cache
counters and latency histograms before and after (from /metrics), the CPU time of the
server's processes and its own, the size of the server's log before and after
(the driver reads which kernels compiled during the load from the bytes between), and any
error. A load whose estimate no longer fits the deadline is recorded as skipped and not
started. A profiled load (its spec has ``profile``) runs inside one profiling session of the
server's workers (step_profile.py); the entry names the session's prefix, or why it failed.
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


def run(spec: dict) -> int:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from . import step_profile
    from .server import latency_means_ms, metrics_text, parse_latency_sums, parse_prefix_cache_counters, process_tree_cpu_s

    progress = Path(spec["progress"])
    go, stop = Path(spec["go_file"]), Path(spec["stop_file"])
    _record(progress, {"event": "imported", "time": time.time()})
    while not go.exists():
        if stop.exists() or time.time() > spec["deadline"]:
            _record(progress, {"event": "never started"})
            return 1
        time.sleep(0.2)
    failures = 0
    for load in spec["loads"]:
        entry = {"event": "load", "load": load["name"], "prompts": load["prompts"]}
        if time.time() + load["estimate_s"] > spec["deadline"]:
            entry["skipped"] = f"~{load['estimate_s']:.0f} s needed, {spec['deadline'] - time.time():.0f} s left"
            _record(progress, entry)
            continue
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        args = parser.parse_args(load["args"])
        before = metrics_text(spec["port"])
        log_before = _size(spec.get("server_log"))
        server_pid = spec.get("server_pid")
        cpu_before = process_tree_cpu_s(server_pid) if server_pid else None
        client_cpu_before = time.process_time()
        t = time.monotonic()
        session = load.get("profile")
        try:
            if session:
                step_profile.start(spec["port"], session)
                entry["profile_prefix"] = session["prefix"]
            try:
                result = main(args)
            finally:
                if session:
                    step_profile.stop(spec["port"])
            entry["completed"] = result.get("completed")
        except Exception as e:  # noqa: BLE001 - recorded; the next load may still run
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["traceback"] = traceback.format_exc()[-3000:]
            failures += 1
        entry["wall_s"] = time.monotonic() - t
        # Where the host's time went during the load (each process's CPU seconds; the load's wall
        # time divides them into cores kept busy) and the server's own latencies, to tell the engine's
        # time from the API server's and the client's (server.LATENCY_HISTOGRAMS).
        entry["client_cpu_s"] = time.process_time() - client_cpu_before
        cpu_after = process_tree_cpu_s(server_pid) if server_pid else None
        if cpu_before is not None and cpu_after is not None:
            entry["server_cpu_s"] = {k: v - cpu_before.get(k, 0.0) for k, v in cpu_after.items()}
        log_after = _size(spec.get("server_log"))
        if log_before is not None and log_after is not None:
            entry["server_log_bytes"] = [log_before, log_after]
        after = metrics_text(spec["port"])
        if before is not None and after is not None:
            counts = parse_prefix_cache_counters(before), parse_prefix_cache_counters(after)
            entry["prefix_cache"] = {k: counts[1][k] - counts[0][k] for k in counts[1]}
            entry["server_latency_ms"] = latency_means_ms(parse_latency_sums(before), parse_latency_sums(after))
        _record(progress, entry)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(run(json.loads(Path(sys.argv[1]).read_text())))
