"""What this plugin needs from vLLM, checked before anything is registered.

The plugin reaches into vLLM's MLA layer (vllm/model_executor/layers/mla.py,
vllm/model_executor/layers/attention/mla_attention.py), whose internals change
between minor releases. Registration therefore requires the minor series the
code was written against and every attribute it relies on; if either is
missing, :func:`incompatibility_reason` says which and vLLM runs unmodified.
"""

from __future__ import annotations

import importlib
import logging

from .settings import SUPPORTED_VLLM

logger = logging.getLogger("vllm.vllm_mla_fusion")  # the entry point's logger (__init__.py)

# (module, attribute path) pairs the plugin relies on. Instance attributes set
# in MLAAttention.__init__ (impl, kv_cache_dtype, _k_scale, ...) cannot be
# checked here; layer construction checks them (eligibility.py) and falls back.
REQUIRED_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("vllm.model_executor.custom_op", "PluggableLayer.register_oot"),
    ("vllm.model_executor.custom_op", "op_registry_oot"),
    ("vllm.model_executor.layers.mla", "MultiHeadLatentAttentionWrapper.forward"),
    ("vllm.model_executor.layers.attention.mla_attention", "MLAAttention.forward_impl"),
    ("vllm.model_executor.layers.attention.mla_attention", "unified_mla_attention_with_output"),
    ("vllm.model_executor.layers.attention.attention", "get_attention_context"),
    ("vllm.model_executor.layers.attention.kv_transfer_utils", "maybe_transfer_kv_layer"),
    ("vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbedding.forward_native"),
    ("vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope", "DeepseekScalingRotaryEmbedding"),
    ("vllm.v1.attention.backend", "MLAAttentionImpl.do_kv_cache_update"),
    ("vllm.compilation.breakable_cudagraph", "eager_break_during_capture"),
    ("vllm.forward_context", "in_piecewise_cudagraph"),
    ("vllm.utils.torch_utils", "direct_register_custom_op"),
    ("vllm.utils.torch_utils", "_encode_layer_name"),
    ("vllm.utils.torch_utils", "_resolve_layer_name"),
    ("vllm.v1.worker.utils", "select_common_block_size"),
    ("vllm.models.common.ops", "fused_q_kv_rmsnorm"),
)

WRAPPER_KEY = "MultiHeadLatentAttentionWrapper"


def _resolve(module: str, path: str) -> object:
    obj: object = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def incompatibility_reason() -> str | None:
    """Why the running vLLM cannot take the plugin, or None if it can."""
    try:
        import vllm
    except ImportError:
        return "vLLM is not installed"
    version = getattr(vllm, "__version__", "unknown")
    if not (version == SUPPORTED_VLLM or version.startswith(SUPPORTED_VLLM + ".")):
        return f"vLLM {version} is not the supported {SUPPORTED_VLLM}.x series"
    missing = []
    for module, path in REQUIRED_ATTRIBUTES:
        try:
            _resolve(module, path)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{path}")
    if missing:
        return f"vLLM {version} lacks {', '.join(missing)}"
    import torch

    if not hasattr(torch.ops.vllm, "unified_mla_attention_with_output"):
        return "torch.ops.vllm.unified_mla_attention_with_output is not registered"
    return None


def register_wrapper(fused_wrapper: type) -> bool:
    """Register ``fused_wrapper`` (layer.FusedMultiHeadLatentAttentionWrapper, which the entry
    point hands over) with ``PluggableLayer.register_oot``, once.

    Returns True if the fused wrapper is the registered replacement after the
    call. ``register_oot`` asserts on a duplicate key, so the registry is
    checked first; another plugin's replacement is left in place.
    """
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

    current = op_registry_oot.get(WRAPPER_KEY)
    if current is fused_wrapper:
        return True
    if current is not None:
        logger.warning(
            "vllm-mla-fusion: %s is already replaced by %s.%s; keeping it, the fused MLA path is off",
            WRAPPER_KEY,
            current.__module__,
            current.__qualname__,
        )
        return False
    MultiHeadLatentAttentionWrapper.register_oot(fused_wrapper)
    logger.debug("vllm-mla-fusion: registered %s for %s", fused_wrapper.__name__, WRAPPER_KEY)
    return True
