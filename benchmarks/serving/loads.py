"""The loads sent to each server, as ``vllm bench serve`` command lines.

Every load is vLLM's random dataset (prompt and output lengths fixed, ``--ignore-eos`` so
every request generates all its tokens), greedy sampling, streamed completions (vLLM's
``openai`` backend), and a seed of its own: two loads with the same lengths and seed
would send the same prompts, and the second would be served from the prefix cache.
vLLM saves its own result JSON (``--save-result``); ``--metadata`` records in it which
server, side and load it belongs to, so the files describe themselves.

A load is written ``name=NAME,in=N,out=N,rate=R,concurrency=C,prompts=N,range=F`` on the
command line (``rate`` in requests per second, ``inf`` to send all at once; ``concurrency``
and ``range`` optional), or chosen from ``PRESETS`` by name. ``range`` is vLLM's
``--random-range-ratio``: lengths drawn from [len * (1 - F), len * (1 + F)] instead of fixed.
``profile=N[,skip=K]`` makes it a profiled load (step_profile.py): the server's workers record N
engine steps after the first K; its latencies are not reported (the profiler slows the server).
``pyspy=1`` makes it a sampled load (host_samples.py): py-spy samples the engine core's Python
stacks for the length of the load; its latencies are not reported either.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# p50 is vLLM's "median_*_ms"; p99 comes from --metric-percentiles.
PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
METRIC_PERCENTILES = "50,99"


@dataclass(frozen=True)
class Load:
    name: str
    input_len: int
    output_len: int
    request_rate: float  # requests per second; inf: all at once (bounded by max_concurrency)
    prompts: int
    max_concurrency: int | None = None
    measured: bool = True  # False: a warm-up, sent but not reported
    range_ratio: float = 0.0  # vLLM's --random-range-ratio: 0, every prompt and output its fixed length
    profile_steps: int = 0  # > 0: a profiled load, this many engine steps recorded (step_profile.py)
    profile_skip: int = 0  # engine steps before the recording starts (the load's ramp-up)
    pyspy: bool = False  # the engine core's host stacks sampled by py-spy during the load (host_samples.py)

    def describe(self) -> str:
        arrival = f"{self.request_rate:g} req/s" if math.isfinite(self.request_rate) else "all at once"
        if self.max_concurrency:
            arrival += f", at most {self.max_concurrency} in flight"
        spread = f" (each +-{100 * self.range_ratio:g}%)" if self.range_ratio else ""
        profiled = f", profiled: engine steps {self.profile_skip}-{self.profile_skip + self.profile_steps}" \
            if self.profile_steps else ""  # fmt: skip
        sampled = ", engine core sampled by py-spy" if self.pyspy else ""
        return f"{self.input_len} in / {self.output_len} out{spread}, {arrival}, {self.prompts} prompts{profiled}{sampled}"

    def bench_args(self, *, served_model: str, tokenizer: str, port: int, seed: int, prompts: int,
                   result_dir: str, result_filename: str, metadata: dict[str, object],
                   extra: tuple[str, ...] = (), backend: str = "openai") -> list[str]:  # fmt: skip
        """The arguments of ``vllm bench serve`` for this load against the server on ``port``
        (``backend``: its request function, configs.Configuration.client_backend)."""
        args = [
            "--backend", backend, "--host", "127.0.0.1", "--port", str(port),
            "--model", served_model, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(self.input_len),
            "--random-output-len", str(self.output_len), "--num-prompts", str(prompts),
            "--request-rate", "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}",
            "--seed", str(seed), "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", PERCENTILE_METRICS, "--metric-percentiles", METRIC_PERCENTILES,
            "--save-result", "--result-dir", result_dir, "--result-filename", result_filename,
            "--disable-tqdm",
        ]  # fmt: skip
        if self.max_concurrency:
            args += ["--max-concurrency", str(self.max_concurrency)]
        if self.range_ratio:
            args += ["--random-range-ratio", f"{self.range_ratio:g}"]
        args += [*extra, "--metadata", *(f"{k}={v}" for k, v in metadata.items())]
        return args


# The loads on an H200, with prompt counts that keep one server's loads near 1.5
# minutes (plan.py's estimates): a moderate and a heavy arrival rate of 1k prompts, a
# saturating decode load, and a prefill-heavy one. Each of their steps that admits a prompt
# has more tokens than vLLM captures in CUDA graphs (512 on an H200), so attention and
# everything around it run without graphs. ``short32`` is the chat-like counterpart: 256-token
# prompts, whose mixed steps (one or two prompts plus the running decodes) fit the capture
# sizes and replay piecewise graphs: vLLM's RoPE is inside the graph there, its cache write
# (a splitting op in vLLM 0.33's defaults) and the plugin's fused op are not, unless
# VLLM_MLA_FUSION_GRAPH_ROPE=1 moves the latter into the graph. The warm-up goes first on every server
# (first requests after start-up pay one-time costs; its own seed keeps its prompts out of
# the measured loads' prefix cache). Its lengths vary (+-90%) so that its steps take every
# size from a few hundred tokens to the 8192 of a full chunk: a step of more tokens than vLLM
# captures runs eagerly, and kernels that specialise on the token count (vLLM's Triton fused
# MoE picks its tile by it) compile at the first step of each size class. Fixed 1k prompts
# left such compiles to the measured loads of the fp8-MoE stand-in (stop 28's ~1.6 s p99
# TTFT at rate4 on both sides); the servers' JIT monitor (run.py) now counts them per load.
# That warm-up still left two fused-MoE compiles (a small-M tile) to ``saturate`` on the H200
# (2026-12-03, docs/performance-history.md): its steps, 64 decodes plus short prompts, are a mix the
# long prompts at 16 in flight never make. ``warmup_decode`` makes it first: short prompts of
# varied length (+-50%) at ``saturate``'s 64 in flight; it removed those compiles there.
# ``profile16`` is rate16 profiled, for where a missed target's time goes (issue 21): 80 prompts
# arrive over 5 s; the first 50 engine steps (~1 s at rate16's ~20 ms per step) ramp up, the next
# 150 (~3 s) are its steady mix of decodes and chunked prompts. Name it last (--loads), after the
# measured loads: the profiler's export stalls the engine.
PRESETS: dict[str, Load] = {
    load.name: load
    for load in (
        Load("warmup", 2048, 64, math.inf, prompts=48, max_concurrency=16, measured=False, range_ratio=0.9),
        Load("warmup_decode", 512, 64, math.inf, prompts=128, max_concurrency=64, measured=False, range_ratio=0.5),
        Load("warm1k", 1024, 128, math.inf, prompts=20, measured=False),
        Load("rate4", 1024, 128, 4.0, prompts=100),
        Load("rate16", 1024, 128, 16.0, prompts=200),
        Load("saturate", 512, 256, math.inf, prompts=256, max_concurrency=64),
        Load("prefill", 4096, 32, 4.0, prompts=60),
        Load("short32", 256, 128, 32.0, prompts=400),
        Load("profile16", 1024, 128, 16.0, prompts=80, measured=False, profile_steps=150, profile_skip=50),
        Load("pyspy16", 1024, 128, 16.0, prompts=80, measured=False, pyspy=True),
    )
}
# ``pyspy16`` is the same mix with the engine core's host stacks sampled (host_samples.py): where the
# host time of host-bound steps goes, which the torch profiler, slowing the host, cannot compare.
# short32, profile16, pyspy16 and warm1k are not among the defaults (the loads): name them (--loads) where
# piecewise-graph steps, or where the time goes, are the question.
DEFAULT_LOADS = ("warmup", "warmup_decode", "rate4", "rate16", "saturate", "prefill")


def parse_load(text: str) -> Load:
    """A preset's name, or ``name=NAME,in=N,out=N,rate=R[,concurrency=C],prompts=N[,range=F][,warmup=1]
    [,profile=N[,skip=K]][,pyspy=1]``."""
    if "=" not in text:
        if text not in PRESETS:
            raise ValueError(f"unknown load {text!r}; presets: {sorted(PRESETS)}")
        return PRESETS[text]
    fields = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"load {text!r}: {item!r} is not KEY=VALUE")
        fields[key.strip()] = value.strip()
    known = {"name", "in", "out", "rate", "concurrency", "prompts", "range", "warmup", "profile", "skip", "pyspy"}
    if set(fields) - known or not {"name", "in", "out", "rate", "prompts"} <= set(fields):
        raise ValueError(f"load {text!r}: keys name, in, out, rate, prompts (and optionally concurrency, range, "
                         "warmup, profile, skip, pyspy)")  # fmt: skip
    if "skip" in fields and "profile" not in fields:
        raise ValueError(f"load {text!r}: skip counts the steps before a profile: give profile=N too")
    profile_steps = int(fields.get("profile", "0"))
    pyspy = fields.get("pyspy", "0") in ("1", "true", "yes")
    load = Load(
        name=fields["name"],
        input_len=int(fields["in"]),
        output_len=int(fields["out"]),
        request_rate=float(fields["rate"]),
        prompts=int(fields["prompts"]),
        max_concurrency=int(fields["concurrency"]) if "concurrency" in fields else None,
        # A profiled or sampled load's latencies are the profiler's as much as the server's: never reported.
        measured=fields.get("warmup", "0") not in ("1", "true", "yes") and not profile_steps and not pyspy,
        range_ratio=float(fields.get("range", "0")),
        profile_steps=profile_steps,
        profile_skip=int(fields.get("skip", "0")),
        pyspy=pyspy,
    )
    if load.profile_steps < 0 or load.profile_skip < 0:
        raise ValueError(f"load {text!r}: profile and skip count engine steps: not negative")
    if min(load.input_len, load.output_len, load.prompts) < 1 or not load.request_rate > 0:
        raise ValueError(f"load {text!r}: lengths, prompts and rate must be positive")
    if not 0 <= load.range_ratio < 1:
        raise ValueError(f"load {text!r}: range must be in [0, 1) (vLLM's --random-range-ratio)")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", load.name):
        raise ValueError(f"load {text!r}: a name of letters, digits, '_' and '-' (it names files)")
    return load


def parse_loads(texts: list[str]) -> list[Load]:
    loads = [parse_load(t) for t in texts]
    names = [load.name for load in loads]
    if len(set(names)) != len(names):
        raise ValueError(f"a load name is given twice: {names}")
    if not any(load.measured or load.profile_steps or load.pyspy for load in loads):
        raise ValueError("every load is a warm-up: nothing would be measured, profiled or sampled")
    return loads


def scaled_prompts(load: Load, scale: float) -> int:
    """Prompts of ``load`` at ``scale``; never fewer than one wave of its concurrency (or 4)."""
    floor = min(load.prompts, load.max_concurrency or 4)
    return max(floor, round(load.prompts * scale))
