"""Test-wide set-up: where the Triton kernel runs, and skips for hardware this machine lacks.

Without a GPU the Triton kernel runs in Triton's interpreter. TRITON_INTERPRET
must be set before any kernel is defined, i.e. before the package's Triton
backend is first imported, which is why it is set here at collection time.
The interpreter is then made to round like the GPU (exact fma, bf16 rounded to
nearest even: tests/exact_interpreter.py), so the kernel's results are checked
bit for bit, not within the interpreter's extra rounding error.

Every test starts from the same global RNG state, so any draw without an
explicit generator still reproduces, whatever ran before it.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
IS_ROCM = HAS_GPU and torch.version.hip is not None

if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETING and importlib.util.find_spec("triton"):
    from . import exact_interpreter

    exact_interpreter.install()

# Backends the CPU op tests run: the Triton kernel joins them when it runs in the interpreter
# (on a GPU machine the CPU tests cover the reference and test_gpu.py covers the kernel).
OP_BACKENDS = ["torch"] + (
    ["triton"] if importlib.util.find_spec("triton") and os.environ.get("TRITON_INTERPRET") == "1" else []
)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA or ROCm GPU; none is visible to torch")
    skip_rocm = pytest.mark.skip(reason="needs a ROCm GPU (torch.version.hip) with AITER")
    skip_vllm = pytest.mark.skip(reason="needs vLLM 0.33.0 installed")
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "rocm" in item.keywords and not IS_ROCM:
            item.add_marker(skip_rocm)
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(skip_vllm)


@pytest.fixture(autouse=True)
def _seeded_global_rng():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _clean_backend_env(monkeypatch):
    """Tests choose backends explicitly; a developer's shell settings must not leak in."""
    for name in ("VLLM_MLA_FUSION_BACKEND", "VLLM_MLA_FUSION_DEBUG", "VLLM_ROCM_USE_AITER"):
        monkeypatch.delenv(name, raising=False)
