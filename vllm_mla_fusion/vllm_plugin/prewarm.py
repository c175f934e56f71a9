"""Compile the Triton kernel's variants during vLLM's profile run, before any request.

The kernel's tile sizes depend on the step's token count (small steps spread
over more programs), and each tile size is a compiled variant. vLLM's warm-up
runs decode batches of the CUDA-graph capture sizes and one profile run at
``max_num_batched_tokens``, so prefills of other sizes would otherwise compile
(or load from Triton's disk cache) on the first request that has them: a
latency spike of milliseconds to a second inside a user's request.

The profile run is the place to do it: it is the one forward that runs once
per process before serving, with the layer's real tensors, so the variants
compiled here are specialized exactly as the real calls will be (strides,
alignment, dtypes). Each variant is compiled by a one-token call with its
launch configuration forced, on scratch outputs and all-padding slots: no
cache row is written, no input is modified, and the extra memory is a few
rows (the profile run measures peak memory). The scratch cache has the
block size vLLM has settled by the profile run (a constexpr of the kernel:
one variant per block size) and the calls go through the bound ops the layer's
steps call (their early-index-loads promise, another constexpr, included). Both
modes compile here: a decode-mode layer from its attention op, a
rope_cache-mode layer from ``rope_kv_cache_update``
(``custom_ops.prewarm_in_profile_run``).
"""

from __future__ import annotations

import torch

from .. import fp8
from ..opcodes import OP_DECODE, OP_PREFILL, OP_ROPE_CACHE
from ..validation import Problem

# (layer signature) -> the most tokens its variants were compiled for: once per process for each
# distinct set of shapes and dtypes, again only for a forward of more tokens (a dummy run that
# came before the profile run compiles less than the steps need).
_DONE: dict[tuple, int] = {}


def _like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A zeroed one-token tensor with ``t``'s strides (so the same kernel specialization)."""
    return torch.empty_strided((1, *t.shape[1:]), t.stride(), dtype=dtype or t.dtype, device=t.device).zero_()


def layer_ops(attn) -> tuple[int, ...]:
    """The ops a fused layer can launch: op 1 always (the profile run, prefill rows whose key vLLM
    builds, decode rows on backends that take the pair, every step of a rope_cache-mode layer),
    op 2 where it assembles the decode query, op 3 where it builds the prefill key. A
    rope_cache-mode layer (vLLM's MLAAttention with the plugin's bound ops) has neither flag."""
    return ((OP_ROPE_CACHE,) + ((OP_DECODE,) if getattr(attn, "_decode_assembles_query", False) else ())
            + ((OP_PREFILL,) if getattr(attn, "_prefill_key_fused", False) else ()))  # fmt: skip


def kernels(attn, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
            cos_sin_cache: torch.Tensor, is_neox: bool, block_size: int, max_tokens: int) -> int:  # fmt: skip
    """Compile every launch configuration the layer's ops use for 1 to ``max_tokens`` tokens.

    ``attn`` is a FusedMLAAttention, or a rope_cache-mode layer; the other tensors are the
    profile run's. Returns the number of variants launched (0 when already done). A layer whose
    ops resolve to the torch backend never comes here (``_prewarm_cache_config`` is None); the
    launch configurations are the Triton kernel's, which AITER's ops hand what they do not compute.
    """
    from ..backends import triton as triton_backend  # an optional dependency: imported only to compile

    H, L, R, P = attn.num_heads, attn.kv_lora_rank, attn.qk_rope_head_dim, attn.qk_nope_head_dim
    act = q.dtype
    kvd = attn.kv_cache_dtype
    storage = torch.uint8 if kvd.startswith("fp8") else (fp8.float_dtype_of_name(kvd) or act)
    ops = layer_ops(attn)
    decode_query_dtype = getattr(attn, "_decode_query_dtype", None)  # fp8 where the backend takes an fp8 query
    q_dtype = decode_query_dtype or act
    key = (H, L, R, P, attn.v_head_dim, act, kvd, q_dtype, block_size, is_neox, cos_sin_cache.dtype, q.stride(),
           k_pe.stride(), kv_c_normed.stride(), ops, q.device)  # fmt: skip
    if _DONE.get(key, 0) >= max_tokens:
        return 0
    _DONE[key] = max_tokens
    device = q.device
    q1 = _like(q)
    q_pe, k_pe1, kv_c = q1[..., P:], _like(k_pe), _like(kv_c_normed)
    pos = positions[:1]
    slots = torch.full((1,), -1, dtype=torch.int64, device=device)  # padding: nothing is written
    cache = torch.zeros((1, block_size, L + R), dtype=storage, device=device)  # the kernel's BLOCK_SIZE
    k_scale = attn._k_scale
    q_scale = attn._q_scale if decode_query_dtype is not None else None
    ql_nope = torch.zeros((1, H, L), dtype=act, device=device)  # forward_impl's token-major bmm output
    q_out = torch.empty((1, H, L + R), dtype=q_dtype, device=device)
    kv_nope = torch.zeros((1, H, P + attn.v_head_dim), dtype=act, device=device)  # kv_b_proj's output view
    k_out = torch.empty((1, H, P + R), dtype=act, device=device)
    cache_dtype = fp8.cache_store_dtype(cache, kvd)
    common = (pos, q_pe, k_pe1, kv_c, cos_sin_cache, slots, cache, k_scale)
    calls = {OP_ROPE_CACHE: common}
    if OP_DECODE in ops:
        calls[OP_DECODE] = (*common, ql_nope, q_out, q_scale)
    if OP_PREFILL in ops:
        calls[OP_PREFILL] = (*common, kv_nope[..., :P], k_out, None)
    launched = 0
    for op, args in calls.items():
        p = Problem(1, H, L, R, cache_dtype, nope_dim=P)
        bound = attn._bound_ops.get(op, kvd, is_neox)  # the ops the layer's steps call
        for cfg in triton_backend.launch_configs(p, op, device, max_tokens):
            with triton_backend.forced_launch_config(cfg):
                bound(*args)
            launched += 1
    return launched
