"""Whole-model greedy generation with vLLM on the CPU, run in a fresh process by test_generate.py.

Usage: ``python -m tests.vllm_plugin.generate_worker MODEL_DIR`` with the
plugin switched on or off through the environment (``VLLM_MLA_FUSION``).
Prints one JSON line: generated token ids and their log-probabilities, the
fused mode of each MLA layer, and how often the fused ops and vLLM's own
cache write ran.

A separate process because vLLM's engine initialises its own process group
and plugin state, which a test session can only do once.

float32, not bf16: with random weights the logits are nearly flat, and in
bf16 two of them can tie exactly on one path and differ by one ulp on the
other (RoPE rounded once versus per operation), which flips a greedy choice
without anything being wrong; float32 leaves that to chance no more.

``load_format="dummy"`` fills weights with values in +-1e-3, so small that the
residual stream is the token embedding and greedy decoding just repeats the
last prompt token whatever attention computes. The weights are therefore
redrawn (seeded normal, 1/sqrt(fan_in)) after loading, and the MLA layers'
absorbed weights recomputed, through ``LLM.apply_model``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
# In-process engine: the stand-in kernels registered here are the ones it calls.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch  # noqa: E402

from demo import cpu_stand_ins  # noqa: E402

from . import harness as H  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7] * 3 + [300, 200, 100]]
MAX_TOKENS = 8
DTYPE = torch.float32


def redraw_weights(model: torch.nn.Module) -> list[str]:
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point() or p.numel() == 0:
                continue
            scale = 1.0 if "norm" in name else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    modes = []
    for module in model.modules():
        if isinstance(module, MLAAttention):
            module.process_weights_after_loading(DTYPE)
        mode = getattr(module, "fusion_mode", "absent")
        if mode != "absent":
            modes.append(str(mode))
    return modes


def main(model_dir: str) -> None:
    cpu_stand_ins.install()
    from vllm import LLM, SamplingParams
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    from vllm_mla_fusion.backends import reference

    calls = {"fused": 0, "vllm_cache_write": 0}

    def counting(key, fn):
        def wrapped(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)

        return wrapped

    reference.rope_cache_write = counting("fused", reference.rope_cache_write)
    reference.decode_rope_cache_write = counting("fused", reference.decode_rope_cache_write)
    CPUMLAImpl.do_kv_cache_update = counting("vllm_cache_write", CPUMLAImpl.do_kv_cache_update)

    llm = LLM(
        model=H.write_model_dir(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=DTYPE,
        max_model_len=256,
        max_num_seqs=4,
        kv_cache_memory_bytes=32 << 20,
        attention_backend="CPU_MLA",
        seed=0,
    )
    modes = llm.apply_model(redraw_weights)[0]
    calls.update(fused=0, vllm_cache_write=0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [
        [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)] for o in outputs
    ]
    result = {"tokens": tokens, "logprobs": logprobs, "modes": modes, "calls": calls}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
