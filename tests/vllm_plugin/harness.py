"""Running vLLM 0.33's MLA layer on the CPU, with and without the plugin.

How (docs/vllm.md, "Testing"): vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``,
gloo), a VllmConfig read from a tiny DeepSeek-V3-architecture config.json,
the layer built through the model's own ``DeepseekV2MLAAttention`` (so
``PluggableLayer.register_oot`` applies as in a real model), attention
metadata from the CPU_MLA backend's own builder fed a
``CommonAttentionMetadata`` filled the way vLLM's model runner fills it, and
each step run under ``set_forward_context`` with the layer's slot mapping.

The CUDA wheel of vLLM has no compiled CPU kernels; CPU_MLA's decode calls
``torch.ops._C.mla_decode_kvcache``, so :func:`install_cpu_stand_ins`
registers a plain-torch kernel under that name (and, for the whole-model
test, the three other ``_C`` ops vLLM's CPU engine calls on this path). The
decode stand-in also records the query it is given: the decode query the
attention backend consumed.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from dataclasses import dataclass, field

import torch

# Per-head dims of DeepSeek-V3; hidden size and head count reduced.
DSV3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 2,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rope_theta": 10000,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    # DeepSeek-V3's own rope scaling, shrunk: yarn -> DeepseekScalingRotaryEmbedding,
    # GPT-J (interleaved) rotation.
    "rope_scaling": {
        "type": "yarn",
        "factor": 32,
        "original_max_position_embeddings": 128,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}
BLOCK_SIZE = 16  # the only block size CPU_MLA supports
NUM_BLOCKS = 32
DTYPE = torch.bfloat16

# Every query the decode stand-in received, in call order (tests clear it).
DECODE_QUERIES: list[torch.Tensor] = []


def write_model_dir(path: str, **overrides) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**DSV3_CONFIG, **overrides}, f)
    return path


def _decode_stand_in(out, query, kv_cache, scale, block_tables, seq_lens) -> None:
    """Plain-torch ``mla_decode_kvcache``: per request, softmax(q K^T * scale) V over its cache rows."""
    DECODE_QUERIES.append(query.clone())
    kv_lora_rank = out.shape[-1]
    block_size = kv_cache.shape[1]
    for b in range(query.shape[0]):  # requests, not tokens: fine in a test kernel
        n = int(seq_lens[b])
        blocks = block_tables[b, : (n + block_size - 1) // block_size].long()
        kv = kv_cache[blocks].reshape(-1, kv_cache.shape[-1])[:n].float()
        probs = ((query[b].float() @ kv.T) * scale).softmax(-1)
        out[b] = (probs @ kv[:, :kv_lora_rank]).to(out.dtype)


def _slot_mapping_stand_in(query_start_loc, positions, block_table, slot_mapping, block_size) -> None:
    """Plain-torch ``compute_slot_mapping_kernel_impl`` (the model runner's slot computation on CPU)."""
    qsl = query_start_loc.long()
    num_tokens = int(qsl[-1])
    request = torch.repeat_interleave(torch.arange(qsl.numel() - 1), qsl[1:] - qsl[:-1])
    pos = positions[:num_tokens].long()
    slot_mapping.fill_(-1)
    slot_mapping[:num_tokens] = block_table[request, pos // block_size].long() * block_size + pos % block_size


# name -> (schema, implementation, dispatch key). Only what the CUDA wheel lacks
# on this path: the MLA decode kernel for the layer tests, plus what vLLM's CPU
# worker, model runner and greedy sampler call for the whole-model test.
_STAND_INS = {
    "mla_decode_kvcache": (
        "(Tensor(a!) out, Tensor query, Tensor kv_cache, float scale, Tensor block_tables, Tensor seq_lens) -> ()",
        _decode_stand_in,
        "CPU",
    ),
    "init_cpu_memory_env": ("(int[] nodes) -> ()", lambda nodes: None, "CompositeExplicitAutograd"),
    "compute_slot_mapping_kernel_impl": (
        "(Tensor query_start_loc, Tensor positions, Tensor block_table, Tensor(a!) slot_mapping, int block_size) -> ()",
        _slot_mapping_stand_in,
        "CPU",
    ),
    "greedy_argmax": ("(Tensor logits) -> Tensor", lambda logits: logits.argmax(dim=-1).view(-1), "CPU"),
}
_STAND_IN_LIB = None


def install_cpu_stand_ins(names=("mla_decode_kvcache",)) -> None:
    """Register plain-torch stand-ins under ``torch.ops._C.<name>`` for those that are missing."""
    global _STAND_IN_LIB
    for name in names:
        if hasattr(torch.ops._C, name):
            continue
        if _STAND_IN_LIB is None:
            _STAND_IN_LIB = torch.library.Library("_C", "FRAGMENT")
        schema, impl, key = _STAND_INS[name]
        _STAND_IN_LIB.define(name + schema)
        _STAND_IN_LIB.impl(name, impl, key)


def install_cpu_decode_stand_in() -> None:
    install_cpu_stand_ins(("mla_decode_kvcache",))


class VllmCpu:
    """One VllmConfig + process group for the test session; layers get unique names."""

    def __init__(self, model_dir: str):
        from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel

        self.model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024)
        self.config = VllmConfig(model_config=self.model_config, cache_config=CacheConfig(block_size=BLOCK_SIZE))
        self._set_config = set_current_vllm_config
        with set_current_vllm_config(self.config):
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0,
                distributed_init_method=f"file://{os.path.join(model_dir, 'dist_init')}", backend="gloo",
            )  # fmt: skip
            initialize_model_parallel(1, 1)
        self._layer_ids = itertools.count()

    @contextlib.contextmanager
    def active(self):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(DTYPE)
        try:
            with self._set_config(self.config):
                yield
        finally:
            torch.set_default_dtype(prev)

    def build_attention(self, hf_config=None):
        """A DeepseekV2MLAAttention (weights uninitialised), as the model builds it."""
        from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLAAttention

        hf = hf_config or self.model_config.hf_config
        prefix = f"model.layers.{next(self._layer_ids)}.self_attn"
        with self.active():
            return DeepseekV2MLAAttention(
                self.config, hf, hf.hidden_size, hf.num_attention_heads, hf.qk_nope_head_dim, hf.qk_rope_head_dim,
                hf.v_head_dim, hf.q_lora_rank, hf.kv_lora_rank, hf.max_position_embeddings, self.config.cache_config,
                None, prefix=prefix,
            )  # fmt: skip

    def finish_weights(self, attn, state: dict | None = None, seed: int = 0) -> dict:
        """Random weights (or ``state``), then vLLM's post-load processing. Returns the state dict used."""
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        if state is None:
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for name, p in attn.named_parameters():
                    scale = 1.0 if "norm" in name else p.shape[-1] ** -0.5
                    p.copy_(torch.randn(p.shape, generator=g) * scale)
            state = {k: v.clone() for k, v in attn.state_dict().items()}
        else:
            attn.load_state_dict(state)
        with self.active():
            process_weights_after_loading(attn, self.model_config, torch.device("cpu"))
        return state

    def builder(self, layer_names: list[str]):
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        spec = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=576, dtype=DTYPE)
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

        with self.active():
            return CPUMLABackend.get_builder_cls()(spec, layer_names, self.config, torch.device("cpu"))


def mla_layer(attn):
    """(the MLA wrapper, its MLAAttention) of a DeepseekV2MLAAttention."""
    return attn.mla_attn, attn.mla_attn.mla_attn


@dataclass
class Request:
    blocks: list[int]
    num_computed: int = 0


@dataclass
class Step:
    """One scheduler step: ``(request, query_len)`` pairs, decodes first as vLLM orders them."""

    name: str
    work: list[tuple[int, int]]
    pad_to: int | None = None  # CUDA-graph style padding of the token dimension
    positions: torch.Tensor = field(init=False)
    slots: torch.Tensor = field(init=False)
    num_tokens: int = field(init=False)


def prepare_step(step: Step, requests: dict[int, Request], block_size: int = BLOCK_SIZE):
    """Positions, slots and CommonAttentionMetadata of ``step``; advances the requests."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    positions, slots, query_lens, seq_lens, tables = [], [], [], [], []
    for rid, qlen in step.work:
        req = requests[rid]
        pos = torch.arange(req.num_computed, req.num_computed + qlen)
        blocks = torch.tensor(req.blocks)
        positions.append(pos)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        query_lens.append(qlen)
        seq_lens.append(req.num_computed + qlen)
        tables.append(req.blocks)
        req.num_computed += qlen
    positions, slots = torch.cat(positions), torch.cat(slots)
    num_tokens = positions.numel()
    pad = (step.pad_to or num_tokens) - num_tokens
    # vLLM's runner: padded tokens have position 0 and slot -1 (PAD_SLOT_ID).
    step.positions = torch.cat([positions, torch.zeros(pad, dtype=torch.int64)])
    step.slots = torch.cat([slots, torch.full((pad,), -1, dtype=torch.int64)])
    step.num_tokens = num_tokens
    qsl = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=sl, num_reqs=len(query_lens),
        num_actual_tokens=num_tokens, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=block_table, slot_mapping=step.slots, seq_lens_cpu_upper_bound=sl,
    )  # fmt: skip


def new_kv_cache(seed: int) -> torch.Tensor:
    """A [num_blocks, 1, block_size, 576] cache filled with canary values (never all-zero rows)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((NUM_BLOCKS, 1, BLOCK_SIZE, 576), generator=g).to(DTYPE)


def run_step(env: VllmCpu, attn, metadata, step: Step, hidden: torch.Tensor) -> torch.Tensor:
    """One forward of the whole attention module (projections to o_proj) for ``step``."""
    from vllm.forward_context import set_forward_context

    _, mla = mla_layer(attn)
    name = mla.layer_name
    with env.active(), set_forward_context({name: metadata}, env.config, slot_mapping={name: step.slots}):
        return attn(step.positions, hidden, None)
