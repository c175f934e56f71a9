"""Fused RoPE + KV-cache write (and decode-query assembly) for MLA attention.

Imports run one way, each module importing only from the layers below it (bottom first):
``opcodes``, ``environment`` and ``fp8``, which import nothing of the package; ``validation``;
the backends (``reference`` and ``triton``, then ``aiter``, which hands the ops AITER does not
compute to the Triton kernel); ``dispatch``; ``binding``; ``ops``; this module; ``selfcheck``;
then ``vllm_plugin/``, which nothing else imports. tests/test_layers.py holds the order and
checks every import against it, those inside functions included.

Public ops (also registered as ``torch.ops.mla_fusion.*``):

- :func:`mla_rope_cache_write`: rotate ``q_pe``/``k_pe`` in place, write
  ``[kv_c | rope(k_pe)]`` into the paged cache (drop-in for vLLM's
  ``concat_and_cache_mla_rope_fused``).
- :func:`mla_decode_rope_cache_write`: the same cache write plus the decode
  query ``[ql_nope | rope(q_pe)]`` (optionally fp8), in one launch.
- :func:`mla_prefill_rope_cache_write`: op 1 plus the prefill attention key
  ``[k_nope | rope(k_pe)]`` (optionally fp8), in one launch.

Importing this package needs only torch: Triton, AITER and vLLM are imported
when a backend or the plugin is first used.
"""

from .dispatch import BACKENDS, available_backends
from .ops import mla_decode_rope_cache_write, mla_prefill_rope_cache_write, mla_rope_cache_write

__version__ = "0.1.0"
__all__ = [
    "mla_rope_cache_write",
    "mla_decode_rope_cache_write",
    "mla_prefill_rope_cache_write",
    "available_backends",
    "BACKENDS",
    "__version__",
]
