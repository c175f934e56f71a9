"""Implementations of the ops, one module each, sharing one signature.

``reference`` (plain torch; defines the semantics), ``triton`` (the kernel used
on GPUs) and ``aiter`` (AMD's HIP kernel on ROCm). Each exposes
``rope_cache_write(problem, ...)`` and ``decode_rope_cache_write(problem, ...)``
taking already-validated arguments (see ``vllm_mla_fusion.validation``).
"""
