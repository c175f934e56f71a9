"""The models a server loads: one tensor-parallel rank of DeepSeek-V3, or all of it; dummy weights.

Three, chosen by name (``MODELS``):

- ``dense``: today's end-to-end stand-in (benchmarks/e2e/bench_vllm_e2e.py), every layer a
  dense MLP of 18432/8 = 2304, bf16 weights; what the earlier results were measured on.
- ``fp8-moe``: DeepSeek-V3 as deployed on one TP8 rank: fp8 weights quantized in 128x128
  blocks (DeepSeek's own ``quantization_config``), 3 dense layers and MoE in the rest,
  256 routed experts of intermediate 2048/8 = 256, top-8 routing in 8 groups (top 4
  groups, sigmoid scores with a correction bias) plus 1 shared expert: vLLM's fp8 MoE
  path with all 256 experts on the rank, as tensor parallelism shards them.
- ``full``: DeepSeek-V3 itself (128 heads, dense intermediate 18432, experts of 2048, the
  fp8 quantization above), for ``--tensor-parallel-size 8``: each rank then holds what
  ``fp8-moe`` holds, but 1/8 of the embedding and LM head (``weight_bytes(config, 8)``).

The stand-ins keep a TP8 rank's attention (128/8 = 16 heads; the MLA dims and YaRN rope of
DeepSeek-V3), the full hidden size and the full vocabulary (the embedding and LM head a rank
would shard 1/8 each are whole here: ~3.2 GiB more than a rank holds, and an LM head 8x
larger per token). The layer count is a parameter: a server start costs ~1-2 s of compile
and load per layer, so a shorter model buys loads; differences per step then scale with
61 / layers (the report says so where it scales).

The directory holds config.json and a tokenizer built here (``build_tokenizer``): a
word-level vocabulary as large as the model's, so that vLLM's random dataset, which takes
runs of consecutive token ids from a random offset, gives every prompt its own tokens and
the prefix cache (on, vLLM's default) hits only where prompts really repeat. No weights
are written: servers load with ``--load-format dummy``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FULL_DEPTH = 61  # DeepSeek-V3's decoder layers
BOS, EOS = "<s>", "</s>"  # as demo/tiny_model.py's (save_tokenizer checks them)
# SentencePiece's word-boundary mark: each token is one word, decoded with a space before it.
WORD_MARK = "\u2581"


def dense_tp8_config() -> dict:
    """benchmarks/e2e/bench_vllm_e2e.py's DSV3_TP8_CONFIG: what the end-to-end results were measured on."""
    saved = dict(os.environ)
    try:
        from benchmarks.e2e.bench_vllm_e2e import DSV3_TP8_CONFIG
    finally:
        # That module sets defaults for its own engines (insecure serialization among them)
        # when imported; the servers here get the environment the user gave.
        os.environ.clear()
        os.environ.update(saved)
    return dict(DSV3_TP8_CONFIG)


# DeepSeek-V3's MoE and quantization, from its published config.json.
DSV3_MOE = {
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2048,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "hidden_act": "silu",
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
}
FULL_TENSOR_PARALLEL = 8  # the stand-ins are one rank of DeepSeek-V3 at this tensor-parallel size
# One TP8 rank: each expert's intermediate size sharded 8 ways (all 256 experts on every rank).
DSV3_MOE_TP8 = {**DSV3_MOE, "moe_intermediate_size": DSV3_MOE["moe_intermediate_size"] // FULL_TENSOR_PARALLEL}
# What tensor parallelism shards and the stand-ins hold 1/8 of; the full model holds them whole.
DSV3_SHARDED_DIMS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def stand_in_config(model: str, layers: int = FULL_DEPTH) -> dict:
    """config.json of stand-in ``model`` (a key of ``MODELS``) with ``layers`` decoder layers."""
    if model not in MODELS:
        raise ValueError(f"unknown model stand-in {model!r}; choose from {sorted(MODELS)}")
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    config = dense_tp8_config()
    # DeepSeek-V3's token ids; its transformers_version also tells transformers 5 that the
    # tokenizer is not one of Mistral's (whose regex it would warn about).
    config.update(num_hidden_layers=layers, bos_token_id=0, eos_token_id=1, transformers_version="4.33.1")
    if model == "dense":
        config["first_k_dense_replace"] = layers
        return config
    moe = DSV3_MOE if model == "full" else DSV3_MOE_TP8
    config.update(json.loads(json.dumps(moe)))  # a deep copy: callers may edit theirs
    config["first_k_dense_replace"] = min(moe["first_k_dense_replace"], layers)
    if model == "full":
        config.update({k: config[k] * FULL_TENSOR_PARALLEL for k in DSV3_SHARDED_DIMS})
    return config


MODELS = {
    "dense": "DeepSeek-V3 TP8 rank, every layer dense (bf16), as in bench_vllm_e2e.py",
    "fp8-moe": "DeepSeek-V3 TP8 rank as deployed: fp8 128x128 blocks, 3 dense + MoE layers (256 experts, top-8 + 1 shared)",
    "full": "DeepSeek-V3 as deployed, the whole model (for --tensor-parallel-size 8): fp8 128x128 blocks, 128 heads, "
    "3 dense + MoE layers (256 experts, top-8 + 1 shared)",
}
# The servers' environment per model, the same on every side. The fp8 models run vLLM's fp8 GEMM and
# MoE kernels without DeepGEMM: DeepGEMM compiles its kernels on the machine at each cold start
# (its warm-up walked 451 of 2020 GEMM shapes in 125 s on the first H200 attempt, after 168 s of
# graph capture; the server missed a 420 s start limit) and a lent machine keeps no cache between
# leases. The attention, where the plugin acts, is the same either way.
_WITHOUT_DEEP_GEMM = {"VLLM_USE_DEEP_GEMM": "0", "VLLM_MOE_USE_DEEP_GEMM": "0"}
SERVER_ENV = {"fp8-moe": _WITHOUT_DEEP_GEMM, "full": _WITHOUT_DEEP_GEMM}
# Seconds a server may take to answer /health: a cold fp8 server captures 51 graph sizes whose fp8
# MoE kernels compile per size (168 s of the first attempt's start at 20 layers).
START_TIMEOUT_S = {"dense": 420.0, "fp8-moe": 560.0, "full": 560.0}
H200_GIB = 139.0  # what torch sees of an H200's memory
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of it


def check_fits(config: dict, tensor_parallel_size: int, gpu_gib: float = H200_GIB,
               share: float = GPU_MEMORY_UTILIZATION) -> float:  # fmt: skip
    """GiB of weights per rank; ValueError when they leave less than a tenth of the server's share of
    the GPU (``share``: vLLM's default, or less where servers share it) for the KV cache."""
    per_rank = sum(weight_bytes(config, tensor_parallel_size).values()) / 2**30
    usable = share * gpu_gib
    if per_rank > 0.9 * usable:
        raise ValueError(f"{per_rank:.1f} GiB of weights per rank at tensor-parallel size {tensor_parallel_size} "
                         f"leave too little of {usable:.0f} GiB ({share:.2f} x {gpu_gib:.0f}) for the KV cache")  # fmt: skip
    return per_rank


def moe_layers(config: dict) -> int:
    return config["num_hidden_layers"] - min(config["first_k_dense_replace"], config["num_hidden_layers"])


def weight_bytes(config: dict, tensor_parallel_size: int = 1) -> dict[str, int]:
    """Bytes of the weights vLLM allocates for ``config`` on one rank of ``tensor_parallel_size``, by part.

    Linear layers store fp8 (1 byte) plus one float32 scale per 128x128 block where the
    config says fp8 and bf16 otherwise; the router, norms, embedding and LM head stay bf16
    (DeepSeek's checkpoint quantizes only the linear layers' weights). vLLM's fused layouts (q_a
    and kv_a merged, gate and up merged) hold the same numbers: tests/benchmarks/serving/
    test_models.py checks these byte counts against the model vLLM builds on the meta device.
    Tensor parallelism shards the heads, the MLPs' intermediate sizes (every expert on every
    rank) and the vocabulary; q_a and kv_a projections, norms and router are whole on each rank.
    """
    c = config
    tp = tensor_parallel_size
    block = (c.get("quantization_config") or {}).get("weight_block_size")

    def linear(out_features: int, in_features: int) -> int:
        if not block:
            return 2 * out_features * in_features
        bn, bk = block
        scales = -(-out_features // bn) * -(-in_features // bk)
        return out_features * in_features + 4 * scales

    hidden, heads = c["hidden_size"], c["num_attention_heads"] // tp
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q_lora, kv_lora = c["q_lora_rank"], c["kv_lora_rank"]
    attention = (
        linear(q_lora, hidden) + linear(heads * (nope + rope), q_lora) + linear(kv_lora + rope, hidden)
        + linear(heads * (nope + v), kv_lora) + linear(hidden, heads * v)
        + 2 * (q_lora + kv_lora + 2 * hidden)  # q_a, kv_a, input and post-attention norms
    )  # fmt: skip

    def mlp(intermediate: int) -> int:
        return 2 * linear(intermediate, hidden) + linear(hidden, intermediate)  # gate, up, down

    n_moe = moe_layers(c)
    expert = c["moe_intermediate_size"] // tp
    moe = c["n_routed_experts"] * mlp(expert)
    moe += mlp(expert * c.get("n_shared_experts", 0))
    moe += 2 * c["n_routed_experts"] * hidden + 4 * c["n_routed_experts"]  # router (bf16), correction bias (fp32)
    vocab = 2 * -(-c["vocab_size"] // tp) * hidden
    return {
        "attention": c["num_hidden_layers"] * attention,
        "dense_mlp": (c["num_hidden_layers"] - n_moe) * mlp(c["intermediate_size"] // tp),
        "moe": n_moe * moe,
        "embedding_and_lm_head": 2 * vocab + 2 * hidden,
    }


def describe(config: dict, tensor_parallel_size: int = 1) -> str:
    c = config
    n_moe = moe_layers(c)
    quant = (c.get("quantization_config") or {}).get("quant_method") or "bf16"
    mlp = f"{c['num_hidden_layers'] - n_moe} dense"
    if n_moe:
        mlp += (f" + {n_moe} MoE ({c['n_routed_experts']} experts x {c['moe_intermediate_size']}, "
                f"top-{c['num_experts_per_tok']} + {c.get('n_shared_experts', 0)} shared)")  # fmt: skip
    gib = sum(weight_bytes(c).values()) / 2**30
    if tensor_parallel_size > 1:
        per_rank = sum(weight_bytes(c, tensor_parallel_size).values()) / 2**30
        gib = f"{gib:.1f} GiB, ~{per_rank:.1f} GiB per rank at tensor-parallel size {tensor_parallel_size}"
    else:
        gib = f"{gib:.1f} GiB"
    return (f"{c['num_hidden_layers']} layers ({mlp}), hidden {c['hidden_size']}, {c['num_attention_heads']} heads, "
            f"{quant} weights ~{gib}, vocab {c['vocab_size']}")  # fmt: skip


def build_tokenizer(vocab_size: int):
    """A word-level tokenizer of exactly ``vocab_size`` tokens: ``<s>``, ``</s>``, then one word per id.

    Any id sequence decodes to words separated by spaces and encodes back to the same ids,
    so vLLM's random dataset gets prompts of exactly the lengths it asks for; BOS is added
    like DeepSeek's tokenizer does (the dataset counts it as a special token).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {BOS: 0, EOS: 1}
    vocab.update({f"{WORD_MARK}w{i}": i for i in range(2, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=WORD_MARK, prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement=WORD_MARK, prepend_scheme="always")
    tok.add_special_tokens([BOS, EOS])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    return tok


def write_model_dir(path: str | os.PathLike, config: dict, tokenizer_vocab: int | None = None) -> Path:
    """config.json, tokenizer and generation config for ``vllm serve --load-format dummy``; the tokenizer
    has ``tokenizer_vocab`` words (default: the model's whole vocabulary)."""
    from demo.tiny_model import save_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_tokenizer(path, build_tokenizer(tokenizer_vocab or config["vocab_size"]), config)
    return path
