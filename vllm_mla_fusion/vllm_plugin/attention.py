"""MLAAttention whose decode query and prefill key are assembled by the fused ops.

In vLLM 0.33 ``MLAAttention.forward_impl`` splits a step's tokens (decodes first):

- decode tokens: ``ql_nope = q_nope @ W_UK``, then ``(ql_nope, q_pe)`` goes to
  the backend's ``forward_mqa``, which concatenates them, or, when the backend
  takes an fp8 query, concatenates and quantizes them first
  (``_decode_concat_quant_fp8_op``). A fused layer changes only that
  hand-over: the fp8 concat-quant becomes a pass-through and ``forward_mqa``
  first turns the pair into ``[ql_nope | rope(q_pe)]`` with
  ``mla_fusion::mla_decode_rope_cache_write``, which writes the decode tokens'
  cache rows in the same launch. Backends that take the pair as it is
  (FLASH_ATTN_MLA, CUTLASS_MLA: no concat to save, and assembling it would
  copy ``ql_nope`` for nothing) instead get ``mla_fusion::mla_rope_cache_write``
  on the decode rows before ``forward_impl``, and the pair passes unchanged.
- prefill tokens: ``forward_mha`` projects ``kv_b_proj(kv_c_normed)`` into
  ``(k_nope, v)`` and builds the attention key with ``_concat_k_nope_k_pe``
  before anything reads ``q``. By default the prefill rows get
  ``mla_fusion::mla_rope_cache_write`` before ``forward_impl`` and vLLM builds
  the key. With ``VLLM_MLA_FUSION_PREFILL_KEY=1`` (opt-in: docs/vllm.md says
  why) a fused layer turns that first call into
  ``mla_fusion::mla_prefill_rope_cache_write``: q and k_pe rotated, cache rows
  written and the key built, in one launch. Later calls (chunked-prefill
  context, whose k_pe comes rotated from the cache) stay vLLM's. Where ``q``
  is read before the key is built (fp8 prefill attention casts it first) or
  the backend builds the key another way, the prefill tokens instead get
  ``mla_fusion::mla_rope_cache_write`` before ``forward_impl`` and vLLM's own
  concat (eligibility.py says which, per backend and step).
- mixed steps on backends that take the decode pair as it is: with op 3,
  vLLM's forward_impl runs ``forward_mha`` before ``forward_mqa``, so the
  prefill op's launch also takes the decode rows (``key_start =
  num_decode_tokens``: rotated and cached like op 1, no key row), and nothing
  runs before forward_impl; without it, one op 1 launch takes the decode and
  prefill rows before forward_impl.

Launches of ours per layer and step: decode-only 1, prefill-only 1, mixed 1 (2
where the decode query is assembled by op 2, whose input ``ql_nope`` only
exists once ``forward_mqa`` runs); vLLM's key concat adds its copies where op 3
does not run.

With ``graph_rope`` (eligibility.graph_rope_reason), a step that captures or
replays piecewise CUDA graphs has its op 1 inside the graph piece before the
attention op (custom_ops.piecewise_rope_kv_cache_update): the attention op then
runs vLLM's forward_impl as vLLM would, with its own key and query
concatenations, and launches nothing of ours. Other steps are as above.

MLAAttention is not a pluggable layer and registers itself in vLLM's
static forward context when built, so a second instance cannot be built in
its place; the wrapper instead promotes the instance it built to this
subclass, which only adds methods and a few attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from vllm.config import CacheConfig
from vllm.forward_context import in_piecewise_cudagraph
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import MLAAttention
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import is_quantized_kv_cache

from ..binding import BoundOps
from ..opcodes import OP_DECODE, OP_PREFILL, OP_ROPE_CACHE
from . import eligibility
from .custom_ops import bind_layer_ops, prewarm_in_profile_run, write_target

logger = init_logger("vllm.vllm_mla_fusion.attention")


class _DeferredDecodeQuery(torch.nn.Module):
    """Takes the place of ``_decode_concat_quant_fp8_op``: leaves the pair for the fused op."""

    def forward(self, ql_nope: torch.Tensor, q_pe: torch.Tensor, scale: torch.Tensor, scale_ub=None):
        return ql_nope, q_pe


@dataclass
class _DecodeStep:
    """What the decode query assembly of one step needs beyond (ql_nope, q_pe)."""

    positions: torch.Tensor  # [>= num_decode_tokens]: the step's, decode tokens first
    k_pe: torch.Tensor  # [num_decode_tokens, 1, R], un-rotated
    kv_c: torch.Tensor  # [num_decode_tokens, L]
    slot_mapping: torch.Tensor  # [>= num_decode_tokens]
    kv_cache: torch.Tensor
    kv_cache_dtype: str
    cos_sin_cache: torch.Tensor
    is_neox: bool
    assembled: bool = False


@dataclass
class _PrefillStep:
    """What the prefill key assembly of one step needs beyond k_nope.

    Its rows are the step's prefill tokens, preceded by ``key_start`` decode tokens when
    the same launch takes those too (their rows get op 1's work and no key row)."""

    positions: torch.Tensor  # [>= key_start + num_prefill_tokens]: its rows' entries first
    q_pe: torch.Tensor  # [key_start + num_prefill_tokens, H, R] view of q, un-rotated
    k_pe: torch.Tensor  # [key_start + num_prefill_tokens, 1, R], un-rotated
    kv_c: torch.Tensor  # [key_start + num_prefill_tokens, L]
    slot_mapping: torch.Tensor  # [>= key_start + num_prefill_tokens]
    kv_cache: torch.Tensor
    kv_cache_dtype: str
    cos_sin_cache: torch.Tensor
    is_neox: bool
    key_start: int  # rows before the prefill tokens (decode tokens), 0 or num_decode_tokens
    assembled: bool = False


class _Steps:
    """The decode and prefill steps forward_fused prepared, for the hooks forward_impl calls.

    A plain object rather than attributes of the layer: setting an attribute of a torch module
    goes through ``nn.Module.__setattr__`` (~1 us each, four per layer and step). ``in_graph``:
    the step's op 1 ran inside a piecewise graph; the hooks leave everything to vLLM."""

    __slots__ = ("decode", "prefill", "in_graph")

    def __init__(self) -> None:
        self.decode: _DecodeStep | None = None
        self.prefill: _PrefillStep | None = None
        self.in_graph = False


def _rows(first: int, last: int, num_tokens: int, rope_dim: int, positions: torch.Tensor, q: torch.Tensor,
          k_pe: torch.Tensor, kv_c: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Rows ``[first, last)`` of a step as an op takes them: ``(positions, q_pe, k_pe, kv_c, slots)``.

    The ops take as many tokens as ``q_pe`` has rows and read only that many leading entries of
    ``positions`` and ``slots``, so those two are sliced from ``first`` alone (not at all from
    row 0), and a prefill-only step without padding slices nothing but ``q_pe`` out of ``q``:
    each slice costs 1-2 us of host time per layer in steps that run outside CUDA graphs.
    """
    if first == 0 and last == num_tokens:
        return positions, q[..., -rope_dim:], k_pe, kv_c, slots
    if first:
        positions, slots = positions[first:], slots[first:]
    return positions, q[first:last, :, -rope_dim:], k_pe[first:last], kv_c[first:last], slots


class FusedMLAAttention(MLAAttention):
    """An MLAAttention whose RoPE, cache write and decode query come from the fused ops."""

    _steps: _Steps  # what the step in progress prepared for forward_impl's hooks
    _decode_query_dtype: torch.dtype | None  # fp8 when the backend takes an fp8 query
    _prefill_key_fused: bool  # the backend's forward_mha builds the key through _concat_k_nope_k_pe
    _prefill_key_step_rule: Callable[[object], str | None] | None  # its per-step rule, bound where it is fused
    _prefill_key_reasons: set[str]  # per-step fallback reasons already logged
    # vLLM's cache config, where kernels are compiled in the profile run: its block size is read
    # then, since vLLM settles it for the attention backend only after the model is built
    # (Platform.update_block_size_for_backend: FLASHMLA 64, not the 16 a layer sees at construction).
    _prewarm_cache_config: CacheConfig | None
    _decode_assembles_query: bool  # op 2 builds [ql_nope | rope(q_pe)]; else op 1 rotates the decode rows
    _graph_rope: bool  # piecewise-graph steps run op 1 inside the graph (custom_ops.piecewise_rope_kv_cache_update)
    # The ops the layer calls, shared with every fused layer built with the same backend and
    # VLLM_MLA_FUSION_DEBUG (binding.shared_ops), both fixed when it was built; keyed by
    # the cache format too, since profile runs write through a scratch cache ("auto").
    _bound_ops: BoundOps

    @classmethod
    def promote(cls, attn: MLAAttention, backend: str, cache_config: CacheConfig,
                graph_rope: bool = False) -> FusedMLAAttention:  # fmt: skip
        """Turn ``attn`` into a FusedMLAAttention in place (see the module docstring).

        ``backend`` is the one the ops resolve to on this layer's device and
        ``cache_config`` vLLM's (its block size, read in the profile run: both for compiling the kernel ahead);
        ``graph_rope``: piecewise-graph steps get op 1 inside the graph.
        """
        # Same condition as forward_impl's choice of the fp8 concat-quant.
        fp8_query = is_quantized_kv_cache(attn.kv_cache_dtype) and attn.impl.supports_quant_query_input
        vllm_forward_mqa = attn.impl.forward_mqa
        assemble_reason = eligibility.decode_pair_reason(attn.impl, fp8_query)
        # vLLM's own fp8 query concat-quant, for piecewise-graph steps whose op 1 ran in the graph.
        vllm_concat_quant = attn._decode_concat_quant_fp8_op if fp8_query else None

        def forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer):
            if isinstance(q, tuple):
                if not layer._steps.in_graph:
                    q = layer.assemble_decode_query(*q)
                elif vllm_concat_quant is not None:
                    q = vllm_concat_quant(*q, layer._q_scale)
                # else: q_pe is rotated already; the backend concatenates the pair as without us
            return vllm_forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)

        def forward_mqa_after_prefill_key(q, kv_c_and_k_pe_cache, attn_metadata, layer):
            # The decode rows of a mixed step are rotated and cached by the prefill op's launch
            # in forward_mha, which vLLM 0.33's forward_impl runs first. A vLLM that ran the
            # decode attention first would read them un-rotated: fail loudly instead.
            step = layer._steps.prefill
            if step is not None and step.key_start and not step.assembled:
                raise RuntimeError(
                    f"vllm-mla-fusion: {layer.layer_name}'s decode attention ran before forward_mha built the "
                    "prefill key; unset VLLM_MLA_FUSION_PREFILL_KEY (the fused key is opt-in) and report this vLLM configuration"
                )
            return vllm_forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)

        prefill_reason = eligibility.prefill_key_reason(attn.impl)
        attn.__class__ = cls
        attn._steps = _Steps()
        attn._decode_query_dtype = current_platform.fp8_dtype() if fp8_query else None
        attn._prefill_key_fused = prefill_reason is None
        attn._prefill_key_step_rule = eligibility.prefill_key_step_rule(attn.impl) if attn._prefill_key_fused else None
        attn._prefill_key_reasons = set()
        attn._decode_assembles_query = assemble_reason is None
        attn._graph_rope = graph_rope
        bind_layer_ops(attn, backend, cache_config)  # _bound_ops and _prewarm_cache_config, as in rope_cache mode
        if fp8_query:
            attn._decode_concat_quant_fp8_op = _DeferredDecodeQuery()
        if assemble_reason is None:
            attn.impl.forward_mqa = forward_mqa
        else:
            logger.debug("vllm-mla-fusion: %s rotates the decode rows with op 1: %s", attn.layer_name, assemble_reason)
            if prefill_reason is None:
                attn.impl.forward_mqa = forward_mqa_after_prefill_key
        if prefill_reason is None:
            impl = attn.impl
            # What vLLM would call: an instance attribute someone set before us (a wrapper
            # of theirs), else the class's method, looked up at each call.
            previous = impl.__dict__.get("_concat_k_nope_k_pe")

            def concat_k_nope_k_pe(k_nope, k_pe):
                vllm_concat = previous or type(impl)._concat_k_nope_k_pe.__get__(impl)
                return attn.assemble_prefill_key(k_nope, k_pe, vllm_concat)

            impl._concat_k_nope_k_pe = concat_k_nope_k_pe
        else:
            logger.debug("vllm-mla-fusion: %s builds the prefill key the vLLM way: %s", attn.layer_name, prefill_reason)
        return attn

    def _fuse_prefill_key(self, attn_metadata) -> bool:
        """Whether this step's prefill rows reach the key through the fused prefill op."""
        if not self._prefill_key_fused:
            return False
        reason = self._prefill_key_step_rule(attn_metadata)
        if reason is not None and reason not in self._prefill_key_reasons:
            self._prefill_key_reasons.add(reason)  # once per layer and reason, never per step
            logger.debug("vllm-mla-fusion: %s keeps vLLM's prefill key for such steps: %s", self.layer_name, reason)
        return reason is None

    def forward_fused(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor | None,
        attn_metadata,
        output: torch.Tensor,
    ) -> None:
        """Attention for one step with un-rotated ``q`` ``[T, H, P + R]`` and ``k_pe`` ``[T, 1, R]``.

        Runs inside ``mla_fusion_vllm::mla_attention_with_output``. Tokens
        past ``num_actual_tokens`` are padding (slot -1): vLLM's forward_impl
        never reads them, so they are neither rotated nor written.
        """
        steps = self._steps
        if self._graph_rope and in_piecewise_cudagraph():
            # The graph piece before this op rotated q and k_pe and wrote the cache rows
            # (custom_ops.piecewise_rope_kv_cache_update): vLLM's own attention step, as is.
            steps.in_graph = True
            try:
                self.forward_impl(q, kv_c_normed, k_pe, kv_cache, attn_metadata, output=output)
            finally:
                steps.in_graph = False
            return
        num_tokens = q.shape[0]
        rope_dim = self.qk_rope_head_dim
        cache, slots, cache_dtype = write_target(
            kv_cache, slot_mapping, self.kv_cache_dtype, num_tokens, self.kv_lora_rank + rope_dim, kv_c_normed
        )
        if attn_metadata is None:
            # Profile and dummy runs: vLLM writes every token that has a slot
            # and forward_impl returns zeros without reading anything.
            num_decode, end = 0, num_tokens
            prewarm_in_profile_run(self, q, kv_c_normed, k_pe, positions, cos_sin_cache, is_neox)
        else:
            num_decode, end = attn_metadata.num_decode_tokens, attn_metadata.num_actual_tokens
        prefill = None
        # Rows [first, last) get op 1 now: the decode rows where the backend takes (ql_nope,
        # q_pe) as is, and the prefill rows where vLLM builds the key. Decode rows come first,
        # so the two ranges are one when both apply: one launch. Where the prefill op builds
        # the key, its launch (inside forward_impl, before the decode attention) takes the
        # decode rows of the first kind as well, and nothing runs here.
        first = num_decode if self._decode_assembles_query else 0
        last = num_decode
        if end > num_decode:
            if attn_metadata is not None and self._fuse_prefill_key(attn_metadata):
                pos, q_pe, k_pe_rows, kv_c, slot = _rows(first, end, num_tokens, rope_dim, positions, q, k_pe,
                                                         kv_c_normed, slots)  # fmt: skip
                prefill = _PrefillStep(pos, q_pe, k_pe_rows, kv_c, slot, cache, cache_dtype, cos_sin_cache, is_neox,
                                       num_decode - first)  # fmt: skip
                last = first
            else:
                last = end
        if last > first:
            pos, q_pe, k_pe_rows, kv_c, slot = _rows(first, last, num_tokens, rope_dim, positions, q, k_pe,
                                                     kv_c_normed, slots)  # fmt: skip
            op1 = self._bound_ops.get(OP_ROPE_CACHE, cache_dtype, is_neox)
            op1(pos, q_pe, k_pe_rows, kv_c, cos_sin_cache, slot, cache, self._k_scale)
        step = None
        if num_decode > 0 and self._decode_assembles_query:
            # positions and slots whole: op 2 reads their first num_decode entries (_rows says why)
            step = _DecodeStep(positions, k_pe[:num_decode], kv_c_normed[:num_decode], slots, cache, cache_dtype,
                               cos_sin_cache, is_neox)  # fmt: skip
        steps.decode, steps.prefill = step, prefill
        try:
            self.forward_impl(q, kv_c_normed, k_pe, kv_cache, attn_metadata, output=output)
        finally:
            steps.decode = steps.prefill = None
        # forward_impl took a route this plugin does not know: the tokens' RoPE and cache
        # rows would be missing. Fail loudly.
        if step is not None and not step.assembled:
            raise RuntimeError(
                f"vllm-mla-fusion: {self.layer_name} had {num_decode} decode tokens but vLLM's forward_impl "
                "never asked for their query; set VLLM_MLA_FUSION_DECODE=0 and report this vLLM configuration"
            )
        if prefill is not None and not prefill.assembled:
            raise RuntimeError(
                f"vllm-mla-fusion: {self.layer_name} had {end - num_decode} prefill tokens (and {prefill.key_start} "
                "decode tokens the same launch serves) but vLLM's forward_mha never built their key; unset "
                "VLLM_MLA_FUSION_PREFILL_KEY (the fused key is opt-in) and report this vLLM configuration"
            )

    def assemble_prefill_key(self, k_nope: torch.Tensor, k_pe: torch.Tensor, vllm_concat) -> torch.Tensor:
        """The prefill attention key ``[k_nope | rope(k_pe)]`` ``[T, H, P + R]``; q, k_pe rotated, cache written.

        Takes the place of ``impl._concat_k_nope_k_pe``. Only the first call of a
        fused step is the step's own tokens; any other (the chunked context, read
        back from the cache already rotated) is vLLM's concat. ``k_pe`` is vLLM's
        view of the prefill rows of the step's k_pe; the launch takes the step's
        own rows (decode rows too, when it serves them), the same memory.
        """
        step = self._steps.prefill
        if step is None or step.assembled:
            return vllm_concat(k_nope, k_pe)
        step.assembled = True
        num_rows, num_heads, rope_dim = step.q_pe.shape
        num_keys = num_rows - step.key_start
        if tuple(k_nope.shape[:2]) != (num_keys, num_heads) or k_nope.dtype != step.q_pe.dtype:
            # Not the key this step was prepared for: keep the semantics (rotate and
            # write first, then vLLM's concat of the rotated k_pe) rather than guess.
            logger.warning_once(
                "vllm-mla-fusion: unexpected prefill key input %s %s in %s; using op 1 + vLLM's concat",
                tuple(k_nope.shape), k_nope.dtype, self.layer_name,
            )  # fmt: skip
            op1 = self._bound_ops.get(OP_ROPE_CACHE, step.kv_cache_dtype, step.is_neox)
            s = step.key_start
            if k_pe.shape[0] != num_keys:
                # Not even vLLM's k_pe has the step's prefill rows: nothing here is safe to write.
                raise RuntimeError(
                    f"vllm-mla-fusion: {self.layer_name}'s forward_mha built a key from {k_pe.shape[0]} rows of "
                    f"k_pe for {num_keys} prefill tokens; unset VLLM_MLA_FUSION_PREFILL_KEY (the fused key is opt-in) and report this vLLM "
                    "configuration"
                )  # fmt: skip
            if s:  # the decode rows this launch was to serve
                op1(step.positions[:s], step.q_pe[:s], step.k_pe[:s], step.kv_c[:s], step.cos_sin_cache,
                    step.slot_mapping[:s], step.kv_cache, self._k_scale)  # fmt: skip
            # The prefill rows through the k_pe vLLM's concat reads.
            op1(step.positions[s:], step.q_pe[s:], k_pe, step.kv_c[s:], step.cos_sin_cache, step.slot_mapping[s:],
                step.kv_cache, self._k_scale)  # fmt: skip
            return vllm_concat(k_nope, k_pe)
        k_out = torch.empty((num_keys, num_heads, k_nope.shape[-1] + rope_dim), dtype=k_nope.dtype,
                            device=k_nope.device)  # fmt: skip
        self._bound_ops.get(OP_PREFILL, step.kv_cache_dtype, step.is_neox)(
            step.positions, step.q_pe, step.k_pe, step.kv_c, step.cos_sin_cache, step.slot_mapping, step.kv_cache,
            self._k_scale, k_nope, k_out, None, step.key_start,
        )  # fmt: skip
        return k_out

    def assemble_decode_query(self, ql_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """``[ql_nope | rope(q_pe)]`` ``[B, H, L + R]`` (fp8 if the backend wants it), caching the decode rows."""
        step = self._steps.decode
        if step is None:
            raise RuntimeError(
                f"vllm-mla-fusion: decode attention of {self.layer_name} ran outside the fused attention op"
            )
        num_tokens, num_heads, _ = ql_nope.shape
        q_out = torch.empty(
            (num_tokens, num_heads, ql_nope.shape[-1] + q_pe.shape[-1]),
            dtype=self._decode_query_dtype or ql_nope.dtype,
            device=ql_nope.device,
        )
        self._bound_ops.get(OP_DECODE, step.kv_cache_dtype, step.is_neox)(
            step.positions, q_pe, step.k_pe, step.kv_c, step.cos_sin_cache, step.slot_mapping, step.kv_cache,
            self._k_scale, ql_nope, q_out, self._q_scale if self._decode_query_dtype is not None else None,
        )  # fmt: skip
        step.assembled = True
        return q_out
