"""How many servers fit the time budget, and with how many prompts.

A server costs its start-up (the client's import of vLLM overlaps it), every load's
duration, and its teardown. Until something is measured the estimates are the guesses in
``SPEEDS``; every server measured replaces them (``Measured``, kept in the work
directory's state file, so a later call on the same machine plans with this one's
figures). Start-up depends on whether the side's compile cache is warm: the first server
of a side compiles its graphs (cold), later ones load vLLM's compiled artifact (warm).

The plan takes servers in their order (sides.py) while they fit; if not even one fits, it
shrinks every load's prompt count (down to ``MIN_SCALE``) before giving up. At run time
each server and each load is checked again against the time left, with the estimates
measured so far.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .loads import Load, scaled_prompts


@dataclass(frozen=True)
class Speed:
    """Planning guesses for one stand-in (seconds), until measured."""

    cold_start_fixed_s: float
    cold_start_per_layer_s: float
    warm_start_fixed_s: float
    warm_start_per_layer_s: float
    tpot_s: float  # time per output token under an arrival-rate load (chunked prefill mixed in)
    decode_step_s: float  # one decode step of a saturating batch
    prefill_tokens_per_s: float


# H200 guesses. Dense, measured by this benchmark's first H200 run (2026-12-02, 61 layers): `vllm
# serve` healthy after 150 and 173 s cold, 93 and 102 s warm (the API server's import, graph
# capture and the compile-cache load dominate a warm start); loads as estimated below to within
# ~10%. TPOT 18-26 ms at 16 req/s and 8.7 ms at 64 in flight.
# fp8-moe, measured by its first full run (2026-12-02, 20 layers, DeepGEMM off: models.SERVER_ENV): healthy
# after 157-159 s cold (the 51 graph sizes' fp8 MoE kernels compile per size, 168 s with DeepGEMM's
# warm-up on top in the attempt before), 115 s warm; the five loads took 76-79 s per server; TPOT 15-26 ms
# at 16 req/s, 9.7 ms at 64 in flight; a 4k prefill ~0.1 s. (The first plan, from guesses of 80 + 9 s per
# layer cold, fitted one server where two did.)
# tiny-cpu: the CPU smoke test's 3-layer model on 2 cores.
SPEEDS = {
    "dense": Speed(60.0, 1.6, 75.0, 0.35, tpot_s=0.015, decode_step_s=0.010, prefill_tokens_per_s=60_000),
    "fp8-moe": Speed(80.0, 4.0, 60.0, 2.75, tpot_s=0.020, decode_step_s=0.010, prefill_tokens_per_s=40_000),
    "tiny-cpu": Speed(60.0, 2.0, 60.0, 2.0, tpot_s=0.3, decode_step_s=0.3, prefill_tokens_per_s=800),
    # The whole model at TP8 (8 H200s): each rank builds fp8-moe's rank and the eight compile in parallel;
    # NCCL and custom all-reduce set-up, eight processes' imports and ~80 GiB of dummy weights per rank
    # (drawn on the GPU) add to fp8-moe's guess; every step adds two all-reduces per layer. Guesses.
    "full": Speed(90.0, 3.0, 60.0, 1.0, tpot_s=0.080, decode_step_s=0.030, prefill_tokens_per_s=40_000),
}
LOAD_OVERHEAD_S = 4.0  # per load: the dataset's prompts, the prefix-cache counters, vLLM's result file
TEARDOWN_S = 10.0  # SIGINT to the last process of the server gone (2-3 s measured for the dense stand-in)
# --probe (probe.py): the redraw on every rank, three greedy requests alone, a profiled decode batch and
# rank 0's trace written and read; a guess for the full model at TP8.
PROBE_S = 60.0
# A profiled load (step_profile.py), on top of its requests: the workers' trace export when its steps
# are done and the driver's reading of rank 0's trace afterwards. Measured on the H200 (2026-12-03,
# fp8-MoE stand-in, profile16 at 48 prompts, 150 steps): 13.3-15.1 s of wall time against rate16's 9 s
# for 120 unprofiled prompts, and 3.3-4.3 s to read the trace.
PROFILED_LOAD_S = 15.0
MIN_SCALE = 0.25


@dataclass
class Measured:
    """What earlier servers took: start-up by side and warmth, load durations (vLLM's ``duration``)."""

    start_s: dict[str, list[float]] = field(default_factory=dict)  # "cold" / "warm:<slug>" -> seconds
    load_s: dict[str, list[float]] = field(default_factory=dict)  # "<load>@<prompts>" -> seconds

    def to_json(self) -> dict:
        return {"start_s": self.start_s, "load_s": self.load_s}

    @classmethod
    def from_json(cls, data: dict | None) -> Measured:
        data = data or {}
        return cls(dict(data.get("start_s", {})), dict(data.get("load_s", {})))

    def add_start(self, slug: str, warm: bool, seconds: float) -> None:
        self.start_s.setdefault(f"warm:{slug}" if warm else "cold", []).append(seconds)

    def add_load(self, load: Load, prompts: int, seconds: float) -> None:
        self.load_s.setdefault(f"{load.name}@{prompts}", []).append(seconds)


class Estimator:
    def __init__(self, speed: Speed, layers: int, measured: Measured, probe_s: float = 0.0):
        self.speed, self.layers, self.measured, self.probe_s = speed, layers, measured, probe_s

    def start_s(self, slug: str, warm: bool) -> float:
        s = self.speed
        if warm:
            seen = self.measured.start_s.get(f"warm:{slug}")
            return max(seen) if seen else s.warm_start_fixed_s + s.warm_start_per_layer_s * self.layers
        seen = self.measured.start_s.get("cold")  # any side's cold start: the sides differ little
        return 1.1 * max(seen) if seen else s.cold_start_fixed_s + s.cold_start_per_layer_s * self.layers

    def load_s(self, load: Load, prompts: int) -> float:
        seen = self.measured.load_s.get(f"{load.name}@{prompts}")
        profiled = PROFILED_LOAD_S if load.profile_steps else 0.0
        if seen:  # a profiled load's measured wall time has the export in it, not the driver's reading
            return max(seen) + LOAD_OVERHEAD_S + profiled / 2
        s = self.speed
        prefill_s = load.input_len / s.prefill_tokens_per_s
        if math.isfinite(load.request_rate):
            busy = prompts / load.request_rate + prefill_s + load.output_len * s.tpot_s
        else:
            in_flight = min(prompts, load.max_concurrency or prompts)
            waves = math.ceil(prompts / in_flight)
            busy = waves * (in_flight * prefill_s + load.output_len * s.decode_step_s)
        return busy + LOAD_OVERHEAD_S + profiled

    def server_s(self, slug: str, warm: bool, loads: list[Load], scale: float) -> float:
        return (self.start_s(slug, warm) + self.probe_s + sum(self.load_s(ld, scaled_prompts(ld, scale)) for ld in loads)
                + TEARDOWN_S)  # fmt: skip


@dataclass
class Plan:
    servers: list  # (index, Side), in start order
    scale: float  # prompts of every load x scale (loads.scaled_prompts)
    estimates_s: list[float]
    budget_s: float
    reason: str = ""  # why nothing fits, or why the queue was cut

    def to_json(self) -> dict:
        return {
            "servers": [
                {"index": i, "side": side.name, "estimate_s": round(e, 1)}
                for (i, side), e in zip(self.servers, self.estimates_s)
            ],
            "prompts_scale": self.scale,
            "budget_s": round(self.budget_s, 1),
            "estimated_s": round(sum(self.estimates_s), 1),
            "reason": self.reason,
        }


def plan(queue: list, budget_s: float, estimator: Estimator, loads: list[Load], warm_slugs: set[str],
         scale: float = 1.0) -> Plan:  # fmt: skip
    """The servers of ``queue`` (index, Side) that fit ``budget_s`` in order, at ``scale`` or less."""
    best = None
    candidate = scale
    while candidate >= MIN_SCALE - 1e-9:
        warm, used, servers, estimates = set(warm_slugs), 0.0, [], []
        for index, side in queue:
            need = estimator.server_s(side.slug, side.slug in warm, loads, candidate)
            if used + need > budget_s:
                break
            used += need
            servers.append((index, side))
            estimates.append(need)
            warm.add(side.slug)
        best = Plan(servers, candidate, estimates, budget_s)
        if servers:
            break
        candidate = round(candidate / 2, 4) if candidate > MIN_SCALE else 0.0
    if not best.servers and queue:
        index, side = queue[0]
        need = estimator.server_s(side.slug, side.slug in warm_slugs, loads, MIN_SCALE)
        best.reason = f"no server fits: the next ({side.name}) needs ~{need:.0f} s at the fewest prompts, {budget_s:.0f} s left"
    elif len(best.servers) < len(queue):
        best.reason = f"{len(queue) - len(best.servers)} more server(s) left for a later call (budget)"
    return best
