"""End to end inside vLLM: DeepSeek-V3 (61 MLA layers, TP8-rank shapes) served with the plugin on and off.

What a vLLM user runs, on one GPU: ``vllm.LLM`` with its serving defaults
(multiprocessing engine core, async scheduling, torch.compile + CUDA graphs, the
attention backend vLLM picks), dummy weights, a bf16 or fp8 KV cache. Engines
alternate plugin on / off in pairs whose order alternates too (on, off, off, on, ...;
``--runs`` per side), each a fresh engine-core process;
per engine:

1. first request: B=1, 64-token prompt, 1 output token, right after start-up, then
   the same shape 3 more times (the first-call cost), with Triton JIT compilations
   recorded from the end of vLLM's warm-up on;
2. timing pass 0: for each batch B, B requests x 1 token and B requests x N tokens
   (``ignore_eos``), TPOT = (t_N - t_1) / (N - 1), the wall time of a decode step,
   throughput = B*N / t_N; for each prompt length L, one request of L tokens x 1
   token, TTFT; for each ``--mixed-lens`` L, a prompt of L tokens joining
   ``--mixed-decoders`` requests that are decoding (the step that admits it is a mixed
   step: decode rows and the prompt's rows in one launch per layer), its TTFT and that
   step's host record (each shape runs once untimed first);
3. GPU time: one torch-profiler session (vLLM's ``profiler_config``) over B requests x
   (1 + K) tokens for each B and one prefill per L; every engine step's kernels
   (benchmarks/e2e/vllm_trace.py); per decode step of batch B: the sum of kernel durations
   and the busy time (union of GPU intervals), median over the steps;
4. timing passes 1 .. ``--repeats``-1, as far as the deadline allows.

The deadline (``--deadline-s``) is kept by pairs: the first engine of a pair starts only if
its partner still fits, and leaves it the time; an engine short of time skips
timing passes, never the first pass or (unless very late) the profile.

Prompts are random token ids, new for every request, so vLLM's prefix cache (on, as
in serving) never hits. The predicted saving per decode step is 61 x (unfused chain -
ours) per layer from the kernel benchmark (``--kernel-bench-json``, H=16, block size 64,
the cache dtype's rows), for the decode path the plugin took: op 2 against RoPE + cache
write + query concat (decode-layer section) where the backend concatenates the query, op 1
against RoPE + cache write (sweep section, op 1 at T = batch) where it takes
(ql_nope, q_pe) as is (FLASH_ATTN_MLA, vLLM's default on Hopper).

Usage::

    python -m benchmarks.e2e.bench_vllm_e2e --out $OUT --tag part1 --kv-cache-dtypes auto --runs 2 --deadline-s 510
    python -m benchmarks.e2e.bench_vllm_e2e --out $OUT --tag part2 --kv-cache-dtypes fp8 --runs 2 --extra-pairs auto
    python -m benchmarks.e2e.bench_vllm_e2e --smoke --out /tmp/e2e      # CPU: same code paths, numbers meaningless

(from the repository root: the engine core and its workers import this module, the demo and
the test harness by package name).

Writes ``bench_vllm_e2e_<tag>.json`` (rewritten after every section), ``.md`` and ``.png``.
The driver never initialises CUDA, so vLLM can fork the engine core.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"

# Read by vLLM lazily, so set before it is imported: callables sent to the engine process
# (apply_model / collective_rpc) need pickling; no usage reporting; local model dir.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("MLA_FUSION_E2E_CPU_STANDINS") == "1":
    # Smoke run: vLLM's CPU platform spawns the engine core and its worker, which import this
    # file as their main module; the plain-torch stand-ins for the kernels the CUDA wheel lacks
    # must be registered there too, and AMX hidden from vLLM (demo/cpu_stand_ins.py).
    from demo import cpu_stand_ins as _cpu_stand_ins

    _cpu_stand_ins.prepare()

from demo.tiny_model import DSV3_ARCHITECTURE, yarn_rope_scaling  # noqa: E402

from .. import provenance  # noqa: E402
from . import vllm_engine as E  # noqa: E402 - stdlib only at import: no vLLM, no CUDA
from . import vllm_trace as T  # noqa: E402

NUM_LAYERS = 61
# DeepSeek-V3 with the shapes of one tensor-parallel rank at TP8: 128/8 = 16 heads, the
# dense MLP's 18432/8 = 2304 intermediate in every layer (no MoE, to fit one GPU), full
# hidden size and vocabulary, DeepSeek-V3's YaRN rope.
DSV3_TP8_CONFIG = {
    **DSV3_ARCHITECTURE,
    "hidden_size": 7168,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_hidden_layers": NUM_LAYERS,
    "intermediate_size": 2304,
    "moe_intermediate_size": 256,
    "n_routed_experts": 8,
    "first_k_dense_replace": NUM_LAYERS,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "rope_scaling": yarn_rope_scaling(40, 4096),
}
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_LENS = (1024, 4096, 16384)
MIXED_LENS = (1024,)
MIXED_DECODERS = 4
MIXED_DECODE_TOKENS = 32
KERNEL_BENCH_JSON = RESULTS / "bench_mla_rope_cache.json"
# For the deadline (seconds), until measured: a cold engine start (compile + capture of 61
# layers), a warm one (vLLM loads the AOT artifact its side compiled before), the least
# measuring worth starting an engine for, the profiling session, teardown.
DEFAULT_COLD_START_S = 150.0
WARM_START_S = 50.0
MIN_MEASURE_S = 45.0
PROFILE_RESERVE_S = 25.0
TEARDOWN_S = 15.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def med(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(xs) if xs else None


def spread(xs):
    xs = [x for x in xs if x is not None]
    return (min(xs), max(xs)) if xs else (None, None)


# ---------------------------------------------------------------------------
# prediction from the kernel benchmark


def load_prediction(path: Path, batches) -> dict:
    """Per decode path and cache dtype, per batch: the kernel-benchmark figures used and 61 x their difference.

    ``op2``: the decode-layer section (RoPE + cache write + query concat or concat-quant,
    3 launches, against op 2), for backends that concatenate the query. ``op1``: the sweep's
    op 1 rows at T = batch (RoPE + cache write, 2 launches, against op 1), for backends
    that take (ql_nope, q_pe) as is (FLASH_ATTN_MLA), where the plugin runs op 1 on the
    decode rows and vLLM has no concat. H=16 (a TP8 rank), block size 64.
    """
    out = {"source": str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path), "rows": {}}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    out["kernel_bench_environment"] = {k: data.get("environment", {}).get(k) for k in ("date_utc", "torch", "triton")}
    ok = [r for r in data.get("results", []) if r.get("H") == 16 and r.get("block_size") == 64
          and r.get("status") == "ok"]  # fmt: skip
    sections = {"op2": ("decode-layer", "decode"), "op1": ("sweep", "prefill")}
    for path_name, (section, op) in sections.items():
        rows = [r for r in ok if r.get("section") == section and r.get("op") == op]
        per_cache = {}
        for cache in ("bf16", "fp8"):
            table = {}
            for b in batches:
                u = next((r["us"] for r in rows if r["cache"] == cache and r["T"] == b and r["impl"] == "unfused"), None)
                o = next((r["us"] for r in rows if r["cache"] == cache and r["T"] == b and r["impl"] == "triton"), None)
                if u is not None and o is not None:
                    table[str(b)] = {"unfused_us_per_layer": u, "ours_us_per_layer": o,
                                     "saving_us_per_step": NUM_LAYERS * (u - o)}  # fmt: skip
            per_cache[cache] = table
        out["rows"][path_name] = per_cache
    return out


# ---------------------------------------------------------------------------
# one engine


class Prompts:
    """Fresh random prompts: vLLM's prefix cache never hits, whatever was sent before."""

    def __init__(self, vocab: int, seed: int):
        self.rng = random.Random(seed)
        self.vocab = vocab

    def take(self, n: int, length: int) -> list[dict]:
        return [{"prompt_token_ids": [self.rng.randrange(1, self.vocab) for _ in range(length)]} for _ in range(n)]


def sampling(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def timed(llm, prompts, max_tokens: int) -> float:
    t = time.perf_counter()
    outs = llm.generate(prompts, sampling(max_tokens), use_tqdm=False)
    dt = time.perf_counter() - t
    got = {len(o.outputs[0].token_ids) for o in outs}
    if got != {max_tokens}:
        raise RuntimeError(f"asked for {max_tokens} tokens per request, got {sorted(got)}")
    return dt


def timed_with_host(llm, prompts, max_tokens: int) -> tuple[float, dict]:
    """``timed``, plus the engine's host record of the request (vllm_engine.install_host_timer)."""
    llm.collective_rpc(E.read_host_timer)  # drop what earlier requests left
    t = timed(llm, prompts, max_tokens)
    return t, E.host_summary(llm.collective_rpc(E.read_host_timer)[0])


def engine_pair(kv: str, on_first: bool) -> list[tuple[str, str, str | None]]:
    """One on/off pair of engines: (kv cache dtype, side, the partner side that must still fit, or None)."""
    first, second = ("on", "off") if on_first else ("off", "on")
    return [(kv, first, second), (kv, second, None)]


class Bench:
    def __init__(self, args):
        self.args = args
        self.t0 = time.monotonic()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work_dir or (self.out / f"e2e_work_{args.tag}"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.json_path = self.out / f"bench_vllm_e2e_{args.tag}.json"
        self.model_dir = self.write_model()
        self.report: dict = {
            "environment": environment(args),
            "config": self.config_json(),
            "prediction": load_prediction(Path(args.kernel_bench_json), args.decode_batches),
            "engines": [],
            "skipped": [],
        }
        self.starts: dict = {}
        self.cores: dict = {}
        # GPU memory in use before any engine (nvidia-smi): an engine's memory counts as released
        # once usage is back near it (the next engine's start checks free >= 90% of the GPU).
        self.gpu_baseline_mib = None if args.smoke else E.wait_gpu_memory_released(float("inf"), timeout_s=0)
        self.report["environment"]["gpu_used_mib_before"] = self.gpu_baseline_mib
        self.min_measure_s = 5.0 if args.smoke else MIN_MEASURE_S

    # -- set-up ---------------------------------------------------------------------

    def write_model(self) -> str:
        cfg = dict(DSV3_TP8_CONFIG)
        if self.args.smoke:
            from tests.vllm_plugin import harness

            cfg = dict(harness.DSV3_CONFIG, max_position_embeddings=4096)
        d = self.work / "model"
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg, indent=1))
        self.vocab = cfg["vocab_size"]
        self.num_layers = cfg["num_hidden_layers"]
        return str(d)

    def config_json(self) -> dict:
        a = self.args
        return {
            "mode": "smoke" if a.smoke else "full",
            "model": "DeepSeek-V3 TP8-rank shapes (tiny harness model in smoke mode)",
            "model_config": json.loads((Path(self.model_dir) / "config.json").read_text()),
            "kv_cache_dtypes": a.kv_cache_dtypes,
            "runs_per_side": a.runs,
            "extra_pairs": a.extra_pairs,
            "on_mode": a.on_mode,
            "decode_batches": a.decode_batches,
            "prefill_lens": a.prefill_lens,
            "mixed_lens": a.mixed_lens,
            "mixed_decoders": a.mixed_decoders,
            "decode_tokens": a.decode_tokens,
            "prompt_len": a.prompt_len,
            "repeats": a.repeats,
            "host_regions": a.host_regions,
            "profile_decode_steps": a.profile_decode_steps,
            "deadline_s": a.deadline_s,
            "attention_backend": a.attention_backend or "vLLM's choice",
            "engine": "vllm.LLM, multiprocessing engine core (VLLM_ENABLE_V1_MULTIPROCESSING="
            + os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1 (default)") + ")",
        }

    def llm_kwargs(self, kv: str, prof_dir: Path) -> dict:
        a = self.args
        longest = max([*a.prefill_lens, *a.mixed_lens])
        max_len = max(longest, a.prompt_len + a.decode_tokens + a.profile_decode_steps) + 256
        # A mixed step holds the decoders and the whole joining prompt.
        batched = max(max(a.prefill_lens), max(a.decode_batches), *(n + a.mixed_decoders for n in a.mixed_lens))
        kw = dict(
            model=self.model_dir, load_format="dummy", skip_tokenizer_init=True, seed=0, kv_cache_dtype=kv,
            max_model_len=max_len, max_num_batched_tokens=batched,
            max_num_seqs=max(max(a.decode_batches), a.mixed_decoders + 1), profiler_config=E.profiler_config(str(prof_dir)),
        )  # fmt: skip
        if a.attention_backend:
            kw["attention_backend"] = a.attention_backend
        if a.smoke:
            from demo.cpu_stand_ins import ATTENTION_BACKEND

            kw.update(dtype="bfloat16", attention_backend=ATTENTION_BACKEND, kv_cache_memory_bytes=256 << 20,
                      enforce_eager=True)  # fmt: skip
        else:
            kw.update(dtype="bfloat16", compilation_config={"cudagraph_capture_sizes": sorted(a.decode_batches)})
        return kw

    def save(self) -> None:
        self.report["summary"] = summarize(self.report, self.args)
        self.report["elapsed_s"] = time.monotonic() - self.t0
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.report, indent=1, default=str))
        tmp.replace(self.json_path)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    # -- the plan -------------------------------------------------------------------

    def plan(self) -> list[tuple[str, str, str | None]]:
        """The engines in order, as ``engine_pair`` gives them: pairs alternate which side goes first
        (on, off, off, on, ...), so that neither side is always started right after the other's teardown."""
        return [e for kv in self.args.kv_cache_dtypes for i in range(self.args.runs) for e in engine_pair(kv, i % 2 == 0)]

    def start_estimate(self, kv: str, side: str) -> float:
        """Expected start-up seconds of the next engine of (kv, side)."""
        seen = self.starts.get((kv, side))
        if seen is not None:
            return min(seen, WARM_START_S)  # same side again: vLLM loads its AOT-compiled artifact
        cache = self.work / f"vllm-cache-{kv}-{side}"
        if cache.is_dir() and any(cache.iterdir()):
            return WARM_START_S  # compiled by an earlier run with this --work-dir
        same_kv = [v for (k, _), v in self.starts.items() if k == kv]
        if same_kv:
            return max(same_kv) * 1.2  # the other side compiles its own graph: a cold start
        return DEFAULT_COLD_START_S

    def engine_need(self, kv: str, side: str) -> float:
        """The least an engine needs to be worth starting: start, first request + one timing pass +
        profile (as measured on engines of this cache dtype, else a guess), teardown."""
        core = [c for (k, _), c in self.cores.items() if k == kv]
        return self.start_estimate(kv, side) + (max(core) if core else self.min_measure_s) + TEARDOWN_S

    def run(self) -> int:
        a = self.args
        eps = E.entry_points()
        self.report["environment"]["entry_points"] = eps
        if eps.get(E.ENTRY_POINT[0]) != E.ENTRY_POINT[1]:
            log(f"error: the plugin's entry point is not installed ({eps}); vLLM would never load it")
            self.save()
            return 2
        t = time.perf_counter()
        import vllm

        self.report["environment"]["vllm"] = vllm.__version__
        self.report["environment"]["import_vllm_s"] = time.perf_counter() - t
        self.report["environment"]["loaded_by_vllm"] = E.load_plugins_through_vllm()
        queue = self.plan()
        idx = 0
        extra = False
        while True:
            if not queue:
                if not a.extra_pairs:
                    break
                queue, extra = engine_pair(a.extra_pairs, on_first=True), True
            kv, side, partner_side = queue[0]
            # Engines run in on/off pairs: the first of a pair starts only if its partner fits
            # too, and stops measuring early enough to leave that partner its time.
            partner = self.engine_need(kv, partner_side) if partner_side else 0.0
            need = self.engine_need(kv, side) + partner
            if self.elapsed() + need > a.deadline_s:
                self.report["skipped"] += [{"kv_cache_dtype": k, "side": s, "optional": extra,
                                            "reason": f"deadline: {self.elapsed():.0f} s elapsed, ~{need:.0f} s needed, "
                                            f"{a.deadline_s:.0f} s allowed"} for k, s, _ in queue]  # fmt: skip
                log(f"deadline: not starting {len(queue)} more engine(s)")
                break
            queue.pop(0)
            rec = self.run_engine(idx, kv, side, engine_deadline=a.deadline_s - partner)
            if "start_s" in rec:
                self.starts[(kv, side)] = rec["start_s"]
            if "core_s" in rec:
                self.cores[(kv, side)] = rec["core_s"]
            idx += 1
            self.report["engines"].append(rec)
            self.save()
        import torch

        # The driver must never have touched CUDA (fork-safety for vLLM's engine core).
        self.report["environment"]["driver_cuda_initialized"] = torch.cuda.is_initialized()
        self.save()
        write_markdown(self.report, self.out / f"bench_vllm_e2e_{a.tag}.md")
        if not a.no_plot:
            plot(self.report, self.out / f"bench_vllm_e2e_{a.tag}.png")
        print_summary(self.report)
        return 0 if all("error" not in e for e in self.report["engines"]) else 1

    # -- one engine -----------------------------------------------------------------

    def run_engine(self, idx: int, kv: str, side: str, engine_deadline: float) -> dict:
        """Start one engine, measure, tear down. Sections, in order: first request; one timing pass
        over every decode batch and prefill length; the profiling session; further timing passes
        while ``engine_deadline`` (seconds since the benchmark started) allows."""
        from vllm import LLM

        a = self.args
        on = side == "on"
        rec: dict = {"index": idx, "kv_cache_dtype": kv, "side": side, "on_mode": a.on_mode if on else None}
        # One compile cache per side: vLLM's AOT-compile key covers the config, not the traced
        # source files, so an artifact compiled with the plugin could otherwise serve an engine
        # without it (vllm/compilation/decorators.py). Same-side engines reuse their cache, as a
        # restarted server would.
        os.environ["VLLM_CACHE_ROOT"] = str(self.work / f"vllm-cache-{kv}-{side}")
        rec["registered"] = E.set_plugin(on, decode=(a.on_mode == "decode"))
        prof_dir = self.work / f"prof-{idx}"
        kwargs = self.llm_kwargs(kv, prof_dir)
        prompts = Prompts(self.vocab, seed=1000 + idx)
        log(f"engine {idx}: kv {kv}, plugin {side}: starting")
        t = time.perf_counter()
        try:
            llm = LLM(**kwargs)
        except Exception as e:  # noqa: BLE001 - record, go on with the next engine
            rec["error"] = f"start: {type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc()[-6000:]
            log(f"engine {idx}: failed to start: {rec['error']}")
            return rec
        rec["start_s"] = time.perf_counter() - t
        log(f"engine {idx}: up in {rec['start_s']:.1f} s")
        try:
            rec["facts"] = {**llm.apply_model(E.mla_facts)[0], **llm.collective_rpc(E.runner_facts)[0]}
            modes = {layer["fusion_mode"] for layer in rec["facts"]["layers"]}
            want = {a.on_mode} if on else {None}
            if modes != want or len(rec["facts"]["layers"]) != self.num_layers:
                raise RuntimeError(f"plugin {side}: the engine built MLA layers in modes {modes}, expected {want}")
            rec["jit_hook"] = llm.collective_rpc(E.install_jit_hook)[0]
            rec["host_timer"] = llm.collective_rpc(E.install_host_timer)[0]
            if a.host_regions:
                rec["host_regions"] = llm.collective_rpc(E.install_region_timer)[0]
            marks = {}

            def mark(name):
                marks[name] = time.perf_counter()

            mark("first_request")
            rec["first_request"] = self.first_request(llm, prompts)
            rec["decode"], rec["prefill"] = {}, {}
            mark("timing pass 0")
            t = time.monotonic()
            self.timing_pass(llm, prompts, rec, 0)
            pass_s = time.monotonic() - t
            self.save_partial(rec)
            mark("profile")
            if self.elapsed() + PROFILE_RESERVE_S < engine_deadline:
                rec["profile"] = self.profile(llm, prompts, prof_dir, idx)
            else:
                rec["profile"] = {"skipped": "deadline"}
            rec["core_s"] = time.perf_counter() - marks["first_request"]
            self.save_partial(rec)
            for r in range(1, a.repeats):
                if self.elapsed() + pass_s + TEARDOWN_S > engine_deadline:
                    rec["timing_passes_skipped"] = f"{a.repeats - r} of {a.repeats} (deadline)"
                    break
                mark(f"timing pass {r}")
                self.timing_pass(llm, prompts, rec, r)
            self.finish_timing(rec)
            mark("end")
            jit = llm.collective_rpc(E.read_jit_log)[0]
            rec["jit_after_warmup"] = attribute_jit(jit, marks)
            if jit:
                rec["kernel_cache_keys"] = llm.collective_rpc(E.kernel_cache_keys)[0]
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc()[-6000:]
            log(f"engine {idx}: {rec['error']}")
        finally:
            rec["shutdown_s"] = E.shutdown(llm)
            del llm
            if self.gpu_baseline_mib is not None:
                rec["gpu_used_mib_after"] = E.wait_gpu_memory_released(self.gpu_baseline_mib + 2048.0, timeout_s=90.0)
        return rec

    def save_partial(self, rec: dict) -> None:
        self.report["engines_in_progress"] = [rec]
        self.save()
        self.report.pop("engines_in_progress", None)

    def first_request(self, llm, prompts: Prompts) -> dict:
        a = self.args
        times, hosts = [], []
        for _ in range(4):
            t, host = timed_with_host(llm, prompts.take(1, a.prompt_len), 1)
            times.append(t)
            hosts.append(host)
        first, rest = times[0], times[1:]
        log(f"  first request {1e3 * first:.1f} ms, then {', '.join(f'{1e3 * x:.1f}' for x in rest)} ms; "
            f"execute_model {[h.get('execute_model_ms') for h in hosts]} ms")  # fmt: skip
        return {"first_s": first, "next_s": rest, "excess_ms": 1e3 * (first - statistics.median(rest)), "host": hosts}

    def timing_pass(self, llm, prompts: Prompts, rec: dict, r: int) -> None:
        """One repeat over every decode batch (t_1, t_N) and prefill length (TTFT); pass 0 first
        runs each shape once untimed (first use of a shape)."""
        a = self.args
        n = a.decode_tokens
        for b in a.decode_batches:
            if r == 0:
                timed(llm, prompts.take(b, a.prompt_len), 4)
            d = rec["decode"].setdefault(str(b), {"t1_s": [], "tN_s": []})
            d["t1_s"].append(timed(llm, prompts.take(b, a.prompt_len), 1))
            d["tN_s"].append(timed(llm, prompts.take(b, a.prompt_len), n))
            tpot = 1e3 * (d["tN_s"][-1] - d["t1_s"][-1]) / (n - 1)
            log(f"  pass {r} decode B={b:4d}: TPOT {tpot:.3f} ms")
        if a.host_regions:
            probe = llm.collective_rpc(E.host_speed_probe)[0]
            rec.setdefault("host_probe", []).append(probe)
            log(f"  pass {r} host probe: {probe['python_us_per_1k']:.1f} us per 1k loop iterations, "
                f"{probe['torch_slice_us']:.2f} us per torch slice")  # fmt: skip
        for length in a.prefill_lens:
            if r == 0:
                timed(llm, prompts.take(1, length), 1)
            p = rec["prefill"].setdefault(str(length), {"ttft_s": [], "host": []})
            t, host = timed_with_host(llm, prompts.take(1, length), 1)
            p["ttft_s"].append(t)
            p["host"].append(host)
            log(f"  pass {r} prefill L={length:5d}: TTFT {1e3 * t:.2f} ms; host: execute_model "
                f"{host.get('execute_model_ms')} ms, sample_tokens {host.get('sample_tokens_ms')} ms, "
                f"gc {host.get('gc_ms')} ms" + (f"; regions (calls, ms) {host['regions_ms']}" if "regions_ms" in host else ""))  # fmt: skip
        for length in a.mixed_lens:
            if r == 0:
                self.mixed_request(llm, prompts, length)
            m = rec.setdefault("mixed", {}).setdefault(str(length), {"ttft_s": [], "host": []})
            t, host = self.mixed_request(llm, prompts, length)
            m["ttft_s"].append(t)
            m["host"].append(host)
            log(f"  pass {r} mixed {a.mixed_decoders} decodes + L={length:5d}: TTFT {1e3 * t:.2f} ms; mixed step "
                f"execute_model {host.get('execute_model_ms')} ms ({host.get('execute_model_tokens')} tokens)"
                + (f"; regions (calls, ms) {host['regions_ms']}" if "regions_ms" in host else ""))  # fmt: skip
        self.finish_timing(rec)

    def mixed_request(self, llm, prompts: Prompts, length: int) -> tuple[float, dict]:
        """A prompt of ``length`` tokens joins ``--mixed-decoders`` requests that are decoding: its TTFT
        (queued to its token), and the host record of the mixed step that admitted it
        (``mixed_step_host``; ``{"mixed_step": "not found", "request": ...}`` where it cannot be picked out)."""
        a = self.args
        # Enough output tokens that the decoders outlive their three warm steps and the prompt's steps.
        decoding = sampling(max(a.decode_tokens, MIXED_DECODE_TOKENS))
        with E.running_decoders(llm, prompts.take(a.mixed_decoders, a.prompt_len), decoding):
            llm.collective_rpc(E.read_host_timer)  # drop the decoders' own steps
            t = time.perf_counter()
            rid = E.add_request(llm, prompts.take(1, length)[0], sampling(1), prefix="mixed")
            E.engine_steps(llm, until=lambda finished: rid in finished)
            dt = time.perf_counter() - t
            host = E.host_summary(llm.collective_rpc(E.read_host_timer)[0])
        # Where the step cannot be picked out, the request's record is kept aside: its TTFT still
        # counts, its host figures (several steps together) stay out of the mixed-step medians.
        return dt, mixed_step_host(host, length) or {"mixed_step": "not found", "request": host}

    def finish_timing(self, rec: dict) -> None:
        n = self.args.decode_tokens
        for b, d in rec["decode"].items():
            tpot = [(y - x) / (n - 1) for x, y in zip(d["t1_s"], d["tN_s"])]
            d.update(tpot_ms=[1e3 * x for x in tpot], tpot_ms_median=1e3 * med(tpot),
                     throughput_tok_s=int(b) * n / med(d["tN_s"]), decode_tok_s=int(b) / med(tpot))  # fmt: skip
        for p in [*rec["prefill"].values(), *rec.get("mixed", {}).values()]:
            p["ttft_ms_median"] = 1e3 * med(p["ttft_s"])
            execs = [sum(h["execute_model_ms"]) for h in p.get("host", []) if h.get("execute_model_ms")]
            p["execute_model_ms_median"] = med(execs) if execs else None

    def profile(self, llm, prompts: Prompts, prof_dir: Path, idx: int) -> dict:
        a = self.args
        k = a.profile_decode_steps

        def work():
            for b in a.decode_batches:
                llm.generate(prompts.take(b, a.prompt_len), sampling(1 + k), use_tqdm=False)
            for length in a.prefill_lens:
                llm.generate(prompts.take(1, length), sampling(1), use_tqdm=False)
            # A step after the last measured one closes its launch window (vllm_trace.py).
            llm.generate(prompts.take(1, 4), sampling(2), use_tqdm=False)

        t = time.perf_counter()
        path = E.profile(llm, str(prof_dir), f"e2e{idx}", work)
        t_export = time.perf_counter() - t
        t = time.perf_counter()
        trace = T.load(path)
        steps = [s for s in T.parse_steps(trace, E.CENSUS_CPU_OPS) if s.closed]
        for s, host in zip(steps, T.host_breakdown(trace, steps)):
            s.host = host
        out = {"trace": os.path.basename(path), "trace_bytes": os.path.getsize(path), "session_s": t_export,
               "unattributed_gpu_events": T.unattributed_gpu_events(trace, steps), "decode": {}, "prefill": {}}  # fmt: skip
        del trace
        for b in a.decode_batches:
            sel = [s for s in steps if s.kind == "decode" and s.gen_reqs == b]
            out["decode"][str(b)] = step_stats(sel)
        # The first request's shape (one decode prompt) is each B=1 request's first step.
        for length in (a.prompt_len, *a.prefill_lens):
            sel = [s for s in steps if s.kind == "prefill" and s.ctx_tokens == length and s.ctx_reqs == 1]
            out["prefill"][str(length)] = step_stats(sel)
        out["parse_s"] = time.perf_counter() - t
        d1 = out["decode"].get(str(a.decode_batches[0]), {})
        log(f"  profile: {out['trace_bytes'] / 2**20:.1f} MiB trace in {t_export:.1f} s, parsed in {out['parse_s']:.1f} s; "
            f"B={a.decode_batches[0]} GPU busy {d1.get('busy_us_median')} us/step over {d1.get('steps')} steps")  # fmt: skip
        return out


def step_stats(steps) -> dict:
    """GPU time per step (median, min, max of sum and busy), our kernel's launches, the kernel table."""
    if not steps:
        return {"steps": 0}
    g = [s.gpu_time_us() for s in steps]
    return {
        "steps": len(steps),
        "sum_us": [x["sum"] for x in g],
        "busy_us": [x["busy"] for x in g],
        "sum_us_median": med([x["sum"] for x in g]),
        "busy_us_median": med([x["busy"] for x in g]),
        "kernels_per_step": med([x["kernels"] for x in g]),
        "graph_launches": sum(s.summary()["graph_launches"] for s in steps),
        "fused_kernels_per_step": med([s.count_matching(T.FUSED_KERNEL) for s in steps]),
        # The fused ops' CPU events: only steps that run eagerly record them (not FULL graph replays).
        "fused_ops_per_step": med([sum(v for k, v in s.cpu_ops.items() if k.startswith("mla_fusion::")) for s in steps]),
        # Host time per step inside the attention-region ops (the plugin's attention op and the
        # fused ops inside it; vLLM's attention op and cache update): where an eager or
        # piecewise step's host cost comes from.
        "host_us_in_ops": {name: med([s.cpu_op_us.get(name, 0.0) for s in steps])
                           for name in sorted({n for s in steps for n in s.cpu_op_us})},  # fmt: skip
        "kernel_table": T.per_step_kernel_table(steps),
        # The host span of execute_model and what fills it (vllm_trace.host_breakdown; the
        # profiler inflates host time, alike for both sides).
        "host_span_us": [s.dur for s in steps],
        "host_span_us_median": med([s.dur for s in steps]),
        **host_stats(steps),
    }


def _median_children(children: list[dict]) -> dict:
    """name -> (count, us), each the median over ``children`` (dicts name -> (count, us); a name
    one of them lacks counts as (0, 0) there)."""
    names = {n for c in children for n in c}
    return {n: (med([c.get(n, (0, 0.0))[0] for c in children]), med([c.get(n, (0, 0.0))[1] for c in children]))
            for n in names}  # fmt: skip


def host_stats(steps, top: int = 14) -> dict:
    """Medians over ``steps`` of the host time not inside any child event, and per child name
    (count and us per step), the ``top`` largest."""
    hosts = [s.host for s in steps if s.host]
    if not hosts:
        return {}
    rows = {n: {"per_step": count, "us_per_step": us}
            for n, (count, us) in _median_children([h["children"] for h in hosts]).items()}  # fmt: skip
    ranked = sorted(rows.items(), key=lambda kv: -kv[1]["us_per_step"])
    return {"host_uncovered_us_median": med([h["uncovered"] for h in hosts]), "host_children": dict(ranked[:top]),
            "host_children_other_us": sum(r["us_per_step"] for _, r in ranked[top:])}  # fmt: skip


def attribute_jit(entries: list, marks: dict) -> list:
    """Each compilation with the benchmark phase it happened in (by host clock)."""
    order = sorted(marks.items(), key=lambda kv: kv[1])
    out = []
    for e in entries:
        phase = "before first request"
        for name, t in order:
            if e["t"] >= t:
                phase = name
        out.append({**{k: v for k, v in e.items() if k != "t"}, "phase": phase})
    return out


# ---------------------------------------------------------------------------
# summary, tables, plot


def _by_side(report, kv):
    ok = [e for e in report["engines"] if e["kv_cache_dtype"] == kv and "error" not in e]
    return [e for e in ok if e["side"] == "on"], [e for e in ok if e["side"] == "off"]


def _vals(engines, getter) -> list:
    out = []
    for e in engines:
        try:
            v = getter(e)
        except (KeyError, TypeError):
            v = None
        if v is not None:
            out.append(v)
    return out


def _pair(on, off, getter) -> dict:
    von, voff = _vals(on, getter), _vals(off, getter)
    return {"on": med(von), "off": med(voff), "on_range": spread(von), "off_range": spread(voff)}


def summarize(report, args) -> dict:
    out = {}
    pred_paths = report.get("prediction", {}).get("rows", {})
    for kv in args.kv_cache_dtypes + ([args.extra_pairs] if args.extra_pairs else []):
        if kv in out:
            continue
        on, off = _by_side(report, kv)
        if not on and not off:
            continue
        cache = "bf16" if kv == "auto" else "fp8"
        decode_op = (_backend(on) or {}).get("decode_op") or "op2"
        pred = pred_paths.get(decode_op, {})
        rows = {}
        for b in args.decode_batches:
            k = str(b)
            r = {
                "engines_on": len(on),
                "engines_off": len(off),
                "busy_us": _pair(on, off, lambda e: e["profile"]["decode"][k]["busy_us_median"]),
                "sum_us": _pair(on, off, lambda e: e["profile"]["decode"][k]["sum_us_median"]),
                "tpot_ms": _pair(on, off, lambda e: e["decode"][k]["tpot_ms_median"]),
                "throughput_tok_s": _pair(on, off, lambda e: e["decode"][k]["throughput_tok_s"]),
            }
            bo, bf = r["busy_us"]["on"], r["busy_us"]["off"]
            r["saving_busy_us"] = bf - bo if bo is not None and bf is not None else None
            so, sf = r["sum_us"]["on"], r["sum_us"]["off"]
            r["saving_sum_us"] = sf - so if so is not None and sf is not None else None
            p = pred.get(cache, {}).get(k)
            r["predicted_saving_us"] = p["saving_us_per_step"] if p else None
            if r["predicted_saving_us"] and r["saving_busy_us"] is not None:
                r["measured_over_predicted"] = r["saving_busy_us"] / r["predicted_saving_us"]
            # Noise: the widest spread of per-engine medians on either side.
            t = r["tpot_ms"]
            widths = [hi - lo for lo, hi in (t["on_range"], t["off_range"]) if lo is not None]
            r["tpot_noise_ms"] = max(widths) if widths else None
            if t["on"] is not None and t["off"] is not None:
                r["tpot_delta_ms"] = t["on"] - t["off"]
            rows[k] = r
        prefill = {}
        for length in args.prefill_lens:
            k = str(length)
            prefill[k] = {"ttft_ms": _pair(on, off, lambda e: e["prefill"][k]["ttft_ms_median"]),
                          "execute_model_ms": _pair(on, off, lambda e: e["prefill"][k]["execute_model_ms_median"]),
                          "busy_us": _pair(on, off, lambda e: e["profile"]["prefill"][k]["busy_us_median"]),
                          "host_span_us": _pair(on, off, lambda e: e["profile"]["prefill"][k]["host_span_us_median"])}  # fmt: skip
        mixed = {}
        for length in args.mixed_lens:
            k = str(length)
            mixed[k] = {"ttft_ms": _pair(on, off, lambda e: e.get("mixed", {})[k]["ttft_ms_median"]),
                        "execute_model_ms": _pair(on, off, lambda e: e.get("mixed", {})[k]["execute_model_ms_median"])}  # fmt: skip
        first = {s: [1e3 * e["first_request"]["first_s"] for e in eng if "first_request" in e]
                 for s, eng in (("on", on), ("off", off))}  # fmt: skip
        excess = {s: [e["first_request"]["excess_ms"] for e in eng if "first_request" in e]
                  for s, eng in (("on", on), ("off", off))}  # fmt: skip
        jit = {s: [[(j["kernel"], j["phase"], round(j["compile_ms"], 1)) for j in e.get("jit_after_warmup", [])]
                   for e in eng] for s, eng in (("on", on), ("off", off))}  # fmt: skip
        diffs = {}
        if on and off:
            for b in sorted({args.decode_batches[0], args.decode_batches[-1]}):
                try:
                    t_on = on[0]["profile"]["decode"][str(b)]["kernel_table"]
                    t_off = off[0]["profile"]["decode"][str(b)]["kernel_table"]
                except KeyError:
                    continue
                diffs[str(b)] = T.kernel_diff(t_on, t_off)
        host = {}
        for length in (args.prompt_len, *args.prefill_lens):
            rows_ = {side: [e["profile"]["prefill"].get(str(length), {}) for e in eng if "prefill" in e.get("profile", {})]
                     for side, eng in (("on", on), ("off", off))}  # fmt: skip
            host[str(length)] = host_comparison(rows_["on"], rows_["off"])
        equal_speed = {str(L): h for L in args.prefill_lens if (h := host_at_equal_speed(on, off, str(L)))}
        mixed_equal = {str(L): h for L in args.mixed_lens if (h := host_at_equal_speed(on, off, str(L), "mixed"))}
        out[kv] = {"decode": rows, "prefill": prefill, "first_request_ms": first, "first_request_excess_ms": excess,
                   "jit_after_warmup": jit, "backend": _backend(on + off), "kernel_diff": diffs,
                   "prefill_host": host, "prefill_host_equal_speed": equal_speed, "mixed": mixed,
                   "mixed_host_equal_speed": mixed_equal}  # fmt: skip
    return out


def host_comparison(on: list, off: list) -> dict:
    """Where a profiled prefill step's host span goes, on against off: per child event name, the
    median over engines of us per step (and launches per step), plus the span and the uncovered
    rest; rows ordered by the largest difference."""

    def side(stats):
        stats = [x for x in stats if x.get("host_children")]
        return {
            "span": med([x["host_span_us_median"] for x in stats]) if stats else None,
            "uncovered": med([x["host_uncovered_us_median"] for x in stats]) if stats else None,
            "children": _median_children([{n: (r["per_step"], r["us_per_step"]) for n, r in x["host_children"].items()}
                                          for x in stats]),  # fmt: skip
        }

    a, b = side(on), side(off)
    names = set(a["children"]) | set(b["children"])
    rows = {n: {"on_per_step": a["children"].get(n, (0, 0.0))[0], "off_per_step": b["children"].get(n, (0, 0.0))[0],
                "on_us": a["children"].get(n, (0, 0.0))[1], "off_us": b["children"].get(n, (0, 0.0))[1]}
            for n in names}  # fmt: skip
    ranked = dict(sorted(rows.items(), key=lambda kv: -abs(kv[1]["on_us"] - kv[1]["off_us"])))
    return {"span_us": {"on": a["span"], "off": b["span"]}, "uncovered_us": {"on": a["uncovered"], "off": b["uncovered"]},
            "children": ranked}  # fmt: skip


def _host_split(side: str, h: dict) -> dict | None:
    """One TTFT request's execute_model host time (ms) split by the --host-regions timers:
    ``common``, vLLM's own forward_mha code (the same on both sides: forward_mha without the key,
    which the plugin's op 3 builds where it is switched on, else vLLM's concat); ``attention``, the rest of the attention region
    (on: the plugin's forward_fused around it; off: forward_impl around it plus vLLM's cache
    write); ``pieces``, the compiled pieces; ``rest``, all else (the split graph, op wrappers,
    input preparation)."""
    g, ex = h.get("regions_ms"), h.get("execute_model_ms")
    if not g or not ex or "forward_mha" not in g:
        return None

    def ms(name):
        return g.get(name, (0, 0.0))[1]

    if side == "on":
        # Op 3's region holds the concat of any chunked context: one of the two, never both.
        key = ms("plugin prefill key (op 3)") if "plugin prefill key (op 3)" in g else ms("vLLM key concat")
        common = ms("forward_mha") - key
        attention = ms("plugin forward_fused") - common
    else:
        common = ms("forward_mha") - ms("vLLM key concat")
        attention = ms("MLAAttention.forward_impl") - common + ms("vLLM cache write")
    pieces = ms("compiled piece")
    return {"execute": ex[0], "common": common, "attention": attention, "pieces": pieces,
            "rest": ex[0] - common - attention - pieces}  # fmt: skip


def mixed_step_host(host: dict, prompt_len: int) -> dict | None:
    """The mixed step's own host record out of a request's (``host_summary``): its execute_model
    call, the one that scheduled the most tokens (at least the joining prompt's ``prompt_len``),
    with the regions timed inside that call. None where no call scheduled the whole prompt or the
    record has no regions per call."""
    tokens = host.get("execute_model_tokens") or []
    per_call = host.get("execute_model_regions_ms")
    if not tokens or not per_call or len(per_call) != len(tokens):
        return None
    i = max(range(len(tokens)), key=lambda j: tokens[j] or 0)
    if (tokens[i] or 0) < prompt_len:
        return None
    return {"execute_model_ms": [host["execute_model_ms"][i]], "execute_model_tokens": [tokens[i]],
            "regions_ms": per_call[i], "request_execute_model_ms": host["execute_model_ms"]}  # fmt: skip


def host_at_equal_speed(on: list, off: list, length: str, section: str = "prefill") -> dict:
    """The TTFT requests' host time per prefill step, on and off, at equal host speed (``section``
    "mixed": the mixed steps of the ``--mixed-lens`` requests).

    The lent machines' host runs the same Python at speeds up to ~2.6x apart from one request
    to the next (docs/performance-history.md). ``common`` (vLLM's own forward_mha code, identical on
    both sides) measures each request's speed: factor = common / the off side's median common;
    every part of the request divided by its factor is its time at the off side's median speed.
    Per side: the factors' range and the medians of the normalized parts (ms)."""
    splits = {side: [x for e in eng for h in e.get(section, {}).get(length, {}).get("host", [])
                     if (x := _host_split(side, h))] for side, eng in (("on", on), ("off", off))}  # fmt: skip
    base = med([x["common"] for x in splits["off"]]) if splits["off"] else None
    if not base or base <= 0:
        return {}
    out = {}
    for side, xs in splits.items():
        if not xs:
            continue
        factors = [x["common"] / base for x in xs]
        out[side] = {"requests": len(xs), "speed_factor_range": spread(factors),
                     **{f"{k}_ms": med([x[k] / f for x, f in zip(xs, factors)])
                        for k in ("execute", "attention", "pieces", "rest", "common")}}  # fmt: skip
    return out


def _backend(engines):
    for e in engines:
        layers = e.get("facts", {}).get("layers") or []
        if layers:
            f = e["facts"]
            return {"backend": layers[0]["backend"], "fp8_query": layers[0]["fp8_query"],
                    "decode_op": layers[0].get("decode_op"), "prefill_key_fused": layers[0].get("prefill_key_fused"),
                    "block_size": f.get("block_size"), "cudagraph_mode": f.get("cudagraph_mode"),
                    "async_scheduling": f.get("async_scheduling"), "mp_method": f.get("mp_method")}  # fmt: skip
    return None


def _f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


def write_markdown(report, path: Path) -> None:
    s = report.get("summary", {})
    env = report["environment"]
    lines = [f"# End to end inside vLLM ({report['config']['mode']})", ""]
    if report["config"]["mode"] == "smoke":
        lines += ["**CPU smoke run: every number below is meaningless (CPU, tiny model, no CUDA graphs).**", ""]
    lines += [f"- device: {env.get('device')}; vLLM {env.get('vllm')}, torch {env.get('torch')}, Triton {env.get('triton')}; "
              f"git {env.get('git_commit')}{' (dirty)' if env.get('git_dirty') else ''}, package_sha256 "
              f"{env.get('package_sha256')}",
              f"- model: {report['config']['model']}, {NUM_LAYERS} layers in full mode; decode prompts "
              f"{report['config']['prompt_len']} tokens, N = {report['config']['decode_tokens']} output tokens; "
              f"{report['config']['repeats']} repeats per engine",
              f"- prediction: {report['prediction'].get('source')} (H=16, block 64): 61 x (unfused chain - ours) "
              "per layer; decode path op 2 (decode-layer section) or op 1 (sweep, T = batch), as the backend takes",
              ""]  # fmt: skip
    for kv, r in s.items():
        be = r.get("backend") or {}
        lines += [f"## KV cache {kv}: backend {be.get('backend')} (fp8 query {be.get('fp8_query')}, block "
                  f"{be.get('block_size')}, plugin decode path {be.get('decode_op')}, prefill key fused "
                  f"{be.get('prefill_key_fused')}), CUDA graphs {be.get('cudagraph_mode')}, async scheduling "
                  f"{be.get('async_scheduling')}", ""]  # fmt: skip
        lines += ["| B | GPU busy/step off (us) | on | saved | predicted | saved / predicted | kernel sum off | on | "
                  "TPOT off (ms) | on | delta | noise | tok/s off | on |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for b, row in r["decode"].items():
            lines.append("| " + " | ".join([
                b, _f(row["busy_us"]["off"]), _f(row["busy_us"]["on"]), _f(row.get("saving_busy_us")),
                _f(row.get("predicted_saving_us")), _f(row.get("measured_over_predicted"), "{:.2f}"),
                _f(row["sum_us"]["off"]), _f(row["sum_us"]["on"]),
                _f(row["tpot_ms"]["off"], "{:.3f}"), _f(row["tpot_ms"]["on"], "{:.3f}"),
                _f(row.get("tpot_delta_ms"), "{:+.3f}"), _f(row.get("tpot_noise_ms"), "{:.3f}"),
                _f(row["throughput_tok_s"]["off"], "{:.0f}"), _f(row["throughput_tok_s"]["on"], "{:.0f}"),
            ]) + " |")  # fmt: skip
        lines += ["", "| prefill L | TTFT off (ms) | on | execute_model host off (ms) | on | GPU busy off (us) | on "
                  "| host span, profiled, off (us) | on |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for length, row in r["prefill"].items():
            lines.append(f"| {length} | {_f(row['ttft_ms']['off'], '{:.2f}')} | {_f(row['ttft_ms']['on'], '{:.2f}')} | "
                         f"{_f(row['execute_model_ms']['off'], '{:.2f}')} | {_f(row['execute_model_ms']['on'], '{:.2f}')} | "
                         f"{_f(row['busy_us']['off'])} | {_f(row['busy_us']['on'])} | "
                         f"{_f(row['host_span_us']['off'])} | {_f(row['host_span_us']['on'])} |")  # fmt: skip
        if r.get("mixed"):
            lines += ["", f"| mixed: {report['config'].get('mixed_decoders')} decodes + a prompt of L | TTFT off (ms) | on | mixed step's "
                      "execute_model host off (ms) | on |", "|---|---|---|---|---|"]  # fmt: skip
            for length, row in r["mixed"].items():
                lines.append(f"| {length} | {_f(row['ttft_ms']['off'], '{:.2f}')} | {_f(row['ttft_ms']['on'], '{:.2f}')} | "
                             f"{_f(row['execute_model_ms']['off'], '{:.2f}')} | {_f(row['execute_model_ms']['on'], '{:.2f}')} |")  # fmt: skip
        lines += ["", f"- first request (B=1, prefill + 1 token) ms, per engine: on {r['first_request_ms']['on']}, "
                  f"off {r['first_request_ms']['off']}; excess over the next three: on "
                  f"{r['first_request_excess_ms']['on']}, off {r['first_request_excess_ms']['off']}",
                  f"- Triton JIT compilations after warm-up (kernel, phase, ms): on {r['jit_after_warmup']['on']}; "
                  f"off {r['jit_after_warmup']['off']}", ""]  # fmt: skip
        equal = [(str(L), h) for L, h in (r.get("prefill_host_equal_speed") or {}).items()]
        equal += [(f"mixed {L}", h) for L, h in (r.get("mixed_host_equal_speed") or {}).items()]
        if equal:
            lines += ["execute_model host time per TTFT request at equal host speed (--host-regions; each request "
                      "scaled by its speed factor, measured on vLLM's own forward_mha code; \"mixed L\": the mixed "
                      "step of a prompt joining the decodes), medians in ms:", "",
                      "| prefill L | side | requests | speed factor range | execute_model | attention region | "
                      "compiled pieces | rest |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
            for length, h in equal:
                for side in ("off", "on"):
                    if side in h:
                        x = h[side]
                        lo, hi = x["speed_factor_range"]
                        lines.append(f"| {length} | {side} | {x['requests']} | {lo:.2f}-{hi:.2f} | {x['execute_ms']:.1f} | "
                                     f"{x['attention_ms']:.1f} | {x['pieces_ms']:.1f} | {x['rest_ms']:.1f} |")  # fmt: skip
            lines.append("")
        for length, h in (r.get("prefill_host") or {}).items():
            if not h["children"]:
                continue
            lines += [f"Host span of the profiled {length}-token prefill step (profiler-inflated), off / on: "
                      f"{_f(h['span_us']['off'])} / {_f(h['span_us']['on'])} us; not inside any event: "
                      f"{_f(h['uncovered_us']['off'])} / {_f(h['uncovered_us']['on'])} us. Events directly under "
                      "the step, largest difference first:", "",
                      "| event | per step off | on | us off | on | on - off |", "|---|---|---|---|---|---|"]  # fmt: skip
            for name, row in list(h["children"].items())[:12]:
                lines.append(f"| `{name[:80]}` | {_f(row['off_per_step'], '{:.0f}')} | {_f(row['on_per_step'], '{:.0f}')} | "
                             f"{_f(row['off_us'])} | {_f(row['on_us'])} | {row['on_us'] - row['off_us']:+.1f} |")  # fmt: skip
            lines.append("")
        if r.get("kernel_diff"):
            for b, diff in r["kernel_diff"].items():
                lines += [f"Decode step at B={b}, first on engine vs first off engine, kernels by name (where the "
                          "saving comes from):", "", "```"] + T.format_diff(diff) + ["```", ""]  # fmt: skip
    if report.get("skipped"):
        lines += [f"- not run: {report['skipped']}", ""]
    path.write_text("\n".join(lines) + "\n")


def plot(report, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return
    s = report.get("summary", {})
    if not s:
        return
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    for kv, r in s.items():
        bs = [int(b) for b in r["decode"]]
        for side, ls in (("off", "--"), ("on", "-")):
            axes[0, 0].plot(bs, [r["decode"][str(b)]["busy_us"][side] for b in bs], ls, marker="o", label=f"{kv} {side}")
            axes[1, 0].plot(bs, [r["decode"][str(b)]["tpot_ms"][side] for b in bs], ls, marker="o", label=f"{kv} {side}")
            ls_ = [int(x) for x in r["prefill"]]
            axes[1, 1].plot(ls_, [r["prefill"][str(x)]["ttft_ms"][side] for x in ls_], ls, marker="o", label=f"{kv} {side}")
        axes[0, 1].plot(bs, [r["decode"][str(b)].get("saving_busy_us") for b in bs], "-", marker="o", label=f"{kv} measured")
        axes[0, 1].plot(bs, [r["decode"][str(b)].get("predicted_saving_us") for b in bs], ":", marker="x",
                        label=f"{kv} predicted (61 x kernel bench)")  # fmt: skip
    titles = (("GPU busy time per decode step (us)", "decode batch B"), ("saved per decode step (us)", "decode batch B"),
              ("TPOT (ms)", "decode batch B"), ("TTFT (ms)", "prompt tokens"))  # fmt: skip
    for ax, (title, xl) in zip(axes.flat, titles):
        ax.set_xscale("log", base=2)
        ax.set_title(title)
        ax.set_xlabel(xl)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    mode = report["config"]["mode"]
    fig.suptitle(f"vllm-mla-fusion end to end, {report['environment'].get('device')}"
                 + (" - CPU SMOKE, MEANINGLESS" if mode == "smoke" else ""))  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_summary(report) -> None:
    print("\n==== E2E SUMMARY" + (" (CPU smoke: numbers meaningless)" if report["config"]["mode"] == "smoke" else ""))
    for e in report["engines"]:
        status = e.get("error") or (f"start {e.get('start_s', 0):.0f} s, first request "
                                    f"{1e3 * e.get('first_request', {}).get('first_s', float('nan')):.1f} ms")  # fmt: skip
        print(f"engine {e['index']}: {e['kv_cache_dtype']} {e['side']}: {status}")
    for kv, r in report.get("summary", {}).items():
        print(f"-- {kv} ({(r.get('backend') or {}).get('backend')})")
        print("   B   busy off    busy on    saved  predicted  ratio   TPOT off   TPOT on   delta  noise")
        for b, row in r["decode"].items():
            print(f"{b:>4} {_f(row['busy_us']['off']):>10} {_f(row['busy_us']['on']):>10} {_f(row.get('saving_busy_us')):>8} "
                  f"{_f(row.get('predicted_saving_us')):>10} {_f(row.get('measured_over_predicted'), '{:.2f}'):>6} "
                  f"{_f(row['tpot_ms']['off'], '{:.3f}'):>10} {_f(row['tpot_ms']['on'], '{:.3f}'):>9} "
                  f"{_f(row.get('tpot_delta_ms'), '{:+.3f}'):>7} {_f(row.get('tpot_noise_ms'), '{:.3f}'):>6}")  # fmt: skip
        for length, row in r["prefill"].items():
            print(f"   prefill {length}: TTFT off {_f(row['ttft_ms']['off'], '{:.2f}')} on {_f(row['ttft_ms']['on'], '{:.2f}')} ms; "
                  f"execute_model off {_f(row['execute_model_ms']['off'], '{:.2f}')} on "
                  f"{_f(row['execute_model_ms']['on'], '{:.2f}')} ms")  # fmt: skip
        for length, row in (r.get("mixed") or {}).items():
            print(f"   mixed + {length}: TTFT off {_f(row['ttft_ms']['off'], '{:.2f}')} on {_f(row['ttft_ms']['on'], '{:.2f}')} ms; "
                  f"mixed step execute_model off {_f(row['execute_model_ms']['off'], '{:.2f}')} on "
                  f"{_f(row['execute_model_ms']['on'], '{:.2f}')} ms")  # fmt: skip
        print(f"   first request ms: on {r['first_request_ms']['on']} off {r['first_request_ms']['off']}")
        print(f"   JIT after warm-up: on {r['jit_after_warmup']['on']} off {r['jit_after_warmup']['off']}")
    if report.get("skipped"):
        print(f"not run: {len(report['skipped'])} engine(s): {report['skipped'][0]['reason']}")


def environment(args) -> dict:
    import torch

    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "TRITON_")) and "TOKEN" not in k},
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env.update(provenance.source_facts(REPO))  # commit, dirtiness and the package's digest
    if args.smoke:
        env["device"] = f"CPU ({platform.machine()})"
    else:
        # nvidia-smi, not torch.cuda: the driver process must not initialise CUDA.
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=20)  # fmt: skip
            env["nvidia_smi"] = q.stdout.strip()
            env["device"] = q.stdout.split(",")[0].strip() or None
        except (OSError, subprocess.SubprocessError):
            env["device"] = None
    return env


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(RESULTS), help="folder for the JSON, markdown and plot")
    ap.add_argument("--tag", default="h200", help="file name suffix: bench_vllm_e2e_<tag>.*")
    ap.add_argument("--work-dir", default=None, help="model dir, compile caches, traces (default: under --out)")
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], choices=["auto", "fp8"])
    ap.add_argument("--runs", type=int, default=2, help="engines per side and cache dtype, in pairs: on, off, off, on, ...")
    ap.add_argument("--extra-pairs", default=None, choices=["auto", "fp8"],
                    help="after the planned engines, more on/off pairs of this cache dtype while the deadline allows")
    ap.add_argument("--on-mode", default="decode", choices=["decode", "rope_cache"],
                    help="plugin mode of the 'on' engines (rope_cache: VLLM_MLA_FUSION_DECODE=0)")
    ap.add_argument("--attention-backend", default=None, help="force a backend (default: vLLM's choice)")
    ap.add_argument("--decode-batches", type=int, nargs="+", default=list(DECODE_BATCHES))
    ap.add_argument("--prefill-lens", type=int, nargs="+", default=list(PREFILL_LENS))
    ap.add_argument("--mixed-lens", type=int, nargs="*", default=list(MIXED_LENS),
                    help="prompt lengths that join running decodes (a mixed step each); none: no mixed section")
    ap.add_argument("--mixed-decoders", type=int, default=MIXED_DECODERS, help="requests decoding when such a prompt arrives")
    ap.add_argument("--decode-tokens", type=int, default=64, help="N of the TPOT difference")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of the decode requests")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-decode-steps", type=int, default=8)
    ap.add_argument("--deadline-s", type=float, default=510.0,
                    help="start no engine (pair) that would end past this many seconds; sections shrink near it")
    ap.add_argument("--kernel-bench-json", default=str(KERNEL_BENCH_JSON))
    ap.add_argument("--smoke", action="store_true", help="CPU code-path check: tiny model, CPU_MLA, stand-in kernels")
    ap.add_argument("--inproc", action="store_true",
                    help="in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) instead of vLLM's default engine-core "
                    "process; for the CI smoke test, where spawning vLLM's CPU engine processes takes minutes")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--host-regions", action="store_true",
                    help="also time host regions (compiled pieces, attention, cache write, the fused ops) per TTFT "
                    "request: a diagnosis run; costs both sides ~1 us per region call")  # fmt: skip
    args = ap.parse_args(argv)
    if args.smoke:
        args.decode_batches = [1, 2]
        args.prefill_lens = [24]
        args.mixed_lens = [16]
        args.mixed_decoders = 2
        args.decode_tokens = 3
        args.prompt_len = 8
        args.repeats = 1
        args.profile_decode_steps = 3
        args.runs = 1
    args.decode_batches = sorted(set(args.decode_batches))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.smoke:
        import shutil

        # A 61-layer model on vLLM's CPU platform would run for hours; checked without CUDA.
        if shutil.which("nvidia-smi") is None or subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode:
            log("error: no NVIDIA GPU (nvidia-smi -L failed); use --smoke for the CPU code-path check")
            return 2
    if args.inproc:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.smoke:
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
        os.environ["MLA_FUSION_E2E_CPU_STANDINS"] = "1"
        from demo import cpu_stand_ins

        cpu_stand_ins.prepare()
    return Bench(args).run()


if __name__ == "__main__":
    sys.exit(main())
