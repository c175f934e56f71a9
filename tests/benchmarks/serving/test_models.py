"""benchmarks/serving/models.py: the stand-ins' configs, their weight sizes, the tokenizer, and vLLM's reading of them."""

from __future__ import annotations

import random

import pytest

from benchmarks.serving import models

GIB = 2**30


def test_dense_stand_in_is_the_e2e_benchmarks_model():
    from benchmarks.e2e.bench_vllm_e2e import DSV3_TP8_CONFIG

    c = models.stand_in_config("dense")
    assert {k: v for k, v in c.items() if k not in ("bos_token_id", "eos_token_id", "transformers_version")} == DSV3_TP8_CONFIG
    assert c["num_hidden_layers"] == c["first_k_dense_replace"] == 61
    assert models.stand_in_config("dense", 20)["first_k_dense_replace"] == 20  # still every layer dense


def test_fp8_moe_stand_in_is_one_tp8_rank_of_deepseek_v3():
    c = models.stand_in_config("fp8-moe")
    assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]) == (7168, 128 // 8, 128 // 8)
    assert (c["num_hidden_layers"], c["first_k_dense_replace"], models.moe_layers(c)) == (61, 3, 58)
    assert (c["n_routed_experts"], c["moe_intermediate_size"], c["intermediate_size"]) == (256, 2048 // 8, 18432 // 8)
    assert (c["num_experts_per_tok"], c["n_shared_experts"], c["n_group"], c["topk_group"]) == (8, 1, 8, 4)
    assert (c["scoring_func"], c["topk_method"], c["routed_scaling_factor"]) == ("sigmoid", "noaux_tc", 2.5)
    assert c["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]}  # fmt: skip
    assert (c["kv_lora_rank"], c["qk_rope_head_dim"], c["q_lora_rank"]) == (512, 64, 1536)


def test_fewer_layers_keep_the_three_dense_ones():
    c = models.stand_in_config("fp8-moe", 12)
    assert (c["num_hidden_layers"], c["first_k_dense_replace"], models.moe_layers(c)) == (12, 3, 9)
    assert models.moe_layers(models.stand_in_config("fp8-moe", 2)) == 0
    with pytest.raises(ValueError):
        models.stand_in_config("fp8-moe", 0)
    with pytest.raises(ValueError):
        models.stand_in_config("sparse")


def test_weight_sizes():
    fp8 = models.weight_bytes(models.stand_in_config("fp8-moe"))
    # One expert: gate, up (256 x 7168) and down (7168 x 256) in fp8, plus a float32 scale per 128x128 block.
    expert = 3 * 256 * 7168 + 4 * 3 * (2 * 56)
    assert fp8["moe"] > 58 * 256 * expert
    total = sum(fp8.values()) / GIB
    # DeepSeek-V3 is 671e9 parameters, ~1 byte each in fp8: an eighth is ~78 GiB; plus the whole vocabulary.
    assert 75 < total < 90
    # An H200 has ~139 GiB; vLLM's default gpu_memory_utilization 0.9 leaves > 30 GiB for activations and KV cache.
    assert 0.9 * 139 - total > 30
    dense = sum(models.weight_bytes(models.stand_in_config("dense")).values()) / GIB
    assert 12 < dense < 15
    assert "58 MoE (256 experts x 256, top-8 + 1 shared)" in models.describe(models.stand_in_config("fp8-moe"))


def test_full_model_is_deepseek_v3_as_published():
    c = models.stand_in_config("full")
    assert (c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]) == (61, 7168, 128, 128)
    assert (c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]) == (
        1536, 512, 64, 128, 128)  # fmt: skip
    assert (c["intermediate_size"], c["moe_intermediate_size"], c["n_routed_experts"], c["num_experts_per_tok"]) == (
        18432, 2048, 256, 8)  # fmt: skip
    assert (c["n_shared_experts"], c["first_k_dense_replace"], c["vocab_size"], c["max_position_embeddings"]) == (
        1, 3, 129280, 163840)  # fmt: skip
    assert c["rope_scaling"] == {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
    assert c["quantization_config"] == models.stand_in_config("fp8-moe")["quantization_config"]
    # The stand-in is one rank of it: only what tensor parallelism shards differs.
    rank = models.stand_in_config("fp8-moe")
    assert {k for k in c if c[k] != rank[k]} == {"num_attention_heads", "num_key_value_heads", "intermediate_size",
                                                 "moe_intermediate_size"}  # fmt: skip


def test_full_model_per_rank_at_tp8():
    full = models.stand_in_config("full")
    per_rank, rank = models.weight_bytes(full, 8), models.weight_bytes(models.stand_in_config("fp8-moe"))
    # A TP8 rank of the whole model holds the stand-in's weights but 1/8 of the embedding and LM head.
    assert {k: per_rank[k] for k in ("attention", "dense_mlp", "moe")} == {k: rank[k] for k in ("attention", "dense_mlp", "moe")}
    assert per_rank["embedding_and_lm_head"] == 2 * 2 * (129280 // 8) * 7168 + 2 * 7168
    assert 84e9 < sum(per_rank.values()) < 86e9  # ~85 GB (79.3 GiB) per H200
    assert 660e9 < sum(models.weight_bytes(full).values()) < 680e9  # 671e9 parameters, ~1 byte each, plus scales
    assert models.check_fits(full, 8) == pytest.approx(79.3, abs=0.1)
    with pytest.raises(ValueError, match="tensor-parallel size 4"):
        models.check_fits(full, 4)  # ~160 GiB per rank
    assert "~79.3 GiB per rank at tensor-parallel size 8" in models.describe(full, 8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return models.write_model_dir(tmp_path_factory.mktemp("fp8"), models.stand_in_config("fp8-moe", 5))


def test_tokenizer_round_trips_any_ids(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.vocab_size == len(tok) == 129280
    assert tok.all_special_ids == [0, 1] and tok.num_special_tokens_to_add() == 1
    rng = random.Random(0)
    ids = [rng.randrange(2, 129280) for _ in range(1000)] + [2, 129279]
    text = tok.decode(ids)
    assert tok(text, add_special_tokens=False).input_ids == ids
    assert tok(text).input_ids == [0, *ids]  # BOS, like DeepSeek's tokenizer


@pytest.mark.vllm
def test_vllms_random_dataset_gives_distinct_prompts_of_the_asked_length(model_dir):
    """With the model's vocabulary the random dataset's prompts share no first cache block (the 512-token
    tokenizer of the first manual run gave 24.5% and 86.7% prefix-cache hits)."""
    from vllm.benchmarks.datasets import RandomDataset
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(str(model_dir))
    requests = RandomDataset(random_seed=1).sample(tok, num_requests=200, input_len=1024, output_len=8)
    assert {r.prompt_len for r in requests} == {1023}  # + BOS = 1024
    heads = {tuple(tok(r.prompt, add_special_tokens=False).input_ids[:16]) for r in requests}
    assert len(heads) == 200


@pytest.mark.vllm
def test_vllm_reads_the_fp8_stand_in_as_block_quantized_fp8(model_dir):
    from vllm.config import ModelConfig
    from vllm.model_executor.layers.quantization import get_quantization_config

    mc = ModelConfig(model=str(model_dir), max_model_len=8192)
    assert mc.quantization == "fp8"
    assert mc.hf_config.architectures == ["DeepseekV3ForCausalLM"] and mc.hf_config.n_routed_experts == 256
    assert mc.get_vocab_size() == 129280 and mc.get_total_num_hidden_layers() == 5
    quant = get_quantization_config("fp8").from_config(mc.hf_config.quantization_config)
    assert quant.weight_block_size == [128, 128] and quant.is_checkpoint_fp8_serialized
    assert quant.activation_scheme == "dynamic"


def built_on_meta(tmp_path, config: dict) -> dict:
    """What vLLM allocates for ``config`` on the meta device (fp8_moe_probe.py, in a process of its own)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    model_dir = models.write_model_dir(tmp_path / "model", config)
    probe = Path(__file__).with_name("fp8_moe_probe.py")
    out = subprocess.run([sys.executable, str(probe), str(model_dir)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.vllm
def test_vllm_allocates_the_estimated_weights_with_its_fp8_moe_method(tmp_path):
    """vLLM builds 3 dense + 1 MoE layer of the stand-in (meta device, in a process of its own): every part's
    bytes are the estimate's, to the byte, and the routed experts run through vLLM's Fp8MoEMethod."""
    config = models.stand_in_config("fp8-moe", 4)
    built = built_on_meta(tmp_path, config)
    assert built["bytes"] == models.weight_bytes(config)
    assert built["experts"] == {"method": "Fp8MoEMethod", "w13_shape": [256, 2 * 256, 7168],
                                "w13_dtype": "torch.float8_e4m3fn"}  # fmt: skip


@pytest.mark.vllm
def test_vllm_reads_the_full_model_as_deepseek_v3_with_fp8_blocks(tmp_path):
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.model_executor.layers.quantization import get_quantization_config

    model_dir = models.write_model_dir(tmp_path / "full", models.stand_in_config("full"))
    mc = ModelConfig(model=str(model_dir), max_model_len=8192)
    assert mc.quantization == "fp8" and mc.use_mla
    assert mc.hf_config.architectures == ["DeepseekV3ForCausalLM"]
    assert (mc.get_total_num_hidden_layers(), mc.get_vocab_size(), mc.get_hidden_size()) == (61, 129280, 7168)
    assert mc.hf_config.num_attention_heads == 128 and mc.hf_config.moe_intermediate_size == 2048
    assert mc.get_num_attention_heads(ParallelConfig(tensor_parallel_size=8)) == 16  # a rank's heads
    rope = mc.hf_config.rope_parameters if hasattr(mc.hf_config, "rope_parameters") else mc.hf_config.rope_scaling
    assert rope["factor"] == 40 and rope["original_max_position_embeddings"] == 4096
    quant = get_quantization_config("fp8").from_config(mc.hf_config.quantization_config)
    assert quant.weight_block_size == [128, 128] and quant.is_checkpoint_fp8_serialized


@pytest.mark.vllm
def test_vllm_allocates_the_estimated_weights_of_the_full_model(tmp_path):
    """3 dense + 1 MoE layer of the whole model on the meta device (one rank: tensor-parallel size 1): its
    full-size layers (128 heads, 18432, experts of 2048) hold exactly the estimate's bytes."""
    config = models.stand_in_config("full", 4)
    built = built_on_meta(tmp_path, config)
    assert built["bytes"] == models.weight_bytes(config)
    assert built["experts"]["w13_shape"] == [256, 2 * 2048, 7168]
