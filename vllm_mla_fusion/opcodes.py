"""The three fused ops' identifiers: which op a bound op, a backend's site or a plugin layer runs.

Imports nothing of the package, so that the backends, the binding and the plugin can all
name the ops (backends/triton.py restates the numbers as the kernel's constexprs).
"""

OP_ROPE_CACHE, OP_DECODE, OP_PREFILL = 1, 2, 3
OP_NAMES = {OP_ROPE_CACHE: "mla_rope_cache_write", OP_DECODE: "mla_decode_rope_cache_write",
            OP_PREFILL: "mla_prefill_rope_cache_write"}  # fmt: skip
