"""vLLM general plugin: gives MLA layers the fused RoPE + KV-cache-write path.

vLLM discovers :func:`register` through the ``vllm.general_plugins`` entry
point (pyproject.toml) and calls it in every vLLM process before the model is
built. It replaces vLLM's ``MultiHeadLatentAttentionWrapper`` with
:class:`~vllm_mla_fusion.vllm_plugin.layer.FusedMultiHeadLatentAttentionWrapper`
through ``PluggableLayer.register_oot``; each layer then decides at
construction whether the fused path applies to it (eligibility.py).

Switches (environment, read when ``register`` runs):

- ``VLLM_MLA_FUSION=0``: register nothing; vLLM runs unmodified.
- ``VLLM_MLA_FUSION_DECODE=0``: keep the fused RoPE + cache write, but leave
  the decode query assembly to vLLM (one fused launch for the whole batch).
- ``VLLM_MLA_FUSION_PREFILL_KEY=0``: prefill rows get the fused RoPE + cache
  write, but vLLM builds their attention key (``_concat_k_nope_k_pe``).
- ``VLLM_MLA_FUSION_PREWARM=0``: do not compile the Triton kernel's variants
  during vLLM's profile run (they then compile on first use).
- ``VLLM_MLA_FUSION_BACKEND=torch|triton|aiter``: which implementation runs
  the ops (dispatch.py); automatic by device when unset.

Importing this module needs no vLLM; vLLM is imported inside :func:`register`.
"""

from __future__ import annotations

import logging
import os

__all__ = ["register", "SUPPORTED_VLLM", "ENV_ENABLE", "ENV_DECODE", "ENV_PREFILL_KEY", "ENV_PREWARM"]

ENV_ENABLE = "VLLM_MLA_FUSION"
ENV_DECODE = "VLLM_MLA_FUSION_DECODE"
ENV_PREFILL_KEY = "VLLM_MLA_FUSION_PREFILL_KEY"
ENV_PREWARM = "VLLM_MLA_FUSION_PREWARM"
# The vLLM minor series whose MLA internals this plugin was written against.
SUPPORTED_VLLM = "0.33"

# vLLM's own loggers are configured by the time plugins load; logging under
# "vllm." inherits its handlers and level.
logger = logging.getLogger("vllm.vllm_mla_fusion")


def env_enabled(name: str) -> bool:
    """False only for an explicit off value; unset means on."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; safe to call any number of times.

    Never raises: vLLM calls general plugins without a guard, so any problem
    here is logged as a warning and vLLM keeps its own MLA layer.
    """
    if not env_enabled(ENV_ENABLE):
        logger.info("vllm-mla-fusion: %s=0, leaving vLLM's MLA layers unmodified", ENV_ENABLE)
        return
    try:
        from . import compat

        reason = compat.incompatibility_reason()
        if reason is not None:
            logger.warning("vllm-mla-fusion: not registering the fused MLA path (%s); vLLM runs unmodified", reason)
            return
        compat.register_wrapper()
    except Exception:  # noqa: BLE001 - a plugin must not take the server down
        logger.warning("vllm-mla-fusion: registration failed; vLLM runs unmodified", exc_info=True)
