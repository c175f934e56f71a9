"""Runs GPU-integration cases in one process and appends one JSON line per engine to a file.

Usage::

    python -m tests.vllm_plugin_gpu.engine_worker --group FLASHMLA --out results.jsonl [--budget-s 240]
    python -m tests.vllm_plugin_gpu.engine_worker --cpu-smoke --out results.jsonl

For every case of the group (workload.py), plugin on then off: build an in-process
``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: requests are scheduled exactly
when this process steps the engine, so both sides see the same batches and on/off
can be compared bit for bit), redraw the weights, run the probe, record, tear down.

The probe:

1. facts: what vLLM built (every MLA layer's wrapper class and fusion mode, backend,
   KV-cache dtype and block size, fp8 query or not, ``reorder_batch_threshold``) and
   how (compilation mode, CUDA-graph mode and captured sizes, splitting ops);
2. greedy generation (tokens + sampled logprobs);
3. teacher forcing: ``prompt_logprobs`` over fixed token sequences, so that a changed
   rounding cannot make the two sides diverge, chunked by the case's token budget;
4. census: a profiled run (vLLM's torch profiler) of prefill-only, decode-only and
   mixed steps; per step the GPU kernels it launched (benchmarks/e2e/vllm_trace.py);
5. which attention paths and CUDA-graph routes ran during 2-4 (counters wrapped
   around the backend and the runner), and Triton JIT compilations after warm-up.

Weights: ``load_format="dummy"`` gives values so small that greedy decoding repeats the
last prompt token whatever attention computes; they are redrawn (seeded normal,
1/sqrt(fan_in)) after loading and the MLA layers' absorbed weights recomputed.
vLLM's ``replace_parameter`` copies into the existing tensors, so CUDA graphs
captured before the redraw read the new values.

Each engine gets its own ``VLLM_CACHE_ROOT`` per plugin side, so a compiled artifact
of one side can never be loaded by the other: vLLM's AOT-compile cache key
(``vllm/compilation/decorators.py``, ``aot_compile_hash_factors``) covers the config
but not the traced source files.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

# Set before vLLM is imported (its platform and engine mode are chosen then).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
# vLLM's own host-sync check (vllm/utils/gpu_sync_debug.py; CUDA only), in its "warn" mode: once the
# engine has warmed up, a GPU<->CPU sync inside execute_model or sample_tokens (torch's synchronizing
# calls, and non_blocking copies that would silently block) is warned about, and the warnings reach
# _count_host_syncs below. "warn", not "error": a sync of vLLM's own on the off side is then a
# reading to compare with, not a failed engine.
os.environ.setdefault("VLLM_GPU_SYNC_CHECK", "warn")
HOST_SYNCS: list[str] = []  # the warnings of the engine in progress (run_engine resets it)
_SYNC_WORDS = ("called a synchronizing CUDA operation", "may be silently synchronous")
PLUGIN_IN_STACK = "[vllm_mla_fusion in the stack] "
_show_warning = warnings.showwarning


def _count_host_syncs(message, category, filename, lineno, file=None, line=None):
    """``warnings.showwarning`` as vLLM's sync check finds it: records each sync warning (marked
    where the plugin's code is anywhere in the stack, e.g. a torch call of ours), shows all."""
    text = str(message)
    if any(w in text for w in _SYNC_WORDS):
        ours = any("vllm_mla_fusion" in f.filename for f in traceback.extract_stack())
        HOST_SYNCS.append(f"{PLUGIN_IN_STACK if ours else ''}{filename}:{lineno}: {text[:160]}")
    return _show_warning(message, category, filename, lineno, file, line)


warnings.showwarning = _count_host_syncs
# vLLM lets every torch sync warning through ("always"); its own warning about a silently
# synchronous copy would otherwise show once per place and process: the first engine only.
warnings.filterwarnings("always", message=".*may be silently synchronous")


def sync_check_control() -> int:
    """A deliberate sync (``.item()`` of a CUDA tensor) under vLLM's sync check, once its engine
    has armed it: how many warnings reached HOST_SYNCS (1 where the chain works; 0 without CUDA,
    where vLLM never arms it). Removes them again."""
    import torch
    from vllm.utils.gpu_sync_debug import with_gpu_sync_check

    if not torch.cuda.is_available():
        return 0
    before = len(HOST_SYNCS)
    with_gpu_sync_check(lambda: torch.ones(1, device="cuda").item())()
    n = len(HOST_SYNCS) - before
    del HOST_SYNCS[before:]
    return n

from benchmarks.e2e import vllm_engine as E  # noqa: E402 - imports no vLLM

from . import workload as W  # noqa: E402


def redraw_weights(model) -> int:
    """Seeded N(0, 1/fan_in) weights (norms N(0, 1)); recompute MLA absorbed weights. Number of MLA layers."""
    import torch
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    g = torch.Generator().manual_seed(0)
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point() or p.numel() == 0:
                continue
            scale = 1.0 if "norm" in name else p.shape[-1] ** -0.5
            p.copy_((torch.randn(p.shape, generator=g) * scale).to(p.device, p.dtype))
    n = 0
    for module in model.modules():
        if isinstance(module, MLAAttention):
            module.process_weights_after_loading(dtype)
            n += 1
    return n


class Runner:
    def __init__(self, args):
        self.args = args
        self.cpu = args.cpu_smoke
        self.probe = W.CPU_PROBE if self.cpu else W.GPU_PROBE
        self.config = W.CPU_MODEL_CONFIG if self.cpu else W.MODEL_CONFIG
        self.work = Path(args.work_dir)
        self.model_dir = W.write_model_dir(str(self.work / "model"), self.config)
        self.out = Path(args.out)
        self.t0 = time.monotonic()
        self.n_engine = 0

    def emit(self, record: dict) -> None:
        with open(self.out, "a") as f:
            f.write(json.dumps(record) + "\n")

    def llm_kwargs(self, case: W.Case) -> dict:
        import torch

        kw = dict(
            model=self.model_dir, load_format="dummy", skip_tokenizer_init=True, seed=0,
            max_model_len=self.probe.max_model_len, max_num_seqs=self.probe.max_num_seqs,
            max_num_batched_tokens=case.max_num_batched_tokens, enable_prefix_caching=False,
            attention_backend=case.backend, kv_cache_dtype=case.kv_cache_dtype, enforce_eager=not case.compiled,
            profiler_config=E.profiler_config(str(self.work / f"prof-{self.n_engine}")),
        )  # fmt: skip
        if self.cpu:
            kw.update(dtype=torch.float32, kv_cache_memory_bytes=64 << 20)
        else:
            # Several workers share the GPU: a small fixed KV cache instead of 90% of the memory.
            kw.update(dtype="bfloat16", kv_cache_memory_bytes=1 << 30, gpu_memory_utilization=0.2)
        if case.compiled:
            kw["compilation_config"] = {"cudagraph_capture_sizes": list(case.capture_sizes)}
        return kw

    # -- probe ------------------------------------------------------------------------

    def greedy(self, llm, vocab: int) -> dict:
        from vllm import SamplingParams

        prompts = W.token_lists(self.probe.greedy_lens, vocab, self.probe.seed)
        params = SamplingParams(temperature=0.0, max_tokens=self.probe.greedy_tokens, ignore_eos=True, logprobs=0,
                                detokenize=False)  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
                    for o in outs]  # fmt: skip
        return {"lens": list(self.probe.greedy_lens), "tokens": tokens, "logprobs": logprobs}

    def teacher(self, llm, vocab: int) -> dict:
        from vllm import SamplingParams

        seqs = W.token_lists(self.probe.teacher_lens, vocab, self.probe.seed + 1)
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
        logprobs = []
        for seq, o in zip(seqs, outs, strict=True):
            lps = o.prompt_logprobs
            # Position 0 has no logprob; position i the log-probability of token i given 0..i-1.
            logprobs.append([lps[i][seq[i]].logprob for i in range(1, len(seq))])
        return {"lens": list(self.probe.teacher_lens), "logprobs": logprobs}

    def census(self, llm, vocab: int, prof_dir: Path) -> dict:
        from vllm import SamplingParams

        p = self.probe
        engine = llm.llm_engine
        prompts = W.token_lists([p.census_prompt] * p.census_requests, vocab, p.seed + 2)
        late = W.token_lists([p.census_late_prompt], vocab, p.seed + 3)[0]
        params = SamplingParams(temperature=0.0, max_tokens=p.census_tokens, ignore_eos=True, detokenize=False)
        late_params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, detokenize=False)

        def work():
            for i, pr in enumerate(prompts):
                engine.add_request(f"census-{i}", {"prompt_token_ids": pr}, params)
            n = 0
            while engine.has_unfinished_requests():
                engine.step()
                n += 1
                if n == p.census_late_after:
                    engine.add_request("census-late", {"prompt_token_ids": late}, late_params)
                if n > 200:
                    raise RuntimeError("census requests did not finish in 200 engine steps")

        path = E.profile(llm, str(prof_dir), "census", work)
        return E.census(path)

    def run_engine(self, case: W.Case, side: str) -> dict:
        from vllm import LLM

        on = side == "on"
        rec: dict = {"case": case.to_json(), "side": side, "engine": self.n_engine, "pid": os.getpid()}
        os.environ["VLLM_CACHE_ROOT"] = str(self.work / f"vllm-cache-{side}")
        rec["registered"] = E.set_plugin(on)
        kwargs = self.llm_kwargs(case)
        prof_dir = Path(kwargs["profiler_config"]["torch_profiler_dir"])
        self.n_engine += 1
        # The plugin side's switches: read when the layers are built.
        switches = dict(case.plugin_env) if on else {}
        saved = {k: os.environ.get(k) for k in switches}
        os.environ.update(switches)
        t = time.perf_counter()
        try:
            llm = LLM(**kwargs)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        rec["build_s"] = time.perf_counter() - t
        HOST_SYNCS.clear()  # vLLM arms its sync check once the engine has warmed up, inside LLM(...)
        rec["sync_check"] = os.environ.get("VLLM_GPU_SYNC_CHECK")
        rec["sync_check_control"] = sync_check_control()
        try:
            rec["mla_layers_redrawn"] = llm.apply_model(redraw_weights)[0]
            rec["facts"] = {**llm.apply_model(E.mla_facts)[0], **llm.collective_rpc(E.runner_facts)[0]}
            llm.collective_rpc(E.install_counters)
            rec["jit_hook"] = llm.collective_rpc(E.install_jit_hook)[0]
            vocab = self.config["vocab_size"]
            t = time.perf_counter()
            rec["greedy"] = self.greedy(llm, vocab)
            rec["teacher"] = self.teacher(llm, vocab)
            rec["paths"] = llm.collective_rpc(E.read_counters)[0]
            rec["census"] = self.census(llm, vocab, prof_dir)
            rec["census_paths"] = llm.collective_rpc(E.read_counters)[0]
            rec["jit_after_warmup"] = llm.collective_rpc(E.read_jit_log)[0]
            rec["probe_s"] = time.perf_counter() - t
            rec["host_syncs"] = list(HOST_SYNCS)
        finally:
            rec["shutdown_s"] = E.shutdown(llm)
            del llm
            self.release()
        return rec

    def release(self, after_failure: bool = False) -> None:
        import torch

        if after_failure:
            # An engine that failed while starting never reached its shutdown: its process
            # groups would make the next engine's distributed init fail.
            try:
                from vllm.distributed import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
            except Exception as e:  # noqa: BLE001 - best effort
                print(f"cleanup after a failed engine raised {type(e).__name__}: {e}", flush=True)
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        # Compiled code of the previous engine must not serve the next one.
        torch.compiler.reset()

    def run(self) -> int:
        groups = W.CPU_GROUPS if self.cpu else {g: W.GROUPS[g] for g in self.args.group}
        header = {"kind": "worker", "groups": list(groups), "pid": os.getpid(), "entry_points": E.entry_points()}
        t = time.perf_counter()
        import vllm  # noqa: F401 - timed: the import is a large part of a worker's budget

        header["import_vllm_s"] = time.perf_counter() - t
        header["vllm"] = vllm.__version__
        # vLLM's own loader must find the plugin through its entry point.
        header["loaded_by_vllm"] = E.load_plugins_through_vllm()
        self.emit(header)
        failures = 0
        for cases in groups.values():
            for c in cases:
                # Cases start whole or not at all: an "on" engine without its "off" partner
                # checks nothing (the caller's reserve past the budget covers the partner).
                elapsed = time.monotonic() - self.t0
                if elapsed > self.args.budget_s:
                    for side in ("on", "off"):
                        self.emit({"case": c.to_json(), "side": side, "skipped": f"worker budget of "
                                   f"{self.args.budget_s:.0f} s used up after {elapsed:.0f} s"})  # fmt: skip
                    continue
                for side in ("on", "off"):
                    E.log(f"{c.name} plugin {side}: building")
                    try:
                        rec = self.run_engine(c, side)
                    except Exception as e:  # noqa: BLE001 - record and go on with the next engine
                        failures += 1
                        rec = {"case": c.to_json(), "side": side, "error": f"{type(e).__name__}: {e}",
                               "traceback": traceback.format_exc()[-6000:]}  # fmt: skip
                        self.release(after_failure=True)
                    E.log(f"{c.name} plugin {side}: " + (rec.get("error") or f"built in {rec['build_s']:.1f} s, "
                          f"probed in {rec['probe_s']:.1f} s"))  # fmt: skip
                    self.emit(rec)
        self.emit({"kind": "done", "elapsed_s": time.monotonic() - self.t0, "failures": failures})
        return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--group", action="append", choices=sorted(W.GROUPS), default=None,
                    help="backend group(s) to run (default: all)")  # fmt: skip
    ap.add_argument("--cpu-smoke", action="store_true", help="vLLM's CPU platform, CPU_MLA, stand-in kernels")
    ap.add_argument("--out", required=True, help="JSON-lines file to append to")
    ap.add_argument("--work-dir", default=None, help="model dir, caches, traces (default: beside --out)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="start no case after this many seconds")
    args = ap.parse_args(argv)
    args.group = args.group or sorted(W.GROUPS)
    if args.work_dir is None:
        args.work_dir = str(Path(args.out).with_suffix("")) + "-work"
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    if args.cpu_smoke:
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    else:
        os.environ.pop("VLLM_TARGET_DEVICE", None)
    if args.cpu_smoke:
        from demo import cpu_stand_ins

        cpu_stand_ins.prepare()
    return Runner(args).run()


if __name__ == "__main__":
    sys.exit(main())
