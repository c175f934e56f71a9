"""What the GPU integration tests run: model, cases, request shapes. Imports neither torch nor vLLM.

A *case* is one engine configuration (attention backend, eager or compiled, KV-cache
dtype, token budget); the worker builds it twice, plugin on then off, and runs the
same *probe* on both (engine_worker.py). The shapes are chosen per backend so that
each path the plugin touches runs (vLLM 0.33's ``reorder_batch_threshold``: a request
with at most that many new tokens in a step goes down the decode path,
``forward_mqa``; longer ones the prefill path, ``forward_mha``):

- FLASH_ATTN_MLA (threshold 512), budget 1024 tokens per step: the 2100- and
  1300-token prompts are prefilled in 1024-token chunks, the second and later ones
  reading the earlier context back from the cache (chunked prefill, prefill path);
  their remainders (52, 276 tokens) and every prompt of <= 512 tokens go down the
  decode path.
- FLASHMLA (threshold 128) and TRITON_MLA (1), budget 256: everything longer than
  the threshold is prefilled in 256-token chunks with context; on FLASHMLA a chunk of
  <= 128 tokens (a remainder, or the 40-token prompt) goes down the decode path and
  reads the (fp8) cache there.
- The census step sequence: 4 short requests (prefill-only step, then decode-only
  steps), then a 600-token request joins (a mixed step whose new request exceeds every
  threshold, so it takes the prefill path while the others decode), then decode-only.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass

from demo.tiny_model import DSV3_ARCHITECTURE, yarn_rope_scaling

NUM_LAYERS = 2

# Tiny DeepSeek-V3-architecture model: DeepSeek-V3's per-head MLA dims and TP8 head
# count (16), everything else small. Dense MLP in both layers (first_k_dense_replace).
MODEL_CONFIG = {
    **DSV3_ARCHITECTURE,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_hidden_layers": NUM_LAYERS,
    "intermediate_size": 1024,
    "moe_intermediate_size": 64,
    "n_routed_experts": 4,
    "first_k_dense_replace": NUM_LAYERS,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    # DeepSeek-V3's rope scaling, shrunk.
    "rope_scaling": yarn_rope_scaling(32, 128),
}
# The CPU smoke run: vLLM's CPU platform has CPU_MLA only, which needs small heads counts
# to stay fast in the test stand-ins; float32 makes on/off exactly comparable there.
CPU_MODEL_CONFIG = {**MODEL_CONFIG, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
                    "intermediate_size": 256, "vocab_size": 512}  # fmt: skip


GRAPH_ROPE = (("VLLM_MLA_FUSION_GRAPH_ROPE", "1"),)  # the plugin side's switch of a graph-rope case
FUSED_PREFILL_KEY = (("VLLM_MLA_FUSION_PREFILL_KEY", "1"),)  # op 3, opt-in since issue 40
DECODE_CAPTURE = (1, 2, 4, 8)  # graphs up to max_num_seqs: every decode-only step replays a FULL graph
# A graph-rope case captures piecewise graphs up to its token budget, so that its prefill and
# mixed steps replay them (with only DECODE_CAPTURE, every step longer than 8 tokens runs eager
# and the graph op would never run inside a graph).
PIECEWISE_CAPTURE = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class Case:
    backend: str
    compiled: bool
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int = 256
    plugin_env: tuple[tuple[str, str], ...] = ()  # switches set for the plugin side's engine

    @property
    def capture_sizes(self) -> tuple[int, ...]:
        """CUDA-graph capture sizes of a compiled case (both sides)."""
        return PIECEWISE_CAPTURE if self.plugin_env == GRAPH_ROPE else DECODE_CAPTURE

    @property
    def name(self) -> str:
        cache = "bf16" if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        name = f"{self.backend}-{'compiled' if self.compiled else 'eager'}-{cache}"
        if self.plugin_env == GRAPH_ROPE:
            return name + "-graph-rope"
        return name + "".join(f"-{k}={v}" for k, v in self.plugin_env)

    def to_json(self) -> dict:
        return {**asdict(self), "name": self.name}


BUDGET = {"FLASH_ATTN_MLA": 1024, "FLASHMLA": 256, "TRITON_MLA": 256, "CPU_MLA": 64}


def case(backend: str, compiled: bool, kv_cache_dtype: str = "auto", plugin_env: tuple = ()) -> Case:
    return Case(backend, compiled, kv_cache_dtype, BUDGET[backend], plugin_env)


# One worker process per backend, run side by side on the GPU (an engine start is mostly
# host work: compile, capture). Within a worker, in priority order: a worker that runs out
# of time drops the last cases. The eager noise bound needs the compiled bf16 case of the
# same backend, the fp8 comparison its compiled bf16 case (the reference). The opt-in fused
# prefill key (op 3, VLLM_MLA_FUSION_PREFILL_KEY=1) runs on FLASH_ATTN_MLA, where a mixed step's
# decode rows join its launch (key_start), and on FLASHMLA, beside op 2. The graph-rope case
# (op 1 inside piecewise graphs, VLLM_MLA_FUSION_GRAPH_ROPE=1) goes last: its prefill and mixed
# steps (at most the 1024-token budget, PIECEWISE_CAPTURE) replay piecewise graphs with the fused
# op captured in them.
GROUPS = {
    "FLASH_ATTN_MLA": [case("FLASH_ATTN_MLA", True), case("FLASH_ATTN_MLA", False),
                       case("FLASH_ATTN_MLA", True, plugin_env=FUSED_PREFILL_KEY),
                       case("FLASH_ATTN_MLA", True, plugin_env=GRAPH_ROPE)],
    "FLASHMLA": [case("FLASHMLA", True), case("FLASHMLA", True, "fp8"), case("FLASHMLA", False),
                 case("FLASHMLA", True, plugin_env=FUSED_PREFILL_KEY)],
    "TRITON_MLA": [case("TRITON_MLA", True), case("TRITON_MLA", True, "fp8"), case("TRITON_MLA", False)],
}
CPU_GROUPS = {"CPU_MLA": [case("CPU_MLA", False)]}
ALL_CASES = {c.name: c for cs in GROUPS.values() for c in cs}


@dataclass(frozen=True)
class Probe:
    """Request shapes of one probe run (token counts)."""

    greedy_lens: tuple[int, ...] = (5, 30, 700, 1300)
    greedy_tokens: int = 16
    teacher_lens: tuple[int, ...] = (2100, 1100, 300, 40)
    census_requests: int = 4
    census_prompt: int = 8
    census_tokens: int = 10
    census_late_prompt: int = 600  # longer than every backend's reorder_batch_threshold
    census_late_after: int = 4  # engine steps before the late request joins
    max_model_len: int = 4096
    max_num_seqs: int = 8
    seed: int = 1234


GPU_PROBE = Probe()
CPU_PROBE = Probe(greedy_lens=(5, 30, 90), greedy_tokens=6, teacher_lens=(150, 60, 20), census_requests=2,
                  census_prompt=4, census_tokens=6, census_late_prompt=40, census_late_after=3, max_model_len=256,
                  max_num_seqs=4)  # fmt: skip


def token_lists(lens, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


def write_model_dir(path: str, config: dict) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path
