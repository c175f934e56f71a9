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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    half = x.shape[-1] // 2
    if is_neox:
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def _quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None, fp8_max: float) -> torch.Tensor:
    if fp8_max:
        if scale is not None:
            x = x / scale
        return x.clamp(-fp8_max, fp8_max).to(dtype)
    return x.to(dtype)


def _cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor, T: int):
    pos = positions[:T].long().clamp(0, cos_sin_cache.shape[0] - 1)
    cs = cos_sin_cache.index_select(0, pos).float()
    half = cs.shape[-1] // 2
    return cs[:, :half], cs[:, half:]


def _write_rows(rows: torch.Tensor, slot_mapping: torch.Tensor, flat_cache: torch.Tensor, store_dtype: torch.dtype,
                scale: torch.Tensor | None, fp8_max: float) -> None:  # fmt: skip
    T = rows.shape[0]
    slots = slot_mapping[:T].long()
    slots = torch.where(slots >= 0, slots, flat_cache.shape[0] - 1)  # padding -> scratch row
    q = _quantize(rows, store_dtype, scale, fp8_max)
    if fp8_max:
        q = q.view(torch.uint8)  # flat_cache is the uint8 storage
    flat_cache.index_copy_(0, slots, q)


def rope_cache_write(positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox: bool, slot_mapping, flat_cache,
                     store_dtype: torch.dtype, kv_cache_scale=None, fp8_max: float = 0.0) -> None:  # fmt: skip
    """Op 1: rotate ``q_pe``/``k_pe`` in place; ``flat_cache`` [rows + scratch, L+R] (uint8 storage for fp8)."""
    T = q_pe.shape[0]
    cos, sin = _cos_sin(positions, cos_sin_cache, T)
    q_rot = _rotate(q_pe.float(), cos[:, None], sin[:, None], is_neox)
    k_rot = _rotate(k_pe.float(), cos, sin, is_neox)
    _write_rows(torch.cat((kv_c.float(), k_rot), dim=-1), slot_mapping, flat_cache, store_dtype, kv_cache_scale,
                fp8_max)  # fmt: skip
    q_pe.copy_(q_rot.to(q_pe.dtype))
    k_pe.copy_(k_rot.to(k_pe.dtype))


def decode_rope_cache_write(positions, ql_nope, q_pe, k_pe, kv_c, cos_sin_cache, is_neox: bool, slot_mapping,
                            flat_cache, store_dtype: torch.dtype, q_out, kv_cache_scale=None, q_scale=None,
                            fp8_max: float = 0.0, q_fp8_max: float = 0.0) -> None:  # fmt: skip
    """Op 2 (nope first): ``q_out = [ql_nope | rope(q_pe)]`` and the cache write; q_pe/k_pe untouched."""
    T = q_pe.shape[0]
    cos, sin = _cos_sin(positions, cos_sin_cache, T)
    q_rot = _rotate(q_pe.float(), cos[:, None], sin[:, None], is_neox)
    k_rot = _rotate(k_pe.float(), cos, sin, is_neox)
    _write_rows(torch.cat((kv_c.float(), k_rot), dim=-1), slot_mapping, flat_cache, store_dtype, kv_cache_scale,
                fp8_max)  # fmt: skip
    q_out.copy_(_quantize(torch.cat((ql_nope.float(), q_rot), dim=-1), q_out.dtype, q_scale, q_fp8_max))


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
