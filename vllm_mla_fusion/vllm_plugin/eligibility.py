"""Which MLA layers take the fused path: every rule, checked once per layer at construction
(the prefill key's per-step rule is bound then too, and asked per step).

Each check returns None when the rule holds, else a short reason that the
layer logs (debug level) before behaving exactly like vLLM's own wrapper. The
rules are the preconditions of ``mla_fusion::mla_rope_cache_write`` and
``mla_decode_rope_cache_write`` stated in vLLM's terms; docs/vllm.md lists
them for users.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention.mla_attention import MLACommonBaseImpl, MLAAttention
from vllm.platforms import current_platform
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import DeepseekScalingRotaryEmbedding
from vllm.v1.attention.backend import MLAAttentionImpl

from .. import dispatch, fp8
from .settings import ENV_DECODE, ENV_GRAPH_ROPE, ENV_PREFILL_KEY, env_enabled, env_opted_in

# RotaryEmbedding subclasses that differ from it only in how cos_sin_cache is
# filled (YaRN, Llama3, NTK, linear scaling, ...) rotate exactly like it; a
# subclass that overrides one of these computes something else (FoPE, Gemma4, ...).
_ROPE_FORWARDS = ("forward", "forward_native", "forward_static", "forward_cuda", "forward_hip", "forward_cpu")


def _cpu_mla_kv_cache_update() -> Callable | None:
    try:
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl
    except ImportError:
        return None
    return CPUMLAImpl.do_kv_cache_update


def rope_reason(rope: torch.nn.Module | None, qk_rope_head_dim: int, act_dtype: torch.dtype) -> str | None:
    """The layer's rope must be a plain cos_sin_cache RoPE over the whole rope dim."""
    if rope is None:
        return "the layer has no rotary embedding"
    cls = type(rope)
    # Exact type: DeepseekV4ScalingRotaryEmbedding subclasses it with another forward.
    plain = cls is DeepseekScalingRotaryEmbedding or (
        isinstance(rope, RotaryEmbedding)
        and all(getattr(cls, m, None) is getattr(RotaryEmbedding, m, None) for m in _ROPE_FORWARDS)
    )
    if not plain:
        return f"rotary embedding {cls.__name__} is not a plain cos_sin_cache RoPE"
    rotary_dim, head_size = getattr(rope, "rotary_dim", None), getattr(rope, "head_size", None)
    if rotary_dim != head_size:
        return f"partial rotary embedding (rotary_dim {rotary_dim} != head_size {head_size})"
    if rotary_dim != qk_rope_head_dim:
        return f"rotary_dim {rotary_dim} != qk_rope_head_dim {qk_rope_head_dim}"
    if qk_rope_head_dim < 2 or qk_rope_head_dim % 2:
        return f"qk_rope_head_dim {qk_rope_head_dim} is not a positive even number"
    if not isinstance(getattr(rope, "is_neox_style", None), bool):
        return "rotary embedding has no boolean is_neox_style"
    cache = getattr(rope, "cos_sin_cache", None)
    if not isinstance(cache, torch.Tensor) or cache.dim() != 2 or cache.shape[1] != rotary_dim:
        return "rotary embedding has no [max_position, rotary_dim] cos_sin_cache"
    if cache.dtype not in (torch.float32, act_dtype):
        return f"cos_sin_cache dtype {cache.dtype} is neither float32 nor the model dtype {act_dtype}"
    return None


def layer_reason(wrapper: torch.nn.Module, vllm_config: VllmConfig) -> str | None:
    """Why ``wrapper`` (a constructed MultiHeadLatentAttentionWrapper) must keep vLLM's path, or None."""
    attn = wrapper.mla_attn
    if type(attn) is not MLAAttention:
        return f"attention layer is {type(attn).__name__}, not MLAAttention"
    if wrapper.is_sparse or wrapper.indexer is not None:
        return "sparse MLA (indexer / top-k attention)"
    if wrapper.dcp_q_replicate:
        return "DCP query replication"
    impl = attn.impl
    if getattr(impl, "dcp_world_size", 1) != 1 or attn.dcp_manager is not None:
        return "decode context parallelism"
    if attn.use_pcp:
        return "prefill context parallelism"
    if attn.hisparse_cache is not None:
        return "HiSparse KV cache"
    if attn.use_direct_call:
        return "platform without an opaque attention op"
    act_dtype = vllm_config.model_config.dtype if vllm_config.model_config else torch.get_default_dtype()
    if act_dtype not in fp8.ACTIVATION_DTYPES:
        return f"model dtype {act_dtype} is not float16, bfloat16 or float32"
    reason = rope_reason(wrapper.rotary_emb, wrapper.qk_rope_head_dim, act_dtype)
    if reason:
        return reason
    if attn.kv_cache_dtype not in fp8.KV_CACHE_DTYPES:
        return f"kv_cache_dtype {attn.kv_cache_dtype!r} is not one of {fp8.KV_CACHE_DTYPES}"
    # The op writes the standard paged layout [num_blocks, block_size, L + R];
    # a backend with its own cache update may store something else.
    update = type(impl).do_kv_cache_update
    if update not in (MLAAttentionImpl.do_kv_cache_update, _cpu_mla_kv_cache_update()):
        return f"attention backend {attn.attn_backend.get_name()} has its own KV-cache layout"
    hf_config = vllm_config.model_config.hf_text_config if vllm_config.model_config else None
    if getattr(hf_config, "llama_4_scaling", None):
        # vLLM scales q after RoPE; the fused op rotates inside the attention step.
        return "llama_4_scaling"
    return None


def decode_reason(attn: MLAAttention, vllm_config: VllmConfig) -> str | None:
    """Why the decode query assembly stays vLLM's (fused op 1 over the whole batch), or None."""
    if not env_enabled(ENV_DECODE):
        return f"{ENV_DECODE}=0"
    pass_config = vllm_config.compilation_config.pass_config
    if getattr(pass_config, "fuse_attn_quant", False):
        # That pass pattern-matches vLLM's attention op, which decode mode replaces.
        return "attention + output-quant fusion (fuse_attn_quant) is on"
    if attn.q_pad_num_heads is not None:
        return "the attention backend pads query heads"
    if attn.is_aiter_triton_fp4_bmm_enabled or attn.is_aiter_triton_fp8_bmm_enabled or attn.is_amx_bmm_enabled:
        return "the W_UK absorption is a quantized/packed BMM"
    if not callable(getattr(attn.impl, "forward_mqa", None)):
        return "the attention backend has no forward_mqa"
    if not isinstance(getattr(attn, "_decode_concat_quant_fp8_op", None), torch.nn.Module):
        return "MLAAttention has no decode concat-quant module"
    return None


def graph_rope_reason(vllm_config: VllmConfig) -> str | None:
    """Why a decode-mode layer keeps its RoPE + cache write in the attention op in piecewise-graph
    steps too, or None: then those steps run op 1 inside the compiled graph, captured with it.

    Piecewise CUDA graphs replay everything between their splitting ops and run those eagerly:
    vLLM 0.33's RoPE sits inside the graph, its cache write (``unified_mla_kv_cache_update``, a
    splitting op by default) and the decode mode's fused op outside, costing host time every such
    step. Inside the graph the fused op costs none there, but the op standing in the graph costs
    a dispatch in every step that runs without graphs. Opt-in until that trade is measured on a
    GPU (``VLLM_MLA_FUSION_GRAPH_ROPE=1``); useless without piecewise graphs.
    """
    if not env_opted_in(ENV_GRAPH_ROPE):
        return f"{ENV_GRAPH_ROPE} is not set"
    mode = vllm_config.compilation_config.cudagraph_mode
    if mode is None or not mode.has_piecewise_cudagraphs():
        return f"CUDA-graph mode {mode} replays no piecewise graphs"
    return None


# Backends whose forward_mqa consumes the (ql_nope, q_pe) pair as it is (FlashAttention's
# q_v / CUTLASS's q_nope, q_pe arguments); the others concatenate a pair first. Matched by
# name along the class's MRO: importing those modules would initialise CUDA.
_DECODE_PAIR_BACKENDS = frozenset({
    ("vllm.v1.attention.backends.mla.flashattn_mla", "FlashAttnMLAImpl"),
    ("vllm.v1.attention.backends.mla.cutlass_mla", "CutlassMLAImpl"),
})  # fmt: skip


def _takes_decode_pair(impl: MLAAttentionImpl) -> bool:
    return any((c.__module__, c.__qualname__) in _DECODE_PAIR_BACKENDS for c in type(impl).__mro__)


def decode_pair_reason(impl: MLAAttentionImpl, fp8_query: bool) -> str | None:
    """Why a decode-mode layer's decode rows get op 1 (the pair passes on) rather than op 2, or None.

    Op 2 writes ``[ql_nope | rope(q_pe)]``: it saves a concatenation the backend would
    do, at the price of copying ``ql_nope``. A backend that takes the pair as it is has
    no concatenation to save: op 1 rotates ``q_pe`` in place and writes the cache rows,
    moving a fraction of the bytes. An fp8 query is always assembled (vLLM quantizes
    the concatenation).
    """
    if fp8_query:
        return None
    if _takes_decode_pair(impl):
        return f"{type(impl).__name__}.forward_mqa takes (ql_nope, q_pe) without concatenating"
    return None


@functools.cache
def _aiter_mla_impl() -> type | None:
    # Cached: asked per layer, and a failing import would be retried each time.
    try:
        from vllm.v1.attention.backends.mla.rocm_aiter_mla import AiterMLAImpl
    except ImportError:
        return None
    return AiterMLAImpl


def prefill_key_reason(impl: MLAAttentionImpl) -> str | None:
    """Why a decode-mode layer's prefill rows keep op 1 + vLLM's key concat, or None.

    The fused prefill op replaces the first ``_concat_k_nope_k_pe`` call of
    ``forward_mha``, which must come before anything reads ``q``. That holds for
    the forward_mha this was written against: MLACommonBaseImpl's (every dense
    backend but these two) and ROCM_AITER_MLA's, whose FP8-prefill branch is
    checked per step (prefill_key_step_rule). AMX_MLA and any other backend
    with a forward_mha of its own build the key their own way.
    """
    if not env_opted_in(ENV_PREFILL_KEY):
        # Opt-in: in the serving configuration where the plugin measured slower (docs/performance.md,
        # "Issue 40's configuration"), the server without op 3 read at parity, for a cause not yet known.
        return f"{ENV_PREFILL_KEY} is not set to 1 (the fused prefill key is opt-in)"
    cls = type(impl)
    known = [MLACommonBaseImpl.forward_mha] + ([aiter.forward_mha] if (aiter := _aiter_mla_impl()) else [])
    if getattr(cls, "forward_mha", None) not in known:
        return f"{cls.__name__} has its own forward_mha"
    if getattr(cls, "_concat_k_nope_k_pe", None) is not MLACommonBaseImpl._concat_k_nope_k_pe:
        return f"{cls.__name__} has its own _concat_k_nope_k_pe"
    return None


def prefill_key_step_rule(impl: MLAAttentionImpl) -> Callable[[object], str | None]:
    """The per-step rule for a layer whose prefill key is fused (``prefill_key_reason`` None).

    Returns ``rule(attn_metadata)``: why this step's prefill rows keep op 1 + vLLM's concat,
    or None (the fused prefill op), decided from the step's metadata as forward_mha decides its
    path. What depends only on the layer (the impl's class and its FP8 prefill switches, fixed
    when vLLM builds it) is decided here, once: a step only reads its own metadata.
    """
    fp8_dtype = current_platform.fp8_dtype()
    aiter = _aiter_mla_impl()
    # AiterMLAImpl.forward_mha: with its FP8 prefill path on and no chunked context,
    # fused_mla_prefill_qkv_fp8 reads q and builds the key itself.
    aiter_fused_fp8 = (
        aiter is not None and isinstance(impl, aiter)
        and getattr(impl, "_fp8_prefill_enabled", False) and getattr(impl, "_fused_prefill_qkv", False)
    )  # fmt: skip

    def rule(attn_metadata) -> str | None:
        prefill = getattr(attn_metadata, "prefill", None)
        if prefill is None:
            return "the step has no prefill metadata"
        if prefill.q_data_type == fp8_dtype:
            # forward_mha casts q to fp8 before it builds the key: q must already be rotated.
            return "fp8 prefill attention reads q before the key is built"
        if (
            aiter_fused_fp8
            and getattr(attn_metadata, "fp8_prefill_qo_indptr", None) is not None
            and prefill.chunked_context is None
        ):
            return "ROCM_AITER_MLA's fused FP8 prefill (fused_mla_prefill_qkv_fp8) builds q and the key"
        return None

    return rule


def load_backend(device: torch.device, decode: bool) -> str:
    """Name of the backend the ops will use on ``device``, its module imported.

    Raises (RuntimeError, ValueError, ImportError) when the requested or
    automatic backend cannot run there: the caller falls back with a warning,
    since a backend named in VLLM_MLA_FUSION_BACKEND that cannot run is a
    configuration error the user should see.
    """
    name = dispatch.resolve(None, device, decode=decode)
    dispatch.load(name)
    return name
