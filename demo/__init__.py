"""What ``./scripts/demo.sh`` runs: vLLM serving a tiny DeepSeek-V3-architecture model with and without the plugin.

Not part of the installed plugin (pyproject installs ``vllm_mla_fusion*``
only): a checkout-only package shared by the demo and the tests.

- ``tiny_model``: writes the model (config, seeded safetensors weights, a
  tokenizer built in-process);
- ``cpu_stand_ins``: plain-torch stand-ins for the vLLM ``_C`` kernels that
  vLLM's CUDA-only PyPI wheel lacks on a CPU-only machine, and AMX hidden from
  vLLM (its docstring: everything the demo and the tests change about vLLM's
  CPU platform, and why);
- ``census``: counts, per MLA layer and engine step, the RoPE / cache-write /
  concat work vLLM ran and the plugin's ``mla_fusion::*`` ops;
- ``generate``: one generation run (one process: plugins load once per process);
- ``serve``: ``vllm serve`` with the stand-ins where they are needed;
- ``main``: the demo itself.
"""
