"""Launch census: per MLA layer and engine step, the RoPE / KV-cache-write / concat work that actually ran.

Counted from what runs, not from what the plugin claims: each engine step
runs under ``torch.profiler`` (CPU activity), which records every dispatcher
op call, nested ones included, whatever called it. Two kinds of event count:

- every op of the project's namespace, ``mla_fusion::*``, each under its own
  name (new ops show up without any change here);
- vLLM's own launch sites in that region, which are Python functions and get
  a ``record_function`` range when the census is installed:
  the layer's rotary embedding forward, ``impl.do_kv_cache_update``,
  ``impl._concat_k_nope_k_pe`` (the prefill attention key), the decode
  query hand-over (the backend's ``forward_mqa`` receiving the pair
  ``(ql_nope, q_pe)``, which CPU_MLA, FlashMLA, FlashInfer-MLA and AMX
  concatenate; CUTLASS-MLA and FA-MLA read the two halves instead) and
  ``_decode_concat_quant_fp8_op`` (concat + fp8 quant); and vLLM's kernels
  themselves where they exist (``_C::rotary_embedding``,
  ``_C::concat_and_cache_mla*``), for paths that bypass those functions.

An event is attributed to the MLA layer whose forward range contains it
(each layer's forward gets a range too) and is counted once per category:
a kernel inside a counted function of the same category is the same launch.

Needs eager execution (``enforce_eager``): a CUDA graph replays kernels
without running the Python that the ranges wrap.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile, record_function

FUSED_PREFIX = "mla_fusion::"
LAYER_PREFIX = "census layer "

VLLM_ROPE = "vLLM RoPE"
VLLM_CACHE_WRITE = "vLLM cache write"
VLLM_FUSED_ROPE_CACHE = "vLLM fused RoPE + cache write"
VLLM_PREFILL_KEY_CONCAT = "vLLM prefill key concat"
VLLM_DECODE_CONCAT = "vLLM decode query concat"
VLLM_DECODE_CONCAT_QUANT = "vLLM decode query concat + fp8 quant"
# What a fused layer in decode mode no longer runs (the prefill key concat it keeps, so far).
VLLM_REPLACED = (VLLM_ROPE, VLLM_CACHE_WRITE, VLLM_FUSED_ROPE_CACHE, VLLM_DECODE_CONCAT, VLLM_DECODE_CONCAT_QUANT)
VLLM_CATEGORIES = (*VLLM_REPLACED, VLLM_PREFILL_KEY_CONCAT)

# vLLM's compiled kernels for the same work, counted where no wrapped function encloses them.
_VLLM_KERNELS = {
    "_C::rotary_embedding": VLLM_ROPE,
    "_C::concat_and_cache_mla": VLLM_CACHE_WRITE,
    "_C::concat_and_cache_mla_grouped": VLLM_CACHE_WRITE,
    "_C::concat_and_cache_mla_rope_fused": VLLM_FUSED_ROPE_CACHE,
}


def category(event_name: str) -> str | None:
    """What a profiler event counts as, or None."""
    if event_name.startswith(FUSED_PREFIX):
        return event_name
    if event_name in VLLM_CATEGORIES:
        return event_name
    return _VLLM_KERNELS.get(event_name)


def is_fused(cat: str) -> bool:
    return cat.startswith(FUSED_PREFIX)


@dataclass
class StepCensus:
    """One engine step: the batch the MLA layers saw, and per layer the count of each category."""

    batch: dict
    counted: bool
    layers: dict[str, dict[str, int]] = field(default_factory=dict)
    outside_layers: dict[str, int] = field(default_factory=dict)


def count(events) -> tuple[dict[str, Counter], Counter]:
    """Per layer (and outside any layer) the counted events of a profile's ``events()``."""
    layers: dict[str, Counter] = {}
    outside: Counter = Counter()
    for event in events:
        if event.name.startswith(LAYER_PREFIX):
            layers.setdefault(event.name.removeprefix(LAYER_PREFIX), Counter())
            continue
        cat = category(event.name)
        if cat is None:
            continue
        layer, parent, nested = None, event.cpu_parent, False
        while parent is not None:
            nested = nested or category(parent.name) == cat
            if layer is None and parent.name.startswith(LAYER_PREFIX):
                layer = parent.name.removeprefix(LAYER_PREFIX)
            parent = parent.cpu_parent
        if nested:
            continue
        if layer is None:
            outside[cat] += 1
        else:
            layers.setdefault(layer, Counter())[cat] += 1
    return layers, outside


def _ranged(label: str, fn, when=None):
    """``fn`` inside a profiler range named ``label`` (only for calls where ``when(*args)`` holds)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if when is not None and not when(*args, **kwargs):
            return fn(*args, **kwargs)
        with record_function(label):
            return fn(*args, **kwargs)

    wrapped.census_wrapped = True
    return wrapped


def _batch_of(layer_name: str) -> dict | None:
    """Decode/prefill split of the step, from the layer's attention metadata in vLLM's forward context."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, dict):
        metadata = metadata.get(layer_name)
    if metadata is None or not hasattr(metadata, "num_decode_tokens"):
        return None
    prefill = getattr(metadata, "prefill", None)
    return {
        "decodes": metadata.num_decodes,
        "prefills": metadata.num_prefills,
        "decode_tokens": metadata.num_decode_tokens,
        "prefill_tokens": metadata.num_actual_tokens - metadata.num_decode_tokens,
        # a prefill that continues a chunk or a prefix-cache hit: attention over cached context
        "prefill_with_context": prefill is not None and prefill.chunked_context is not None,
    }


class Census:
    """Install before the model is built; then ``with census.step(): engine.step()`` records one step."""

    def __init__(self) -> None:
        self.steps: list[StepCensus] = []
        self._undo: list[tuple[object, str, object]] = []
        self._batch: dict | None = None

    def _patch(self, owner, name: str, value) -> None:
        self._undo.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)

    def install(self) -> Census:
        """Wrap vLLM's launch sites in every MLA layer built from now on."""
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
        from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

        census = self
        attention_init = MLAAttention.__init__
        wrapper_init = MultiHeadLatentAttentionWrapper.__init__

        # Instance attributes, set right after vLLM builds them: the plugin's
        # decode mode captures impl.forward_mqa afterwards, so what it calls is
        # the counted function, and a query it assembled arrives as one tensor.
        def counted_attention_init(attn, *args, **kwargs):
            attention_init(attn, *args, **kwargs)
            impl = attn.impl
            impl.do_kv_cache_update = _ranged(VLLM_CACHE_WRITE, impl.do_kv_cache_update)
            if hasattr(impl, "_concat_k_nope_k_pe"):
                impl._concat_k_nope_k_pe = _ranged(VLLM_PREFILL_KEY_CONCAT, impl._concat_k_nope_k_pe)
            if hasattr(impl, "forward_mqa"):
                impl.forward_mqa = _ranged(
                    VLLM_DECODE_CONCAT, impl.forward_mqa, when=lambda q, *a, **k: isinstance(q, tuple)
                )
            quant = getattr(attn, "_decode_concat_quant_fp8_op", None)
            if isinstance(quant, torch.nn.Module):
                quant.forward = _ranged(VLLM_DECODE_CONCAT_QUANT, quant.forward)

        def counted_wrapper_init(wrapper, *args, **kwargs):
            wrapper_init(wrapper, *args, **kwargs)
            rope = wrapper.rotary_emb
            if rope is not None and not getattr(rope.forward, "census_wrapped", False):  # shared between layers
                rope.forward = _ranged(VLLM_ROPE, rope.forward)
            label = LAYER_PREFIX + wrapper.prefix
            forward, layer_name = wrapper.forward, wrapper.mla_attn.layer_name

            @functools.wraps(forward)
            def counted_forward(*a, **k):
                if census._batch is None:
                    census._batch = _batch_of(layer_name)
                with record_function(label):
                    return forward(*a, **k)

            wrapper.forward = counted_forward

        self._patch(MLAAttention, "__init__", counted_attention_init)
        self._patch(MultiHeadLatentAttentionWrapper, "__init__", counted_wrapper_init)
        return self

    def uninstall(self) -> None:
        """Restore vLLM's classes (layers built meanwhile keep their counted methods)."""
        while self._undo:
            owner, name, value = self._undo.pop()
            setattr(owner, name, value)

    @contextlib.contextmanager
    def step(self, profiled: bool = True):
        """Record what runs inside as one step (``profiled=False``: only the batch, nothing counted)."""
        self._batch = None
        if not profiled:
            yield
            self.steps.append(StepCensus(self._batch or {}, counted=False))
            return
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield
        layers, outside = count(prof.events())
        self.steps.append(
            StepCensus(self._batch or {}, True, {k: dict(v) for k, v in sorted(layers.items())}, dict(outside))
        )
