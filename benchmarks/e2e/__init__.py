"""Inside vLLM's in-process engine: the shared engine harness (``vllm_engine``), its trace reader, and
the end-to-end and host-path measurements built on them (benchmarks/e2e/README.md)."""
