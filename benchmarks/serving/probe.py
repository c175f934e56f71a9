"""Before a server's loads (``--probe``): redraw its dummy weights, greedy tokens and logprobs, decode-step GPU time.

Why through the server and not an offline ``vllm.LLM(tensor_parallel_size=8)``: on the 8-GPU machine a
TP8 engine of the full model takes minutes to start (load, compile, graph capture), and a lease holds
the machine 30 minutes; one server per side that answers the probe and then the loads starts once
where an offline check beside it would start twice. The server needs two things for it, both switched
on by the driver only with ``--probe``:

- ``--worker-extension-cls benchmarks.serving.probe.RedrawWeights``: vLLM mixes the class into every
  worker, so ``redraw_weights`` runs on every rank;
- ``VLLM_SERVER_DEV_MODE=1``: the server's ``/collective_rpc`` route, which calls it; and
  ``--profiler-config``: its ``/start_profile`` and ``/stop_profile`` routes.

Weights: ``--load-format dummy`` draws values so small that greedy decoding repeats the last prompt
token whatever attention computes (tests/vllm_plugin_gpu/engine_worker.py). They are redrawn on every
rank, seeded by parameter name (and by tensor-parallel rank where the layer is sharded, so that
replicated weights agree across ranks and shards differ): bf16 and float32 weights N(0, 1/fan_in)
(norms N(0, 1)), fp8 block-quantized weights N(0, 1) in e4m3 with every block's scale 1/sqrt(fan_in),
so that the dequantized weight is N(0, 1/fan_in) too; fills that need no knowledge of the layout
vLLM keeps the blocks in. Then the MLA layers' absorbed weights are recomputed. Both sides draw the
same values, so on and off must agree: the probe's requests go one at a time (each alone in the
engine, the same batches on both sides), greedy, with the sampled tokens' logprobs.

The driver imports this module without torch or vLLM (the worker-side parts import them inside).
"""

from __future__ import annotations

import json
import math
import random
import re
import statistics
import time
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

WORKER_EXTENSION = "benchmarks.serving.probe.RedrawWeights"
REDRAW_METHOD = "redraw_weights"
FP8_MAX = 448.0  # e4m3's largest finite value
SCALE_SUFFIXES = ("_scale_inv", "_scale")  # vLLM's block scales (weight_scale_inv) and per-tensor ones


@dataclass(frozen=True)
class ProbeShape:
    """The probe's requests (token counts)."""

    greedy_lens: tuple[int, ...] = (7, 100, 1000)
    greedy_tokens: int = 16
    decode_requests: int = 16  # in flight together while profiled: decode steps of this batch
    decode_prompt: int = 64
    decode_tokens: int = 24
    seed: int = 4321


GPU_SHAPE = ProbeShape()
CPU_SHAPE = ProbeShape(greedy_lens=(5, 40), greedy_tokens=6, decode_requests=2, decode_prompt=8, decode_tokens=4)


# -- on the workers ------------------------------------------------------------------------


def _seed(name: str, rank: int | None) -> int:
    return zlib.crc32(f"{name}@{rank}".encode()) if rank is not None else zlib.crc32(name.encode())


def _sharded_rank(module) -> int | None:
    """The module's tensor-parallel rank if tensor parallelism shards it, else None (replicated).

    Linear layers and the vocabulary embedding say ``tp_size``/``tp_rank`` themselves (1 where
    replicated); vLLM 0.33's routed experts keep theirs in ``moe_config.moe_parallel_config``."""
    size, rank = getattr(module, "tp_size", None), getattr(module, "tp_rank", 0)
    if size is None:
        parallel = getattr(getattr(module, "moe_config", None), "moe_parallel_config", None)
        size, rank = getattr(parallel, "tp_size", 1), getattr(parallel, "tp_rank", 0)
    return int(rank) if size > 1 else None


CHUNK_ELEMENTS = 1 << 27  # float32 draws of 512 MiB at most: the GPU's memory is mostly weights and KV cache


def _draw_normal(p, seed: int, scale: float) -> None:
    """``p`` := N(0, scale^2), drawn on p's device (~80 GiB a rank: on the host it would take minutes), in
    slices along the first dimension so the float32 draw stays small; clamped to fp8's range for fp8."""
    import torch

    g = torch.Generator(device=p.device).manual_seed(seed)
    flat = p.view(1, *p.shape) if p.dim() == 0 else p
    per_row = max(1, flat[0].numel())
    step = max(1, CHUNK_ELEMENTS // per_row)
    for start in range(0, flat.shape[0], step):
        part = flat[start : start + step]
        draw = torch.randn(part.shape, generator=g, device=p.device).mul_(scale)
        if p.dtype == torch.float8_e4m3fn:
            draw.clamp_(-FP8_MAX, FP8_MAX)
        part.copy_(draw)


def redraw(model, act_dtype=None) -> dict:
    """Redraw every floating-point weight of ``model`` as the module docstring says; what was drawn, by kind.

    ``act_dtype``: the model's activation dtype, for the MLA layers' absorbed weights (the server's
    ``--dtype``; bf16 on the GPU, float32 on vLLM's CPU platform)."""
    import torch
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    counts = {"fp8_weights": 0, "block_scales": 0, "other": 0, "mla_layers": 0, "sharded": 0}
    with torch.no_grad():
        for module_name, module in model.named_modules():
            own = dict(module.named_parameters(recurse=False))
            rank = _sharded_rank(module)
            counts["sharded"] += rank is not None and bool(own)
            for pname, p in own.items():
                if not p.is_floating_point() or p.numel() == 0:
                    continue
                seed = _seed(f"{module_name}.{pname}", rank)
                weight_of_scale = next((pname[: -len(s)] for s in SCALE_SUFFIXES if pname.endswith(s)), None)
                if weight_of_scale in own and own[weight_of_scale].dtype == torch.float8_e4m3fn:
                    # fan-in: the weight's last dimension (vLLM keeps block-quantized weights [.., out, in]).
                    p.fill_(own[weight_of_scale].shape[-1] ** -0.5)
                    counts["block_scales"] += 1
                elif p.dtype == torch.float8_e4m3fn:
                    _draw_normal(p, seed, 1.0)
                    counts["fp8_weights"] += 1
                else:
                    norm = "norm" in pname or "norm" in module_name.rsplit(".", 1)[-1]
                    _draw_normal(p, seed, 1.0 if norm or p.dim() == 0 else p.shape[-1] ** -0.5)
                    counts["other"] += 1
        for module in model.modules():
            if isinstance(module, MLAAttention):
                module.process_weights_after_loading(act_dtype or torch.bfloat16)
                counts["mla_layers"] += 1
    return counts


class RedrawWeights:
    """Mixed into every vLLM worker (``--worker-extension-cls``): ``redraw_weights`` through ``/collective_rpc``."""

    def redraw_weights(self) -> dict:
        from vllm.distributed import get_tensor_model_parallel_rank

        counts = self.apply_model(lambda model: redraw(model, self.model_config.dtype))
        # Graphs captured before read the same tensors (copied into, never replaced); stale compiled code does not.
        return {"tp_rank": get_tensor_model_parallel_rank(), **counts}


# -- from the driver -----------------------------------------------------------------------


def post(port: int, path: str, body: dict | None, timeout_s: float = 600.0) -> dict | None:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        text = r.read().decode()
    return json.loads(text) if text.strip() else None


def token_lists(lens, vocab: int, seed: int) -> list[list[int]]:
    """Prompts of random token ids (2 ..: not BOS or EOS), one list per length."""
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in lens]


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    """Greedy, every token sampled (ignore_eos), its logprob, token ids rather than text."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip


def parse_completion(response: dict) -> dict:
    """Tokens (ids) and their logprobs from an OpenAI completions response of ``completion_body``."""
    logprobs = response["choices"][0]["logprobs"]
    tokens = [int(t.rsplit(":", 1)[1]) for t in logprobs["tokens"]]  # "token_id:123"
    return {"tokens": tokens, "logprobs": [float(x) for x in logprobs["token_logprobs"]]}


def greedy(port: int, model: str, vocab: int, shape: ProbeShape) -> dict:
    prompts = token_lists(shape.greedy_lens, vocab, shape.seed)
    outs = [parse_completion(post(port, "/v1/completions", completion_body(model, p, shape.greedy_tokens)))
            for p in prompts]  # one at a time: each request alone in the engine, on both sides  # fmt: skip
    return {"lens": list(shape.greedy_lens), "tokens": [o["tokens"] for o in outs],
            "logprobs": [o["logprobs"] for o in outs]}  # fmt: skip


def compare(on: dict, off: dict) -> dict:
    """On against off, prompt by prompt: tokens equal, where they first differ, logprob differences.

    ``equal``: every token and every logprob equal. Logprobs are compared where the tokens agree
    (after the first different token the two continue from different text)."""
    prompts = []
    for i, (t_on, t_off, l_on, l_off) in enumerate(zip(on["tokens"], off["tokens"], on["logprobs"], off["logprobs"],
                                                       strict=True)):  # fmt: skip
        first = next((k for k, (a, b) in enumerate(zip(t_on, t_off)) if a != b), None)
        if first is None and len(t_on) != len(t_off):
            first = min(len(t_on), len(t_off))
        same = len(t_on) if first is None else first
        diffs = [abs(a - b) for a, b in zip(l_on[:same], l_off[:same])]
        prompts.append({"prompt": i, "tokens_equal": first is None, "first_different_token": first,
                        "max_logprob_diff": max(diffs, default=0.0),
                        "logprobs_equal": first is None and all(d == 0.0 for d in diffs)})  # fmt: skip
    if len(on["tokens"]) != len(off["tokens"]):
        raise ValueError(f"on answered {len(on['tokens'])} prompts, off {len(off['tokens'])}")
    degenerate = _degenerate(on)
    return {"equal": all(p["logprobs_equal"] for p in prompts), "tokens_equal": all(p["tokens_equal"] for p in prompts),
            "max_logprob_diff": max((p["max_logprob_diff"] for p in prompts), default=0.0), "prompts": prompts,
            "degenerate": degenerate}  # fmt: skip


def _degenerate(result: dict) -> str | None:
    """Why greedy outputs say nothing about attention, or None: each prompt repeating one token, or all alike."""
    seqs = [tuple(t) for t in result["tokens"]]
    if seqs and all(len(set(s)) <= 1 for s in seqs):
        return "every prompt's output repeats one token: the weights were not redrawn?"
    if len(seqs) > 1 and len(set(seqs)) == 1:
        return "every prompt gives the same output"
    return None


# -- the decode-step profile ---------------------------------------------------------------


RANK0_TRACE = re.compile(r"_rank0\.")  # vLLM names a worker's trace <prefix>_dp0_pp0_tp0_..._rank<R>.<...>


def decode_batch(port: int, model: str, vocab: int, shape: ProbeShape) -> None:
    """``decode_requests`` requests at once: after their prefill, decode steps of that batch."""
    prompts = token_lists([shape.decode_prompt] * shape.decode_requests, vocab, shape.seed + 1)
    with ThreadPoolExecutor(shape.decode_requests) as pool:
        list(pool.map(lambda p: post(port, "/v1/completions", completion_body(model, p, shape.decode_tokens)), prompts))


def rank0_trace(directory: Path, prefix: str, wait_s: float = 120.0) -> Path | None:
    """Rank 0's trace of the session ``prefix`` once its size settles (workers write it after stop)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        found = sorted(p for p in directory.glob(f"{prefix}*") if RANK0_TRACE.search(p.name) and ".pt.trace.json" in p.name)
        if found:
            size = -1
            while size != found[-1].stat().st_size and time.monotonic() < deadline:
                size = found[-1].stat().st_size
                time.sleep(1.0)
            return found[-1]
        time.sleep(1.0)
    return None


def decode_step_times(trace_path: Path) -> dict:
    """GPU time per decode step of rank 0's trace: the busy time (union of its kernels) of every decode-only step."""
    from benchmarks.e2e import vllm_trace

    steps = vllm_trace.parse_steps(vllm_trace.load(str(trace_path)))
    return summarize_steps([(s.kind, s.gen_reqs, s.gpu_time_us()["busy"]) for s in steps], trace_path.name)


def summarize_steps(steps: list[tuple[str, int, float]], trace: str) -> dict:
    """(kind, requests decoding, GPU busy us) per step -> the median and spread of the decode-only steps
    at the largest batch seen (the steps of the whole batch; the first and last are partial)."""
    decode = [(n, us) for kind, n, us in steps if kind == "decode"]
    if not decode:
        return {"trace": trace, "steps": len(steps), "decode_steps": 0, "error": "no decode-only step in the trace"}
    batch = max(n for n, _ in decode)
    times = sorted(us for n, us in decode if n == batch)
    return {"trace": trace, "steps": len(steps), "decode_steps": len(decode), "batch": batch,
            "steps_at_batch": len(times), "gpu_us_median": statistics.median(times), "gpu_us_min": times[0],
            "gpu_us_max": times[-1]}  # fmt: skip


def profile_decode(port: int, model: str, vocab: int, shape: ProbeShape, trace_dir: Path, prefix: str) -> dict:
    post(port, "/start_profile", {"profile_prefix": prefix})
    try:
        decode_batch(port, model, vocab, shape)
    finally:
        post(port, "/stop_profile", None)
    path = rank0_trace(trace_dir, prefix)
    if path is None:
        return {"error": f"no rank-0 trace {prefix}*_rank0.* in {trace_dir}"}
    return decode_step_times(path)


def run(port: int, model: str, vocab: int, shape: ProbeShape, trace_dir: Path, prefix: str) -> dict:
    """The whole probe on a healthy server: redraw, greedy, decode profile; each part's seconds."""
    out: dict = {}
    t = time.monotonic()
    results = (post(port, "/collective_rpc", {"method": REDRAW_METHOD}) or {}).get("results", [])
    out["redraw"] = results
    out["redraw_s"] = time.monotonic() - t
    if not results or any(not isinstance(r, dict) or not r.get("mla_layers") for r in results):
        raise RuntimeError(f"redrawing the weights did not reach every rank's MLA layers: {results}")
    t = time.monotonic()
    out["greedy"] = greedy(port, model, vocab, shape)
    out["greedy_s"] = time.monotonic() - t
    degenerate = _degenerate(out["greedy"])
    if degenerate:
        out["degenerate"] = degenerate
    t = time.monotonic()
    try:
        out["decode_profile"] = profile_decode(port, model, vocab, shape, trace_dir, prefix)
    except OSError as e:  # the profile is worth less than the loads after it: note and go on
        out["decode_profile"] = {"error": f"{type(e).__name__}: {e}"}
    out["profile_s"] = time.monotonic() - t
    return out


def compare_sides(probes: dict[str, dict]) -> dict:
    """``{side name: probe of its first server}`` -> each plugin side against ``off``; decode-step GPU times."""
    out: dict = {"decode_gpu_us": {side: p.get("decode_profile", {}).get("gpu_us_median") for side, p in probes.items()}}
    if "off" in probes:
        for side, p in probes.items():
            if side != "off" and "greedy" in p and "greedy" in probes["off"]:
                out[f"{side} vs off"] = compare(p["greedy"], probes["off"]["greedy"])
        off_us = out["decode_gpu_us"].get("off")
        out["decode_gpu_ratio_vs_off"] = {s: us / off_us for s, us in out["decode_gpu_us"].items()
                                          if us and off_us and s != "off" and math.isfinite(us)}  # fmt: skip
    return out


def problems(summary: dict) -> list[str]:
    """What in ``compare_sides``' summary makes the comparison false: outputs differ, or say nothing."""
    out = list(summary.get("errors", []))
    for key, c in summary.items():
        if key.endswith(" vs off") and isinstance(c, dict):
            if not c["equal"]:
                out.append(f"probe {key}: greedy outputs differ (tokens equal: {c['tokens_equal']}, "
                           f"largest logprob difference {c['max_logprob_diff']:.3g})")  # fmt: skip
            if c["degenerate"]:
                out.append(f"probe {key}: {c['degenerate']}")
    return out


def markdown(summary: dict) -> str:
    lines = ["", "## Probe: redrawn weights, greedy on vs off, decode-step GPU time (rank 0)", ""]
    for key, c in summary.items():
        if key.endswith(" vs off") and isinstance(c, dict):
            lines.append(f"- {key}: {'equal' if c['equal'] else 'DIFFERENT'} (tokens equal {c['tokens_equal']}, "
                         f"largest logprob difference {c['max_logprob_diff']:.3g}"
                         + (f"; {c['degenerate']}" if c["degenerate"] else "") + ")")  # fmt: skip
    for side, us in summary.get("decode_gpu_us", {}).items():
        ratio = summary.get("decode_gpu_ratio_vs_off", {}).get(side)
        lines.append(f"- decode step GPU time, {side}: " + (f"{us:.0f} us" if us else "not measured")
                     + (f" ({ratio:.4f} x off)" if ratio else ""))  # fmt: skip
    lines += [f"- error: {e}" for e in summary.get("errors", [])]
    return "\n".join(lines) + "\n"
