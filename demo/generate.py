"""One generation run of the demo: vLLM's engine serving the tiny model's requests, in this process.

``python -m demo.generate MODEL_DIR``, with the plugin on, or off with
``VLLM_MLA_FUSION=0``: a process per setting, because vLLM loads plugins
once per process. Prints ``PROGRESS ...`` lines while it works and one
``RESULT {json}`` line at the end (see :func:`main` for its fields).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
that the CPU stand-ins registered here and the census installed here are
the ones the model uses, and eagerly (``enforce_eager``), so that every
launch is visible to the census. Requests arrive at different engine steps,
so the run has prefill-only, decode-only and mixed steps; one prompt is long
enough to be split into chunks where chunked prefill is on, and another
shares its beginning (a prefix-cache hit where prefix caching is on).

The schedule runs twice: the first pass is counted (census, under the
profiler) and warms the engine up, the second is timed without the profiler.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is local; never ask the Hub

from . import census as census_mod  # noqa: E402
from . import cpu_stand_ins  # noqa: E402
from .tiny_model import CORPUS  # noqa: E402

# float32 on the CPU: the fused op rounds RoPE once, vLLM's native RoPE after
# each bf16 operation, and with bf16 logits an exact tie on one path can be a
# one-ulp difference on the other, flipping a greedy choice with nothing wrong
# (tests/vllm_plugin/test_layer.py compares bf16 layers with tolerances).
# On a GPU, bf16: what DeepSeek models run, and what the GPU MLA backends take.
DTYPE = "bfloat16" if ON_GPU else "float32"
# Small enough that the long prompt is split where chunked prefill is on.
MAX_NUM_BATCHED_TOKENS = 128


@dataclass
class Request:
    name: str
    prompt: str
    arrives: int  # added before this engine step
    max_tokens: int


def schedule() -> list[Request]:
    lines = CORPUS.splitlines()
    return [
        Request("short", "The fused kernel", 0, 16),
        Request("medium", " ".join(lines[:3]), 0, 12),
        Request("long", CORPUS, 2, 8),
        Request("long, same start", CORPUS[:1200] + " A second question about the cache.", 6, 6),
        Request("late", "A padded token", 9, 10),
    ]


def engine_args(model_dir: str) -> dict:
    args = dict(
        model=model_dir,
        dtype=DTYPE,
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=64 << 20,
        seed=0,
    )
    if not ON_GPU:
        # By name: vLLM's CPU platform would pick AMX_MLA on a CPU with AMX (demo/cpu_stand_ins.py).
        args["attention_backend"] = cpu_stand_ins.ATTENTION_BACKEND
    return args


def progress(message: str) -> None:
    print(f"PROGRESS {message}", flush=True)


def layer_facts(model: torch.nn.Module) -> list[dict]:
    """Name, fused mode (None: vLLM's path) and attention backend of each MLA layer."""
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

    return [
        {"name": m.prefix, "mode": getattr(m, "fusion_mode", None), "backend": m.mla_attn.attn_backend.get_name()}
        for m in model.modules()
        if isinstance(m, MultiHeadLatentAttentionWrapper)
    ]


def run_pass(engine, requests: list[Request], census: census_mod.Census, counted: bool, tag: str):
    """Feed the schedule to the engine step by step; returns (outputs by request name, steps)."""
    from vllm import SamplingParams

    pending = sorted(requests, key=lambda r: r.arrives)
    outputs, steps, index = {}, [], 0
    while pending or engine.has_unfinished_requests():
        while pending and (pending[0].arrives <= index or not engine.has_unfinished_requests()):
            r = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True, logprobs=0)
            engine.add_request(f"{tag}:{r.name}", r.prompt, params)
        start = time.perf_counter()
        with census.step(profiled=counted):
            finished = engine.step()
        if ON_GPU:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3
        record = census.steps[-1]
        steps.append({"ms": ms, **asdict(record)})
        for out in finished:
            if out.finished:
                completion = out.outputs[0]
                tokens = list(completion.token_ids)
                outputs[out.request_id.split(":", 1)[1]] = {
                    "prompt_tokens": len(out.prompt_token_ids),
                    "tokens": tokens,
                    "logprobs": [lp[t].logprob for t, lp in zip(tokens, completion.logprobs, strict=True)],
                    "text": completion.text,
                }
        index += 1
        if index % 5 == 0:
            progress(f"{tag} pass: {index} engine steps, {len(outputs)}/{len(requests)} requests done")
    return outputs, steps


def main(model_dir: str) -> None:
    started = time.perf_counter()
    stand_ins = [] if ON_GPU else cpu_stand_ins.prepare()  # and AMX hidden from vLLM
    census = census_mod.Census().install()
    progress("starting vLLM's engine")
    from vllm import LLM, __version__

    llm = LLM(**engine_args(model_dir))
    engine = llm.llm_engine
    config = engine.vllm_config
    layers = llm.apply_model(layer_facts)[0]
    progress(f"engine ready after {time.perf_counter() - started:.0f} s; running the requests")
    requests = schedule()
    counted_outputs, counted_steps = run_pass(engine, requests, census, counted=True, tag="counted")
    timed_outputs, timed_steps = run_pass(engine, requests, census, counted=False, tag="timed")
    result = {
        "device": torch.cuda.get_device_name() if ON_GPU else "CPU",
        "vllm": __version__,
        "torch": torch.__version__,
        "dtype": DTYPE,
        "stand_ins": stand_ins,
        # What torch says about AMX tiles on this host, and what vLLM was told (demo/cpu_stand_ins.py).
        "amx": {"host": cpu_stand_ins.host_has_amx(), "vllm": torch.cpu._is_amx_tile_supported()},
        "chunked_prefill": config.scheduler_config.enable_chunked_prefill,
        "prefix_caching": config.cache_config.enable_prefix_caching,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "requested_max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "layers": layers,
        "requests": [asdict(r) for r in requests],
        "counted": {"outputs": counted_outputs, "steps": counted_steps},
        "timed": {"outputs": timed_outputs, "steps": timed_steps},
    }
    print("RESULT " + json.dumps(result), flush=True)
    with contextlib.suppress(Exception):
        del llm  # shut the engine down before the interpreter does


if __name__ == "__main__":
    main(sys.argv[1])
