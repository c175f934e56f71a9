"""A tiny DeepSeek-V3-architecture checkpoint, written locally: config, safetensors weights, tokenizer.

``python -m demo.tiny_model DIR`` writes it (a few seconds, ~17 MB). The MLA
dims are DeepSeek-V3's own (kv_lora_rank 512, qk_rope_head_dim 64,
qk_nope_head_dim 128, v_head_dim 128, q_lora_rank 1536, yarn RoPE with
interleaved pairs); hidden size, heads, layers and vocabulary are shrunk,
and every layer is dense (no MoE: the point is attention).

Weights are seeded normal, scaled by 1/sqrt(fan_in) (embeddings 1, norms 1):
with vLLM's ``load_format="dummy"`` (values in +-1e-3) the residual stream is
the token embedding and greedy decoding repeats the prompt's last token,
whatever attention computes; with these, attention shapes every next token.

The tokenizer is a byte-level BPE trained in-process on a short built-in
text, saved as ``tokenizer.json`` for transformers' fast tokenizer: nothing
is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

# DeepSeek-V3's architecture as vLLM's DeepseekV3ForCausalLM reads it: its MLA dims, LoRA
# ranks and norms. The models built on it (this one, the GPU tests', the end-to-end
# benchmark's) set the sizes: hidden size, heads, layers, MLP, vocabulary, rope range.
DSV3_ARCHITECTURE = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "rope_theta": 10000,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def yarn_rope_scaling(factor: int, original_max_position_embeddings: int) -> dict:
    """DeepSeek-V3's rope scaling (yarn -> vLLM's DeepseekScalingRotaryEmbedding, GPT-J rotation)."""
    return {
        "type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": original_max_position_embeddings,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }


NUM_LAYERS = 3
CONFIG = {
    **DSV3_ARCHITECTURE,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": NUM_LAYERS,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "n_routed_experts": 4,
    "first_k_dense_replace": NUM_LAYERS,  # every layer dense
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "bos_token_id": 0,
    "eos_token_id": 1,
    # DeepSeek-V3's own rope scaling, shrunk.
    "rope_scaling": yarn_rope_scaling(32, 128),
}
BOS, EOS = "<s>", "</s>"

# What the tokenizer is trained on: any text would do; this one is about the model's attention.
CORPUS = """\
Multi-head latent attention compresses the keys and values of every token into one latent vector.
The latent vector has five hundred and twelve numbers, and a small rotary part carries the position.
Each layer writes the latent vector and the rotated key into a paged cache, one row per token.
A decode step reads the whole cache of a request and produces one new token for it.
A prefill step runs the prompt through the model and fills the cache for every prompt token.
The scheduler mixes prefills and decodes in one batch, and long prompts are split into chunks.
Rotary position embeddings turn pairs of numbers by an angle that grows with the position.
DeepSeek rotates neighbouring pairs, while other models rotate the first half against the second.
The fused kernel rotates the query and the key, and writes the cache row, in a single launch.
Without it, one kernel rotates, another writes the cache, and a third joins the query parts.
Fewer launches leave the processor less idle time between small kernels in every decode step.
The reference implementation defines what every backend must compute, to the last rounding.
Tests compare each backend with an independent reference written in double precision.
A padded token has slot minus one and is never written into the cache.
The model in this demo is tiny and its weights are random, so what it says is noise,
but the noise must be the same with the plugin on and off, token for token.
"""


def weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a Hugging Face DeepSeek-V3 checkpoint with dense layers."""
    c = config
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    kv_lora, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
    nope, v, q_lora = c["qk_nope_head_dim"], c["v_head_dim"], c["q_lora_rank"]
    inter, vocab = c["intermediate_size"], c["vocab_size"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_a_proj.weight": (q_lora, hidden),
            p + "self_attn.q_a_layernorm.weight": (q_lora,),
            p + "self_attn.q_b_proj.weight": (heads * (nope + rope), q_lora),
            p + "self_attn.kv_a_proj_with_mqa.weight": (kv_lora + rope, hidden),
            p + "self_attn.kv_a_layernorm.weight": (kv_lora,),
            p + "self_attn.kv_b_proj.weight": (heads * (nope + v), kv_lora),
            p + "self_attn.o_proj.weight": (hidden, heads * v),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })  # fmt: skip
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    return shapes


def state_dict(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded float32 weights for :func:`weight_shapes`."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        elif name == "model.embed_tokens.weight":
            weights[name] = torch.randn(shape, generator=g)
        else:
            weights[name] = torch.randn(shape, generator=g) * shape[-1] ** -0.5
    return weights


def build_tokenizer(vocab_size: int):
    """A byte-level BPE over CORPUS with ``vocab_size`` entries; adds BOS like DeepSeek's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def write(path: str | os.PathLike, weights: bool = True, seed: int = 0, **overrides) -> Path:
    """Write the model directory; ``weights=False`` writes only config.json (layer tests build their own)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**CONFIG, **overrides}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    if not weights:
        return path
    from safetensors.torch import save_file

    dtype = getattr(torch, config["torch_dtype"])
    save_file({k: t.to(dtype) for k, t in state_dict(config, seed).items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    save_tokenizer(path, build_tokenizer(config["vocab_size"]), config)
    return path


def save_tokenizer(path: Path, tok, config: dict) -> None:
    """``tok`` (a ``tokenizers.Tokenizer`` with BOS and EOS) as transformers' fast tokenizer, and the
    generation config, beside the model's config.json. A tokenizer smaller than the model's vocabulary
    uses some of its ids (the serving benchmark's small-vocabulary configurations); a larger one would
    produce ids past the embedding."""
    if tok.get_vocab_size() > config["vocab_size"]:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} entries, the model only {config['vocab_size']}")
    assert (tok.token_to_id(BOS), tok.token_to_id(EOS)) == (config["bos_token_id"], config["eos_token_id"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "model_max_length": config["max_position_embeddings"],
    }, indent=1))  # fmt: skip
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    )


def describe(config: dict = CONFIG) -> str:
    c = config
    params = sum(torch.Size(s).numel() for s in weight_shapes(c).values())
    return (
        f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} heads, "
        f"kv_lora_rank {c['kv_lora_rank']}, qk_rope_head_dim {c['qk_rope_head_dim']}, "
        f"qk_nope_head_dim {c['qk_nope_head_dim']}, v_head_dim {c['v_head_dim']}, vocab {c['vocab_size']}; "
        f"{params / 1e6:.1f}M parameters"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the tiny DeepSeek-V3-architecture model directory.")
    parser.add_argument("path")
    args = parser.parse_args()
    print(write(args.path), "-", describe())


if __name__ == "__main__":
    main()
