"""One ``vllm serve`` process: start, wait until healthy, confirm the side from its log, stop.

The plugin says what it did in one INFO line per process that built the model:
``vllm-mla-fusion (rank 0, local rank 0): MLA layers use the fused RoPE + KV-cache write
(backend triton, mode decode)`` (older checkouts write it without the parenthesised rank).
A server of a plugin side must show it and no fallback warning; an ``off`` server must not
show it. Anything else means the comparison would not compare what it says, so
``confirm_side`` raises and the benchmark stops. With tensor parallelism every rank builds the
model and writes its own line: all ranks must, with one backend and mode between them.
"""

from __future__ import annotations

import http.client
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .sides import Side

FUSED_LINE = re.compile(
    r"vllm-mla-fusion(?: \((?P<rank>[^)]*)\))?: MLA layers use the fused RoPE \+ KV-cache write "
    r"\(backend (?P<backend>[\w-]+), mode (?P<mode>[\w-]+)\)"
)
FALLBACK_LINE = re.compile(r"vllm-mla-fusion[^\n]*setting up the fused MLA path failed[^\n]*")
# Lines worth keeping in the report: what vLLM chose and sized (attention and MoE backends,
# KV cache, compile and graph capture times).
NOTABLE_LINE = re.compile(
    r"(attention backend|Using \S+ backend|MoE|moe|KV cache size|Maximum concurrency|torch\.compile take|"
    r"Graph capturing finished|Model loading took|init engine|vllm-mla-fusion)"
)
# vLLM's kernel JIT monitor (vllm/model_executor/warmup/jit_monitor.py, 0.33), active once the server has
# warmed up: "Triton kernel JIT compilation during inference: <kernel>", "CuTeDSL JIT compilation ...", and
# Triton's own "Triton autotuning for function <kernel>" (which the monitor switches on). Without
# --jit-monitor-verbose vLLM logs only a kernel's first compile; run.py starts every server with it.
KERNEL_COMPILE_LINE = re.compile(
    # the kernel is Triton's __qualname__ (dots, <locals>), ended by the verbose details or the advice
    r"(?P<backend>\w+) (?:kernel )?JIT compilation during inference: (?P<kernel>.+?)(?: \(|\. This causes)"
    r"|Triton (?P<autotune>autotuning) for function (?P<tuned>[\w.]+)"
)
HEALTH_POLL_S = 1.0


class ServerFailed(RuntimeError):
    """The server exited, never became healthy, or is not the side it should be."""


class PortTaken(ServerFailed):
    """Another process bound the chosen port before the server did: try another."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANK_NUMBER = re.compile(r"^rank (\d+)\b")


def confirm_side(side: Side, log: str, ranks: int = 1) -> dict:
    """What the log says about the plugin, checked against ``side``; ServerFailed if they disagree.

    ``ranks`` > 1 (tensor parallelism): a plugin side needs the line of every rank 0 .. ranks-1,
    each once, all naming the same backend and mode (``fused_by_rank`` in the facts)."""
    fused = [m.groupdict() for m in FUSED_LINE.finditer(log)]
    fallback = FALLBACK_LINE.findall(log)
    facts = {"fused_lines": fused, "fallback_lines": fallback}
    if side.plugin:
        if not fused:
            raise ServerFailed(f"side {side.name}: the plugin's line 'MLA layers use the fused RoPE + KV-cache write' "
                               "is missing from the server log: the plugin did not run")  # fmt: skip
        if fallback:
            raise ServerFailed(f"side {side.name}: the plugin fell back to vLLM's path: {fallback[0]}")
        wrong = [f for f in fused if not side.accepts_mode(f["mode"])]
        if wrong:
            raise ServerFailed(f"side {side.name}: its switches ask for mode {side.expected_mode}, the plugin's "
                               f"line says {wrong[0]['mode']}: the switch did not take effect (not set in the "
                               "server, or not eligible there: the layers say why at debug level)")  # fmt: skip
        if ranks > 1:
            facts["fused_by_rank"] = _every_rank_fused(side, fused, ranks)
    elif fused:
        raise ServerFailed(f"side {side.name}: the server log says the plugin ran ({fused[0]}), with it switched off")
    return facts


def _every_rank_fused(side: Side, fused: list[dict], ranks: int) -> dict[int, str]:
    """``{rank: "backend/mode"}`` of ranks 0 .. ranks-1; ServerFailed if one is missing, doubled or differs."""
    by_rank: dict[int, str] = {}
    for line in fused:
        m = RANK_NUMBER.match(line["rank"] or "")
        if m is None:
            raise ServerFailed(f"side {side.name}: a plugin line names no rank ({line['rank']!r}) at "
                               f"tensor-parallel size {ranks}")  # fmt: skip
        rank = int(m.group(1))
        if rank in by_rank:
            raise ServerFailed(f"side {side.name}: rank {rank} wrote the plugin's line twice: two model builds?")
        by_rank[rank] = f"{line['backend']}/{line['mode']}"
    missing = sorted(set(range(ranks)) - set(by_rank))
    if missing:
        raise ServerFailed(f"side {side.name}: no plugin line from rank(s) {missing} of {ranks}: "
                           f"those ranks run vLLM's path or did not say")  # fmt: skip
    extra = sorted(set(by_rank) - set(range(ranks)))
    if extra:
        raise ServerFailed(f"side {side.name}: plugin lines from rank(s) {extra}, beyond tensor-parallel size {ranks}")
    if len(set(by_rank.values())) > 1:
        raise ServerFailed(f"side {side.name}: the ranks chose differently: "
                           + ", ".join(f"rank {r} {c}" for r, c in sorted(by_rank.items())))  # fmt: skip
    return dict(sorted(by_rank.items()))


def notable_lines(log: str, limit: int = 40) -> list[str]:
    out = []
    for line in log.splitlines():
        if NOTABLE_LINE.search(line) and line not in out:
            out.append(line.strip()[:300])
            if len(out) == limit:
                break
    return out


def kernel_compiles(log: str) -> list[str]:
    """The kernels compiled or autotuned while serving, in the order ``log`` (a stretch of a server log)
    names them: ``"Triton fused_moe_kernel"``, ``"Triton autotuning _fwd_kernel"``. Each stalls the engine
    for the compile's length, so the requests in flight then carry it in their TTFT and ITL."""
    return [f"Triton autotuning {m['tuned']}" if m["autotune"] else f"{m['backend']} {m['kernel']}"
            for m in KERNEL_COMPILE_LINE.finditer(log)]


# vLLM's line for each engine step under --enable-logging-iteration-details (vllm/v1/metrics/loggers.py,
# 0.33): the step's prefill ("context") and decode ("generation") requests and tokens, and how long the
# engine loop blocked waiting for the step's output (vllm/v1/engine/core.py, capture_iteration_details:
# from after the step's launch, under async scheduling after the next step's too, to its sampled
# tokens). Scheduling and launching are outside it: the part of a step the host did not overlap, near
# zero where the host bounds the step. vLLM's API server logs each line (a little more work there).
ITERATION_LINE = re.compile(
    r"Iteration\((?P<index>\d+)\): (?P<ctx_reqs>\d+) context requests, (?P<ctx_tokens>\d+) context tokens, "
    r"(?P<gen_reqs>\d+) generation requests, (?P<gen_tokens>\d+) generation tokens, "
    r"iteration elapsed time: (?P<ms>[0-9.]+) ms(?P<dummy> \(dummy\))?"
)


def engine_steps(log: str) -> dict[str, dict]:
    """The engine's steps in ``log`` (a stretch of a server log) by kind, from vLLM's iteration lines:
    ``decode`` (no prompt tokens), ``mixed`` (prompt and decode tokens), ``prefill`` (prompt tokens
    only); per kind the step count, the medians of prompt and decode tokens, and the median, p90 and
    sum of the elapsed time (ms). Empty when the server did not log them (the option is off)."""
    kinds: dict[str, list[tuple[int, int, float]]] = {}
    for m in ITERATION_LINE.finditer(log):
        if m["dummy"]:
            continue
        ctx, gen = int(m["ctx_tokens"]), int(m["gen_tokens"])
        kind = "decode" if not ctx else ("mixed" if gen else "prefill")
        kinds.setdefault(kind, []).append((ctx, gen, float(m["ms"])))
    out = {}
    for kind, steps in kinds.items():
        ms = sorted(s[2] for s in steps)
        out[kind] = {"steps": len(steps), "prompt_tokens_p50": statistics.median(s[0] for s in steps),
                     "decode_tokens_p50": statistics.median(s[1] for s in steps),
                     "ms_p50": statistics.median(ms), "ms_p90": ms[math.ceil(0.9 * len(ms)) - 1],
                     "ms_sum": sum(ms)}  # fmt: skip
    return out


def metrics_text(port: int, timeout_s: float = 5.0) -> str | None:
    """The server's /metrics page (Prometheus text), or None when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as r:
            return r.read().decode()
    except (OSError, http.client.HTTPException, ValueError):  # no answer, a cut answer, not text
        return None


def parse_prefix_cache_counters(metrics_text: str) -> dict[str, float]:
    totals = {"queries": 0.0, "hits": 0.0}
    for line in metrics_text.splitlines():
        m = re.match(r"vllm:prefix_cache_(queries|hits)_total(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            totals[m.group(1)] += float(m.group(2))
    return totals


# The server's own latency histograms (vLLM 0.33's /metrics, seconds). Their sums and counts over a
# load give the server's view of each request, to set against the client's: queue (arrival at the
# engine to first scheduled), prefill (scheduled to first token), decode and itl are the engine's
# timestamps (itl between its outputs for a request); ttft is taken where the API server turns the
# engine's first output into a request output, before it is streamed. A client-side TTFT or ITL well
# above the server's is time spent between the two: an API server or client that cannot keep up (it
# then sends several tokens in one stream message). The histograms count every request of the load,
# the client's initial test prompt included.
LATENCY_HISTOGRAMS = {
    "ttft": "time_to_first_token_seconds",
    "itl": "inter_token_latency_seconds",
    "queue": "request_queue_time_seconds",
    "prefill": "request_prefill_time_seconds",
    "decode": "request_decode_time_seconds",
}
_HISTOGRAM_LINE = re.compile(r"vllm:(\w+)_(sum|count)(?:\{[^}]*\})? ([0-9.eE+-]+)$")


def parse_latency_sums(metrics_text: str) -> dict[str, float]:
    """``{name_sum, name_count}`` for each of LATENCY_HISTOGRAMS (seconds, observations), summed over
    engines; a histogram the page lacks is left out."""
    names = {metric: name for name, metric in LATENCY_HISTOGRAMS.items()}
    totals: dict[str, float] = {}
    for line in metrics_text.splitlines():
        m = _HISTOGRAM_LINE.match(line)
        if m and m.group(1) in names:
            key = f"{names[m.group(1)]}_{m.group(2)}"
            totals[key] = totals.get(key, 0.0) + float(m.group(3))
    return totals


def latency_means_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean of each server-side latency over the observations made between two readings (ms)."""
    means = {}
    for name in LATENCY_HISTOGRAMS:
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        if count > 0:
            means[name] = 1000.0 * (after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)) / count
    return means


def process_cpu_s(pid: int) -> dict[tuple[int, float], tuple[str, float]] | None:
    """CPU seconds (user + system) used so far by ``pid`` and each of its descendants, keyed by
    (pid, start time) so that two readings pair the same processes: ``(role, seconds)``. The role
    of ``pid`` itself (``vllm serve``'s main process) is ``api_server``; a child's is its vLLM process
    title past ``::`` (``VLLM::EngineCore_DP0`` -> ``EngineCore_DP0``), or its name. None if ``pid``
    is gone or psutil is missing."""
    try:
        import psutil  # a dependency of vLLM, which the client imports anyway
    except ImportError:
        return None
    try:
        root = psutil.Process(pid)
        procs = [(root, "api_server"), *((c, None) for c in root.children(recursive=True))]
    except psutil.Error:
        return None
    out = {}
    for proc, role in procs:
        try:
            t = proc.cpu_times()
            if role is None:
                title = (proc.cmdline() or [proc.name()])[0]
                role = title.split("::", 1)[1] if "::" in title else proc.name()
            out[(proc.pid, proc.create_time())] = (role, t.user + t.system)
        except psutil.Error:  # exited meanwhile
            continue
    return out


def cpu_by_role(before: dict, after: dict) -> dict[str, float]:
    """The CPU seconds each role used between two readings of ``process_cpu_s``, summed over its
    processes: a process started in between counts from zero; one that ended in between is not in
    the second reading, and its last seconds are lost."""
    out: dict[str, float] = {}
    for key, (role, cpu) in after.items():
        out[role] = out.get(role, 0.0) + cpu - (before[key][1] if key in before else 0.0)
    return out


@dataclass
class ServerSpec:
    """How to start a server; the same for every side but its environment."""

    launcher: list[str]  # the command before the model path: vllm serve, or demo.serve on a CPU
    model_dir: str
    served_model: str
    args: list[str]  # vLLM options after the model path (dummy weights, lengths, extra options)
    cwd: str


class Server:
    """``vllm serve`` in its own process group (so that teardown reaches the engine core)."""

    def __init__(self, spec: ServerSpec, side: Side, env: dict[str, str], log_path: Path, port: int | None = None):
        self.side = side
        self.port = port or free_port()
        self.log_path = log_path
        self.command = [*spec.launcher, spec.model_dir, "--served-model-name", spec.served_model,
                        "--host", "127.0.0.1", "--port", str(self.port), *spec.args]  # fmt: skip
        self._log = open(log_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.command, cwd=spec.cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds from launch to a 200 from /health; ServerFailed (PortTaken) if it exits or times out."""
        deadline = self.started + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log()
                if "Address already in use" in log:
                    raise PortTaken(f"port {self.port} was taken")
                raise ServerFailed(f"server exited with {self.proc.returncode} while starting:\n{log[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - self.started
            except OSError:
                pass
            time.sleep(HEALTH_POLL_S)
        raise ServerFailed(f"server not healthy after {timeout_s:.0f} s:\n{self.log()[-3000:]}")

    def stop(self, grace_s: float = 30.0) -> float:
        """SIGINT (vLLM shuts its engine core down), then SIGKILL to what is left of the group."""
        t = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # The group's other processes (engine core, workers) may outlive the API server briefly;
        # the next server needs their GPU memory.
        deadline = time.monotonic() + grace_s
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if _group_alive(self.proc.pid):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this Server started
        self.proc.wait()
        self._log.close()
        return time.monotonic() - t


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
