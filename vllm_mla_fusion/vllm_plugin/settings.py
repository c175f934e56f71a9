"""The plugin's switches (environment variables) and the vLLM series it supports.

One module that every part of the plugin reads its settings from; the entry point
(``__init__.py``) re-exports them. Each switch is read when ``register`` runs or when a
layer is built, never per step.
"""

from __future__ import annotations

import os

ENV_ENABLE = "VLLM_MLA_FUSION"
ENV_DECODE = "VLLM_MLA_FUSION_DECODE"
ENV_PREFILL_KEY = "VLLM_MLA_FUSION_PREFILL_KEY"
ENV_PREWARM = "VLLM_MLA_FUSION_PREWARM"
ENV_GRAPH_ROPE = "VLLM_MLA_FUSION_GRAPH_ROPE"
# Every variable that changes what the package does (docs/vllm.md, "Switches";
# docs/rocm.md for the AITER one). A test checks the package reads no other.
ENVIRONMENT_VARIABLES = (
    ENV_ENABLE,
    ENV_DECODE,
    ENV_PREFILL_KEY,
    ENV_PREWARM,
    ENV_GRAPH_ROPE,
    "VLLM_MLA_FUSION_BACKEND",
    "VLLM_MLA_FUSION_DEBUG",
    "VLLM_MLA_FUSION_PDL",
    "VLLM_MLA_FUSION_AITER_FP8",
)
# Read only by the checkout's scripts and benchmark: where something lives, not what is computed.
LOCATION_VARIABLES = ("VLLM_MLA_FUSION_ENV", "VLLM_MLA_FUSION_AITER_TRITON_PATH")
# The vLLM minor series whose MLA internals this plugin was written against.
SUPPORTED_VLLM = "0.33"

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def env_enabled(name: str) -> bool:
    """A switch that is on unless set to an off value (unset means on)."""
    return os.environ.get(name, "1").strip().lower() not in _OFF


def env_opted_in(name: str) -> bool:
    """A switch that is off unless set to an on value (unset means off)."""
    return os.environ.get(name, "0").strip().lower() in _ON
