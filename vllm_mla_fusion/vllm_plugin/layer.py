"""The out-of-tree MultiHeadLatentAttentionWrapper that vLLM builds once the plugin is registered.

vLLM 0.33's wrapper forward (vllm/model_executor/layers/mla.py) runs, per layer:

1. the q/kv down projections, the q/kv RMSNorms and the q up projection;
2. RoPE on ``q[..., qk_nope_head_dim:]`` and ``k_pe``;
3. ``MLAAttention.forward``: ``unified_mla_kv_cache_update`` writes
   ``[kv_c_normed | k_pe]``, then ``unified_mla_attention_with_output``;
4. ``o_proj``.

A fused layer keeps 1 and 4, and replaces 2 and the cache write of 3 with one
call of this project's op per layer and step. Which op, and where, depends
on the layer's mode, chosen once at construction:

- ``decode`` (default): one op, ``mla_fusion_vllm::mla_attention_with_output``,
  carries ``positions`` into the attention step, where prefill tokens get
  ``mla_rope_cache_write`` and the decode tokens' query is assembled by
  ``mla_decode_rope_cache_write`` (attention.py).
- ``rope_cache``: ``mla_fusion_vllm::rope_kv_cache_update`` (op 1 over the
  whole batch, inside the compiled graph), then vLLM's own attention op, whose
  decode path concatenates the query itself. Used when the decode part of
  vLLM's attention is one the plugin does not handle (eligibility.decode_reason)
  or ``VLLM_MLA_FUSION_DECODE=0``.

Layers the fused ops cannot serve (eligibility.layer_reason) keep vLLM's
forward unchanged; the reason is logged at debug level per layer, and at
info level once per process and reason.

Logging: vLLM's ``*_once`` loggers default to ``scope="local"``, i.e. local
rank 0 only, so a setup failure on another rank (a missing library, a GPU
the backend cannot run on) would leave that rank on vLLM's path without a
word. The fallback warning, the chosen backend and mode, and the reason a
layer keeps vLLM's path are therefore logged once per process
(``scope="process"``), each line naming its rank.

vLLM 0.33's forward has no seam between stage 1 and stage 2, and its
attention call cannot carry ``positions``, so a fused layer restates stage 1
in ``_project`` (only the dense configurations eligibility admits: no DCP
query replication, no sparse indexer) and calls the attention ops itself.
The layer tests compare the whole forward against vLLM's, which catches drift.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper
from vllm.models.common.ops import fused_q_kv_rmsnorm
from vllm.utils.torch_utils import _encode_layer_name

from .. import dispatch, validation
from . import eligibility

logger = init_logger("vllm.vllm_mla_fusion.layer")

MODE_DECODE = "decode"
MODE_ROPE_CACHE = "rope_cache"
VLLM_ATTENTION_OP = "vllm::unified_mla_attention_with_output"


def rank_label() -> str:
    """``"rank 3, local rank 3"`` for this process in vLLM's world group, else ``"single process"``."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        world = get_world_group()
        return f"rank {world.rank}, local rank {world.local_rank}"
    except Exception:  # noqa: BLE001 - no world group yet (or another vLLM layout): fall back to torch
        pass
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return f"rank {torch.distributed.get_rank()}"
    return "single process"


def slow_settings(backend: str, device: torch.device) -> list[str]:
    """Settings the user chose that make a server's fused layers slower, each said once per rank at
    start-up: a serving comparison whose plugin side runs with one of them measures the setting,
    and the log is where whoever reads the comparison finds it. (The reference backend that the
    automatic choice takes where no kernel runs, e.g. on a CPU, is no such setting.)"""
    slow = []
    if validation.debug_enabled():
        slow.append(
            "VLLM_MLA_FUSION_DEBUG is set: every fused call checks its index values on the host and "
            "waits for the device, so steps outside CUDA graphs (prefill and mixed steps) are slower; unset it to serve"
        )
    if backend == "torch" and device.type != "cpu" and dispatch.requested_backend() == "torch":
        slow.append(
            f"VLLM_MLA_FUSION_BACKEND=torch runs the reference backend on the {device.type} device: each fused "
            "call is tens of torch ops, for checking the kernels, not for serving"
        )
    return slow


class FusedMultiHeadLatentAttentionWrapper(MultiHeadLatentAttentionWrapper):
    """MultiHeadLatentAttentionWrapper with the fused RoPE + KV-cache write where eligible.

    ``fusion_mode`` is None (vLLM's forward), ``"rope_cache"`` or ``"decode"``.
    """

    fusion_mode: str | None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fusion_mode = None
        vllm_config = get_current_vllm_config()
        try:
            reason = eligibility.layer_reason(self, vllm_config)
            if reason is not None:
                logger.debug("vllm-mla-fusion: %s keeps vLLM's MLA path: %s", self.prefix, reason)
                logger.info_once(
                    "vllm-mla-fusion (%s): MLA layers keep vLLM's path: %s",
                    rank_label(),
                    reason,
                    scope="process",  # every rank says why it is not fused (e.g. AMX_MLA on a CPU with AMX)
                )
                return
            decode_reason = eligibility.decode_reason(self.mla_attn, vllm_config)
            backend = eligibility.load_backend(self.rotary_emb.cos_sin_cache.device, decode=decode_reason is None)
            if decode_reason is None:
                self._setup_decode_mode(vllm_config, backend)
            else:
                logger.debug(
                    "vllm-mla-fusion: %s assembles the decode query the vLLM way: %s", self.prefix, decode_reason
                )
                self._setup_rope_cache_mode(vllm_config, backend)
        except Exception as e:  # noqa: BLE001 - any setup failure means vLLM's path, never a half-fused layer
            self.fusion_mode = None
            logger.warning_once(
                "vllm-mla-fusion (%s): setting up the fused MLA path failed (%s: %s); layers fall back to vLLM's path",
                rank_label(),
                type(e).__name__,
                str(e),  # warning_once dedups on its arguments: exception objects never compare equal
                scope="process",  # every rank: a failure on rank 3 alone must not go unseen
            )
            logger.debug("vllm-mla-fusion: setup failure in %s", self.prefix, exc_info=True)
            return
        decode = self.fusion_mode == MODE_DECODE
        logger.info_once(
            "vllm-mla-fusion (%s): MLA layers use the fused RoPE + KV-cache write (backend %s, mode %s)",
            rank_label(),
            backend,
            # The opt-in switches that took effect: VLLM_MLA_FUSION_GRAPH_ROPE, VLLM_MLA_FUSION_PREFILL_KEY
            # (a backend whose prefill key op 3 cannot build keeps vLLM's: eligibility.prefill_key_reason).
            self.fusion_mode
            + ("-graph-rope" if decode and self.mla_attn._graph_rope else "")
            + ("-prefill-key" if decode and self.mla_attn._prefill_key_fused else ""),
            scope="process",  # one line per rank, so ranks that chose differently are visible
        )
        for setting in slow_settings(backend, self.rotary_emb.cos_sin_cache.device):
            logger.warning_once("vllm-mla-fusion (%s): %s", rank_label(), setting, scope="process")

    def _setup_rope_cache_mode(self, vllm_config, backend: str) -> None:
        from . import custom_ops

        # Op 1's bound ops live on the attention layer, where rope_kv_cache_update finds them
        # by the layer's name; backend and debug mode fixed now, as in decode mode.
        custom_ops.bind_layer_ops(self.mla_attn, backend, vllm_config.cache_config)
        self.fusion_mode = MODE_ROPE_CACHE

    def _setup_decode_mode(self, vllm_config, backend: str) -> None:
        from . import custom_ops
        from .attention import FusedMLAAttention

        # The attention op must be split out of piecewise CUDA graphs wherever
        # vLLM splits its own (it reads per-step metadata on the host).
        splitting = vllm_config.compilation_config.splitting_ops
        if splitting is not None and VLLM_ATTENTION_OP in splitting and custom_ops.ATTENTION_OP not in splitting:
            splitting.append(custom_ops.ATTENTION_OP)
        graph_rope_reason = eligibility.graph_rope_reason(vllm_config)
        FusedMLAAttention.promote(self.mla_attn, backend, vllm_config.cache_config,
                                  graph_rope=graph_rope_reason is None)  # fmt: skip
        if graph_rope_reason is not None:
            logger.debug("vllm-mla-fusion: %s keeps its RoPE in the attention op in piecewise-graph steps: %s",
                         self.prefix, graph_rope_reason)  # fmt: skip
        self.fusion_mode = MODE_DECODE

    def _project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stage 1 of vLLM's forward: ``(q [T, H, P + R], kv_c_normed [T, L], k_pe [T, 1, R])``, un-rotated."""
        if self.q_lora_rank is not None:
            qkv_lora = self.fused_qkv_a_proj(hidden_states)[0]
            q_c, kv_lora = qkv_lora.split([self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1)
            q_proj, q_input = self.q_b_proj, q_c
        else:
            kv_lora = self.kv_a_proj_with_mqa(hidden_states)[0]
            q_proj, q_input = self.q_proj, hidden_states
        kv_c, k_pe = kv_lora.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        if self.q_lora_rank is not None and self.fuse_qkv_rmsnorm:
            q_input, kv_c_normed = fused_q_kv_rmsnorm(
                q_input,
                kv_c,
                self.q_a_layernorm.weight.data,
                self.kv_a_layernorm.weight.data,
                self.q_a_layernorm.variance_epsilon,
            )
        else:
            if self.q_lora_rank is not None:
                q_input = self.q_a_layernorm(q_input)
            kv_c_normed = self.kv_a_layernorm(kv_c)
        q = q_proj(q_input)[0].view(-1, self.num_heads, self.qk_head_dim)
        return q, kv_c_normed, k_pe.unsqueeze(1)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        llama_4_scaling: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.fusion_mode is None:
            return super().forward(positions, hidden_states, llama_4_scaling)
        if llama_4_scaling is not None:
            # Eligibility excludes models whose config sets llama_4_scaling; a
            # caller passing it anyway would get different math, not a fallback.
            raise ValueError(
                f"vllm-mla-fusion: {self.prefix} was built for the fused path but received llama_4_scaling; "
                "set VLLM_MLA_FUSION=0 for this model"
            )
        q, kv_c_normed, k_pe = self._project(hidden_states)
        rope = self.rotary_emb
        layer_name = _encode_layer_name(self.mla_attn.layer_name)
        output = torch.empty((hidden_states.shape[0], self.num_heads * self.v_head_dim), dtype=q.dtype, device=q.device)
        if self.fusion_mode == MODE_DECODE:
            attn = self.mla_attn
            if attn._graph_rope:
                # Inside the graph piece: does the RoPE + cache write in piecewise-graph forwards only.
                torch.ops.mla_fusion_vllm.piecewise_rope_kv_cache_update(
                    positions, q, k_pe, kv_c_normed, rope.cos_sin_cache, rope.is_neox_style, layer_name,
                    attn.kv_cache_dtype, attn._k_scale,
                )  # fmt: skip
            torch.ops.mla_fusion_vllm.mla_attention_with_output(
                q, kv_c_normed, k_pe, positions, rope.cos_sin_cache, rope.is_neox_style, output, layer_name
            )
        else:
            attn = self.mla_attn
            dep = torch.ops.mla_fusion_vllm.rope_kv_cache_update(
                positions, q, k_pe, kv_c_normed, rope.cos_sin_cache, rope.is_neox_style, layer_name,
                attn.kv_cache_dtype, attn._k_scale,
            )  # fmt: skip
            torch.ops.vllm.unified_mla_attention_with_output(
                q, kv_c_normed, k_pe, output, layer_name, kv_cache_dummy_dep=dep
            )
        if self.g_proj is not None:
            output = output * self.g_proj(hidden_states)[0].sigmoid()
        return self.o_proj(output)[0]
