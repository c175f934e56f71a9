"""vLLM's engine on AMX_MLA, plugin on then off: what tests/vllm_plugin/test_amx.py compares.

``python -m tests.vllm_plugin.amx_mla_engine MODEL_DIR`` runs the demo's
schedule (demo/generate.py: requests arriving at different steps, one long
prompt, one sharing its beginning) through two in-process engines, one with
the plugin and one without (benchmarks/e2e/vllm_engine.py ``set_plugin``), on
vLLM's CPU platform as it is on a CPU with AMX: ``torch.cpu`` reports AMX
tiles, AMX_MLA is asked for by name, and its kernels, which vLLM's CUDA
wheel lacks, are the plain-torch stand-ins of demo/cpu_stand_ins.py
(``AMX_STAND_INS``). bf16, AMX_MLA's only dtype; on that path vLLM keeps
chunked prefill and prefix caching on. Prints one ``RESULT {json}`` line:
per side, the wrapper class registered, the MLA layers' facts, whether
chunked prefill and prefix caching stayed on, each request's tokens and
logprobs.
"""

from __future__ import annotations

import json
import sys

import torch

from benchmarks.e2e import vllm_engine as E
from demo import cpu_stand_ins
from demo import generate as G  # also sets the CPU platform and the in-process engine


def main(model_dir: str) -> None:
    from vllm import LLM

    from demo.census import Census

    cpu_stand_ins.install([*cpu_stand_ins.STAND_INS, *cpu_stand_ins.AMX_STAND_INS])
    torch.cpu._is_amx_tile_supported = lambda: True  # vLLM as on a CPU with AMX (not hidden here)
    result = {}
    for side in ("on", "off"):
        registered = E.set_plugin(side == "on")
        llm = LLM(**{**G.engine_args(model_dir), "dtype": "bfloat16", "attention_backend": "AMX_MLA"})
        config = llm.llm_engine.vllm_config
        outputs, _ = G.run_pass(llm.llm_engine, G.schedule(), Census(), counted=False, tag=side)
        result[side] = {
            "registered": registered,
            "layers": llm.apply_model(G.layer_facts)[0],
            "outputs": outputs,
            "chunked_prefill": config.scheduler_config.enable_chunked_prefill,
            "prefix_caching": config.cache_config.enable_prefix_caching,
        }
        E.shutdown(llm)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
