"""Running vLLM 0.33's MLA layer on the CPU, with and without the plugin.

How (docs/vllm.md, "Testing"): vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``,
gloo), a VllmConfig read from a tiny DeepSeek-V3-architecture config.json,
the layer built through the model's own ``DeepseekV2MLAAttention`` (so
``PluggableLayer.register_oot`` applies as in a real model), attention
metadata from the CPU_MLA backend's own builder fed a
``CommonAttentionMetadata`` filled the way vLLM's model runner fills it, and
each step run under ``set_forward_context`` with the layer's slot mapping.

The CUDA wheel of vLLM has no compiled CPU kernels; CPU_MLA's decode calls
``torch.ops._C.mla_decode_kvcache``, for which conftest.py registers the
plain-torch stand-in of demo/cpu_stand_ins.py (shared with the demo), which
also records the queries it is given: the decode query the attention backend
consumed. As in the demo, CPU_MLA is asked for by name and conftest.py hides
AMX from vLLM, so that a CPU with AMX takes the same path (that module's
docstring says why).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass, field

import torch

from demo import cpu_stand_ins, tiny_model

# Per-head dims of DeepSeek-V3; hidden size and head count reduced (demo/tiny_model.py).
DSV3_CONFIG = tiny_model.CONFIG
BLOCK_SIZE = 16  # the only block size CPU_MLA supports
NUM_BLOCKS = 32
DTYPE = torch.bfloat16


def write_model_dir(path: str, **overrides) -> str:
    """config.json only: the layer tests draw their own weights."""
    return str(tiny_model.write(path, weights=False, **overrides))


class VllmCpu:
    """One VllmConfig + process group for the test session; layers get unique names."""

    def __init__(self, model_dir: str):
        from vllm.config import AttentionConfig, CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        self.model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024)
        self.config = VllmConfig(
            model_config=self.model_config, cache_config=CacheConfig(block_size=BLOCK_SIZE),
            attention_config=AttentionConfig(backend=AttentionBackendEnum[cpu_stand_ins.ATTENTION_BACKEND]),
        )  # fmt: skip
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

    def builder(self, layer_names: list[str], backend=None, block_size: int = BLOCK_SIZE):
        """The metadata builder of ``backend`` (default CPU_MLA, the harness's backend) for these layers."""
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576, dtype=DTYPE)
        with self.active():
            return (backend or CPUMLABackend).get_builder_cls()(spec, layer_names, self.config, torch.device("cpu"))


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


def step_inputs(env: VllmCpu, builder, steps: list[Step], requests: dict[int, Request], seed: int,
                block_size: int = BLOCK_SIZE):
    """Each step of ``steps`` in turn, as ``(step, attention metadata, hidden states)``: the requests
    advanced as vLLM's scheduler would (prepare_step), the metadata built by the backend's builder,
    fresh random hidden states from one generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    for step in steps:
        common = prepare_step(step, requests, block_size)
        with env.active():
            metadata = builder.build(0, common)
        yield step, metadata, torch.randn((step.positions.numel(), DSV3_CONFIG["hidden_size"]), generator=g).to(DTYPE)


def new_kv_cache(seed: int, shape: tuple[int, ...] = (NUM_BLOCKS, 1, BLOCK_SIZE, 576)) -> torch.Tensor:
    """A cache (CPU_MLA's [num_blocks, 1, block_size, 576] by default) filled with canary values (never all-zero rows)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(DTYPE)


def run_step(env: VllmCpu, attn, metadata, step: Step, hidden: torch.Tensor, cudagraph_runtime_mode=None) -> torch.Tensor:
    """One forward of the whole attention module (projections to o_proj) for ``step``.

    ``cudagraph_runtime_mode`` (vLLM's CUDAGraphMode, default NONE) is what the forward context
    says, as when vLLM captures or replays graphs: the ops that look at it behave accordingly
    (on a CPU nothing is captured; the ops' Python runs as it does at capture time)."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import set_forward_context

    _, mla = mla_layer(attn)
    name = mla.layer_name
    mode = CUDAGraphMode.NONE if cudagraph_runtime_mode is None else cudagraph_runtime_mode
    with env.active(), set_forward_context({name: metadata}, env.config, slot_mapping={name: step.slots},
                                           cudagraph_runtime_mode=mode):  # fmt: skip
        return attn(step.positions, hidden, None)
