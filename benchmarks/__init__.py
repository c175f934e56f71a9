"""The benchmarks, in sections (benchmarks/README.md): ``kernels`` (the ops alone on a GPU), ``e2e``
(inside vLLM's in-process engine), ``serving`` (behind ``vllm serve``). Not installed; every script
runs from the repository root as ``python -m benchmarks.<section>.<module>``."""
