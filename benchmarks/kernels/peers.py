"""Optional peer implementations, imported lazily; a missing one is reported, never faked.

- ``aiter_triton``: AITER's Triton op ``fused_qk_rope_cat_and_cache_mla`` from
  the unpacked amd-aiter wheel (``scripts/fetch_aiter_triton.sh``; loaded by
  ``aiter_triton_peer.py``). Decode (op 2) semantics with a bf16 cache only: on
  NVIDIA its fp8 path asserts the ROCm e4m3 flavour, and it has no query scale.
- ``vllm_fused``: vLLM's CUDA ``concat_and_cache_mla_rope_fused`` (op 1), plus the
  query concat for op 2. Needs vLLM's compiled extension.
- ``vllm_k3``: vLLM's Kimi-K3 prefill epilogue ``fused_kimi_k3_mla_key_concat_kv_cache_insert``
  (RoPE of q in place, the full key, the cache row; op 3 semantics but for the
  k_pe write-back). Needs vLLM's compiled extension (0.33 ships it).
- ``flashinfer``: FlashInfer's ``rope_quantize_fp8_append_paged_kv_cache`` (op 2
  with an fp8 query and fp8 cache only). JIT-compiled by FlashInfer on first use.

Each ``load_*`` returns ``(handle, None)`` or ``(None, reason)``; each is tried
once per process.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect

import torch


@functools.lru_cache(maxsize=None)
def load_aiter_triton():
    """AITER's Triton ``fused_qk_rope_cat_and_cache_mla`` (through ``aiter_triton_peer``), or why not.

    The loader (benchmarks/kernels/aiter_triton_peer.py) finds the files that
    scripts/fetch_aiter_triton.sh unpacks (``VLLM_MLA_FUSION_AITER_TRITON_PATH``,
    default ``<repo>/third_party_aiter``).
    """
    if not torch.cuda.is_available():
        return None, "needs a GPU"
    from . import aiter_triton_peer  # noqa: PLC0415

    op = aiter_triton_peer.load()
    if op is None:
        return None, aiter_triton_peer.unavailable_reason()
    return op, None


def aiter_decode_call(fn, v, is_neox: bool):
    """A call of AITER's op with op 2's semantics on the benchmark's views ``v`` (bf16 cache).

    The same arguments as ``aiter_triton_peer.mla_decode`` (float32 cos/sin
    halves as strided views, cache viewed ``[-1, 1, L+R]``, no scaling for a
    bf16 cache), but every output the signature accepts is preallocated here,
    so that the call allocates as little as its wrapper allows (it runs inside
    CUDA graphs).
    """
    params = inspect.signature(fn).parameters
    T, H, R = v.q_pe.shape
    k_pe3 = v.k_pe.unsqueeze(1)  # [T, 1, R]
    kv_c3 = v.kv_c.unsqueeze(1)  # [T, 1, L]
    cache = v.kv_cache.view(-1, 1, v.kv_cache.shape[-1])  # page-size-1 view: row = slot
    half = R // 2
    cos, sin = v.cos_sin_cache[:, :half], v.cos_sin_cache[:, half:]
    kwargs = {}
    if "apply_scale" in params:
        kwargs["apply_scale"] = False  # bf16 cache: no scaling
    if "q_out" in params:
        kwargs["q_out"] = v.q_out
    if "decode_q_pe_out" in params:
        kwargs["decode_q_pe_out"] = torch.empty((0, H, R), dtype=v.q_pe.dtype, device=v.q_pe.device)
    if "k_pe_out" in params:
        kwargs["k_pe_out"] = torch.empty((T, 1, R), dtype=v.k_pe.dtype, device=v.k_pe.device)
    scale = torch.ones(1, dtype=torch.float32, device=v.q_pe.device)
    q_out_given = "q_out" in kwargs

    def call():
        res = fn(v.ql_nope, v.q_pe, kv_c3, k_pe3, cache, v.slot_mapping, v.positions, cos, sin, scale, is_neox,
                 **kwargs)  # fmt: skip
        if not q_out_given:  # an old signature without q_out: copy its result (counted in its time)
            v.q_out.copy_(res[0])

    return call


@functools.lru_cache(maxsize=None)
def load_vllm():
    """vLLM's ``_custom_ops`` module with the fused kernel, or the reason it is unavailable."""
    if importlib.util.find_spec("vllm") is None:
        return None, "vllm is not installed"
    try:
        from vllm import _custom_ops as ops  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001
        return None, f"import vllm._custom_ops failed: {type(e).__name__}: {e}"
    if not hasattr(ops, "concat_and_cache_mla_rope_fused"):
        return None, "vllm._custom_ops has no concat_and_cache_mla_rope_fused"
    return ops, None


def vllm_prefill_call(ops, v, is_neox: bool, kv_cache_dtype: str, cos_sin_act: torch.Tensor):
    """vLLM's fused op 1. Recent vLLM requires cos/sin in the activation dtype: ``cos_sin_act``."""
    scale = v.kv_cache_scale if v.kv_cache_scale is not None else torch.ones(1, device=v.q_pe.device)

    def call():
        ops.concat_and_cache_mla_rope_fused(v.positions, v.q_pe, v.k_pe, v.kv_c, cos_sin_act, is_neox,
                                            v.slot_mapping, v.kv_cache, kv_cache_dtype, scale)  # fmt: skip

    return call


def vllm_decode_call(ops, v, is_neox: bool, kv_cache_dtype: str, cos_sin_act: torch.Tensor, concat_fp8):
    """vLLM's fused op 1 then the query assembly: ``concat_mla_q`` (bf16) or ``concat_fp8`` (fp8 query)."""
    fused = vllm_prefill_call(ops, v, is_neox, kv_cache_dtype, cos_sin_act)
    use_vllm_concat = v.q_out.dtype == v.q_pe.dtype and hasattr(ops, "concat_mla_q")

    def call():
        fused()
        if use_vllm_concat:
            ops.concat_mla_q(v.ql_nope, v.q_pe, v.q_out)
        else:
            concat_fp8(v.ql_nope, v.q_pe, v.q_out, v.q_scale)

    return call


@functools.lru_cache(maxsize=None)
def load_vllm_k3():
    """vLLM's K3 epilogue op (``torch.ops._C.fused_kimi_k3_mla_key_concat_kv_cache_insert``), or why not."""
    ops, reason = load_vllm()
    if ops is None:
        return None, reason
    fn = getattr(torch.ops._C, "fused_kimi_k3_mla_key_concat_kv_cache_insert", None)
    if fn is None:
        return None, "torch.ops._C has no fused_kimi_k3_mla_key_concat_kv_cache_insert"
    return fn, None


def vllm_k3_epilogue_call(fn, v, nope: int, cos_sin_cache: torch.Tensor):
    """K3's epilogue on the benchmark's views: q is the full [T, H, P + R] tensor whose rope
    part is rotated in place; the key goes into the preallocated ``k_out``; bf16 cache;
    ``cos_sin_cache`` fp32 (K3 refuses any other)."""
    q = v.q_pe.as_strided((*v.q_pe.shape[:2], nope + v.q_pe.shape[-1]), v.q_pe.stride(),
                          v.q_pe.storage_offset() - nope)  # fmt: skip
    bs = v.kv_cache.shape[1]

    def call():
        fn(q, v.k_nope, v.k_pe, v.kv_c, v.k_out, v.kv_cache, v.slot_mapping, bs, v.positions, cos_sin_cache)

    return call


K3_DECODE_OPS = ("fused_kimi_k3_mla_decode_q_concat_kv_cache_insert",  # bf16 query and cache
                 "fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert")  # e4m3fn query and cache


def load_vllm_k3_decode():
    """vLLM's K3 decode ops (``K3_DECODE_OPS``: the query ``[ql_nope | rope(q_pe)]`` and the cache
    rows in one launch, op 2's work), as ``(bf16 op, fp8 op)``, or why not."""
    ops, reason = load_vllm()
    if ops is None:
        return None, reason
    fns = tuple(getattr(torch.ops._C, name, None) for name in K3_DECODE_OPS)
    missing = [name for name, fn in zip(K3_DECODE_OPS, fns) if fn is None]
    if missing:
        return None, f"torch.ops._C has no {', '.join(missing)}"
    return fns, None


def vllm_k3_decode_call(fns, v, cos_sin_cache: torch.Tensor):
    """K3's decode op on the benchmark's views, as vLLM's Kimi-K3 MLA layer calls it
    (``models/kimi_k3/nvidia/ops/fused_mla_key_concat_kv_cache.py``): ``q_out`` written
    ``[ql_nope | rope(q_pe)]``, the cache rows inserted. A bf16 query with a bf16 cache, or an
    e4m3fn query with an e4m3fn cache (the views' ``q_out`` and ``typed_cache``), each multiplied by its
    scale's reciprocal (K3 takes ``1 / scale`` as a [1] float32 tensor, made here once, outside the timed
    call); fp32 cos/sin."""
    bf16_op, fp8_op = fns
    T = v.q_pe.shape[0]
    k_pe = v.k_pe.reshape(T, -1)
    block_size = v.kv_cache.shape[1]
    if v.q_scale is None:
        def call():
            bf16_op(v.ql_nope, v.q_pe, v.kv_c, k_pe, v.q_out, v.kv_cache, v.slot_mapping, block_size, v.positions,
                    cos_sin_cache)  # fmt: skip

        return call
    q_scale_inv = v.q_scale.reciprocal().reshape(1)
    cache_scale_inv = v.kv_cache_scale.reciprocal().reshape(1)

    def call():
        fp8_op(v.ql_nope, v.q_pe, v.kv_c, k_pe, v.q_out, v.typed_cache, v.slot_mapping, q_scale_inv, cache_scale_inv,
               block_size, v.positions, cos_sin_cache)  # fmt: skip

    return call


@functools.lru_cache(maxsize=None)
def load_flashinfer():
    if importlib.util.find_spec("flashinfer") is None:
        return None, "flashinfer is not installed"
    try:
        from flashinfer import rope  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001
        return None, f"import flashinfer.rope failed: {type(e).__name__}: {e}"
    fn = getattr(rope, "rope_quantize_fp8_append_paged_kv_cache", None)
    if fn is None:
        return None, "flashinfer.rope has no rope_quantize_fp8_append_paged_kv_cache"
    return fn, None


def flashinfer_decode_call(fn, v, is_neox: bool, fp8_dtype: torch.dtype):
    """FlashInfer's one-launch fp8 op: q written as [ql_nope | rope(q_pe)] into ``q_out``'s two halves.

    FlashInfer multiplies by host-float scales (baked into the graph): 1/scale.
    Its paged-append index tensors are derived from the slots here, outside the
    timed region (a real integration would build them once per step).
    """
    T, H, R = v.q_pe.shape
    L = v.kv_c.shape[-1]
    bs = v.kv_cache.shape[1]
    cache = v.kv_cache.view(fp8_dtype) if v.kv_cache.dtype == torch.uint8 else v.kv_cache
    ckv, kpe = cache[..., :L], cache[..., L:]
    slots = v.slot_mapping[:T].long()
    kv_indices = (slots // bs).to(torch.int32)
    page_pos = (slots % bs).to(torch.int32)
    indptr = torch.arange(T + 1, device=slots.device, dtype=torch.int32)
    batch_indices = torch.arange(T, device=slots.device, dtype=torch.int32)
    qs = 1.0 / float(v.q_scale) if v.q_scale is not None else 1.0
    ks = 1.0 / float(v.kv_cache_scale) if v.kv_cache_scale is not None else 1.0

    def call():
        fn(v.q_pe, v.k_pe, v.ql_nope, v.kv_c, None, v.cos_sin_cache, v.positions, (ckv, kpe), kv_indices, indptr,
           batch_indices, page_pos, is_neox=is_neox, quantize_dtype=fp8_dtype, quant_scale_q=qs,
           quant_scale_kv=ks, page_size=bs, kv_layout="NHD", q_rope_out=v.q_out[..., L:],
           q_nope_out=v.q_out[..., :L])  # fmt: skip

    return call
