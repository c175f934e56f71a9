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
- ``VLLM_MLA_FUSION_PREFILL_KEY=1`` (opt-in): the prefill rows' attention key is
  built in the fused launch (op 3) instead of by vLLM's ``_concat_k_nope_k_pe``
  after the fused RoPE + cache write (docs/vllm.md says why it is off by default).
- ``VLLM_MLA_FUSION_GRAPH_ROPE=1`` (opt-in): in piecewise-graph steps, the fused
  RoPE + cache write runs inside the graph piece, captured with it (eligibility.py).
- ``VLLM_MLA_FUSION_PREWARM=0``: do not compile the Triton kernel's variants
  during vLLM's profile run (they then compile on first use).
- ``VLLM_MLA_FUSION_BACKEND=torch|triton|aiter``: which implementation runs
  the ops (dispatch.py); automatic by device when unset.

:func:`register` also declares the package's ``VLLM_MLA_FUSION*`` variables
to vLLM (:func:`declare_environment_variables`), so that vLLM does not warn
about them as unknown ``VLLM_*`` variables and hashes them into its
compilation cache key.

Importing this module needs no vLLM; vLLM is imported inside :func:`register`.
"""

from __future__ import annotations

import logging
import os

from .settings import (
    ENV_DECODE,
    ENV_ENABLE,
    ENV_GRAPH_ROPE,
    ENV_PREFILL_KEY,
    ENV_PREWARM,
    ENVIRONMENT_VARIABLES,
    LOCATION_VARIABLES,
    SUPPORTED_VLLM,
    env_enabled,
)

__all__ = [
    "register",
    "SUPPORTED_VLLM",
    "ENV_ENABLE",
    "ENV_DECODE",
    "ENV_PREFILL_KEY",
    "ENV_PREWARM",
    "ENV_GRAPH_ROPE",
    "ENVIRONMENT_VARIABLES",
    "LOCATION_VARIABLES",
]

# vLLM's own loggers are configured by the time plugins load; logging under
# "vllm." inherits its handlers and level.
logger = logging.getLogger("vllm.vllm_mla_fusion")


def _reader(name: str):
    def read() -> str | None:
        return os.environ.get(name)  # looked up at each call: vLLM and tests may change the environment

    return read


def _location_only() -> None:
    return None


def declare_environment_variables() -> None:
    """Add the package's variables to ``vllm.envs.environment_variables``, vLLM's registry of known names.

    vLLM checks every ``VLLM_*`` name in the environment against that
    registry (``Platform.validate_environ``, run by
    ``EngineArgs.create_engine_config`` in the process that builds the
    engine config, after ``EngineArgs.__post_init__`` has loaded the general
    plugins) and logs "Unknown vLLM environment variable detected" for the
    others, or refuses to start under ``--fail-on-environ-validation``.

    The registry also feeds ``vllm.envs.compile_factors()``, which hashes the
    value of every registered name into the torch.compile cache key (the
    Inductor cache and the AOT-compile cache, whose key has no other trace of
    the plugin). The switches are therefore registered with their raw values:
    plugin on, off and each mode compile into different cache entries, and two
    spellings of one setting at worst cost a recompile. The location-only
    names hash as a constant, as vLLM's own location variables are excluded.
    Names vLLM already knows are left as they are.
    """
    from vllm import envs

    for name in ENVIRONMENT_VARIABLES:
        envs.environment_variables.setdefault(name, _reader(name))
    for name in LOCATION_VARIABLES:
        envs.environment_variables.setdefault(name, _location_only)


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; safe to call any number of times.

    Never raises: vLLM calls general plugins without a guard, so any problem
    here is logged as a warning and vLLM keeps its own MLA layer.
    """
    try:
        # First, and also when the plugin is switched off: VLLM_MLA_FUSION=0 is one of the names.
        declare_environment_variables()
    except Exception:  # noqa: BLE001 - a vLLM without that registry warns about the names, nothing worse
        logger.debug("vllm-mla-fusion: could not declare the environment variables to vLLM", exc_info=True)
    if not env_enabled(ENV_ENABLE):
        logger.info("vllm-mla-fusion: %s=0, leaving vLLM's MLA layers unmodified", ENV_ENABLE)
        return
    try:
        from . import compat

        reason = compat.incompatibility_reason()
        if reason is not None:
            logger.warning("vllm-mla-fusion: not registering the fused MLA path (%s); vLLM runs unmodified", reason)
            return
        from .layer import FusedMultiHeadLatentAttentionWrapper

        compat.register_wrapper(FusedMultiHeadLatentAttentionWrapper)
    except Exception:  # noqa: BLE001 - a plugin must not take the server down
        logger.warning("vllm-mla-fusion: registration failed; vLLM runs unmodified", exc_info=True)
