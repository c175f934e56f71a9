"""The plugin's vLLM-side custom ops (namespace ``mla_fusion_vllm``).

Like vLLM's ``unified_mla_kv_cache_update`` and
``unified_mla_attention_with_output``, each op takes the layer's name and
resolves the layer's KV cache, slot mapping and attention metadata from
vLLM's forward context when it runs. That lookup cannot be traced, so it
lives inside an opaque op: torch.compile records one node, CUDA graphs
capture what the op launches.

- ``rope_kv_cache_update`` (traced into the compiled graph, needs no
  attention metadata): ``mla_fusion::mla_rope_cache_write`` over the whole
  padded batch. Replaces the wrapper's RoPE and vLLM's
  ``unified_mla_kv_cache_update``; vLLM's attention op follows unchanged.
  In a forward without attention metadata (the profile run) it first compiles
  the layer's variants ahead (``prewarm_in_profile_run``).
- ``mla_attention_with_output`` (a splitting op, like vLLM's attention op):
  RoPE + cache write for prefill tokens, then vLLM's ``forward_impl`` whose
  decode query assembly runs ``mla_fusion::mla_decode_rope_cache_write``
  (attention.py). Takes ``positions``, which vLLM's attention op has no
  argument for.
- ``piecewise_rope_kv_cache_update`` (traced into the compiled graph, before
  the attention op of a decode-mode layer whose RoPE moves into the graph:
  eligibility.graph_rope_reason): in a forward that captures or replays
  piecewise CUDA graphs, ``rope_kv_cache_update``'s work, captured with the
  graph piece; in any other forward nothing (the attention op then does it).
"""

# No `from __future__ import annotations`: infer_schema reads the annotations as types.
import inspect

import torch
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.forward_context import in_piecewise_cudagraph
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
from vllm.platforms import current_platform
from vllm.utils.torch_utils import LayerNameType, _resolve_layer_name, direct_register_custom_op
from vllm.v1.worker.utils import select_common_block_size

from .. import validation
from ..binding import shared_ops
from ..opcodes import OP_ROPE_CACHE
from . import prewarm
from .settings import ENV_PREWARM, env_enabled

NAMESPACE = "mla_fusion_vllm"
ATTENTION_OP = f"{NAMESPACE}::mla_attention_with_output"
# The op's lifetime is the library object's: keep it for the process.
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")

# The promise a fused layer's ops make when they are bound (binding.py, ``early_index_loads``): no
# kernel that can still be running when one of our launches starts writes its positions, slot
# mapping, rope table or fp8 scales, so that the Triton kernel may read them before its
# grid-dependency wait (sm_90, PDL). The scales (the layer's _k_scale and _q_scale) are set when
# the weights load, or computed once by torch kernels launched without PDL, which end before ours
# starts. In vLLM 0.33 the positions and the slot mapping are written by the step's input
# preparation (host-to-device copies, the block table's slot-mapping kernel), before the model's
# first layer: between them and our launch run at least the embedding (a torch kernel, launched
# without PDL: it starts only once everything before it has finished), the norms and the q/kv
# projections; the rope table is written once, when the model is built. The one exception is
# this plugin's own scratch slots (write_target), filled just before a profile-run launch: the
# only cache a stale read of them could address is the one-row scratch cache, which nothing
# reads. A plugin change that writes any of these tensors just before a launch of ours must
# bind that launch without the promise.
EARLY_INDEX_LOADS = True


def write_target(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor | None,
    kv_cache_dtype: str,
    num_tokens: int,
    row_width: int,
    like: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """The (cache, slots, cache dtype) a fused call writes through.

    vLLM writes nothing when the layer has no slot mapping or no cache yet
    (profile runs); RoPE must still happen, so such calls get a one-row
    scratch cache and all-padding slots instead.
    """
    if slot_mapping is not None and kv_cache.numel() > 0:
        return kv_cache, slot_mapping, kv_cache_dtype
    # The slots are filled here, possibly by the kernel launched just before ours, which may read
    # them early (EARLY_INDEX_LOADS): any value read addresses the one-row scratch or nothing.
    scratch = torch.empty((1, 1, row_width), dtype=like.dtype, device=like.device)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=like.device)
    return scratch, slots, "auto"


def bind_layer_ops(attn: torch.nn.Module, backend: str, cache_config) -> None:
    """Give a fused layer its ops, in either mode (``_bound_ops``: a rope_cache-mode layer, vLLM's
    own MLAAttention, uses them through ``rope_kv_cache_update``; a decode-mode layer from its
    attention op too): backend and debug mode fixed when the layer is built, layouts validated
    once for all the layers (binding.shared_ops); early index loads as EARLY_INDEX_LOADS says.
    ``cache_config`` is vLLM's, whose block size the profile run reads to compile the variants
    ahead (``_prewarm_cache_config``; None for the torch backend, which compiles nothing, or with
    VLLM_MLA_FUSION_PREWARM=0)."""
    attn._bound_ops = shared_ops(backend, validation.debug_enabled(), EARLY_INDEX_LOADS)
    attn._prewarm_cache_config = cache_config if backend != "torch" and env_enabled(ENV_PREWARM) else None


def prewarm_in_profile_run(layer, q, kv_c_normed, k_pe, positions, cos_sin_cache, is_neox) -> None:
    """In a forward without attention metadata (vLLM's profile and dummy runs), compile the
    variants of every op the layer can launch (prewarm.py), for the block size of the cache its
    steps will address; never while a CUDA graph is being captured.

    That block size is vLLM's kernel block size: the cache manager's (``cache_config.block_size``,
    which vLLM settles for the backend only after the model is built, so it is read now), or the
    largest size the backend supports that divides it where the manager's is not one of them
    (``--block-size 128`` on FLASHMLA's 64), as vLLM's ``prepare_kernel_block_sizes`` picks it
    for an MLA model's one cache group."""
    config = layer._prewarm_cache_config
    if config is not None and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        block_size = select_common_block_size(config.block_size, [layer.attn_backend])
        prewarm.kernels(layer, q, kv_c_normed, k_pe, positions, cos_sin_cache, is_neox, block_size, q.shape[0])


def rope_kv_cache_update(
    positions: torch.Tensor,
    q: torch.Tensor,
    k_pe: torch.Tensor,
    kv_c_normed: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    layer_name: LayerNameType,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
) -> torch.Tensor:
    """Rotate ``q[..., -R:]`` and ``k_pe`` in place and write the layer's KV cache.

    Shapes: positions ``[T]``, q ``[T, H, P + R]``, k_pe ``[T, 1, R]``,
    kv_c_normed ``[T, L]``. Returns an empty tensor that the attention op
    takes as ``kv_cache_dummy_dep``, so that the write is ordered before it.
    """
    attn_metadata, layer, kv_cache, slot_mapping = get_attention_context(_resolve_layer_name(layer_name))
    if attn_metadata is None:
        prewarm_in_profile_run(layer, q, kv_c_normed, k_pe, positions, cos_sin_cache, is_neox)
    rope_dim = k_pe.shape[-1]
    q_pe = q[..., q.shape[-1] - rope_dim :]
    cache, slots, cache_dtype = write_target(
        kv_cache, slot_mapping, kv_cache_dtype, q.shape[0], kv_c_normed.shape[-1] + rope_dim, kv_c_normed
    )
    op1 = layer._bound_ops.get(OP_ROPE_CACHE, cache_dtype, is_neox)
    op1(positions, q_pe, k_pe, kv_c_normed, cos_sin_cache, slots, cache, k_scale)
    return torch.empty(0, device=kv_c_normed.device, dtype=kv_c_normed.dtype)


def _rope_kv_cache_update_fake(
    positions, q, k_pe, kv_c_normed, cos_sin_cache, is_neox, layer_name, kv_cache_dtype, k_scale
) -> torch.Tensor:
    return torch.empty(0, device=kv_c_normed.device, dtype=kv_c_normed.dtype)


def piecewise_rope_kv_cache_update(*args) -> None:
    """``rope_kv_cache_update`` (same arguments) in a piecewise-graph forward, else nothing.

    Its launch is then captured into the graph piece before the attention op (the
    forward's q and k_pe come rotated to that op, which leaves the rest to vLLM:
    FusedMLAAttention.forward_fused); in eager and full-graph forwards the attention
    op assembles everything in one launch. Returns nothing: the attention op takes
    the q and k_pe this op mutates, which orders the two.
    """
    if in_piecewise_cudagraph():
        rope_kv_cache_update(*args)


# The schema is inferred from the signature: rope_kv_cache_update's parameters, no result.
piecewise_rope_kv_cache_update.__signature__ = inspect.signature(rope_kv_cache_update).replace(
    return_annotation=None
)


def _piecewise_rope_kv_cache_update_fake(*args) -> None:
    return None


# Outermost as in vLLM's attention op: the KV-connector hooks must run eagerly
# when a breakable CUDA graph is being captured.
@eager_break_during_capture
@maybe_transfer_kv_layer
def mla_attention_with_output(
    q: torch.Tensor,
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    output: torch.Tensor,
    layer_name: LayerNameType,
) -> None:
    """MLA attention of one layer with the fused RoPE / cache write / decode query.

    q ``[T, H, P + R]`` and k_pe ``[T, 1, R]`` arrive un-rotated; the prefill
    rows of both are rotated in place. ``output`` ``[T, H * V]`` is written.
    """
    attn_metadata, layer, kv_cache, slot_mapping = get_attention_context(_resolve_layer_name(layer_name))
    layer.forward_fused(
        q, kv_c_normed, k_pe, positions, cos_sin_cache, is_neox, kv_cache, slot_mapping, attn_metadata, output
    )


def _mla_attention_with_output_fake(
    q, kv_c_normed, k_pe, positions, cos_sin_cache, is_neox, output, layer_name
) -> None:
    return None


# (op, its Python body, the arguments it writes, its fake)
_OPS = (
    ("rope_kv_cache_update", rope_kv_cache_update, ["q", "k_pe"], _rope_kv_cache_update_fake),
    ("piecewise_rope_kv_cache_update", piecewise_rope_kv_cache_update, ["q", "k_pe"],
     _piecewise_rope_kv_cache_update_fake),
    ("mla_attention_with_output", mla_attention_with_output, ["q", "k_pe", "output"], _mla_attention_with_output_fake),
)  # fmt: skip
for _name, _body, _mutates, _fake in _OPS:
    direct_register_custom_op(op_name=_name, op_func=_body, mutates_args=_mutates, fake_impl=_fake, target_lib=_LIB,
                              dispatch_key=current_platform.dispatch_key)  # fmt: skip
