"""The tiny model's checkpoint: what vLLM's config loader, transformers and the tokenizer make of it."""

from __future__ import annotations

import json

import pytest
import torch

from demo import tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model.write(tmp_path_factory.mktemp("tiny") / "model")


def test_weights_have_the_names_and_shapes_of_a_deepseek_v3_checkpoint(model_dir):
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    config = transformers.AutoConfig.from_pretrained(model_dir)
    assert type(config).__name__ == "DeepseekV3Config"
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(config)
    want = {name: tuple(t.shape) for name, t in reference.state_dict().items()}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        got = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert got == want
    assert dtypes == {"BF16"}


def test_weights_are_seeded_and_scaled(model_dir):
    from safetensors.torch import load_file

    weights = load_file(str(model_dir / "model.safetensors"))
    again = tiny_model.state_dict(tiny_model.CONFIG)
    for name, t in weights.items():
        assert torch.equal(t, again[name].to(torch.bfloat16)), name
    q_b = weights["model.layers.0.self_attn.q_b_proj.weight"].float()
    # 1/sqrt(fan_in): projections keep activations at unit scale (not vLLM's dummy +-1e-3)
    assert q_b.std().item() == pytest.approx(tiny_model.CONFIG["q_lora_rank"] ** -0.5, rel=0.05)
    assert torch.equal(weights["model.norm.weight"], torch.ones(tiny_model.CONFIG["hidden_size"], dtype=torch.bfloat16))


@pytest.mark.vllm
def test_vllm_reads_it_as_deepseek_v3_mla(model_dir):
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig

    config = ModelConfig(model=str(model_dir), dtype="bfloat16", max_model_len=1024)
    hf = config.hf_text_config
    assert config.architectures == ["DeepseekV3ForCausalLM"]
    assert config.use_mla
    assert (hf.kv_lora_rank, hf.qk_rope_head_dim, hf.qk_nope_head_dim, hf.v_head_dim) == (512, 64, 128, 128)
    assert config.get_head_size() == 512 + 64  # what the MLA cache stores per token
    assert config.get_vocab_size() == tiny_model.CONFIG["vocab_size"]


def test_tokenizer_loads_in_transformers_and_round_trips(model_dir):
    transformers = pytest.importorskip("transformers")

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert len(tok) == config["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id) == (config["bos_token_id"], config["eos_token_id"])
    text = "A prefill step fills the cache; Überraschung, 42 tokens!"  # bytes outside the corpus too
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert len(ids) < len(text.encode())  # merges learnt, not one token per byte
    assert tok.decode(ids, skip_special_tokens=True) == text


@pytest.mark.vllm
def test_vllm_loads_the_tokenizer(model_dir):
    pytest.importorskip("vllm")
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(str(model_dir))
    text = "The fused kernel writes the cache row."
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
