"""Backend selection: which implementation runs a call.

Order of precedence: the ``backend=`` keyword, then ``VLLM_MLA_FUSION_BACKEND``,
then automatic choice by device:

- CPU tensors: ``torch`` (the reference).
- GPU tensors: ``aiter`` on ROCm when ``VLLM_ROCM_USE_AITER=1`` and AITER's
  fused op is importable and supports the call; ``triton`` otherwise; ``torch``
  for a cache format neither writes (``fp8_ds_mla``, for now: ``PACKED_FORMATS``).

A backend that is asked for by name but cannot run is an error (never a
silent fallback), and so is one asked for by name that does not write the
call's cache format (a ValueError, raised before anything is written).
``triton`` runs CPU tensors only in Triton's interpreter (``TRITON_INTERPRET=1``),
which is how the Triton kernel is tested without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType

import torch

from . import fp8
from .backends import aiter as aiter_backend
from .backends import reference
from .environment import env_flag, environment_value
from .validation import Problem

BACKENDS = ("torch", "triton", "aiter")
ENV_BACKEND = "VLLM_MLA_FUSION_BACKEND"
# The packed cache formats (validation.Problem.cache_format) each backend writes; every backend
# writes the plain [L + R] rows. The Triton kernel and AITER do not write fp8_ds_mla yet (issue 42).
PACKED_FORMATS = {"torch": (fp8.FP8_DS_MLA,), "triton": (), "aiter": ()}


def triton_interpreting() -> bool:
    return env_flag("TRITON_INTERPRET")


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def requested_backend(backend: str | None = None) -> str:
    """The backend named by the keyword or the environment, or "auto"."""
    name = backend if backend not in (None, "", "auto") else environment_value(ENV_BACKEND)
    name = (name or "auto").strip().lower()
    if name != "auto" and name not in BACKENDS:
        source = "backend" if backend not in (None, "", "auto") else ENV_BACKEND
        raise ValueError(f"{source}={name!r} is not a backend; expected 'auto' or one of {BACKENDS}")
    return name


def _triton_unavailable_reason(device: torch.device) -> str | None:
    if not triton_available():
        return "the triton package is not installed"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and triton_interpreting():
        return None
    if device.type == "cpu":
        return "CPU tensors run the Triton kernel only in Triton's interpreter; set TRITON_INTERPRET=1"
    return f"Triton does not run on {device.type} tensors"


def writes_format(name: str, problem: Problem | None = None) -> bool:
    """Whether backend ``name`` writes the cache format of ``problem`` (a validation.Problem; None: plain rows)."""
    return problem is None or problem.cache_format is None or problem.cache_format in PACKED_FORMATS[name]


def check_format(name: str, problem: Problem | None) -> None:
    """A ValueError if backend ``name`` does not write ``problem``'s cache format."""
    if not writes_format(name, problem):
        writers = [b for b in BACKENDS if writes_format(b, problem)]
        raise ValueError(f"backend {name!r} does not write kv_cache_dtype={problem.cache_format!r}; "
                         f"only {writers} do")  # fmt: skip


def resolve(backend: str | None, device: torch.device, decode: bool, problem=None) -> str:
    """Name of the backend that runs a call on ``device``.

    ``decode`` says which op is asked for (the AITER HIP op only implements the
    decode op); ``problem`` (a validation.Problem) lets AITER decline shapes it
    does not handle when the choice is automatic, and names the cache format,
    which a backend asked for by name must write (ValueError otherwise).
    """
    name = requested_backend(backend)
    if name == "torch":
        return name
    if name == "triton":
        check_format(name, problem)  # first: the ops' fakes raise the same error, wherever they trace
        reason = _triton_unavailable_reason(device)
        if reason:
            raise RuntimeError(f"backend 'triton' was requested but cannot run: {reason}")
        return name
    if name == "aiter":
        check_format(name, problem)  # and the Triton kernel it hands the rest to writes the same formats
        reason = aiter_backend.unavailable_reason(device)
        if reason:
            raise RuntimeError(f"backend 'aiter' was requested but cannot run: {reason}")
        # AITER covers some cases only (docs/rocm.md); the rest take our Triton kernel.
        return "aiter" if aiter_backend.applies(decode, problem, device) else "triton"
    # auto (a format the GPU backends do not write takes the reference: correct, if slow)
    if device.type != "cuda" or not writes_format("triton", problem):
        return "torch"
    if torch.version.hip is not None and env_flag("VLLM_ROCM_USE_AITER"):
        if aiter_backend.unavailable_reason(device) is None and aiter_backend.applies(decode, problem, device):
            return "aiter"
    return "triton"


def load(name: str) -> ModuleType:
    """The backend module."""
    if name == "torch":
        return reference
    if name == "triton":
        # Imported on first use: it imports the triton package, which is optional (and slow to import).
        from .backends import triton as triton_backend

        return triton_backend
    if name == "aiter":
        return aiter_backend
    raise ValueError(f"unknown backend {name!r}")


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """The backends that can run on ``device`` on this machine, in order of preference."""
    device = torch.device(device)
    names = ["torch"]
    if _triton_unavailable_reason(device) is None:
        names.insert(0, "triton")
    if device.type == "cuda" and aiter_backend.unavailable_reason(device) is None:
        names.insert(0, "aiter")
    return names
