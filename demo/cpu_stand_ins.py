"""Plain-torch stand-ins for the few vLLM ``_C`` kernels that vLLM's PyPI wheel lacks on a CPU-only machine.

vLLM's PyPI wheel is built for CUDA: on a machine without a GPU driver its
kernel library (``vllm._C_stable_libtorch``) does not load, and there is no
CPU kernel library at all. vLLM's CPU platform runs everything else in plain
torch, so serving an MLA model on the CPU needs only these four ops:

- ``mla_decode_kvcache``: CPU_MLA's decode attention;
- ``init_cpu_memory_env``: called once when vLLM's CPU worker starts;
- ``compute_slot_mapping_kernel_impl``: the model runner's cache-slot computation;
- ``greedy_argmax``: the sampler's greedy path.

None of them is on the path the plugin replaces (RoPE, cache write, decode
query), so the comparison plugin on / off is not affected by them. A stand-in
is registered only where ``torch.ops._C`` lacks the op *after* vLLM has
loaded its own kernels: with a vLLM that has them (a GPU machine, a CPU build
of vLLM), :func:`install` registers nothing.

Demo and test support only: the installed plugin never imports this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

# Tests that compare the decode query the attention kernel received set this
# to a list; the decode stand-in then appends a copy of each query it gets.
DECODE_QUERIES: list[torch.Tensor] | None = None


def _decode(out, query, kv_cache, scale, block_tables, seq_lens) -> None:
    """``mla_decode_kvcache``: per request, softmax(q K^T * scale) V over its cache rows."""
    if DECODE_QUERIES is not None:
        DECODE_QUERIES.append(query.clone())
    kv_lora_rank = out.shape[-1]
    block_size = kv_cache.shape[1]
    for b in range(query.shape[0]):  # requests, not tokens: fine for a stand-in
        n = int(seq_lens[b])
        blocks = block_tables[b, : (n + block_size - 1) // block_size].long()
        kv = kv_cache[blocks].reshape(-1, kv_cache.shape[-1])[:n].float()
        probs = ((query[b].float() @ kv.T) * scale).softmax(-1)
        out[b] = (probs @ kv[:, :kv_lora_rank]).to(out.dtype)


def _slot_mapping(query_start_loc, positions, block_table, slot_mapping, block_size) -> None:
    """``compute_slot_mapping_kernel_impl``: block_table[request, pos // bs] * bs + pos % bs; -1 past the batch."""
    qsl = query_start_loc.long()
    num_tokens = int(qsl[-1])
    request = torch.repeat_interleave(torch.arange(qsl.numel() - 1), qsl[1:] - qsl[:-1])
    pos = positions[:num_tokens].long()
    slot_mapping.fill_(-1)
    slot_mapping[:num_tokens] = block_table[request, pos // block_size].long() * block_size + pos % block_size


# name -> (schema, implementation, dispatch key, what vLLM uses it for)
STAND_INS: dict[str, tuple[str, Callable, str, str]] = {
    "mla_decode_kvcache": (
        "(Tensor(a!) out, Tensor query, Tensor kv_cache, float scale, Tensor block_tables, Tensor seq_lens) -> ()",
        _decode,
        "CPU",
        "CPU_MLA's decode attention",
    ),
    "init_cpu_memory_env": (
        "(int[] nodes) -> ()",
        lambda nodes: None,
        "CompositeExplicitAutograd",
        "CPU worker start-up (NUMA memory binding)",
    ),
    "compute_slot_mapping_kernel_impl": (
        "(Tensor query_start_loc, Tensor positions, Tensor block_table, Tensor(a!) slot_mapping, int block_size) -> ()",
        _slot_mapping,
        "CPU",
        "the model runner's KV-cache slot computation",
    ),
    "greedy_argmax": (
        "(Tensor logits) -> Tensor",
        lambda logits: logits.argmax(dim=-1).view(-1),
        "CPU",
        "greedy sampling",
    ),
}

# One library object per namespace; the ops live as long as it does.
_LIBRARIES: dict[str, torch.library.Library] = {}


def load_vllm_kernels() -> None:
    """Let vLLM load its own kernel library, if this machine can: it registers ``torch.ops._C.*``."""
    import vllm._custom_ops  # noqa: F401 - its import runs current_platform.import_kernels()


def install(
    names: Iterable[str] = tuple(STAND_INS),
    namespace: str = "_C",
    before_checking: Callable[[], None] = load_vllm_kernels,
) -> list[str]:
    """Register a stand-in under ``torch.ops.<namespace>.<name>`` for each op that is missing.

    ``before_checking`` runs first so that vLLM's own kernels, where it has
    them, are registered before anything is looked up. Returns the names
    registered by this call (empty when vLLM has its kernels, or on a
    second call). Safe to call in every process and any number of times.
    """
    before_checking()
    ops = getattr(torch.ops, namespace)
    installed = []
    for name in names:
        if hasattr(ops, name):
            continue
        if namespace not in _LIBRARIES:
            _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
        schema, impl, key, _ = STAND_INS[name]
        _LIBRARIES[namespace].define(name + schema)
        _LIBRARIES[namespace].impl(name, impl, key)
        installed.append(name)
    return installed
