"""Bind once, launch thin: an op bound to everything about its calls that does not change per step.

A fused op's arguments are of two kinds:

- *static*: which op, the rotation style, the cache's format name, the query layout flag,
  the backend asked for; and, once tensors are seen, every tensor's dtype, device, strides
  and sizes past the token dimension (the *layout*). A vLLM layer fixes all of them when
  it is built (the cache's layout at its first step);
- *per step*: the token count ``T``, the tensors' addresses and, for the prefill op in a
  mixed batch, ``key_start`` (its decode tokens, which come first, get no key row).

:class:`BoundOp` takes the static flags once. The first call with a layout validates it
with the same checks as the public ops (validation.py: a bad call raises the same
ValueError/TypeError before anything is written), resolves the backend for the tensors'
device and lets the backend bind what follows from the layout (a :class:`Site`). A later
call compares its layout with the ones already validated (one tuple of strides, sizes,
dtypes and devices: a few microseconds), checks that its token dimensions agree, and
calls the site, which only computes the grid for ``T`` and launches. A call whose layout
differs in anything validation looks at is validated again: the reuse rule is "same
layout, same validation result", never "same layer".

The public ops (ops.py) and the vLLM plugin (one BoundOp per op for all its layers) share this
path; the plugin never reads the environment or re-validates per step.

``early_index_loads`` is a promise of the caller's, made when it builds its ops: *no kernel that
can still be running when one of these ops starts writes its ``positions``, ``slot_mapping``,
``cos_sin_cache`` or fp8 scales* (not the kernel launched just before it, nor an earlier one
that a chain of programmatic dependent launches lets overlap it). With that promise, the Triton
kernel reads those tensors before its grid-dependency wait on sm_90 (backends/triton.py,
BoundLaunch; a scale's bits pick the program's power-of-two path there), while
the previous kernel is still finishing; without it, it reads nothing before the wait. The vLLM
plugin makes the promise (vLLM writes positions and slots in its input preparation, long before
the layers run, and the rope table once); the public ops do not (a user may write positions
with the kernel launched just before the call).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from . import dispatch, validation
from .opcodes import OP_DECODE, OP_NAMES, OP_PREFILL, OP_ROPE_CACHE


class Site(Protocol):
    """A backend's launch for one validated layout: ``site(T, ...)`` with every tensor of the call
    and op 3's ``key_start`` (0 for ops 1 and 2). A backend's ``bind(p, op, is_neox, is_nope_first,
    *tensors, early_index_loads)`` makes it, the flag last and positional like the rest."""

    def __call__(self, T: int, positions, q_pe, k_pe, kv_c, cos_sin_cache, slot_mapping, kv_cache,
                 kv_cache_scale, nope, out, out_scale, key_start: int) -> None: ...  # fmt: skip


def _layout(positions, q_pe, k_pe, kv_c, cos_sin_cache, slot_mapping, kv_cache, kv_cache_scale, nope, out,
            out_scale) -> tuple:  # fmt: skip
    """Everything validation and the backends' specialization read, except T and addresses.

    Sizes past the token dimension, strides (their count is the rank), dtypes and devices of
    each tensor; the scales' presence, dtype, size and device. ``positions``/``slot_mapping``
    are read for their first T entries only, so only their rank, stride, dtype and device count.
    """
    key = (
        q_pe.shape[1:], q_pe.stride(), q_pe.dtype, q_pe.device,
        k_pe.shape[1:], k_pe.stride(), k_pe.dtype, k_pe.device,
        kv_c.shape[1:], kv_c.stride(), kv_c.dtype, kv_c.device,
        kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device,
        cos_sin_cache.shape, cos_sin_cache.stride(), cos_sin_cache.dtype, cos_sin_cache.device,
        positions.stride(), positions.dtype, positions.device,
        slot_mapping.stride(), slot_mapping.dtype, slot_mapping.device,
        None if kv_cache_scale is None else (kv_cache_scale.shape, kv_cache_scale.dtype, kv_cache_scale.device),
    )  # fmt: skip
    if out is None:
        return key
    return key + (
        nope.shape[1:], nope.stride(), nope.dtype, nope.device,
        out.shape[1:], out.stride(), out.dtype, out.device,
        None if out_scale is None else (out_scale.shape, out_scale.dtype, out_scale.device),
    )  # fmt: skip


class BoundOp:
    """One fused op with its static flags bound; call it with the step's tensors.

    ``op``: OP_ROPE_CACHE, OP_DECODE (``nope``/``out``/``out_scale`` are ql_nope, q_out,
    q_scale) or OP_PREFILL (k_nope, k_out; their rows are the key of tokens ``key_start ..
    T - 1``, the tokens before getting op 1's work: a mixed batch in one launch).
    ``backend``: "torch", "triton", "aiter" or "auto" (by device, dispatch.resolve), fixed
    here: no environment is read per call.
    ``debug``: also check index values on the host each call (validation.py).
    ``early_index_loads``: the caller's promise (module docstring) that lets the kernel read the
    index tensors and the rope table before its grid-dependency wait; False unless promised.
    """

    MAX_SITES = 64  # distinct layouts kept; a model has a handful per op

    def __init__(self, op: int, *, is_neox: bool, kv_cache_dtype: str = "auto", is_nope_first: bool = True,
                 backend: str = "auto", debug: bool = False, early_index_loads: bool = False) -> None:  # fmt: skip
        if op not in OP_NAMES:
            raise ValueError(f"op must be one of {sorted(OP_NAMES)}, got {op!r}")
        self.op = op
        self.is_neox = is_neox
        self.kv_cache_dtype = kv_cache_dtype
        self.is_nope_first = is_nope_first
        self.backend = backend
        self.debug = debug
        self.early_index_loads = early_index_loads
        self.qualname = f"mla_fusion::{OP_NAMES[op]}"
        self.sites: dict[tuple, tuple[Site, str]] = {}

    def __call__(self, positions, q_pe, k_pe, kv_c, cos_sin_cache, slot_mapping, kv_cache, kv_cache_scale=None,
                 nope=None, out=None, out_scale=None, key_start=0) -> None:  # fmt: skip
        """Run the op on the first ``T = q_pe.shape[0]`` tokens (the public ops' semantics)."""
        args = (positions, q_pe, k_pe, kv_c, cos_sin_cache, slot_mapping, kv_cache, kv_cache_scale, nope, out,
                out_scale)  # fmt: skip
        try:
            entry = self.sites.get(_layout(*args))
        except AttributeError:  # not a tensor somewhere: validation names it
            entry = None
        T = q_pe.shape[0] if entry is not None else -1
        rows_agree = entry is not None and type(key_start) is int and (
            k_pe.shape[0] == T and kv_c.shape[0] == T and positions.shape[0] >= T and slot_mapping.shape[0] >= T
            and (out is None or (nope.shape[0] == T - key_start and out.shape[0] == T - key_start))
            and (key_start == 0 or (self.op == OP_PREFILL and 0 < key_start <= T))
        )  # fmt: skip
        if not rows_agree:
            entry = self._bind(args, key_start)
            T = q_pe.shape[0]
        if self.debug and rows_agree:
            self._validate(args, key_start)  # the index-value checks run with validation (_bind ran it otherwise)
        if not T:
            return
        if torch.autograd._profiler_enabled():
            # Named in a profiler trace as the dispatcher names the public ops, so that a profile
            # shows the same op names whichever entry point ran.
            with torch.profiler.record_function(self.qualname):
                entry[0](T, *args, key_start)
        else:
            entry[0](T, *args, key_start)

    def validate(self, positions, q_pe, k_pe, kv_c, cos_sin_cache, slot_mapping, kv_cache, kv_cache_scale=None,
                 nope=None, out=None, out_scale=None, key_start=0) -> validation.Problem:  # fmt: skip
        """The call's sizes, or the ValueError/TypeError the call would raise (the ops' fakes)."""
        p = self._validate((positions, q_pe, k_pe, kv_c, cos_sin_cache, slot_mapping, kv_cache, kv_cache_scale,
                            nope, out, out_scale), key_start)  # fmt: skip
        if self.backend != "auto":
            dispatch.check_format(self.backend, p)  # as the call's backend resolution would: at trace time too
        return p

    def backend_of(self, positions, q_pe, k_pe, kv_c, cos_sin_cache, slot_mapping, kv_cache, kv_cache_scale=None,
                   nope=None, out=None, out_scale=None) -> str | None:  # fmt: skip
        """The backend that runs calls of this layout, once one has been made (None before)."""
        entry = self.sites.get(_layout(positions, q_pe, k_pe, kv_c, cos_sin_cache, slot_mapping, kv_cache,
                                       kv_cache_scale, nope, out, out_scale))  # fmt: skip
        return entry[1] if entry else None

    def _validate(self, args, key_start=0) -> validation.Problem:
        positions, q_pe, k_pe, kv_c, cos_sin_cache, slot_mapping, kv_cache, kv_cache_scale, nope, out, out_scale = args
        common = (cos_sin_cache, self.is_neox, slot_mapping, kv_cache)
        if self.op != OP_PREFILL and not (type(key_start) is int and key_start == 0):
            raise ValueError(f"key_start applies to {OP_NAMES[OP_PREFILL]} only; {self.qualname} got {key_start!r}")
        if self.op == OP_ROPE_CACHE:
            return validation.check_rope_cache_write(positions, q_pe, k_pe, kv_c, *common, self.kv_cache_dtype,
                                                     kv_cache_scale)  # fmt: skip
        if self.op == OP_DECODE:
            return validation.check_decode_rope_cache_write(
                positions, nope, q_pe, k_pe, kv_c, *common, out, self.kv_cache_dtype, kv_cache_scale, out_scale,
                self.is_nope_first,
            )  # fmt: skip
        return validation.check_prefill_rope_cache_write(positions, q_pe, k_pe, kv_c, nope, *common, out,
                                                         self.kv_cache_dtype, kv_cache_scale, key_start)  # fmt: skip

    def _bind(self, args, key_start) -> tuple[Site, str]:
        """Validate a call whose layout (or token rows) is new, and bind its layout's site."""
        p = self._validate(args, key_start)
        key = _layout(*args)
        entry = self.sites.get(key)
        if entry is None:
            # The backend is chosen for the layout, whatever this call's token count: a choice
            # that depends on it (AITER's kernels) is the site's, per call.
            layout_problem = dataclasses.replace(p, num_tokens=1)
            name = dispatch.resolve(self.backend, args[1].device, decode=self.op == OP_DECODE, problem=layout_problem)
            site = dispatch.load(name).bind(p, self.op, self.is_neox, self.is_nope_first, *args,
                                            self.early_index_loads)  # fmt: skip
            if len(self.sites) >= self.MAX_SITES:
                self.sites.clear()
            entry = self.sites[key] = (site, name)
        return entry



class BoundOps:
    """BoundOps made on first use per flag set, all with the same backend, debug mode and
    ``early_index_loads`` promise (module docstring), fixed when they are made. Owners take the
    process's set for their setting (``shared_ops``)."""

    def __init__(self, backend: str = "auto", debug: bool = False, early_index_loads: bool = False) -> None:
        self.backend, self.debug, self.early_index_loads = backend, debug, early_index_loads
        self._ops: dict[tuple, BoundOp] = {}

    def get(self, op: int, kv_cache_dtype: str, is_neox: bool, is_nope_first: bool = True) -> BoundOp:
        key = (op, kv_cache_dtype, is_neox, is_nope_first)
        bound = self._ops.get(key)
        if bound is None:
            bound = self._ops[key] = BoundOp(op, is_neox=is_neox, kv_cache_dtype=kv_cache_dtype,
                                             is_nope_first=is_nope_first, backend=self.backend,
                                             debug=self.debug, early_index_loads=self.early_index_loads)  # fmt: skip
        return bound


# The process's BoundOps, one set per (backend, debug mode, promise), shared by every owner with that
# setting: the public ops (per backend asked for and debug mode, read per call) and the vLLM plugin's
# fused layers (fixed when each layer is built). A bound layout's site depends only on its BoundOp's
# flags and the layout (the reuse rule above), so owners of one setting share each site with its
# launch plans (one per token count) and compiled kernels: a model's MLA layers plan a step whose
# token count is new once, not once per layer (6-12 us of host time each on a 2-core CPU).
_SHARED: dict[tuple[str, bool, bool], BoundOps] = {}


def shared_ops(backend: str = "auto", debug: bool = False, early_index_loads: bool = False) -> BoundOps:
    """The process's BoundOps for this backend, debug mode and ``early_index_loads`` promise."""
    setting = (backend, debug, early_index_loads)
    ops = _SHARED.get(setting)
    if ops is None:
        ops = _SHARED[setting] = BoundOps(*setting)
    return ops
