"""Timing primitives for the benchmarks: CUDA-graph replay, eager event timing, machine ceilings.

Conventions (docs/performance-history.md, "Method"):

- A kernel is timed as a CUDA graph holding ``n_calls`` back-to-back calls,
  each call on the next of several input sets (the caller rotates them so
  that the L2 does not serve data from a previous call when the working set
  would fit in it). Each replay is bracketed by CUDA events; the result is the
  median over ``repeats`` replays divided by ``n_calls``. Warm-up calls (which
  also trigger Triton/Inductor compilation) and warm-up replays are excluded.
- Code that cannot be captured (it synchronizes with the device, like the
  torch reference backend's boolean-mask indexing) is timed eagerly: events
  around a loop of ``n_calls`` calls, median over repeats. Those numbers
  include the Python/dispatch host overhead and the syncs; they are labelled
  as such wherever printed.
- The launch floor is the per-launch time of a trivial kernel (one store)
  captured the same way; the bandwidth ceiling is a large device-to-device
  copy, bytes read plus bytes written over time. Both are measured in the same
  process as the kernels they are compared with.

Without a GPU (``--smoke``) everything falls back to host wall-clock timing so
that the code paths run; those numbers mean nothing.

Why not ``triton.testing.do_bench_cudagraph``: it captures ``fn()`` unrolled on one set of
inputs, so every call after the first finds its inputs in the L2 wherever the working set fits
there (50 MB on an H200: a decode step's tensors up to a few hundred tokens), which a layer in a
served model never does (the other layers' weights and activations have evicted them). Ours
rotates the input sets per call. A closure advancing a counter would make ``do_bench_cudagraph``
rotate too (the counter advances while the graph is captured); switching to it is left until the
two can be compared on a GPU, since the published numbers come from this helper.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

Call = Callable[[int], object]  # call(i): issue one call on input set i (mod the number of sets)


@dataclass
class Timing:
    """Per-call time of one implementation on one shape, in microseconds."""

    us: float  # median over repeats of (replay time / n_calls)
    us_min: float
    us_max: float
    n_calls: int  # calls per timed region (graph or eager loop)
    repeats: int
    method: str  # "cuda_graph" | "eager_events" | "cpu_wall"
    first_call_ms: float  # wall time of the first call (compilation included): a hint, not a result

    def as_dict(self) -> dict:
        return asdict(self)


def _summary(per_call_us: list[float], n_calls: int, method: str, first_call_ms: float) -> Timing:
    return Timing(
        us=statistics.median(per_call_us),
        us_min=min(per_call_us),
        us_max=max(per_call_us),
        n_calls=n_calls,
        repeats=len(per_call_us),
        method=method,
        first_call_ms=first_call_ms,
    )


def _first_call_ms(call: Call, device: torch.device) -> float:
    t0 = time.perf_counter()
    call(0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def cuda_graph_time(
    call: Call, n_calls: int, repeats: int, device: torch.device, warmup_calls: int = 2, warmup_replays: int = 2
) -> Timing:
    """Capture ``call(0) .. call(n_calls - 1)`` in one CUDA graph; time its replays.

    Warm-up runs eagerly on a side stream first (compilation, lazy
    initialisation, allocator warm-up), as torch.cuda.graph requires.
    Raises whatever capture raises (a sync or an allocation pattern that
    cannot be captured): the caller records it as that implementation's error.
    """
    first_ms = _first_call_ms(call, device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for i in range(1, max(1, warmup_calls)):
            call(i)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)

    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for i in range(n_calls):
                call(i)
        for _ in range(warmup_replays):
            graph.replay()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize(device)
        per_call = [s.elapsed_time(e) * 1e3 / n_calls for s, e in events]
    finally:
        del graph
    return _summary(per_call, n_calls, "cuda_graph", first_ms)


def _event_times_ms(run, repeats: int, device: torch.device) -> list[float]:
    """CUDA-event time of ``run()`` (enqueued work included), ``repeats`` times, in ms."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
    return times


def eager_event_time(call: Call, n_calls: int, repeats: int, device: torch.device, warmup_calls: int = 2) -> Timing:
    """Events around an eager loop of ``n_calls`` calls (host overhead and syncs included)."""
    first_ms = _first_call_ms(call, device)
    for i in range(1, max(1, warmup_calls)):
        call(i)
    torch.cuda.synchronize(device)

    def loop():
        for i in range(n_calls):
            call(i)

    per_call = [ms * 1e3 / n_calls for ms in _event_times_ms(loop, repeats, device)]
    return _summary(per_call, n_calls, "eager_events", first_ms)


def cpu_wall_time(call: Call, n_calls: int, repeats: int, device: torch.device) -> Timing:
    """Host wall clock around ``n_calls`` calls; only for exercising code paths without a GPU."""
    first_ms = _first_call_ms(call, device)
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(n_calls):
            call(i)
        per_call.append((time.perf_counter() - t0) * 1e6 / n_calls)
    return _summary(per_call, n_calls, "cpu_wall", first_ms)


# ---------------------------------------------------------------------------
# Machine ceilings, measured in the same run.

_trivial_kernel = None


def _get_trivial_kernel():
    """A Triton kernel that does one load and one store: the launch floor of a Triton kernel."""
    global _trivial_kernel
    if _trivial_kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _trivial(x_ptr):
            tl.store(x_ptr, tl.load(x_ptr) + 1.0)

        _trivial_kernel = _trivial
    return _trivial_kernel


def launch_floor(device: torch.device, n_calls: int = 200, repeats: int = 15) -> dict:
    """Per-launch time (us) of trivial kernels captured ``n_calls`` to a graph.

    ``triton``: one-element load+store Triton kernel; ``torch``: ``x.add_(1)``
    on one element. ``floor_us`` is the smaller (the stricter floor).
    """
    x = torch.zeros(1, device=device, dtype=torch.float32)
    out: dict = {}
    timers = {"torch": lambda i: x.add_(1.0)}
    try:
        kernel = _get_trivial_kernel()
        timers["triton"] = lambda i: kernel[(1,)](x)
    except Exception as e:  # noqa: BLE001 - a missing/failed Triton must not stop the torch floor
        out["triton_error"] = f"{type(e).__name__}: {e}"
    for name, call in timers.items():
        if device.type == "cuda":
            t = cuda_graph_time(call, n_calls, repeats, device)
        else:
            t = cpu_wall_time(call, 5, 3, device)
        out[f"{name}_us"] = t.us
    out["floor_us"] = min(v for k, v in out.items() if k.endswith("_us"))
    out["method"] = "cuda_graph" if device.type == "cuda" else "cpu_wall (meaningless)"
    return out


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 7, copies: int = 5) -> dict:
    """Device-to-device copy of ``nbytes`` (bf16): bytes read + bytes written per second."""
    n = nbytes // 2
    src = torch.randn(n, device=device, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    moved = 2 * n * 2  # read + write
    if device.type == "cuda":
        torch.cuda.synchronize(device)

        def copy_loop():
            for _ in range(copies):
                dst.copy_(src)

        times = [ms * 1e-3 / copies for ms in _event_times_ms(copy_loop, repeats, device)]
        method = "cuda_events"
    else:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        method = "cpu_wall (meaningless)"
    sec = statistics.median(times)
    return {"bytes_moved": moved, "us": sec * 1e6, "bytes_per_s": moved / sec, "TBps": moved / sec / 1e12,
            "method": method}  # fmt: skip


def l2_cache_bytes(device: torch.device) -> int:
    """The device's L2 size (torch reports it for CUDA devices); 60 MB when unknown."""
    if device.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        if size:
            return int(size)
    return 60 * 1024 * 1024
