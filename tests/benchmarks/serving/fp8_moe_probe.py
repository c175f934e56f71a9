"""vLLM builds the fp8-moe stand-in on the meta device (no memory, no kernels): what it allocates, as JSON.

``python fp8_moe_probe.py MODEL_DIR`` prints {"bytes": {part: bytes}, "experts": {...}} for
test_models.py, in a process of its own (it initialises vLLM's distributed state). On the CPU, vLLM
finds no fp8 GEMM kernel to run the linear layers with (they need AMX or a GPU); the kernel choice is
skipped, which changes no weight: the weights are created before it.
"""

import json
import sys

import torch

from vllm.config import CacheConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel

model_dir = sys.argv[1]
config = VllmConfig(model_config=ModelConfig(model=model_dir, max_model_len=8192), cache_config=CacheConfig(block_size=16),
                    load_config=LoadConfig(load_format="dummy"))  # fmt: skip
with set_current_vllm_config(config):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{model_dir}/dist_init")  # fmt: skip
    initialize_model_parallel(1, 1)
    from vllm.model_executor.layers.quantization import fp8

    fp8.init_fp8_linear_kernel = lambda *args, **kwargs: None
    from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM

    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(vllm_config=config, prefix="")

parts: dict[str, int] = {}
for name, p in model.named_parameters():
    if ".mlp.gate." in name or ".experts." in name or "shared_experts" in name:
        part = "moe"
    elif ".mlp." in name:
        part = "dense_mlp"
    elif name.startswith(("model.embed_tokens", "lm_head", "model.norm")):
        part = "embedding_and_lm_head"
    else:
        part = "attention"  # the attention projections and the layer's norms
    parts[part] = parts.get(part, 0) + p.numel() * p.element_size()
experts = model.model.layers[-1].mlp.experts
routed = dict(experts.named_modules())["routed_experts"]
w13 = routed.w13_weight
print(json.dumps({"bytes": parts, "experts": {"method": type(routed.quant_method).__name__, "w13_shape": list(w13.shape),
                                               "w13_dtype": str(w13.dtype)}}))  # fmt: skip
