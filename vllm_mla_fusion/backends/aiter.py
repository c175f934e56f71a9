"""AMD AITER's fused HIP kernel for the decode op, on ROCm GPUs.

AITER's ``fused_qk_rope_concat_and_cache_mla`` (``aiter/ops/cache.py``, host
code in ``csrc/kernels/cache_kernels.cu``) writes the decode query
``[ql_nope | rope(q_pe)]`` and the cache row ``[kv_c | rope(k_pe)]`` in one
launch. This module maps :func:`vllm_mla_fusion.mla_decode_rope_cache_write`
onto it where, and only where, the kernel computes exactly this project's
semantics (``decline_reason`` lists every case it refuses and why); the
dispatcher and, for properties only the tensors show, this module itself send
the other calls to the Triton kernel. ``docs/rocm.md`` has the table.

Three layers, so that everything but the kernel launch runs on a CPU in CI:

1. Probing (``unavailable_reason``): ROCm torch, a supported chip, AITER new
   enough to have ``compute_all_q_rope``. Probed once per device, and never
   imports ``aiter`` on a machine without ROCm.
2. Policy (``select_kernel``, ``decline_reason``, ``call_decline_reason``):
   pure functions of sizes, dtypes, strides and the chip name.
3. Preparation (``prepare_decode_args``): views and index conversions that
   turn validated arguments into the HIP op's, plus the per-rope-cache cos/sin
   split (``RopeSplitCache``), computed once per rope cache, not per call.

Op 1 (``mla_rope_cache_write``) rotates ``q_pe``/``k_pe`` in place; the HIP
op never writes them, so op 1 never runs here (``applies(False, ...)`` is
False and ``bind`` hands ops 1 and 3 to the Triton kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import fp8
from ..environment import env_flag
from ..opcodes import OP_DECODE
from ..validation import Problem

__all__ = [
    "AITER_OP",
    "MIN_AITER_VERSION",
    "ENV_FP8",
    "AiterArgs",
    "RopeSplitCache",
    "applies",
    "call_decline_reason",
    "cache_view",
    "decline_reason",
    "decode_rope_cache_write",
    "guard_slots",
    "native_fp8_dtype",
    "prepare_decode_args",
    "rope_cache_write",
    "select_kernel",
    "unavailable_reason",
]

logger = logging.getLogger(__name__)

AITER_OP = "fused_qk_rope_concat_and_cache_mla"
# First tag whose op takes compute_all_q_rope (ROCm/aiter PR #4342, 2026-07-29):
# without it the decode kernels leave q_out unwritten for padded tokens.
MIN_AITER_VERSION = "0.1.19.post1"
# AITER's opus types: clang < 20 (ROCm 6.x) registers bf16_t as unsigned short
# (csrc/include/opus/opus.hpp REGISTER_DTYPE), and the kernel's
# static_cast<float>(bf16) would then convert the bit pattern as an integer.
MIN_HIP_VERSION = (7, 0)
# Chips AITER builds this kernel for, with their native e4m3 flavour
# (aiter/utility/dtypes.py defaultDtypes). The op asserts "Unsupported dtype"
# for the other flavour, so an fp8 cache must be of exactly this type.
_NATIVE_FP8 = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}
# fp8 outputs are opt-in: see decline_reason.
ENV_FP8 = "VLLM_MLA_FUSION_AITER_FP8"

# Kernel selection constants of the host function (cache_kernels.cu,
# fused_qk_rope_concat_and_cache_mla "Kernel Dispatch Logic").
_OPT_KV_LORA_RANK = 512
_OPT_ROT_DIM = 64
_PER_HEAD_MAX_TOKENS = 256
_OPT_MIN_SIZE = 2048
# Vector loads/stores of 16 bytes (8 x bf16/fp16, 4 x fp32): require 16-byte
# aligned rows rather than rely on the hardware's unaligned-access mode.
_VECTOR_BYTES = 16
# The host function passes strides as C int.
_INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------
# Chip and library probing
# --------------------------------------------------------------------------


def arch_name(gcn_arch_name: str) -> str:
    """``"gfx942:sramecc+:xnack-"`` -> ``"gfx942"`` (torch reports target features after a colon)."""
    return gcn_arch_name.split(":", 1)[0].strip()


def native_fp8_dtype(arch: str | None) -> torch.dtype | None:
    """The fp8 e4m3 type AITER's HIP kernels use on ``arch``, or None if AITER is not used there."""
    if arch is None:
        return None
    return _NATIVE_FP8.get(arch_name(arch))


def parse_hip_version(version: str | None) -> tuple[int, int] | None:
    """``"7.0.51831-a3e329ad8"`` -> ``(7, 0)``; None when it cannot be read."""
    if not version:
        return None
    m = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def source_supports_compute_all(cache_py: str) -> bool:
    """Whether AITER's ``ops/cache.py`` source declares the fused op with ``compute_all_q_rope``.

    Read from the file rather than the imported function: AITER's
    ``torch_compile_guard`` returns a ``(*args, **kwargs)`` wrapper, so
    ``inspect.signature`` cannot see the parameter.
    """
    m = re.search(rf"def {AITER_OP}\((.*?)\)\s*->", cache_py, flags=re.S)
    return bool(m) and "compute_all_q_rope" in m.group(1)


def _aiter_package_dir() -> Path | None:
    # find_spec on the top-level name locates the package without running its __init__.
    spec = importlib.util.find_spec("aiter")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _installed_version(pkg_dir: Path) -> str | None:
    """AITER's version as setuptools_scm wrote it (``aiter/_version.py``), else package metadata."""
    try:
        text = (pkg_dir / "_version.py").read_text()
        m = re.search(r"""__version__\s*=\s*['"]([^'"]+)['"]""", text)
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        from importlib.metadata import version

        return version("amd-aiter")
    except Exception:  # noqa: BLE001 - a version string is only for messages
        return None


@functools.lru_cache(maxsize=None)
def _device_arch(index: int) -> str:
    return arch_name(torch.cuda.get_device_properties(index).gcnArchName)


@functools.lru_cache(maxsize=None)
def _library_unavailable_reason() -> str | None:
    """Library checks that do not depend on the device (run once per process)."""
    pkg_dir = _aiter_package_dir()
    if pkg_dir is None:
        return (
            f"AITER is not installed; it ships in AMD's ROCm vLLM images or builds from github.com/ROCm/aiter "
            f"(>= {MIN_AITER_VERSION}); see requirements-rocm.txt"
        )
    cache_py = pkg_dir / "ops" / "cache.py"
    try:
        source = cache_py.read_text()
    except OSError:
        return (
            f"the installed 'aiter' package at {pkg_dir} has no ops/cache.py, so it is not AMD's AITER "
            "(PyPI's 'aiter' is an unrelated async-iterator library)"
        )
    version = _installed_version(pkg_dir) or "unknown version"
    if f"def {AITER_OP}(" not in source:
        return f"AITER {version} at {pkg_dir} has no {AITER_OP} (added in 0.1.8; need >= {MIN_AITER_VERSION})"
    if not source_supports_compute_all(source):
        return (
            f"AITER {version} at {pkg_dir} is too old: its {AITER_OP} lacks compute_all_q_rope, so padded "
            f"tokens would get no q_out row (need >= {MIN_AITER_VERSION})"
        )
    try:
        import aiter
    except Exception as e:  # noqa: BLE001 - any import failure means "cannot run", never a crash
        return f"importing AITER {version} failed: {type(e).__name__}: {e}"
    if not callable(getattr(aiter, AITER_OP, None)):
        return f"AITER {version} imported but does not export {AITER_OP}"
    return None


@functools.lru_cache(maxsize=None)
def _device_unavailable_reason(index: int) -> str | None:
    hip = parse_hip_version(torch.version.hip)
    if hip is None or hip < MIN_HIP_VERSION:
        return (
            f"ROCm {torch.version.hip} is older than {MIN_HIP_VERSION[0]}.{MIN_HIP_VERSION[1]}; AITER's kernels "
            "mis-handle bf16 when built by its compiler (clang < 20)"
        )
    try:
        arch = _device_arch(index)
    except Exception as e:  # noqa: BLE001
        return f"cannot query GPU {index}: {type(e).__name__}: {e}"
    if native_fp8_dtype(arch) is None:
        return f"GPU {index} is {arch}; AITER's fused MLA kernel is used only on {sorted(_NATIVE_FP8)} here"
    return _library_unavailable_reason()


def unavailable_reason(device: torch.device) -> str | None:
    """None when AITER's fused HIP op can run on ``device``, else why not (never raises).

    Cheap checks first: on a machine without ROCm torch nothing is imported
    and no GPU is queried. The rest is probed once per device and cached.
    """
    device = torch.device(device)
    if torch.version.hip is None:
        return "this torch build has no ROCm support (torch.version.hip is None); AITER's HIP kernels need ROCm"
    if device.type != "cuda":
        return f"AITER runs on ROCm GPU tensors, not on {device.type} tensors"
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
    except Exception as e:  # noqa: BLE001
        return f"no usable ROCm GPU: {type(e).__name__}: {e}"
    return _device_unavailable_reason(index)


def _clear_probe_caches() -> None:
    """Forget probe results (tests; or after installing AITER in a running process)."""
    for probe in (_device_arch, _library_unavailable_reason, _device_unavailable_reason):
        getattr(probe, "cache_clear", lambda: None)()  # tests may have replaced a probe with a plain function


# --------------------------------------------------------------------------
# Policy: which calls AITER computes exactly as this project defines them
# --------------------------------------------------------------------------


def select_kernel(
    num_tokens: int, num_heads: int, kv_lora_rank: int, rope_dim: int, block_size: int, is_nope_first: bool = True
) -> str:
    """The kernel AITER's host function launches for a 2-D ``kv_c``/``k_pe`` (decode) call.

    ``"per_head"`` (grid T*H, 64 threads), ``"opt"`` (grid T, 256 threads) or
    ``"general"`` (no position clamp, ignores ``compute_all_q_rope`` and so
    rejects the flag with an error). Mirrors ``use_per_head_kernel`` and the
    ``_opt`` condition in cache_kernels.cu, where ``num_tokens`` is
    ``slot_mapping.size(0)`` and ``block_size`` is ``kv_cache.size(1)``.
    """
    if (
        is_nope_first
        and kv_lora_rank <= _OPT_KV_LORA_RANK
        and block_size == 1
        and rope_dim == _OPT_ROT_DIM
        and num_tokens < _PER_HEAD_MAX_TOKENS
    ):
        return "per_head"
    if rope_dim == _OPT_ROT_DIM and kv_lora_rank * num_heads >= _OPT_MIN_SIZE and kv_lora_rank == _OPT_KV_LORA_RANK:
        return "opt"
    return "general"


def _kernel_decline_reason(kernel: str, cache_dtype: torch.dtype, arch: str | None) -> str | None:
    if kernel == "general":
        return (
            "the shape selects AITER's general decode kernel, which has no position clamp and writes no q_out "
            "for padded tokens (fewer than 4 heads with 256+ tokens, or a cache that cannot be viewed with "
            "block size 1)"
        )
    if kernel == "opt" and cache_dtype == torch.bfloat16 and arch_name(arch or "") != "gfx950":
        # opus::cast<bf16_t>(float) is fp32_to_bf16<OPUS_FP32_to_BF16_DEFAULT=2>, a truncation, except on
        # gfx950/gfx12 with clang >= 20 (hardware round-to-nearest). The per-head kernel uses static_cast.
        return (
            "AITER's opt kernel (256+ tokens) truncates rope(k_pe) to bf16 on this chip instead of rounding "
            "to nearest; only gfx950 rounds"
        )
    return None


def decline_reason(
    decode: bool, problem: Problem | None, *, arch: str | None, allow_fp8: bool = False
) -> str | None:
    """Why AITER's HIP op does not compute exactly this call's semantics, or None if it does.

    A pure function of the call's sizes and formats (``problem``) and the chip
    (``arch``, None when unknown: every chip-dependent case is then declined).
    It assumes the adapter's cache view of block size 1 (``cache_view``);
    ``call_decline_reason`` rechecks with the real tensors.

    fp8 outputs are declined unless ``allow_fp8``: AITER clamps the latent
    (nope) part to the fp8 range but converts the 64 rotated elements with a
    bare ``v_cvt_pk_fp8_f32`` (``opus::cast<fp8_t>``), so a rotated value
    beyond the fp8 range after scaling is not saturated as this project
    specifies. With a calibrated scale nothing is out of range and the results
    agree within one fp8 rounding (AITER multiplies by ``1/scale`` where the
    spec divides).
    """
    if not decode:
        return "op 1 rotates q_pe and k_pe in place; AITER's fused op leaves them untouched"
    if problem is None:
        return "no call shape was given"
    p = problem
    if p.num_tokens < 1:
        return "no tokens"
    if p.rope_dim != _OPT_ROT_DIM:
        return f"rope_dim {p.rope_dim} != {_OPT_ROT_DIM}: AITER's decode kernels hard-code 64 rotary dims"
    if p.kv_lora_rank != _OPT_KV_LORA_RANK:
        return f"kv_lora_rank {p.kv_lora_rank} != {_OPT_KV_LORA_RANK}: AITER's opt kernel hard-codes 512"
    if p.q_out_dtype is None:
        return "no q_out dtype (not a decode call)"

    cache_fp8 = fp8.is_fp8(p.cache_dtype)
    q_fp8 = fp8.is_fp8(p.q_out_dtype)
    if cache_fp8 or q_fp8:
        native = native_fp8_dtype(arch)
        if native is None:
            return f"fp8 output on an unknown or unsupported chip ({arch}); the fp8 flavour AITER uses depends on it"
        for name, dtype in (("kv_cache", p.cache_dtype), ("q_out", p.q_out_dtype)):
            if fp8.is_fp8(dtype) and dtype != native:
                return f"{name} is {dtype}; AITER on {arch_name(arch)} takes only {native}"
        if q_fp8 and not cache_fp8:
            return "AITER rejects an fp8 q_out with a non-fp8 cache"
        if not allow_fp8:
            return (
                f"fp8 output is off by default: AITER does not saturate the rotated elements when converting "
                f"them to fp8; set {ENV_FP8}=1 to use it anyway"
            )
    elif p.q_out_dtype != p.cache_dtype:
        # With a non-fp8 cache AITER instantiates cache_t = query_t = the input dtype.
        return f"q_out {p.q_out_dtype} and kv_cache {p.cache_dtype} differ; AITER writes both in the input dtype"

    kernel = select_kernel(p.num_tokens, p.num_heads, p.kv_lora_rank, p.rope_dim, block_size=1)
    return _kernel_decline_reason(kernel, p.cache_dtype, arch)


def _arch_of(device: torch.device | None) -> str | None:
    """The chip of ``device`` (or of the current GPU), or None without ROCm."""
    if torch.version.hip is None:
        return None
    try:
        if device is None or device.index is None:
            if not torch.cuda.is_available():
                return None
            return _device_arch(torch.cuda.current_device())
        return _device_arch(device.index)
    except Exception:  # noqa: BLE001 - unknown chip means "declined", never a crash
        return None


def applies(decode: bool, problem: Problem | None, device: torch.device | None = None) -> bool:
    """Whether AITER's HIP op implements exactly this call's semantics (see ``decline_reason``).

    ``device`` defaults to the current GPU; the chip decides the fp8 flavour
    and the bf16 rounding of one kernel.
    """
    if not decode or problem is None:
        return False
    return decline_reason(decode, problem, arch=_arch_of(device), allow_fp8=env_flag(ENV_FP8)) is None


def _aligned(t: torch.Tensor, dims: tuple[int, ...]) -> bool:
    size = t.element_size()
    if t.data_ptr() % _VECTOR_BYTES:
        return False
    return all((t.stride(d) * size) % _VECTOR_BYTES == 0 for d in dims if t.shape[d] > 1)


def cache_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The paged cache as ``[num_slots, 1, L+R]`` when its rows are densely packed, else unchanged.

    Block size 1 selects AITER's per-head kernel for fewer than 256 tokens
    (the fastest for decode) and makes the slot the row index, exactly this
    project's addressing. A cache with padding between blocks cannot be
    viewed so; it is passed as is (the opt kernel honours its strides).
    """
    nb, bs, d = kv_cache.shape
    if bs == 1:
        return kv_cache
    rows_dense = kv_cache.stride(2) == 1 and kv_cache.stride(1) == d
    blocks_dense = nb == 1 or kv_cache.stride(0) == bs * d
    if rows_dense and blocks_dense:
        return kv_cache.view(nb * bs, 1, d)
    return kv_cache


def call_decline_reason(
    p: Problem,
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    kv_c: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    q_out: torch.Tensor,
    is_nope_first: bool,
    *,
    arch: str | None,
    allow_fp8: bool = False,
) -> str | None:
    """``decline_reason`` plus what only the tensors show: dtypes, strides, alignment, layout.

    Host-side only (shapes, strides, pointers): no device work, safe under
    CUDA-graph capture.
    """
    reason = decline_reason(True, p, arch=arch, allow_fp8=allow_fp8)
    if reason:
        return reason
    if not is_nope_first:
        # The opt kernel then writes cache rows as [rope | nope]; this project's rows are always [kv_c | rope].
        return "is_nope_first=False: AITER would also store the cache rows rope-first"
    act = q_pe.dtype
    if cos_sin_cache.dtype != act:
        return f"cos_sin_cache is {cos_sin_cache.dtype}; AITER reads cos/sin in the input dtype {act}"
    if not fp8.is_fp8(p.cache_dtype) and p.cache_dtype != act:
        return f"kv_cache is {p.cache_dtype}; AITER stores a non-fp8 cache in the input dtype {act}"
    if not fp8.is_fp8(q_out.dtype) and q_out.dtype != act:
        return f"q_out is {q_out.dtype}; AITER writes a non-fp8 q_out in the input dtype {act}"
    for name, t in (("ql_nope", ql_nope), ("q_pe", q_pe), ("k_pe", k_pe), ("kv_c", kv_c), ("q_out", q_out),
                    ("kv_cache", kv_cache)):  # fmt: skip
        if t.stride(-1) != 1:
            return f"{name} has last-dim stride {t.stride(-1)}; AITER needs unit stride"
        if any(abs(s) > _INT32_MAX for s in t.stride()):
            return f"{name} has a stride beyond int32, which AITER's host code passes as int"
    if q_out.shape[1] > 1 and q_out.stride(1) != p.kv_lora_rank + p.rope_dim:
        # The opt kernel bounds its q_out buffer to num_heads * (L+R) elements per token.
        return "q_out heads are not densely packed (stride(1) != L+R)"
    span = ((p.num_heads - 1) * ql_nope.stride(1) + p.kv_lora_rank) * ql_nope.element_size()
    if span > _INT32_MAX:
        return "ql_nope's per-token head span exceeds AITER's 32-bit buffer range"
    for name, t, dims in (("ql_nope", ql_nope, (0, 1)), ("kv_c", kv_c, (0,)), ("q_out", q_out, (0, 1)),
                          ("kv_cache", kv_cache, (0, 1))):  # fmt: skip
        if not _aligned(t, dims):
            return f"{name} rows are not {_VECTOR_BYTES}-byte aligned; AITER loads and stores them as vectors"
    view = cache_view(kv_cache)
    kernel = select_kernel(p.num_tokens, p.num_heads, p.kv_lora_rank, p.rope_dim, view.shape[1], is_nope_first)
    return _kernel_decline_reason(kernel, p.cache_dtype, arch)


# --------------------------------------------------------------------------
# Preparation
# --------------------------------------------------------------------------


def _version_or_none(t: torch.Tensor) -> int | None:
    # Inference-mode tensors (vLLM runs under torch.inference_mode) carry no version counter.
    try:
        return t._version
    except RuntimeError:
        return None


class RopeSplitCache:
    """``cos_sin_cache [max_pos, R]`` -> contiguous ``cos``, ``sin`` ``[max_pos, R/2]``, made once per rope cache.

    AITER's fast kernels read cos/sin at ``pos * 32`` ignoring strides, so the
    halves must be contiguous copies. A model has one or two rope caches and
    calls the op thousands of times per second, so the copies are kept:

    - Key: device, data pointer, shape, strides, dtype and the version
      counter (bumped by in-place writes; inference-mode tensors have none,
      so an in-place rewrite of such a tensor is not seen: call ``clear``).
    - Each entry holds a reference to its source tensor, so its memory cannot
      be freed and reused by another tensor while the key is cached.
    - At most ``max_entries`` entries, least recently used dropped first.

    A hit allocates nothing, so a call replayed by a CUDA graph allocates
    nothing. A miss during capture allocates from the graph's pool and
    records the copy; the copy stays valid (the cache holds it). Warm-up
    (one eager call, as vLLM does before capture) makes replays hits.
    """

    def __init__(self, max_entries: int = 8) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self.misses = 0

    @staticmethod
    def key(cos_sin_cache: torch.Tensor) -> tuple:
        t = cos_sin_cache
        return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, _version_or_none(t))

    def get(self, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = self.key(cos_sin_cache)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry[1], entry[2]
        half = cos_sin_cache.shape[-1] // 2
        cos = cos_sin_cache[:, :half].contiguous()
        sin = cos_sin_cache[:, half:].contiguous()
        with self._lock:
            self.misses += 1
            self._entries[key] = (cos_sin_cache, cos, sin)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return cos, sin

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


_ROPE_SPLITS = RopeSplitCache()
_ONES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_ONES_LOCK = threading.Lock()


def default_scales(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One-element float32 ones, cached per device: AITER dereferences both scales on every call.

    Two tensors, not one: AITER's op schema marks every tensor argument
    mutable, and one tensor passed as two mutable arguments is an alias.
    """
    device = torch.device(device)
    ones = _ONES.get(device)
    if ones is None:
        with _ONES_LOCK:
            ones = _ONES.get(device)
            if ones is None:
                ones = (torch.ones(1, dtype=torch.float32, device=device),
                        torch.ones(1, dtype=torch.float32, device=device))  # fmt: skip
                _ONES[device] = ones
    return ones


def as_int64_index(t: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` entries as contiguous int64, without a copy when they already are.

    AITER reads ``slot_mapping`` and ``positions`` as raw ``int64_t*`` (no
    dtype check, no strides) and takes the token count from
    ``slot_mapping.size(0)``, so both are cut to exactly T entries. vLLM passes
    int64, so the conversion (an allocation) only happens for int32 callers.
    """
    t = t[:num_tokens]
    if t.dtype != torch.int64:
        t = t.to(torch.int64)
    if num_tokens > 1 and t.stride(0) != 1:
        t = t.contiguous()
    return t


def guard_slots(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``slots`` (int64) with every entry at or past ``num_slots`` replaced by -1 (padding).

    AITER's decode kernels test only ``slot < 0`` (cache_kernels.cu: the per-head kernel
    writes when ``head_idx == 0 && slot_idx >= 0`` at row ``slot_idx``, the opt kernel when
    ``write_kv = slot_idx >= 0`` at ``slot / block_size``), so a slot past the cache would be
    written into whatever memory follows it. This project's semantics make such a slot
    padding; the host cannot see slot values without a sync, so the guard is one elementwise
    pass over the T entries on the device (an allocation, from the graph pool under capture).
    """
    return torch.where(slots < num_slots, slots, -1)


def _two_d(t: torch.Tensor) -> torch.Tensor:
    # [T, 1, X] -> [T, X] keeping the row stride: a 3-D single-head tensor whose head stride is not X
    # would match none of AITER's layouts (decode wants 2-D; 3-D must be "contiguous" per head).
    return t.select(1, 0) if t.dim() == 3 else t


@dataclass(frozen=True)
class AiterArgs:
    """The HIP op's arguments, in its order (``aiter/ops/cache.py``)."""

    q_nope: torch.Tensor  # [T, H, L]
    q_pe: torch.Tensor  # [T, H, R]
    kv_c: torch.Tensor  # [T, L]
    k_pe: torch.Tensor  # [T, R]
    kv_cache: torch.Tensor  # [num_slots, 1, L+R] or [num_blocks, block_size, L+R], typed
    q_out: torch.Tensor  # [T, H, L+R]
    slot_mapping: torch.Tensor  # [T] int64
    k_scale: torch.Tensor  # [1] float32
    q_scale: torch.Tensor  # [1] float32
    positions: torch.Tensor  # [T] int64
    cos_cache: torch.Tensor  # [max_pos, R/2] contiguous, input dtype
    sin_cache: torch.Tensor  # [max_pos, R/2] contiguous, input dtype
    is_neox: bool
    is_nope_first: bool
    compute_all_q_rope: bool

    def as_tuple(self) -> tuple:
        return (self.q_nope, self.q_pe, self.kv_c, self.k_pe, self.kv_cache, self.q_out, self.slot_mapping,
                self.k_scale, self.q_scale, self.positions, self.cos_cache, self.sin_cache, self.is_neox,
                self.is_nope_first, self.compute_all_q_rope)  # fmt: skip


def prepare_decode_args(p: Problem, positions, q_pe, k_pe, kv_c, cos_sin_cache, slot_mapping, kv_cache, kv_cache_scale,
                        ql_nope, q_out, q_scale, *, is_neox: bool, is_nope_first: bool,
                        rope_splits: RopeSplitCache | None = None) -> AiterArgs:  # fmt: skip
    """Map a validated op-2 call onto the HIP op's arguments (views; copies only where unavoidable).

    The tensors come as every backend takes them (binding.Site's order: ``ql_nope``, ``q_out``,
    ``q_scale`` in the places of ``nope``, ``out``, ``out_scale``).

    - uint8 fp8 storage -> a typed view (``p.cache_dtype``, the chip's e4m3);
    - the cache viewed ``[num_slots, 1, L+R]`` when possible (``cache_view``);
    - ``kv_c``/``k_pe`` ``[T, 1, X]`` -> ``[T, X]`` views;
    - ``slot_mapping``/``positions`` cut to T, int64 (``as_int64_index``); slots at or past
      the cache's capacity become -1 (``guard_slots``): AITER would write past the cache;
    - cos/sin: cached contiguous halves (``RopeSplitCache``);
    - scales: the caller's, or cached ones (AITER always dereferences them);
    - ``compute_all_q_rope=True``: padded tokens (slot < 0) get their q_out row.
    """
    T = p.num_tokens
    splits = rope_splits if rope_splits is not None else _ROPE_SPLITS
    cos, sin = splits.get(cos_sin_cache)
    ones_k, ones_q = default_scales(q_pe.device)
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    return AiterArgs(
        q_nope=ql_nope,
        q_pe=q_pe,
        kv_c=_two_d(kv_c),
        k_pe=_two_d(k_pe),
        kv_cache=cache_view(fp8.typed_view(kv_cache, p.cache_dtype)),
        q_out=q_out,
        slot_mapping=guard_slots(as_int64_index(slot_mapping, T), num_slots),
        k_scale=kv_cache_scale if kv_cache_scale is not None else ones_k,
        q_scale=q_scale if q_scale is not None else ones_q,
        positions=as_int64_index(positions, T),
        cos_cache=cos,
        sin_cache=sin,
        is_neox=is_neox,
        is_nope_first=is_nope_first,
        compute_all_q_rope=True,
    )


# --------------------------------------------------------------------------
# Backend entry points (shared signature, see backends/__init__.py)
# --------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _log_fallback(reason: str) -> None:
    # Once per distinct reason: this runs per layer per step.
    logger.debug("AITER declined a decode call, using the Triton kernel: %s", reason)


class BoundDecode:
    """Op 2 bound to one validated layout on a ROCm GPU: AITER's HIP op where it computes this
    project's semantics, the Triton kernel (bound alongside) where it does not.

    Fixed here: AITER's op, the chip, the fp8 switch, the Triton fallback. Per call, on the host
    only (no device work, safe under graph capture): the decline check for the call's token count
    and pointers (``call_decline_reason``: the token count selects AITER's kernel, and its vector
    loads need aligned rows), then the argument mapping. The slot guard (``guard_slots``) stays a
    per-call elementwise pass: AITER's kernels do not bound slots, the host cannot see slot values
    without a sync, and vLLM rewrites its slot mapping in place between steps, so no earlier
    result can stand in for it.
    """

    def __init__(self, p: Problem, is_neox: bool, is_nope_first: bool, fallback, device: torch.device) -> None:
        import aiter

        self.p, self.is_neox, self.is_nope_first, self.fallback = p, is_neox, is_nope_first, fallback
        self.aiter_op = getattr(aiter, AITER_OP)
        self.arch = _arch_of(device)
        self.allow_fp8 = env_flag(ENV_FP8)
        self.device_index = device.index

    def __call__(self, T, positions, q_pe, k_pe, kv_c, cos_sin_cache, slot_mapping, kv_cache, kv_cache_scale,
                 ql_nope, q_out, q_scale, key_start: int = 0) -> None:  # fmt: skip
        # key_start is op 3's (binding.Site): the decode op has a query row for every token.
        p = dataclasses.replace(self.p, num_tokens=T)
        reason = call_decline_reason(
            p, ql_nope, q_pe, k_pe, kv_c, cos_sin_cache, fp8.typed_view(kv_cache, p.cache_dtype), q_out,
            self.is_nope_first, arch=self.arch, allow_fp8=self.allow_fp8,
        )  # fmt: skip
        if reason:
            _log_fallback(reason)
            self.fallback(T, positions, q_pe, k_pe, kv_c, cos_sin_cache, slot_mapping, kv_cache, kv_cache_scale,
                          ql_nope, q_out, q_scale)  # fmt: skip
            return
        args = prepare_decode_args(p, positions, q_pe, k_pe, kv_c, cos_sin_cache, slot_mapping, kv_cache,
                                   kv_cache_scale, ql_nope, q_out, q_scale, is_neox=self.is_neox,
                                   is_nope_first=self.is_nope_first)  # fmt: skip
        # AITER launches on the current device's current stream (its pybind path sets the stream from
        # torch.cuda.current_device()), so a tensor on another GPU would be launched with a foreign stream.
        if self.device_index is not None and self.device_index != torch.cuda.current_device():
            with torch.cuda.device(self.device_index):
                self.aiter_op(*args.as_tuple())
        else:
            self.aiter_op(*args.as_tuple())


def bind(p: Problem, op: int, is_neox: bool, is_nope_first: bool, *tensors):
    """AITER for op 2 (``BoundDecode``); ops 1 and 3, which AITER's fused op does not compute
    (it leaves q_pe and k_pe unrotated and builds no key), are the Triton kernel's. ``tensors``:
    the layout's tensors and binding.py's ``early_index_loads``, handed to the Triton binding
    as they come."""
    # Imported here: dispatch imports this module on every machine, and the triton package is optional.
    from . import triton as triton_backend

    fallback = triton_backend.bind(p, op, is_neox, is_nope_first, *tensors)
    if op != OP_DECODE:
        return fallback
    return BoundDecode(p, is_neox, is_nope_first, fallback, tensors[1].device)
