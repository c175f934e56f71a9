"""Benchmark the fused MLA RoPE + KV-cache write against its peers and the hardware floor.

One command, four sections (docs/performance-history.md explains every column):

- ``sweep``: op 1 (``prefill``: q_pe/k_pe rotated in place + cache write) and
  op 2 (``decode``: query ``[ql_nope | rope(q_pe)]`` + cache write) over
  DeepSeek-V3 shapes (L=512, R=64, H in {16, 128}, T in 1..16384, bf16 and fp8
  caches, block size 1 and 64, GPT-J rotation, fp32 cos/sin [163840, 64]).
- ``mixed``: a decode-first batch, op 2 on the decode prefix + op 1 on the rest
  (2 launches) against the unfused chain (3 launches).
- ``decode-layer`` (issue 4): one DeepSeek-V3 MLA layer's decode-step q/k
  preparation, unfused chain vs op 2, batches 1..512, microseconds per layer
  per step and the ratio.
- ``epilogue`` (issue 10): the prefill epilogue from ``kv_b_proj``'s output to
  the attention key, the rotated q and the cache rows: op 3 (one launch)
  against vLLM's chain (RoPE + cache write + key concat), our op 1 + a
  ``torch.cat`` of the key, vLLM's fused CUDA op + the concat, and vLLM's
  Kimi-K3 epilogue kernel where vLLM is importable; H 16/128, T 1..16384,
  bf16 key, plus an fp8 key with an fp8 cache.

Every implementation runs on identical inputs in the same process and is timed
as a CUDA graph of many back-to-back calls with inputs rotated across several
sets (benchmarks/kernels/timing.py). The launch floor (trivial kernel) and the copy
bandwidth are measured in the same run; floor = max(launch, bytes / bandwidth).

Usage::

    python -m benchmarks.kernels.bench_mla_rope_cache --out benchmarks/results          # full sweep (H200: ~3-4 min)
    python -m benchmarks.kernels.bench_mla_rope_cache --quick --out /tmp/bench          # subset (~1 min)
    python -m benchmarks.kernels.bench_mla_rope_cache --decode-layer --out /tmp/bench   # only the issue-4 section
    python -m benchmarks.kernels.bench_mla_rope_cache --smoke --out /tmp/smoke          # CPU, Triton interpreter, tiny shapes

(from the repository root).

Writes ``bench_mla_rope_cache.json``, ``bench_mla_rope_cache.md`` (tables for
docs/performance-history.md) and, when matplotlib is installed, ``bench_mla_rope_cache.png``
and ``bench_decode_layer.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

from .. import provenance

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"

# DeepSeek-V3 dimensions.
KV_LORA_RANK = 512  # L
ROPE_DIM = 64  # R
MAX_POSITION = 163840  # cos_sin_cache rows
QK_NOPE_HEAD_DIM = 128  # q is [T, H, 128 + 64]; q_pe = q[..., 128:]
NUM_LAYERS = 61  # MLA layers per decode step

TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
TOKENS_QUICK = (1, 16, 256, 4096)
HEADS = (16, 128)  # TP8 and TP1 heads per rank
CACHE_DTYPES = ("bf16", "fp8")
BLOCK_SIZES = (1, 64)
DECODE_BATCHES = tuple(2**i for i in range(10))  # 1 .. 512
DECODE_BATCHES_QUICK = (1, 4, 16, 64, 256)
MIXED_SPLITS = ((16, 496), (64, 1984), (256, 7936))  # (decode tokens, prefill tokens)
MIXED_SPLITS_QUICK = ((64, 1984),)
EPILOGUE_FP8_TOKENS = (1, 64, 1024, 4096, 16384)  # fp8 key + fp8 cache: a subset of T
SECTIONS = ("sweep", "mixed", "decode-layer", "epilogue")
IMPLS = ("triton", "unfused", "op1_cat", "triton_dense", "torch_ref", "torch_compile", "aiter_triton", "vllm_fused",
         "vllm_k3", "flashinfer")  # fmt: skip
PEERS = ("aiter_triton", "vllm_fused", "vllm_k3", "flashinfer")
TORCH_IMPLS = ("torch_ref", "torch_compile")  # block-size independent: measured at the largest block size only

# Non-trivial fp8 scales (stored = saturate(x / scale)); inputs are N(0, 1).
KV_CACHE_SCALE = 0.02
Q_SCALE = 0.03

LABELS = {
    "triton": "this project, backend='triton' (1 launch per op; CUDA graph)",
    "unfused": "unfused chain of separate Triton kernels (benchmarks/kernels/unfused.py): RoPE in place + "
    "concat_and_cache [+ query concat/quant] = 2 launches (prefill) / 3 (decode, mixed); CUDA graph",
    "torch_ref": "this project, backend='torch' (the reference): EAGER, CUDA events around a loop; "
    "includes host overhead and the device sync of its boolean-mask indexing",
    "torch_compile": "torch.compile(dynamic=True, fullgraph=True) of the benchmark's sync-free torch variant "
    "(benchmarks/kernels/torch_variants.py); CUDA graph",
    "aiter_triton": "AITER Triton fused_qk_rope_cat_and_cache_mla (amd-aiter wheel; decode, bf16 cache only "
    "on NVIDIA); CUDA graph",
    "vllm_fused": "vLLM CUDA concat_and_cache_mla_rope_fused (bf16 cos/sin) [+ concat_mla_q or the unfused "
    "concat/quant kernel for decode; + torch.cat of the key for the epilogue]; CUDA graph",
    "op1_cat": "epilogue: this project's op 1 then torch.cat(k_nope, k_pe) into the key (fp8 key: then a cast), "
    "what the plugin ran before op 3; CUDA graph",
    "triton_dense": "diagnostic: this project's op, but q_pe and k_pe dense tensors instead of vLLM's strided "
    "views (same bytes, no 384-byte row stride): what the layout costs; CUDA graph",
    "vllm_k3": "vLLM's Kimi-K3 kernels: the epilogue fused_kimi_k3_mla_key_concat_kv_cache_insert (RoPE of q in "
    "place, key, cache row; bf16 only, fp32 cos/sin; does not write k_pe back) and, for op 2, the decode ops "
    "fused_kimi_k3_mla_decode_q_concat_kv_cache_insert / _fp8_insert (query and cache row; bf16, or an e4m3fn "
    "query with an e4m3fn cache); CUDA graph",
    "flashinfer": "FlashInfer rope_quantize_fp8_append_paged_kv_cache (decode, fp8 query and cache; "
    "index conversion outside the timed region); CUDA graph",
}
SHORT = {
    "triton": "ours",
    "unfused": "unfused",
    "torch_ref": "torch-ref*",
    "torch_compile": "compile",
    "aiter_triton": "aiter",
    "vllm_fused": "vllm",
    "flashinfer": "flashinf",
    "op1_cat": "op1+cat",
    "triton_dense": "dense",
    "vllm_k3": "k3",
}


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------
# Shapes and byte counts.


@dataclass(frozen=True)
class Config:
    section: str  # "sweep" | "mixed" | "decode-layer"
    op: str  # "prefill" (op 1) | "decode" (op 2) | "mixed" (op 2 on the decode prefix + op 1 on the rest)
    #          | "epilogue" (op 3: op 1 + the prefill attention key)
    H: int
    T: int  # tokens in the call (all of them for mixed)
    cache: str  # "bf16" | "fp8"
    block_size: int
    decode_tokens: int = 0  # tokens that get the decode query (T for decode, the prefix for mixed)
    key: str = ""  # epilogue: element format of the key k_out, "bf16" | "fp8"

    @property
    def q_out(self) -> str | None:
        """Element format of the assembled query: fp8 with an fp8 cache (vLLM's fp8 MLA decode)."""
        return None if self.op == "prefill" else self.cache

    def name(self) -> str:
        t = f"T={self.T}" if self.op != "mixed" else f"D={self.decode_tokens}+P={self.T - self.decode_tokens}"
        key = f" key={self.key}" if self.key else ""
        return f"{self.section} {self.op} H={self.H} {t} {self.cache}{key} bs={self.block_size}"


@dataclass(frozen=True)
class Dims:
    L: int
    R: int
    max_pos: int
    nope: int  # q's nope head dim (q_pe is a view past it)
    is_neox: bool
    kv_cache_scale: float = KV_CACHE_SCALE  # the fp8 configs' scales (--fp8-scales)
    q_scale: float = Q_SCALE


def op_bytes(op: str, T: int, H: int, d: Dims, cache_elem: int, q_elem: int, act: int = 2, key_elem: int = 2) -> int:
    """Bytes one call must move: each input read once, each output written once (peers-and-floors §7).

    Per token: positions + slot (int64, 16 B) and one fp32 cos/sin row (4R) are read;
    k_pe and kv_c are read; the cache row (L+R elements) is written. Op 1 also
    reads and writes q_pe (H*R) and writes k_pe back; op 2 reads ql_nope and
    q_pe (H*(L+R)) and writes q_out (H*(L+R) at q_elem bytes); op 3 (epilogue)
    moves op 1's bytes plus k_nope read (H*P) and the key written (H*(P+R) at
    key_elem bytes), P = q's nope head dim.
    """
    L, R = d.L, d.R
    common_read = act * R + act * L + 16 + 4 * R
    cache_row = (L + R) * cache_elem
    if op in ("prefill", "epilogue"):
        per_token = (act * R * H + common_read) + (act * R * H + act * R + cache_row)
        if op == "epilogue":
            per_token += act * d.nope * H + (d.nope + R) * H * key_elem
    elif op == "decode":
        per_token = (act * L * H + act * R * H + common_read) + ((L + R) * H * q_elem + cache_row)
    else:
        raise ValueError(op)
    return T * per_token


def config_bytes(cfg: Config, d: Dims) -> int:
    ce = 1 if cfg.cache == "fp8" else 2
    qe = 1 if cfg.q_out == "fp8" else 2
    if cfg.op == "mixed":
        D = cfg.decode_tokens
        return op_bytes("decode", D, cfg.H, d, ce, qe) + op_bytes("prefill", cfg.T - D, cfg.H, d, ce, qe)
    return op_bytes(cfg.op, cfg.T, cfg.H, d, ce, qe, key_elem=1 if cfg.key == "fp8" else 2)


def launches(impl: str, op: str) -> int | None:
    """Kernel launches per call (None: several torch kernels, not counted)."""
    if impl == "unfused":
        return 2 if op == "prefill" else 3
    if impl in TORCH_IMPLS:
        return None
    if impl in ("triton", "triton_dense"):
        return 2 if op == "mixed" else 1
    if impl in ("vllm_fused", "op1_cat"):
        return 1 if op == "prefill" else 2
    return 1


# ---------------------------------------------------------------------------
# Inputs: a pool of `n_sets` input sets laid out the way vLLM hands them over.


class Workload:
    """``n_sets`` independent input sets for one config, plus one paged cache they all write into.

    Layout per set, as in vLLM: ``q_pe`` is ``q[..., nope:]`` of a [T, H, nope+R]
    tensor; ``k_pe`` is ``kv_a[:, L:]`` of a [T, L+R] tensor; ``kv_c`` is
    contiguous [T, L]; ``ql_nope`` is the transposed bmm output
    (``[H, T, L].transpose(0, 1)``). Positions are random in [0, max_pos);
    slots are a random permutation of the cache's slots (unique, no padding),
    distinct across sets. Each set has its own allocations, so every set has
    the same strides, storage offsets and pointer alignment: one Triton
    specialization and one torch.compile graph serve them all.
    The cache has one extra block past the real ones: the scratch row of the
    sync-free torch variant, never a slot.
    """

    _SET_TENSORS = ("q_full", "kv_a", "kv_c", "ql_store", "q_out", "positions", "slots", "kv_nope", "k_out",
                    "q_dense", "k_dense")  # fmt: skip

    def __init__(self, cfg: Config, d: Dims, n_sets: int, device, gen, fp8_dtype, _from: Workload | None = None):
        import torch

        self.cfg, self.d, self.n_sets, self.device, self.fp8_dtype = cfg, d, n_sets, device, fp8_dtype
        T, H, L, R = cfg.T, cfg.H, d.L, d.R
        self.D = D = cfg.decode_tokens
        bs = cfg.block_size
        self.num_blocks = nb = -(-n_sets * T // bs)
        act = torch.bfloat16
        q_dtype = fp8_dtype if cfg.q_out == "fp8" else act
        key_dtype = fp8_dtype if cfg.key == "fp8" else act
        epi = cfg.op == "epilogue"
        dense = cfg.op in ("prefill", "epilogue")  # the triton_dense diagnostic's own q_pe / k_pe
        if _from is not None:  # a deep copy (for correctness checks)
            self.sets = [{k: (None if t is None else t.clone()) for k, t in st.items()} for st in _from.sets]
            self.cache_storage = _from.cache_storage.clone()
            self.cos_sin_cache = _from.cos_sin_cache
            self.kv_cache_scale, self.q_scale = _from.kv_cache_scale, _from.q_scale
        else:

            def randn(*shape):
                return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(act)

            perm = torch.randperm(nb * bs, generator=gen, device=device)[: n_sets * T]
            self.sets = []
            for i in range(n_sets):
                self.sets.append({
                    "q_full": randn(T, H, d.nope + R),
                    "kv_a": randn(T, L + R),
                    "kv_c": randn(T, L),
                    "ql_store": randn(H, D, L) if D else None,
                    # Poisoned (NaN) so that an unwritten query row cannot pass a check.
                    "q_out": torch.full((D, H, L + R), float("nan"), device=device).to(q_dtype) if D else None,
                    "positions": torch.randint(0, d.max_pos, (T,), generator=gen, device=device),
                    "slots": perm[i * T : (i + 1) * T].clone(),
                    # kv_b_proj's output [T, H, P + V]; the key concat reads its first P columns.
                    "kv_nope": randn(T, H, 2 * d.nope) if epi else None,
                    "k_out": torch.full((T, H, d.nope + R), float("nan"), device=device).to(key_dtype) if epi
                    else None,
                })  # fmt: skip
                st = self.sets[-1]
                # The same values as q_pe and k_pe, in dense tensors of their own.
                st["q_dense"] = st["q_full"][:, :, d.nope :].contiguous() if dense else None
                st["k_dense"] = st["kv_a"][:, L:].contiguous() if dense else None
            # Random finite canary in every cache row (fp8: random values, never NaN bit patterns).
            canary = torch.randn((nb + 1) * bs, L + R, generator=gen, device=device)
            self.cache_storage = canary.to(act) if cfg.cache == "bf16" else (canary * 8).to(fp8_dtype).view(torch.uint8)
            self.cos_sin_cache = None  # set by the caller (shared across configs)
            self.kv_cache_scale = (
                torch.tensor([d.kv_cache_scale], dtype=torch.float32, device=device) if cfg.cache == "fp8" else None
            )
            self.q_scale = torch.tensor([d.q_scale], dtype=torch.float32, device=device) if cfg.q_out == "fp8" else None
        self.store_dtype = fp8_dtype if cfg.cache == "fp8" else act
        self.kv_cache_dtype = "fp8" if cfg.cache == "fp8" else "auto"
        self.kv_cache = self.cache_storage[: nb * bs].view(nb, bs, L + R)
        self.typed_cache = self.kv_cache.view(fp8_dtype) if cfg.cache == "fp8" else self.kv_cache
        self.flat_cache = self.cache_storage  # [(nb + 1) * bs, L + R]; the last block is scratch
        self._views = None

    def clone(self) -> Workload:
        return Workload(self.cfg, self.d, self.n_sets, self.device, None, self.fp8_dtype, _from=self)

    def views(self, i: int) -> SimpleNamespace:
        """The tensors of input set ``i`` (built once)."""
        if self._views is None:
            self._views = [self._make_views(k) for k in range(self.n_sets)]
        return self._views[i % self.n_sets]

    def _make_views(self, i: int) -> SimpleNamespace:
        cfg, d, st = self.cfg, self.d, self.sets[i]
        D = self.D
        v = SimpleNamespace(
            positions=st["positions"],
            slot_mapping=st["slots"],
            q_pe=st["q_full"][:, :, d.nope :],
            k_pe=st["kv_a"][:, d.L :],
            kv_c=st["kv_c"],
            cos_sin_cache=self.cos_sin_cache,
            kv_cache=self.kv_cache,
            typed_cache=self.typed_cache,
            flat_cache=self.flat_cache,
            store_dtype=self.store_dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_scale=self.kv_cache_scale,
            q_scale=self.q_scale,
            ql_nope=st["ql_store"].transpose(0, 1) if D else None,  # [D, H, L], strided
            q_out=st["q_out"],
            k_nope=st["kv_nope"][..., : d.nope] if st.get("kv_nope") is not None else None,
            k_out=st.get("k_out"),
            q_dense=st.get("q_dense"),
            k_dense=st.get("k_dense"),
        )
        if cfg.op == "mixed":
            v.dec = SimpleNamespace(**vars(v))
            v.pre = SimpleNamespace(**vars(v))
            for name in ("positions", "slot_mapping", "q_pe", "k_pe", "kv_c"):
                full = getattr(v, name)
                setattr(v.dec, name, full[:D])
                setattr(v.pre, name, full[D:])
        return v


# ---------------------------------------------------------------------------
# Implementations: each builds a zero-argument call on one input set.


class Unavailable(Exception):
    """The implementation does not apply to this config ("n/a") or is not installed ("missing")."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


class Impls:
    def __init__(self, args, d: Dims, device, fp8_dtype):
        self.args, self.d, self.device, self.fp8_dtype = args, d, device, fp8_dtype
        self._cos_sin_act = None
        # --plugin-launches: "triton" launches as the vLLM plugin's layers do, bound with the
        # early_index_loads promise (binding.py; nothing here writes positions, slots or cos/sin
        # between calls), which on sm_90 reads them before the grid-dependency wait.
        self._plugin_ops = None
        if getattr(args, "plugin_launches", False):
            from vllm_mla_fusion.binding import BoundOps

            self._plugin_ops = BoundOps("triton", early_index_loads=True)

    def _plugin_op(self, op: int, kv_cache_dtype: str):
        return self._plugin_ops.get(op, kv_cache_dtype, self.d.is_neox)

    def check_applicable(self, impl: str, cfg: Config) -> None:
        """Raise Unavailable when ``impl`` cannot run ``cfg``."""
        if impl == "torch_compile" and cfg.op in ("mixed", "epilogue"):
            raise Unavailable("n/a", "not measured for mixed batches or the epilogue")
        if impl == "op1_cat" and cfg.op != "epilogue":
            raise Unavailable("n/a", "op 1 + key concat is the epilogue's baseline")
        if impl == "triton_dense" and (cfg.op not in ("prefill", "epilogue")
                                       or cfg.block_size != max(self.args.block_sizes)):  # fmt: skip
            raise Unavailable("n/a", "the layout diagnostic: in-place ops, the largest block size")
        if impl == "unfused" and cfg.op == "epilogue" and cfg.section != "epilogue":
            raise Unavailable("n/a", "epilogue configs live in the epilogue section")
        if impl in TORCH_IMPLS and cfg.block_size != max(self.args.block_sizes) and cfg.section == "sweep":
            raise Unavailable("n/a", "torch rows are measured at the largest block size only (cost independent of it)")
        if impl in TORCH_IMPLS and cfg.section == "decode-layer":
            raise Unavailable("n/a", "decode-layer compares the unfused chain with op 2 (and peers)")
        if impl == "aiter_triton":
            if cfg.op != "decode":
                raise Unavailable("n/a", "AITER's op assembles the decode query (op 2 semantics) only")
            if cfg.cache != "bf16":
                raise Unavailable("n/a", "AITER Triton on NVIDIA: bf16 cache only (fp8 asserts e4m3fnuz; no q_scale)")
            self._peer("aiter_triton")
        elif impl == "vllm_fused":
            if cfg.op == "mixed":
                raise Unavailable("n/a", "not measured for mixed batches")
            self._peer("vllm_fused")
        elif impl == "vllm_k3":
            if self.d.is_neox or (self.d.L, self.d.R) != (512, 64):
                raise Unavailable("n/a", "vLLM's K3 kernels: GPT-J rotation, L 512 and R 64 only")
            if cfg.op == "decode":
                import torch

                if cfg.cache == "fp8" and self.fp8_dtype != torch.float8_e4m3fn:
                    raise Unavailable("n/a", "vLLM's K3 decode ops: bf16, or an e4m3fn query and cache")
                self._peer("vllm_k3_decode")
            elif cfg.op != "epilogue" or cfg.key != "bf16" or cfg.cache != "bf16":
                raise Unavailable("n/a", "vLLM's K3 kernels: op 2 (decode), or the prefill key with a bf16 key and "
                                  "cache")  # fmt: skip
            else:
                self._peer("vllm_k3")
        elif impl == "flashinfer":
            if cfg.op != "decode" or cfg.cache != "fp8":
                raise Unavailable("n/a", "FlashInfer's fused op is decode-only with fp8 query and cache")
            self._peer("flashinfer")

    def _peer(self, impl: str):
        from . import peers

        if self.device.type != "cuda":
            raise Unavailable("missing", "peers run on a GPU only")
        loader = {"aiter_triton": peers.load_aiter_triton, "vllm_fused": peers.load_vllm,
                  "vllm_k3": peers.load_vllm_k3, "vllm_k3_decode": peers.load_vllm_k3_decode,
                  "flashinfer": peers.load_flashinfer}[impl]  # fmt: skip
        handle, reason = loader()
        if handle is None:
            raise Unavailable("missing", reason)
        return handle, None

    def make(self, impl: str, cfg: Config, v: SimpleNamespace):
        """A zero-argument callable running ``impl`` once on the views ``v``."""
        import torch

        neox = self.d.is_neox
        if cfg.op == "epilogue":
            return self._make_epilogue(impl, v)
        if impl == "triton_dense":
            from vllm_mla_fusion import mla_rope_cache_write

            return lambda: mla_rope_cache_write(v.positions, v.q_dense, v.k_dense, v.kv_c, v.cos_sin_cache, neox,
                                                v.slot_mapping, v.kv_cache, v.kv_cache_dtype, v.kv_cache_scale,
                                                backend="triton")  # fmt: skip
        if impl in ("triton", "torch_ref"):
            from vllm_mla_fusion import mla_decode_rope_cache_write, mla_rope_cache_write

            backend = "triton" if impl == "triton" else "torch"

            def op1(x):
                mla_rope_cache_write(x.positions, x.q_pe, x.k_pe, x.kv_c, x.cos_sin_cache, neox, x.slot_mapping,
                                     x.kv_cache, x.kv_cache_dtype, x.kv_cache_scale, backend=backend)  # fmt: skip

            def op2(x):
                mla_decode_rope_cache_write(x.positions, x.ql_nope, x.q_pe, x.k_pe, x.kv_c, x.cos_sin_cache, neox,
                                            x.slot_mapping, x.kv_cache, x.q_out, x.kv_cache_dtype,
                                            x.kv_cache_scale, x.q_scale, backend=backend)  # fmt: skip

            if impl == "triton" and self._plugin_ops is not None:
                from vllm_mla_fusion.opcodes import OP_DECODE, OP_ROPE_CACHE

                def op1(x):  # noqa: F811 - as the plugin launches it
                    self._plugin_op(OP_ROPE_CACHE, x.kv_cache_dtype)(
                        x.positions, x.q_pe, x.k_pe, x.kv_c, x.cos_sin_cache, x.slot_mapping, x.kv_cache,
                        x.kv_cache_scale)  # fmt: skip

                def op2(x):  # noqa: F811
                    self._plugin_op(OP_DECODE, x.kv_cache_dtype)(
                        x.positions, x.q_pe, x.k_pe, x.kv_c, x.cos_sin_cache, x.slot_mapping, x.kv_cache,
                        x.kv_cache_scale, x.ql_nope, x.q_out, x.q_scale)  # fmt: skip

            if cfg.op == "prefill":
                return lambda: op1(v)
            if cfg.op == "decode":
                return lambda: op2(v)
            return lambda: (op2(v.dec), op1(v.pre))

        if impl == "unfused":
            from . import unfused

            if cfg.op == "prefill":
                return lambda: unfused.prefill_chain(v.positions, v.q_pe, v.k_pe, v.kv_c, v.cos_sin_cache, neox,
                                                     v.slot_mapping, v.typed_cache, v.kv_cache_scale)  # fmt: skip
            if cfg.op == "decode":
                return lambda: unfused.decode_chain(v.positions, v.ql_nope, v.q_pe, v.k_pe, v.kv_c, v.cos_sin_cache,
                                                    neox, v.slot_mapping, v.typed_cache, v.q_out, v.kv_cache_scale,
                                                    v.q_scale)  # fmt: skip

            def mixed():  # RoPE over the batch, cache write over the batch, query for the decode prefix
                unfused.rope_inplace(v.positions, v.q_pe, v.k_pe, v.cos_sin_cache, neox)
                unfused.concat_and_cache_mla(v.kv_c, v.k_pe, v.slot_mapping, v.typed_cache, v.kv_cache_scale)
                unfused.concat_mla_q(v.dec.ql_nope, v.dec.q_pe, v.q_out, v.q_scale)

            return mixed

        if impl == "torch_compile":
            from . import torch_variants

            fn = torch_variants.compiled(cfg.op, enabled=not self.args.smoke)
            if cfg.op == "prefill":
                return lambda: fn(v.positions, v.q_pe, v.k_pe, v.kv_c, v.cos_sin_cache, neox, v.slot_mapping,
                                  v.flat_cache, v.store_dtype, v.kv_cache_scale)  # fmt: skip
            return lambda: fn(v.positions, v.ql_nope, v.q_pe, v.k_pe, v.kv_c, v.cos_sin_cache, neox, v.slot_mapping,
                              v.flat_cache, v.store_dtype, v.q_out, v.kv_cache_scale, v.q_scale)  # fmt: skip

        from . import peers

        if impl == "aiter_triton":
            op, _ = self._peer("aiter_triton")
            return peers.aiter_decode_call(op.fn, v, neox)
        if impl == "vllm_fused":
            ops, _ = self._peer("vllm_fused")
            if self._cos_sin_act is None:
                self._cos_sin_act = v.cos_sin_cache.to(torch.bfloat16)  # recent vLLM wants q's dtype
            if cfg.op == "prefill":
                return peers.vllm_prefill_call(ops, v, neox, v.kv_cache_dtype, self._cos_sin_act)
            from . import unfused

            return peers.vllm_decode_call(ops, v, neox, v.kv_cache_dtype, self._cos_sin_act, unfused.concat_mla_q)
        if impl == "flashinfer":
            fn, _ = self._peer("flashinfer")
            return peers.flashinfer_decode_call(fn, v, neox, self.fp8_dtype)
        if impl == "vllm_k3" and cfg.op == "decode":
            fns, _ = self._peer("vllm_k3_decode")
            return peers.vllm_k3_decode_call(fns, v, v.cos_sin_cache)  # K3 wants the fp32 table
        raise ValueError(impl)

    def _make_epilogue(self, impl: str, v: SimpleNamespace):
        """Op 3 semantics (q_pe, k_pe rotated in place, cache rows, key) by ``impl`` on the views ``v``."""
        import torch

        neox = self.d.is_neox
        T, H, _ = v.q_pe.shape
        fp8_key = v.k_out.dtype != v.q_pe.dtype
        # An fp8 key is built in q's dtype and then cast, as vLLM does (k.to(fp8) after the concat).
        scratch = torch.empty(v.k_out.shape, dtype=v.q_pe.dtype, device=v.q_pe.device) if fp8_key else None

        def cat_key(k_pe):
            k = scratch if fp8_key else v.k_out
            torch.cat((v.k_nope, k_pe[:, None, :].expand(T, H, -1)), dim=-1, out=k)
            if fp8_key:
                v.k_out.copy_(scratch)

        if impl in ("triton", "torch_ref", "triton_dense"):
            from vllm_mla_fusion import mla_prefill_rope_cache_write

            q_pe, k_pe = (v.q_dense, v.k_dense) if impl == "triton_dense" else (v.q_pe, v.k_pe)
            backend = "torch" if impl == "torch_ref" else "triton"
            if impl == "triton" and self._plugin_ops is not None:  # as the plugin launches it
                from vllm_mla_fusion.opcodes import OP_PREFILL

                bound = self._plugin_op(OP_PREFILL, v.kv_cache_dtype)
                return lambda: bound(v.positions, q_pe, k_pe, v.kv_c, v.cos_sin_cache, v.slot_mapping, v.kv_cache,
                                     v.kv_cache_scale, v.k_nope, v.k_out, None)  # fmt: skip
            return lambda: mla_prefill_rope_cache_write(v.positions, q_pe, k_pe, v.kv_c, v.k_nope, v.cos_sin_cache,
                                                        neox, v.slot_mapping, v.kv_cache, v.k_out,
                                                        v.kv_cache_dtype, v.kv_cache_scale,
                                                        backend=backend)  # fmt: skip
        if impl == "op1_cat":
            from vllm_mla_fusion import mla_rope_cache_write

            def op1_cat():
                mla_rope_cache_write(v.positions, v.q_pe, v.k_pe, v.kv_c, v.cos_sin_cache, neox, v.slot_mapping,
                                     v.kv_cache, v.kv_cache_dtype, v.kv_cache_scale, backend="triton")  # fmt: skip
                cat_key(v.k_pe)

            return op1_cat
        if impl == "unfused":
            from . import unfused

            return lambda: unfused.epilogue_chain(v.positions, v.q_pe, v.k_pe, v.kv_c, v.k_nope, v.cos_sin_cache,
                                                  neox, v.slot_mapping, v.typed_cache, v.k_out, v.kv_cache_scale,
                                                  key_scratch=scratch)  # fmt: skip
        from . import peers

        if self._cos_sin_act is None:
            self._cos_sin_act = v.cos_sin_cache.to(torch.bfloat16)  # vLLM's kernels want q's dtype
        if impl == "vllm_fused":
            ops, _ = self._peer("vllm_fused")
            fused = peers.vllm_prefill_call(ops, v, neox, v.kv_cache_dtype, self._cos_sin_act)
            return lambda: (fused(), cat_key(v.k_pe))
        if impl == "vllm_k3":
            fn, _ = self._peer("vllm_k3")
            # K3 checks for an fp32 table (its RoPE math is fp32), unlike the generic fused op.
            return peers.vllm_k3_epilogue_call(fn, v, self.d.nope, v.cos_sin_cache)
        raise ValueError(impl)


# ---------------------------------------------------------------------------
# Correctness check of every implementation against the torch reference backend.


def _as_float(t):
    import torch

    if t.dtype == torch.uint8:
        raise TypeError("compare typed tensors")
    return t.float()


def _compare(got, ref, fp8: bool) -> tuple[float, int]:
    """(max |got - ref|, elements outside tolerance). Tolerance: 2 bf16 ulps, or 1 fp8 e4m3 ulp."""
    import torch

    g, r = _as_float(got), _as_float(ref)
    rtol, atol = (0.13, 2.0**-6) if fp8 else (2.0**-6, 2.0**-6)
    diff = (g - r).abs()
    bad = ~(diff <= atol + rtol * r.abs())  # NaN counts as bad
    finite = diff[torch.isfinite(diff)]
    return (float(finite.max()) if finite.numel() else float("nan")), int(bad.sum())


# Triton's interpreter rounds float32 -> fp8 wrongly (e.g. 125.4 -> 64 for e4m3fn); the project's
# kernel encodes fp8 bits itself there, the unfused chain does not. Under --smoke its fp8 outputs are
# compared and reported but not judged. On a GPU every field is judged.
INTERPRETER_FP8_NOTE = "fp8 field not judged: Triton's interpreter rounds fp8 wrongly (GPU runs judge it)"


def check_outputs(cfg: Config, got: Workload, ref: Workload, impl: str, lenient_fp8: bool = False) -> dict:
    """Compare the outputs ``impl`` produced in set 0 of ``got`` with the reference's in ``ref``."""
    D = cfg.decode_tokens
    fields = []
    gv, rv = got.views(0), ref.views(0)
    cache_fp8 = cfg.cache == "fp8"
    fields.append(("kv_cache", got.typed_cache, ref.typed_cache, cache_fp8))
    if cfg.op in ("decode", "mixed"):
        fields.append(("q_out", gv.q_out, rv.q_out, cfg.q_out == "fp8"))
    if cfg.op in ("prefill", "epilogue") and impl == "triton_dense":
        fields += [("q_pe", gv.q_dense, rv.q_pe, False), ("k_pe", gv.k_dense, rv.k_pe, False)]
    elif cfg.op == "epilogue" and impl == "vllm_k3":
        fields += [("q_pe", gv.q_pe, rv.q_pe, False)]  # K3 leaves k_pe un-rotated (it has no k_pe output)
    elif cfg.op in ("prefill", "epilogue"):
        fields += [("q_pe", gv.q_pe, rv.q_pe, False), ("k_pe", gv.k_pe, rv.k_pe, False)]
    if cfg.op == "epilogue":
        fields.append(("k_out", gv.k_out, rv.k_out, cfg.key == "fp8"))
    if cfg.op == "mixed":
        fields += [("q_pe[D:]", gv.q_pe[D:], rv.q_pe[D:], False), ("k_pe[D:]", gv.k_pe[D:], rv.k_pe[D:], False)]
    out = {"ok": True, "fields": {}}
    for name, g, r, fp8 in fields:
        err, bad = _compare(g, r, fp8)
        out["fields"][name] = {"max_abs_err": err, "n_bad": bad}
        if fp8 and lenient_fp8:
            out["fields"][name]["note"] = INTERPRETER_FP8_NOTE
        elif bad:
            out["ok"] = False
    return out


# ---------------------------------------------------------------------------
# The run.


@dataclass
class Plan:
    n_calls: int  # calls captured per graph
    n_sets: int  # distinct input sets the calls rotate through
    repeats: int
    eager_calls: int  # calls per eager loop (torch_ref)
    eager_repeats: int


def plan_timing(cfg: Config, nbytes: int, args, l2: int) -> Plan:
    """Calls per graph and input sets: ~target_us of work per replay, sets covering ``rotate_factor`` x L2."""
    if args.smoke:
        return Plan(n_calls=1, n_sets=1, repeats=1, eager_calls=1, eager_repeats=1)
    est_us = max(2.5 * launches("unfused", cfg.op), nbytes / 3.0e6)  # ~3 TB/s
    n_calls = max(2, min(args.max_calls, math.ceil(args.target_us / est_us)))
    n_sets = max(1, min(n_calls, math.ceil(args.rotate_factor * l2 / max(nbytes, 1))))
    repeats = max(5, min(args.repeats, math.ceil(300e3 / (n_calls * est_us))))
    est_eager = 60.0 + nbytes / 0.5e6
    eager_calls = max(1, min(20, math.ceil(args.target_us / est_eager)))
    eager_repeats = 5 if est_eager * eager_calls < 50e3 else 3
    return Plan(n_calls, n_sets, repeats, eager_calls, eager_repeats)


class Runner:
    def __init__(self, args):
        import torch

        self.args = args
        self.torch = torch
        self.device = torch.device("cpu" if args.smoke else "cuda")
        from vllm_mla_fusion import fp8 as fp8_mod

        self.fp8_dtype = fp8_mod.platform_fp8_e4m3(self.device)
        self.d = Dims(L=args.kv_lora_rank, R=args.rope_dim, max_pos=args.max_position, nope=args.nope_head_dim,
                      is_neox=args.neox, kv_cache_scale=args.fp8_scales[0], q_scale=args.fp8_scales[1])  # fmt: skip
        self.impls = Impls(args, self.d, self.device, self.fp8_dtype)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(args.seed)
        self.cos_sin_cache = self._cos_sin_cache()
        self.results: list[dict] = []
        self.calibration: dict = {}
        self.peers: dict = {}
        from . import timing

        self.timing = timing
        self.l2 = timing.l2_cache_bytes(self.device)

    def _cos_sin_cache(self):
        """fp32 [max_pos, R]: rows [cos | sin] of standard RoPE frequencies (base 10000)."""
        torch = self.torch
        R = self.d.R
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, R, 2, dtype=torch.float64) / R))
        t = torch.arange(self.d.max_pos, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(torch.float32).to(self.device)

    # -- machine ceilings ---------------------------------------------------
    def calibrate(self, tag: str) -> dict:
        t = self.timing
        c = {"launch": t.launch_floor(self.device), "copy": t.copy_bandwidth(
            self.device, nbytes=(16 << 20) if self.args.smoke else self.args.copy_bytes)}  # fmt: skip
        self.calibration[tag] = c
        lc, cp = c["launch"], c["copy"]
        log(f"[calibration:{tag}] trivial kernel in a CUDA graph: triton {lc.get('triton_us', float('nan')):.2f} us, "
            f"torch {lc['torch_us']:.2f} us -> launch floor {lc['floor_us']:.2f} us; "
            f"D2D copy {cp['TBps']:.3f} TB/s (read+write of {cp['bytes_moved'] / 2**30:.1f} GiB)")  # fmt: skip
        return c

    @property
    def launch_us(self) -> float:
        return self.calibration["start"]["launch"]["floor_us"]

    @property
    def copy_bps(self) -> float:
        return self.calibration["start"]["copy"]["bytes_per_s"]

    def floors(self, nbytes: int) -> tuple[float, float]:
        bw_us = nbytes / self.copy_bps * 1e6
        return max(self.launch_us, bw_us), bw_us

    # -- one config ---------------------------------------------------------
    def run_config(self, cfg: Config, impls: tuple[str, ...], index: str) -> list[dict]:
        torch, args = self.torch, self.args
        nbytes = config_bytes(cfg, self.d)
        floor_us, bw_us = self.floors(nbytes)
        plan = plan_timing(cfg, nbytes, args, self.l2)
        rows = []
        runnable = []
        for impl in impls:
            base = {**asdict(cfg), "impl": impl, "q_out_dtype": cfg.q_out, "bytes": nbytes, "floor_us": floor_us,
                    "bw_term_us": bw_us, "launches": launches(impl, cfg.op)}  # fmt: skip
            try:
                self.impls.check_applicable(impl, cfg)
                runnable.append((impl, base))
            except Unavailable as u:
                rows.append({**base, "status": u.status, "reason": u.reason})
                if u.status == "missing":
                    self.peers.setdefault(impl, u.reason)

        wl = None
        checks = {}
        if runnable and (args.smoke or cfg.T <= args.check_max_tokens):
            checks = self._check(cfg, [i for i, _ in runnable])
        if runnable:
            wl = Workload(cfg, self.d, plan.n_sets, self.device, self.gen, self.fp8_dtype)
            wl.cos_sin_cache = self.cos_sin_cache
        for impl, base in runnable:
            row = {**base, "n_sets": plan.n_sets, "rotation_bytes": plan.n_sets * nbytes,
                   "l2_resident": plan.n_sets * nbytes <= self.l2, "check": checks.get(impl)}  # fmt: skip
            try:
                calls = [self.impls.make(impl, cfg, wl.views(i)) for i in range(plan.n_sets)]
                call = lambda i, calls=calls: calls[i % len(calls)]()  # noqa: E731
                t = self._time(impl, call, plan)
                row.update(status="ok", **t.as_dict())
                row["efficiency"] = floor_us / t.us
                row["achieved_TBps"] = nbytes / (t.us * 1e-6) / 1e12
            except Unavailable as u:
                row.update(status=u.status, reason=u.reason)
            except Exception as e:  # noqa: BLE001 - record, keep going; one broken implementation must not end the run
                row.update(status="error", reason=f"{type(e).__name__}: {e}")
                if args.verbose:
                    traceback.print_exc()
                self._recover()
            if row.get("check") and not row["check"]["ok"]:
                row["check_failed"] = True
            if args.smoke and impl == "torch_compile":
                row["note"] = "not compiled under --smoke (the same function, eager)"
            rows.append(row)
        del wl
        if self.device.type == "cuda" and nbytes > (512 << 20):
            torch.cuda.empty_cache()
        order = {name: k for k, name in enumerate(impls)}
        rows.sort(key=lambda r: order[r["impl"]])
        self.results.extend(rows)
        log(f"[{index}] {cfg.name()}: " + self._progress(rows, floor_us))
        return rows

    def _time(self, impl: str, call, plan: Plan):
        t = self.timing
        if self.args.smoke:
            return t.cpu_wall_time(call, plan.n_calls, plan.repeats, self.device)
        if impl == "torch_ref":  # syncs: not capturable
            return t.eager_event_time(call, plan.eager_calls, plan.eager_repeats, self.device)
        return t.cuda_graph_time(call, plan.n_calls, plan.repeats, self.device, warmup_calls=min(3, plan.n_sets))

    def _recover(self) -> None:
        if self.device.type == "cuda":
            try:
                self.torch.cuda.synchronize(self.device)
            except Exception as e:  # noqa: BLE001
                log(f"  warning: device error after a failed implementation: {e}")

    def _check(self, cfg: Config, impls: list[str]) -> dict:
        """Run each implementation once on a copy of fresh inputs; compare with backend='torch'."""
        base = Workload(cfg, self.d, 1, self.device, self.gen, self.fp8_dtype)
        base.cos_sin_cache = self.cos_sin_cache
        ref = base.clone()
        try:
            self.impls.make("torch_ref", cfg, ref.views(0))()
        except Exception as e:  # noqa: BLE001
            return {i: {"ok": False, "error": f"reference failed: {type(e).__name__}: {e}"} for i in impls}
        out = {}
        for impl in impls:
            got = base.clone()
            try:
                t0 = time.perf_counter()
                self.impls.make(impl, cfg, got.views(0))()
                if self.device.type == "cuda":
                    self.torch.cuda.synchronize(self.device)
                call_ms = (time.perf_counter() - t0) * 1e3
                out[impl] = check_outputs(cfg, got, ref, impl, lenient_fp8=self.args.smoke and impl == "unfused")
                out[impl]["call_ms"] = call_ms  # first eager call: includes any compilation
            except Unavailable:
                continue
            except Exception as e:  # noqa: BLE001
                out[impl] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                self._recover()
        return out

    @staticmethod
    def _progress(rows: list[dict], floor_us: float) -> str:
        parts = [f"floor {floor_us:.2f}us"]
        for r in rows:
            if r["status"] == "ok":
                bad = "!" if r.get("check_failed") else ""
                parts.append(f"{SHORT[r['impl']]} {r['us']:.2f}{bad} ({r['efficiency']:.2f})")
            elif r["status"] == "error":
                parts.append(f"{SHORT[r['impl']]} ERR")
        return " | ".join(parts)


# ---------------------------------------------------------------------------
# Sections.


def sweep_configs(args) -> list[Config]:
    out = []
    for op in args.ops:
        for cache in args.cache_dtypes:
            for H in args.heads:
                for bs in args.block_sizes:
                    for T in args.tokens:
                        out.append(Config("sweep", op, H, T, cache, bs, decode_tokens=T if op == "decode" else 0))
    return out


def mixed_configs(args) -> list[Config]:
    bs = max(args.block_sizes)
    return [Config("mixed", "mixed", H, D + P, cache, bs, decode_tokens=D)
            for cache in args.cache_dtypes for H in args.heads for D, P in args.mixed]  # fmt: skip


def epilogue_configs(args) -> list[Config]:
    """bf16 key and cache over the token sweep, plus an fp8 key with an fp8 cache on a subset."""
    bs = max(args.block_sizes)
    out = [Config("epilogue", "epilogue", H, T, "bf16", bs, key="bf16") for H in args.heads for T in args.tokens]
    if "fp8" in args.cache_dtypes:
        fp8_tokens = [T for T in args.tokens if T in EPILOGUE_FP8_TOKENS] or args.tokens[:1]
        out += [Config("epilogue", "epilogue", H, T, "fp8", bs, key="fp8") for H in args.heads for T in fp8_tokens]
    return out


def decode_layer_configs(args) -> list[Config]:
    bs = max(args.block_sizes)
    return [Config("decode-layer", "decode", H, B, cache, bs, decode_tokens=B)
            for cache in args.cache_dtypes for H in args.heads for B in args.decode_batches]  # fmt: skip


# ---------------------------------------------------------------------------
# Reports: tables, targets, JSON, Markdown, plots.


def _fmt_cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if r["status"] == "ok":
        return f"{r['us']:.2f}" + ("!" if r.get("check_failed") else "")
    return {"n/a": "-", "missing": "miss", "error": "ERR", "skipped": "skip"}.get(r["status"], r["status"])


def _by_config(results: list[dict], section: str) -> dict:
    grouped: dict = {}
    for r in results:
        if r["section"] != section:
            continue
        cache = r["cache"] + (f"/key {r['key']}" if r.get("key") else "")
        key = (r["op"], cache, r["H"], r["block_size"], r["T"], r["decode_tokens"])
        grouped.setdefault(key, {})[r["impl"]] = r
    return grouped


def _speedup(a: dict | None, b: dict | None) -> float | None:
    """How many times faster ``b`` (ours) is than ``a``."""
    if a and b and a["status"] == "ok" and b["status"] == "ok":
        return a["us"] / b["us"]
    return None


def table_rows(results: list[dict], section: str, impls: tuple[str, ...]) -> tuple[list[str], list[list[str]]]:
    head = ["op", "cache", "H", "bs", "T", "KB/call", "bw us", "floor us"] + [SHORT[i] for i in impls]
    speedup_peers = ("unfused", "vllm_k3") if section == "epilogue" else ("unfused", "vllm_k3", "aiter_triton")
    head += ["ours eff", "ours TB/s"] + [f"x {SHORT[p]}" for p in speedup_peers] + ["L2"]
    rows = []
    for key, by in sorted(_by_config(results, section).items(),
                          key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], kv[0][3], kv[0][4])):  # fmt: skip
        op, cache, H, bs, T, D = key
        any_r = next(iter(by.values()))
        ours = by.get("triton")
        t_label = str(T) if op != "mixed" else f"{D}+{T - D}"
        row = [op, cache, str(H), str(bs), t_label, f"{any_r['bytes'] / 1e3:.0f}", f"{any_r['bw_term_us']:.2f}",
               f"{any_r['floor_us']:.2f}"]  # fmt: skip
        row += [_fmt_cell(by.get(i)) for i in impls]
        ok = ours and ours["status"] == "ok"
        row.append(f"{ours['efficiency']:.2f}" if ok else "-")
        row.append(f"{ours['achieved_TBps']:.2f}" if ok else "-")
        for peer in speedup_peers:
            s = _speedup(by.get(peer), ours)
            row.append(f"{s:.2f}" if s else "-")
        row.append("yes" if ok and ours.get("l2_resident") else ("no" if ok else "-"))
        rows.append(row)
    return head, rows


def decode_layer_rows(results: list[dict], impls: tuple[str, ...]) -> tuple[list[str], list[list[str]]]:
    peers_present = [i for i in impls if i not in ("triton", "unfused")]
    head = ["cache", "H", "batch", "floor us", "unfused us/layer", "op2 us/layer", "unfused/op2"]
    head += [f"{SHORT[p]} us" for p in peers_present]
    head += [f"saved us/step ({NUM_LAYERS} layers)"]
    rows = []
    for key, by in sorted(_by_config(results, "decode-layer").items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][4])):
        _, cache, H, _, T, _ = key
        u, o = by.get("unfused"), by.get("triton")
        s = _speedup(u, o)
        saved = (u["us"] - o["us"]) * NUM_LAYERS if s else None
        any_r = next(iter(by.values()))
        row = [cache, str(H), str(T), f"{any_r['floor_us']:.2f}", _fmt_cell(u), _fmt_cell(o), f"{s:.2f}" if s else "-"]
        row += [_fmt_cell(by.get(p)) for p in peers_present]
        row.append(f"{saved:.1f}" if saved is not None else "-")
        rows.append(row)
    return head, rows


def format_table(head: list[str], rows: list[list[str]], markdown: bool = False) -> str:
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[k]) for r in rows)) if rows else len(h) for k, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def section_impls(results: list[dict], section: str, impls: tuple[str, ...]) -> tuple[str, ...]:
    """The implementations that have a row in ``section`` (measured, missing or failed; not all n/a)."""
    return tuple(i for i in impls if any(r["impl"] == i and r["section"] == section and r["status"] != "n/a"
                                         for r in results))  # fmt: skip


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def evaluate_targets(results: list[dict], launch_us: float, smoke: bool) -> list[dict]:
    """The issue-6 targets for the Triton backend, each met / NOT MET / not measured, with numbers."""
    ok = [r for r in results if r["status"] == "ok"]
    ours = {(r["section"], r["op"], r["cache"], r["H"], r["block_size"], r["T"], r["decode_tokens"]): r
            for r in ok if r["impl"] == "triton"}  # fmt: skip

    def key(r):
        return (r["section"], r["op"], r["cache"], r["H"], r["block_size"], r["T"], r["decode_tokens"])

    def where(r):
        return f"{r['op']} H={r['H']} T={r['T']} {r['cache']} bs={r['block_size']}"

    targets = []

    def add(tid, text, measured, met, detail, worst=None):
        status = "not measured" if not measured else ("met" if met else "NOT MET")
        if smoke and measured:
            status += " (CPU smoke: meaningless)"
        targets.append({"id": tid, "target": text, "status": status, "detail": detail, "worst": worst})

    sweep = [r for r in ours.values() if r["section"] == "sweep"]
    # 1. Bandwidth-bound efficiency.
    bw = [r for r in sweep if r["bw_term_us"] >= 5.0]
    if bw:
        w = min(bw, key=lambda r: r["efficiency"])
        n_met = sum(r["efficiency"] >= 0.90 for r in bw)
        add("bandwidth", "efficiency >= 0.90 where bytes/copy-bandwidth >= 5 us", True, n_met == len(bw),
            f"{n_met}/{len(bw)} shapes; min efficiency {w['efficiency']:.3f} at {where(w)}",
            {"where": where(w), "efficiency": w["efficiency"], "us": w["us"], "floor_us": w["floor_us"]})  # fmt: skip
    else:
        add("bandwidth", "efficiency >= 0.90 where bytes/copy-bandwidth >= 5 us", False, False,
            "no shape with a bandwidth term >= 5 us was measured")  # fmt: skip
    # 2. Launch-bound shapes.
    lb = [r for r in sweep if r["T"] <= 16]
    if lb:
        w = max(lb, key=lambda r: r["us"])
        n_met = sum(r["us"] <= 1.5 * launch_us for r in lb)
        add("launch", "T <= 16: time <= 1.5 x trivial-kernel time", True, n_met == len(lb),
            f"{n_met}/{len(lb)} shapes; worst {w['us']:.2f} us = {w['us'] / launch_us:.2f} x trivial "
            f"({launch_us:.2f} us) at {where(w)}",
            {"where": where(w), "us": w["us"], "ratio": w["us"] / launch_us})  # fmt: skip
    else:
        add("launch", "T <= 16: time <= 1.5 x trivial-kernel time", False, False, "no T <= 16 shape measured")
    # 3. Peers: never slower, geomean >= 1.15.
    for peer in (p for p in PEERS if p != "vllm_k3"):  # K3 is an epilogue peer (issue10_targets)
        pairs = []
        for r in ok:
            if r["impl"] == peer and r["section"] == "sweep" and key(r) in ours:
                pairs.append((r["us"] / ours[key(r)]["us"], r))
        text = f"vs {peer} (sweep): never slower, geomean speedup >= 1.15"
        if not pairs:
            reason = next((r.get("reason") for r in results if r["impl"] == peer and r["status"] != "n/a"), None)
            add(f"vs_{peer}", text, False, False, f"not measured ({reason or 'no applicable shape ran'})")
            continue
        g = _geomean([s for s, _ in pairs])
        s_min, w = min(pairs, key=lambda p: p[0])
        add(f"vs_{peer}", text, True, g >= 1.15 and s_min >= 1.0,
            f"geomean {g:.3f}x over {len(pairs)} shapes; min {s_min:.3f}x at {where(w)}",
            {"geomean": g, "min": s_min, "where": where(w), "n": len(pairs)})  # fmt: skip
    # 4. Decode: op 2 vs the unfused chain, T <= 64.
    pairs = []
    for r in ok:
        if r["impl"] == "unfused" and r["op"] == "decode" and r["T"] <= 64 and key(r) in ours:
            pairs.append((r["us"] / ours[key(r)]["us"], r))
    text = "decode (op 2) vs unfused chain, T <= 64: >= 2x faster"
    if pairs:
        s_min, w = min(pairs, key=lambda p: p[0])
        add("decode_vs_unfused", text, True, s_min >= 2.0,
            f"min {s_min:.2f}x over {len(pairs)} shapes ({w['section']} {where(w)}); "
            f"geomean {_geomean([s for s, _ in pairs]):.2f}x",
            {"min": s_min, "where": where(w), "n": len(pairs)})  # fmt: skip
    else:
        add("decode_vs_unfused", text, False, False, "not measured")
    targets += issue10_targets(results, launch_us, smoke)
    return targets


# vLLM's Kimi-K3 epilogue as measured in issue 10 (H200, 2026-12-01; us per call), (H, T) -> us.
K3_ISSUE10_US = {(16, 1): 2.02, (16, 16): 2.88, (16, 64): 3.14, (16, 256): 3.91, (16, 4096): 27.65,
                 (128, 1): 2.68, (128, 64): 4.82, (128, 1024): 47.21, (128, 4096): 181.8}  # fmt: skip


def issue10_targets(results: list[dict], launch_us: float, smoke: bool) -> list[dict]:
    """Issue 10's targets: the epilogue (op 3), op 1 at large T, two decode shapes; and issue 41's op 2
    against K3's decode ops."""
    ok = [r for r in results if r["status"] == "ok"]
    out = []

    def add(tid, text, rows, met, detail):
        status = "not measured" if not rows else ("met" if met else "NOT MET")
        if smoke and rows:
            status += " (CPU smoke: meaningless)"
        out.append({"id": tid, "target": text, "status": status, "detail": detail if rows else "not measured"})

    def where(r):
        return f"H={r['H']} T={r['T']} {r['cache']}" + (f" key {r['key']}" if r.get("key") else "")

    epi = [r for r in ok if r["section"] == "epilogue" and r["impl"] == "triton"]
    bw = [r for r in epi if r["bw_term_us"] >= 5.0]
    w = min(bw, key=lambda r: r["efficiency"]) if bw else None
    add("epilogue_bandwidth", "epilogue (op 3): efficiency >= 0.90 where bytes/copy-bandwidth >= 5 us", bw,
        bw and all(r["efficiency"] >= 0.90 for r in bw),
        w and f"{sum(r['efficiency'] >= 0.90 for r in bw)}/{len(bw)} shapes; min {w['efficiency']:.3f} at {where(w)}")
    bf16 = {(r["H"], r["T"]): r for r in epi if r["cache"] == "bf16" and r.get("key") == "bf16"}
    pairs = [(K3_ISSUE10_US[k] / r["us"], k) for k, r in bf16.items() if k in K3_ISSUE10_US]
    s_min = min(pairs) if pairs else None
    add("epilogue_vs_k3_issue", "epilogue (op 3) >= 1.3x faster than issue 10's K3 figures at every shape", pairs,
        pairs and s_min[0] >= 1.3,
        s_min and f"min {s_min[0]:.2f}x at H={s_min[1][0]} T={s_min[1][1]} over {len(pairs)} shapes; "
        + ", ".join(f"({h},{t}) {x:.2f}x" for x, (h, t) in sorted(pairs, key=lambda p: p[1])))
    k3 = {(r["H"], r["T"]): r for r in ok if r["section"] == "epilogue" and r["impl"] == "vllm_k3"}
    same = [(k3[k]["us"] / r["us"], k) for k, r in bf16.items() if k in k3]
    s_min = min(same) if same else None
    add("epilogue_vs_k3_same_run", "epilogue (op 3) vs vLLM's K3 kernel in this run: >= 1.3x at every shape", same,
        same and s_min[0] >= 1.3,
        s_min and f"min {s_min[0]:.2f}x at H={s_min[1][0]} T={s_min[1][1]}; geomean "
        f"{_geomean([x for x, _ in same]):.2f}x over {len(same)} shapes")
    # Issue 41: op 2 never slower than K3's decode ops, in bf16 or fp8, at any shape (same run).
    # Rows whose output check failed compare nothing (either side).
    checked = [r for r in ok if not r.get("check_failed")]
    k3_dec = {(r["cache"], r["H"], r["block_size"], r["T"]): r for r in checked
              if r["section"] == "sweep" and r["op"] == "decode" and r["impl"] == "vllm_k3"}  # fmt: skip
    dec_pairs = [(k3_dec[k]["us"] / r["us"], k) for r in checked
                 if r["section"] == "sweep" and r["op"] == "decode" and r["impl"] == "triton"
                 and (k := (r["cache"], r["H"], r["block_size"], r["T"])) in k3_dec]  # fmt: skip
    s_min = min(dec_pairs) if dec_pairs else None
    add("decode_vs_k3_same_run", "decode (op 2) vs vLLM's K3 decode ops in this run: never slower (>= 1.0x)",
        dec_pairs, dec_pairs and s_min[0] >= 1.0,
        s_min and f"min {s_min[0]:.3f}x at {s_min[1][0]} H={s_min[1][1]} T={s_min[1][3]} bs={s_min[1][2]}; slower at "
        f"{sum(x < 1.0 for x, _ in dec_pairs)} of {len(dec_pairs)}; geomean "
        + ", ".join(f"{c} {_geomean([x for x, k in dec_pairs if k[0] == c]):.3f}x"
                    for c in sorted({k[0] for _, k in dec_pairs})))  # fmt: skip
    op1 = [r for r in ok if r["section"] == "sweep" and r["impl"] == "triton" and r["op"] == "prefill"
           and r["T"] >= 4096]  # fmt: skip
    w = min(op1, key=lambda r: r["efficiency"]) if op1 else None
    add("op1_large_T", "op 1: efficiency >= 0.90 at T >= 4096", op1, op1 and all(r["efficiency"] >= 0.90 for r in op1),
        w and f"{sum(r['efficiency'] >= 0.90 for r in op1)}/{len(op1)} shapes; min {w['efficiency']:.3f} at "
        f"{where(w)} bs={w['block_size']}")
    dec = {(r["cache"], r["block_size"], r["T"]): r for r in ok
           if r["section"] == "sweep" and r["impl"] == "triton" and r["op"] == "decode" and r["H"] == 128}  # fmt: skip
    t16 = [r for (c, bs, T), r in dec.items() if T == 16]
    worst = max(t16, key=lambda r: r["us"]) if t16 else None
    add("decode_H128_T16", "decode H=128 T=16: <= 1.5 x the trivial kernel", t16,
        t16 and all(r["us"] <= 1.5 * launch_us for r in t16),
        worst and f"worst {worst['us']:.2f} us = {worst['us'] / launch_us:.2f} x trivial ({launch_us:.2f} us), "
        f"{where(worst)} bs={worst['block_size']}")
    t256 = [r for (c, bs, T), r in dec.items() if T == 256]
    worst = min(t256, key=lambda r: r["efficiency"]) if t256 else None
    add("decode_H128_T256", "decode H=128 T=256: efficiency >= 0.90", t256,
        t256 and all(r["efficiency"] >= 0.90 for r in t256),
        worst and f"min {worst['efficiency']:.3f} ({worst['us']:.2f} us), {where(worst)} bs={worst['block_size']}")
    return out


def environment(args, device) -> dict:
    import torch

    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": torch.version.hip,
        "host": platform.node(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        env["triton"] = f"unavailable: {e}"
    env.update(provenance.source_facts(REPO))  # commit, dirtiness and the package's digest
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env["device"] = {"name": p.name, "sms": p.multi_processor_count, "memory_GiB": p.total_memory / 2**30,
                         "L2_bytes": getattr(p, "L2_cache_size", None),
                         "capability": f"{p.major}.{p.minor}"}  # fmt: skip
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem,clocks.max.sm",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=10)  # fmt: skip
            env["nvidia_smi"] = q.stdout.strip() or None
        except Exception:  # noqa: BLE001
            env["nvidia_smi"] = None
    else:
        env["device"] = {"name": f"CPU ({platform.processor() or platform.machine()}), Triton interpreter"}
    return env


def write_outputs(out_dir: Path, report: dict, final: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench_mla_rope_cache.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)
    if final:
        log(f"wrote {path}")


def markdown_report(report: dict, impls: tuple[str, ...]) -> str:
    res = report["results"]
    dev = report["environment"]["device"]["name"]
    c = report["calibration"]["start"]
    lines = [
        f"Device: {dev}; torch {report['environment']['torch']}, Triton {report['environment']['triton']}; "
        f"{report['environment']['date_utc']}.",
        f"Command: `{' '.join(report['environment']['argv'])}`",
        f"Launch floor (trivial kernel, CUDA graph): {c['launch']['floor_us']:.2f} us; "
        f"copy bandwidth {c['copy']['TBps']:.3f} TB/s.",
        "",
    ]
    for section, title in (("sweep", "Sweep (us per call)"), ("mixed", "Mixed decode-first batches (us per call)"),
                           ("epilogue", "Prefill epilogue, op 3 (issue 10; us per call)")):  # fmt: skip
        head, rows = table_rows(res, section, section_impls(res, section, impls))
        if rows:
            lines += [f"### {title}", "", format_table(head, rows, markdown=True), ""]
    head, rows = decode_layer_rows(res, section_impls(res, "decode-layer", impls))
    if rows:
        lines += ["### Decode layer (issue 4): q/k preparation per MLA layer per decode step", "",
                  format_table(head, rows, markdown=True), ""]  # fmt: skip
    lines += ["### Targets (issues 6 and 10)", "", "| target | status | numbers |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['status']} | {t['detail']} |" for t in report["targets"]]
    lines += ["", "Legend: " + "; ".join(f"`{SHORT[i]}` = {LABELS[i]}" for i in impls)]
    return "\n".join(lines) + "\n"


def plot(report: dict, out_dir: Path, impls: tuple[str, ...]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        log(f"plot skipped: matplotlib unavailable ({type(e).__name__}: {e})")
        return []
    res = [r for r in report["results"] if r["status"] == "ok"]
    c = report["calibration"]["start"]
    launch, bps = c["launch"]["floor_us"], c["copy"]["bytes_per_s"]
    written = []
    markers = dict(zip(IMPLS, "os^<>vDPX*", strict=True))

    def panel(ax, rows, title):
        for impl in impls:
            pts = sorted((r["T"], r["us"]) for r in rows if r["impl"] == impl)
            if pts:
                ax.plot(*zip(*pts), marker=markers[impl], ms=3, lw=1.2, label=SHORT[impl])
        fl = sorted({(r["T"], r["floor_us"]) for r in rows})
        if fl:
            ax.plot(*zip(*fl), "k--", lw=1, label="floor")
            ax.axhline(launch, color="grey", lw=0.6, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("tokens")
        ax.set_ylabel("us per call")
        ax.grid(True, which="both", lw=0.3)

    sweep = [r for r in res if r["section"] == "sweep"]
    if sweep:
        bs = max(r["block_size"] for r in sweep)
        keys = sorted({(r["op"], r["H"], r["cache"]) for r in sweep})
        ncol = min(4, len(keys))
        nrow = math.ceil(len(keys) / ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.6 * nrow), squeeze=False)
        for ax, (op, H, cache) in zip(axes.flat, keys):
            rows = [r for r in sweep if (r["op"], r["H"], r["cache"], r["block_size"]) == (op, H, cache, bs)]
            panel(ax, rows, f"{'op 1 prefill' if op == 'prefill' else 'op 2 decode'}, H={H}, {cache} cache, bs={bs}")
        for ax in list(axes.flat)[len(keys) :]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.suptitle(f"{report['environment']['device']['name']}: time per call (CUDA graph; torch-ref* eager); "
                     f"floor = max({launch:.2f} us, bytes / {bps / 1e12:.2f} TB/s)", fontsize=10)  # fmt: skip
        fig.tight_layout()
        p = out_dir / "bench_mla_rope_cache.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(str(p))
    dl = [r for r in res if r["section"] == "decode-layer"]
    if dl:
        keys = sorted({(r["H"], r["cache"]) for r in dl})
        fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
        for ax, (H, cache) in zip(axes.flat, keys):
            panel(ax, [r for r in dl if (r["H"], r["cache"]) == (H, cache)], f"decode layer, H={H}, {cache}")
            ax.set_xlabel("decode batch")
            ax.set_ylabel("us per layer per step")
        axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        p = out_dir / "bench_decode_layer.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(str(p))
    epi = [r for r in res if r["section"] == "epilogue"]
    if epi:
        keys = sorted({(r["H"], r["cache"], r["key"]) for r in epi})
        fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
        for ax, (H, cache, key) in zip(axes.flat, keys):
            panel(ax, [r for r in epi if (r["H"], r["cache"], r["key"]) == (H, cache, key)],
                  f"epilogue (op 3), H={H}, {cache} cache, {key} key")  # fmt: skip
        axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        p = out_dir / "bench_epilogue.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(str(p))
    for p in written:
        log(f"wrote {p}")
    return written


# ---------------------------------------------------------------------------
# Command line.


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a subset: T in %s, block size 64, no torch.compile"
                      % (TOKENS_QUICK,))  # fmt: skip
    mode.add_argument(
        "--smoke",
        action="store_true",
        help="CPU only, Triton interpreter, tiny shapes, no CUDA graphs: checks the code paths run",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="output directory (default: %(default)s)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=None, help="default: all")
    p.add_argument("--decode-layer", action="store_true",
                   help="only the decode-layer section (same as --sections decode-layer)")  # fmt: skip
    p.add_argument("--ops", nargs="+", choices=("prefill", "decode"), default=["prefill", "decode"])
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=None, help="default: all (peers when importable)")
    p.add_argument("--heads", nargs="+", type=int, default=None)
    p.add_argument("--tokens", nargs="+", type=int, default=None)
    p.add_argument("--cache-dtypes", nargs="+", choices=CACHE_DTYPES, default=list(CACHE_DTYPES))
    p.add_argument("--block-sizes", nargs="+", type=int, choices=(1, 16, 32, 64, 128), default=None)
    p.add_argument("--decode-batches", nargs="+", type=int, default=None)
    p.add_argument("--neox", action="store_true", help="NeoX rotation instead of GPT-J (DeepSeek uses GPT-J)")
    p.add_argument("--repeats", type=int, default=15, help="graph replays timed per measurement (median)")
    p.add_argument("--target-us", type=float, default=None, help="work per graph replay (sets calls per graph)")
    p.add_argument("--max-calls", type=int, default=None, help="cap on calls captured per graph")
    p.add_argument("--rotate-factor", type=float, default=4.0, help="input sets cover this many x L2 when possible")
    p.add_argument("--check-max-tokens", type=int, default=1024,
                   help="check outputs against the torch reference up to this T (0: never)")  # fmt: skip
    p.add_argument("--copy-bytes", type=int, default=1 << 30, help="size of the bandwidth-probe copy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp8-scales", nargs=2, type=float, default=(KV_CACHE_SCALE, Q_SCALE), metavar=("KV", "Q"),
                   help="kv_cache_scale and q_scale of the fp8 configs (default %(default)s; vLLM's default is 1.0)")
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=480.0,
        help="skip the remaining configs once this much time has passed (default: %(default)s)",
    )
    p.add_argument("--plugin-launches", action="store_true",
                   help="launch this project's op ('triton') as the vLLM plugin does: bound with the early-index-loads "
                   "promise (binding.py), which on sm_90 reads positions, slots and cos/sin before the "
                   "grid-dependency wait; the default is the public ops, which never do")  # fmt: skip
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing implementations")
    # Dimensions (DeepSeek-V3 by default; --smoke shrinks them).
    p.add_argument("--kv-lora-rank", type=int, default=None)
    p.add_argument("--rope-dim", type=int, default=None)
    p.add_argument("--max-position", type=int, default=None)
    p.add_argument("--nope-head-dim", type=int, default=None)
    args = p.parse_args(argv)

    smoke, quick = args.smoke, args.quick
    if args.decode_layer:
        args.sections = ["decode-layer"]
    args.sections = args.sections or list(SECTIONS)
    dflt = lambda name, full, q, s: setattr(args, name, getattr(args, name) if getattr(args, name) is not None  # noqa: E731
                                            else (s if smoke else q if quick else full))  # fmt: skip
    dflt("heads", list(HEADS), list(HEADS), [2])
    dflt("tokens", list(TOKENS), list(TOKENS_QUICK), [1, 5])
    dflt("block_sizes", list(BLOCK_SIZES), [64], [1, 16])
    dflt("decode_batches", list(DECODE_BATCHES), list(DECODE_BATCHES_QUICK), [1, 2])
    dflt("kv_lora_rank", KV_LORA_RANK, KV_LORA_RANK, 128)
    dflt("rope_dim", ROPE_DIM, ROPE_DIM, ROPE_DIM)
    dflt("max_position", MAX_POSITION, MAX_POSITION, 256)
    dflt("nope_head_dim", QK_NOPE_HEAD_DIM, QK_NOPE_HEAD_DIM, 32)
    dflt("target_us", 2000.0, 1000.0, 0.0)
    dflt("max_calls", 400, 100, 1)
    args.mixed = [(2, 3)] if smoke else list(MIXED_SPLITS_QUICK if quick else MIXED_SPLITS)
    if args.impls is None:
        args.impls = [i for i in IMPLS if not (quick and i == "torch_compile")]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        # Must precede the first import of triton (the interpreter is chosen at kernel definition).
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not args.smoke and not torch.cuda.is_available():
        log("error: no GPU visible to torch; run with --smoke for the CPU code-path check")
        return 2
    t_start = time.perf_counter()
    runner = Runner(args)
    impls = tuple(args.impls)
    env = environment(args, runner.device)
    log(f"bench_mla_rope_cache: {env['device']['name']}; torch {env['torch']} (CUDA {env['torch_cuda']}), "
        f"Triton {env['triton']}, Python {env['python']}; commit {env.get('git_commit')}"
        f"{' (dirty)' if env.get('git_dirty') else ''}")  # fmt: skip
    config_info = {
        "mode": "smoke" if args.smoke else "quick" if args.quick else "full",
        "sections": args.sections, "ops": args.ops, "impls": list(impls), "heads": args.heads, "tokens": args.tokens,
        "cache_dtypes": args.cache_dtypes, "block_sizes": args.block_sizes, "decode_batches": args.decode_batches,
        "mixed_splits": args.mixed, "kv_lora_rank": args.kv_lora_rank, "rope_dim": args.rope_dim,
        "max_position": args.max_position, "q_nope_head_dim": args.nope_head_dim,
        "rotation": "neox" if args.neox else "gptj", "activation_dtype": "bfloat16", "cos_sin_cache": "float32",
        "index_dtype": "int64", "fp8_format": str(runner.fp8_dtype), "kv_cache_scale": args.fp8_scales[0],
        "q_scale": args.fp8_scales[1], "fp8_cache_storage": "uint8 (kv_cache_dtype='fp8')",
        "q_pe": "q[..., nope:] of [T, H, nope+R]", "k_pe": "kv_a[:, L:] of [T, L+R]",
        "ql_nope": "[H, T, L].transpose(0, 1) (bmm output)", "slots": "random permutation (unique, no padding)",
        "positions": "uniform random in [0, max_position)", "repeats": args.repeats, "target_us": args.target_us,
        "max_calls": args.max_calls, "rotate_factor": args.rotate_factor, "L2_bytes": runner.l2,
        "check_max_tokens": args.check_max_tokens, "seed": args.seed, "plugin_launches": args.plugin_launches,
    }  # fmt: skip
    for k, v in config_info.items():
        log(f"  {k}: {v}")
    report = {"environment": env, "config": config_info, "labels": {i: LABELS[i] for i in impls},
              "calibration": runner.calibration, "peers": runner.peers, "results": runner.results,
              "targets": [], "timings_s": {}}  # fmt: skip
    runner.calibrate("start")
    # Peer availability, reported up front.
    for peer in (i for i in impls if i in PEERS):
        try:
            runner.impls._peer(peer)
            runner.peers[peer] = "available"
        except Unavailable as u:
            runner.peers[peer] = f"missing: {u.reason}"
        log(f"  peer {peer}: {runner.peers[peer]}")

    # The small sections first, so that a run cut short by --time-budget-s still has them.
    sections = []
    if "decode-layer" in args.sections:
        sections.append(("decode-layer", decode_layer_configs(args), tuple(i for i in impls if i not in TORCH_IMPLS)))
    if "mixed" in args.sections:
        mixed_impls = tuple(i for i in impls if i in ("triton", "unfused", "torch_ref"))
        sections.append(("mixed", mixed_configs(args), mixed_impls))
    if "epilogue" in args.sections:
        epi_impls = tuple(i for i in impls if i in ("triton", "unfused", "op1_cat", "triton_dense", "torch_ref",
                                                    "vllm_fused", "vllm_k3"))  # fmt: skip
        sections.append(("epilogue", epilogue_configs(args), epi_impls))
    if "sweep" in args.sections:
        sections.append(("sweep", sweep_configs(args), impls))
    total = sum(len(c) for _, c, _ in sections)
    done = 0
    report["skipped_configs"] = skipped = []
    for name, configs, sec_impls in sections:
        t0 = time.perf_counter()
        log(f"== section {name}: {len(configs)} configs, implementations {', '.join(sec_impls)}")
        for cfg in configs:
            done += 1
            if time.perf_counter() - t_start > args.time_budget_s:
                skipped.append(cfg.name())
                continue
            runner.run_config(cfg, sec_impls, f"{done}/{total}")
            if done % 8 == 0:
                write_outputs(args.out, report, final=False)
        report["timings_s"][name] = time.perf_counter() - t0
        write_outputs(args.out, report, final=False)
    if skipped:
        log(f"time budget ({args.time_budget_s:.0f} s) reached: {len(skipped)} configs skipped, first: {skipped[0]}")
    runner.calibrate("end")

    # Tables.
    res = runner.results
    log("")
    log(f"Legend ({env['device']['name']}; us per call, median of CUDA-graph replays unless noted; "
        "'!' = output check failed; miss = peer not importable; ERR = failed; - = not applicable):")  # fmt: skip
    for i in impls:
        log(f"  {SHORT[i]:>10} = {LABELS[i]}")
    if args.smoke:
        log("  SMOKE MODE: host wall-clock of CPU / Triton-interpreter runs, no CUDA graphs: the numbers mean nothing")
    log("  KB/call = bytes each call must move (each input read once, each output written once); bw us = that / copy "
        "bandwidth; floor = max(launch floor, bw us); eff = floor / time; x unfused, x k3, x aiter = their time / ours; "
        "L2 = the rotated input sets fit in L2 (launch-bound shapes only)")  # fmt: skip
    for section, title in (("sweep", "SWEEP"), ("mixed", "MIXED DECODE-FIRST BATCHES"),
                           ("epilogue", "PREFILL EPILOGUE (op 3, issue 10)")):  # fmt: skip
        head, rows = table_rows(res, section, section_impls(res, section, impls))
        if rows:
            log(f"\n{title}\n" + format_table(head, rows))
    head, rows = decode_layer_rows(res, section_impls(res, "decode-layer", impls))
    if rows:
        log(
            "\nDECODE LAYER (issue 4): q/k preparation region of one MLA layer per decode step\n"
            + format_table(head, rows)
        )

    report["targets"] = evaluate_targets(res, runner.launch_us, args.smoke)
    log("\nTARGETS (issues 6 and 10, this project's Triton backend)")
    for t in report["targets"]:
        log(f"  [{t['status']}] {t['target']}: {t['detail']}")
    problems = [r for r in res if r["status"] == "error" or r.get("check_failed")]
    if problems:
        log("\nPROBLEMS")
        for r in problems:
            why = r.get("reason") or json.dumps(r.get("check"))
            where = Config(r["section"], r["op"], r["H"], r["T"], r["cache"], r["block_size"], r["decode_tokens"],
                           r.get("key", ""))  # fmt: skip
            log(f"  {r['impl']} {where.name()}: {why}")
    # First eager call per implementation (includes Triton / Inductor compilation): where the run's time goes.
    first = {}
    for r in res:
        ms = max((r.get("check") or {}).get("call_ms", 0.0), r.get("first_call_ms", 0.0) or 0.0)
        first[r["impl"]] = first.get(r["impl"], 0.0) + ms
    report["first_call_s"] = {k: v / 1e3 for k, v in first.items()}
    log("\nFIRST-CALL WALL TIME (compilation included), summed per implementation: "
        + ", ".join(f"{SHORT[k]} {v / 1e3:.1f} s" for k, v in first.items() if v))  # fmt: skip
    missing = {k: v for k, v in runner.peers.items() if v != "available"}
    if missing:
        log("\nPEERS NOT MEASURED: " + "; ".join(f"{k} ({v})" for k, v in missing.items()))

    report["timings_s"]["total"] = time.perf_counter() - t_start
    write_outputs(args.out, report, final=True)
    md = args.out / "bench_mla_rope_cache.md"
    md.write_text(markdown_report(report, impls))
    log(f"wrote {md}")
    if not args.no_plot:
        report["plots"] = plot(report, args.out, impls)
        write_outputs(args.out, report, final=False)
    log(f"total {report['timings_s']['total']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
