"""A sync-free plain-torch version of both ops, for ``torch.compile`` and CUDA graphs.

The package's torch backend (the semantic reference) selects non-padding
tokens with a boolean mask, which synchronizes with the GPU, so it can be
neither captured in a CUDA graph nor compiled without a graph break. This
variant computes the same values without a sync: every token's cache row is
written with ``index_copy_`` into the cache seen as flat rows, and padding
tokens (slot < 0) are sent to a scratch row, the last row of the flat view,
which the benchmark allocates past the cache's real blocks (so it requires a
cache whose blocks are contiguous rows, as the benchmark's are). fp8 rows
are quantized, then written as their uint8 bit patterns (index_copy_ has no
fp8 kernels).

It is the benchmark's own code, not a vLLM path: labelled as such in the output.
"""

from __future__ import annotations

import torch

# The math is the package reference's (rotation, position clamping, fp8 rounding); only the
# write differs, so that nothing synchronizes.
from vllm_mla_fusion.backends.reference import cos_sin, rotate
from vllm_mla_fusion.fp8 import is_fp8, round_for_store


def _rotate_and_write_rows(positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, flat_cache,
                           store_dtype, scale) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Both ops' shared part: float32 ``(q_rot, k_rot)``, and every token's cache row written."""
    T = q_pe.shape[0]
    cos, sin = cos_sin(positions, cos_sin_cache, T)
    q_rot = rotate(q_pe.float(), cos[:, None], sin[:, None], is_neox)
    k_rot = rotate(k_pe.float(), cos, sin, is_neox)
    slots = slot_mapping[:T].long()
    slots = torch.where(slots >= 0, slots, flat_cache.shape[0] - 1)  # padding -> scratch row
    rows = round_for_store(torch.cat((kv_c.float(), k_rot), dim=-1), store_dtype, scale)
    if is_fp8(store_dtype):
        rows = rows.view(torch.uint8)  # flat_cache is the uint8 storage
    flat_cache.index_copy_(0, slots, rows)
    return q_rot, k_rot


def rope_cache_write(positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox: bool, slot_mapping, flat_cache,
                     store_dtype: torch.dtype, kv_cache_scale=None) -> None:  # fmt: skip
    """Op 1: rotate ``q_pe``/``k_pe`` in place; ``flat_cache`` [rows + scratch, L+R] (uint8 storage for fp8)."""
    q_rot, k_rot = _rotate_and_write_rows(positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping,
                                          flat_cache, store_dtype, kv_cache_scale)  # fmt: skip
    q_pe.copy_(q_rot.to(q_pe.dtype))
    k_pe.copy_(k_rot.to(k_pe.dtype))


def decode_rope_cache_write(positions, ql_nope, q_pe, k_pe, kv_c, cos_sin_cache, is_neox: bool, slot_mapping,
                            flat_cache, store_dtype: torch.dtype, q_out, kv_cache_scale=None,
                            q_scale=None) -> None:  # fmt: skip
    """Op 2 (nope first): ``q_out = [ql_nope | rope(q_pe)]`` and the cache write; q_pe/k_pe untouched."""
    q_rot, _ = _rotate_and_write_rows(positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping,
                                      flat_cache, store_dtype, kv_cache_scale)  # fmt: skip
    q_out.copy_(round_for_store(torch.cat((ql_nope.float(), q_rot), dim=-1), q_out.dtype, q_scale))


_compiled: dict = {}


def compiled(op: str, enabled: bool = True):
    """The op compiled once per process (``dynamic=True``: T, H and strides stay symbolic)."""
    fn = rope_cache_write if op == "prefill" else decode_rope_cache_write
    if not enabled:
        return fn
    if op not in _compiled:
        import torch._dynamo.config as dynamo_config
        import torch.fx.experimental._config as fx_config

        # One graph per (op, dtypes, T == 1). Duck sizing would add guards on sizes
        # that happen to be equal (H == T, L == an offset) and recompile when they
        # stop being equal; keep Dynamo from falling back to eager silently too.
        if hasattr(fx_config, "use_duck_shape"):
            fx_config.use_duck_shape = False
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(64, getattr(dynamo_config, name)))
        _compiled[op] = torch.compile(fn, dynamic=True, fullgraph=True)
    return _compiled[op]
