"""Optional loader for AMD AITER's Triton MLA op, a peer for cross-checks and benchmarks.

AITER's ``fused_qk_rope_cat_and_cache_mla`` (Triton, so it also runs on
NVIDIA GPUs for bf16 caches) does what this project's op 2 does, with other
conventions. It is never bundled or installed by this project:
``scripts/fetch_aiter_triton.sh`` unpacks the op's files from the ``amd-aiter``
wheel into ``<repo>/third_party_aiter/`` (git-ignored), and this module finds
them only through ``VLLM_MLA_FUSION_AITER_TRITON_PATH`` or that default
folder. Without them, ``load()`` returns None and ``unavailable_reason()``
says why.

Differences from this project's op 2 (read from the 0.1.7 wheel's
``aiter/ops/triton/_triton_kernels/fused_kv_cache.py``):

- rope is computed in the operands' type: with bf16 cos/sin every product is
  rounded to bf16 (about one bf16 ulp off on a fifth of the rotated values);
  with float32 cos/sin the math is float32, like ours.
- no position clamp: an out-of-range position reads out of bounds.
- slot < 0: no cache write, but ``q_out`` is still computed (as ours).
- an fp8 ``q_out`` is a plain cast (no ``q_scale``); the cache value is
  ``x * (1 / k_scale)`` (ours: ``x / k_scale``, equal for powers of two).
- the cache must be ``[num_slots, 1, L+R]`` (page size 1): a paged cache is
  viewed so, which needs densely packed blocks.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from vllm_mla_fusion import mla_decode_rope_cache_write

ENV_PATH = "VLLM_MLA_FUSION_AITER_TRITON_PATH"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PATH = REPO_ROOT / "third_party_aiter"
# Module paths of the op: HEAD moved it under fusions/ (a compat map keeps the old path).
_MODULES = ("aiter.ops.triton.fusions.fused_kv_cache", "aiter.ops.triton.fused_kv_cache")
_OP = "fused_qk_rope_cat_and_cache_mla"


@dataclass(frozen=True)
class AiterTritonOp:
    fn: Callable
    module: str
    path: Path | None  # the folder put on sys.path, None when an already imported aiter was used
    version: str  # from AITER_VERSION written by the fetch script, else "unknown"


def search_path() -> Path | None:
    """The folder holding ``aiter/ops/triton``: ``$VLLM_MLA_FUSION_AITER_TRITON_PATH``, else ``<repo>/third_party_aiter``."""
    env = os.environ.get(ENV_PATH, "").strip()
    path = Path(env).expanduser() if env else DEFAULT_PATH
    return path if (path / "aiter" / "ops" / "triton").is_dir() else None


def _version(path: Path | None) -> str:
    try:
        return (path / "AITER_VERSION").read_text().splitlines()[0].strip() if path else "unknown"
    except (OSError, IndexError):
        return "unknown"


@functools.lru_cache(maxsize=1)
def _load() -> tuple[AiterTritonOp | None, str | None]:
    path = search_path()
    loaded = sys.modules.get("aiter")
    if loaded is not None:
        # Never mix two AITERs in one process: use the one already imported if it has the op.
        origin = Path(next(iter(getattr(loaded, "__path__", [])), "")).resolve()
        if path is None or origin != (path / "aiter").resolve():
            path = None
    elif path is None:
        where = os.environ.get(ENV_PATH) or DEFAULT_PATH
        return None, f"AITER's Triton op is not unpacked at {where}; run scripts/fetch_aiter_triton.sh"
    else:
        sys.path.insert(0, str(path))
        # A full AITER source tree (not the fetch script's stub) needs this to import without ROCm.
        os.environ.setdefault("AITER_TRITON_ONLY", "1")
    errors = []
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - report, never crash a test collection
            errors.append(f"{name}: {type(e).__name__}: {e}")
            continue
        fn = getattr(module, _OP, None)
        if callable(fn):
            return AiterTritonOp(fn, name, path, _version(path)), None
        errors.append(f"{name} has no {_OP}")
    return None, "cannot import AITER's Triton op: " + "; ".join(errors)


def load() -> AiterTritonOp | None:
    """The op, or None when it is not available (see ``unavailable_reason``)."""
    return _load()[0]


def unavailable_reason() -> str | None:
    return _load()[1]


def mla_decode(op: AiterTritonOp, *args, **kwargs) -> torch.Tensor:
    """Op 2's call run by AITER's Triton op; returns ``q_out``.

    The arguments are ``vllm_mla_fusion.mla_decode_rope_cache_write``'s (bound against its
    signature: the op's one definition), with ``kv_cache`` typed, not uint8; the fp8 format
    comes from its dtype, so ``kv_cache_dtype`` is not read, nor ``q_scale`` (a bf16 query),
    ``is_nope_first`` (AITER's order is nope first) or ``backend``. ``positions`` and
    ``slot_mapping`` must have exactly T entries (AITER takes the token count from them).
    """
    call = inspect.signature(mla_decode_rope_cache_write).bind(*args, **kwargs)
    call.apply_defaults()
    a = call.arguments
    if a["kv_cache_dtype"] != "auto" or a["q_scale"] is not None or not a["is_nope_first"]:
        raise ValueError("AITER's Triton op takes the cache's format from its dtype, a bf16 query and the nope "
                         "part first: kv_cache_dtype='auto', q_scale=None, is_nope_first=True")  # fmt: skip
    positions, ql_nope, q_pe, k_pe, kv_c = a["positions"], a["ql_nope"], a["q_pe"], a["k_pe"], a["kv_c"]
    cos_sin_cache, is_neox, slot_mapping, kv_cache, q_out = (a["cos_sin_cache"], a["is_neox"], a["slot_mapping"],
                                                             a["kv_cache"], a["q_out"])  # fmt: skip
    kv_cache_scale = a["kv_cache_scale"]
    T, H, R = q_pe.shape
    L = kv_c.shape[-1]
    if kv_cache.shape[1] != 1:
        # Page size 1 is AITER's layout; view() raises if the blocks are not densely packed.
        kv_cache = kv_cache.view(-1, 1, L + R)
    k_nope = kv_c.reshape(T, 1, L) if kv_c.dim() == 2 else kv_c
    k_pe3 = k_pe.reshape(T, 1, R) if k_pe.dim() == 2 else k_pe
    cos = cos_sin_cache[:, : R // 2]  # strided views are fine: the kernel takes cos.stride(0), stride(-1)
    sin = cos_sin_cache[:, R // 2 :]
    fp8_cache = kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)
    if kv_cache_scale is None:
        kv_cache_scale = torch.ones(1, dtype=torch.float32, device=kv_cache.device)
    out = op.fn(
        ql_nope, q_pe, k_nope, k_pe3, kv_cache, slot_mapping, positions, cos, sin, kv_cache_scale, is_neox,
        num_decode_toks_for_zeros=0, apply_scale=fp8_cache, q_out=q_out,
    )  # fmt: skip
    # <= 0.1.9: (q_out, decode_q_pe_out, k_pe_out, kv_cache); >= 0.1.10: (q_out, decode_q_pe_out, k_pe_out, zeros).
    return out[0]
