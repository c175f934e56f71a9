"""What the demo and the tests change about vLLM's CPU platform, and why: the one place that says so.

vLLM's PyPI wheel is built for CUDA: on a machine without a GPU driver its
kernel library (``vllm._C_stable_libtorch``) does not load, and there is no
CPU kernel library at all. vLLM's CPU platform runs everything else in plain
torch. Every process here that runs that wheel on the CPU calls
:func:`prepare`, which makes the first two changes below: demo/generate.py,
every process of demo/serve.py, the end-to-end benchmark's ``--smoke`` mode,
the GPU tests' worker in ``--cpu-smoke`` mode; the test session in two halves
(tests/vllm_plugin/conftest.py: :func:`hide_amx` when it loads, :func:`install`
in the ``vllm_cpu`` fixture; test_environment.py's start script hides AMX too).
The third is a setting wherever a backend is chosen.

1. **Stand-ins.** A plain-torch stand-in for each of the four ``_C`` ops the
   reference MLA path calls (:data:`STAND_INS`):

   - ``mla_decode_kvcache``: CPU_MLA's decode attention;
   - ``init_cpu_memory_env``: called once when vLLM's CPU worker starts;
   - ``compute_slot_mapping_kernel_impl``: the model runner's cache-slot computation;
   - ``greedy_argmax``: the sampler's greedy path.

   A stand-in is registered only where ``torch.ops._C`` lacks the op *after*
   vLLM has loaded its own kernels: with a vLLM that has them (a GPU machine,
   a CPU build of vLLM), :func:`install` registers nothing.

2. **AMX reported absent** (:func:`hide_amx`): ``torch.cpu._is_amx_tile_supported()``
   returns False in the process. On a CPU with AMX tiles (Intel Sapphire
   Rapids and later) vLLM 0.33's CPU platform reads it at each of these
   decisions and then calls kernels only its CPU build has:
   ``CpuPlatform.get_attn_backend_cls`` picks AMX_MLA for MLA models unless
   CPU_MLA is asked for by name, and AMX_MLA's weight loading calls
   ``_C.convert_weight_packed`` (the plugin rightly declines AMX_MLA: its own
   cache update); ``dispatch_cpu_unquantized_gemm`` (``check_cpu_sgl_kernel``,
   vllm/model_executor/layers/utils.py) packs every bf16/fp16 linear weight
   with that op, whatever the attention backend; ``check_and_update_config``
   keeps block size, chunked prefill and prefix caching for AMX_MLA. With
   AMX hidden, every x86 host takes the path of a host without it: the one
   the tests and the demo check. vLLM reads the function at each decision,
   so hiding works wherever it happens before the model is built; the engine
   core and worker that vLLM spawns re-import the parent's main module
   (multiprocessing's spawn), which is why demo/serve.py and the benchmark
   call :func:`prepare` at module level. Hiding also keeps Inductor from
   emitting AMX code in these processes (it reads the same function).

3. **CPU_MLA by name** (:data:`ATTENTION_BACKEND`) wherever the attention
   backend is chosen: demo/generate.py, demo/serve.py's documented command
   line and its test, the test harness's VllmConfig, the benchmark's smoke
   mode. So the choice does not rest on (2) alone.

None of this is on the path the plugin replaces (RoPE, cache write, decode
query), so the comparison plugin on / off is not affected by it. The AMX path
itself is tested, on any machine, by tests/vllm_plugin/test_amx.py: the
vLLM tests and the demo's engine runs again with AMX reported *present*
(tests/amx_simulation/sitecustomize.py, which reaches the processes vLLM
spawns), and the plugin on AMX_MLA itself, with the plain-torch
:data:`AMX_STAND_INS` for the packed-weight and attention kernels that
path calls.

Demo and test support only: the installed plugin never imports this module
and never touches ``torch.cpu``.
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


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, first_position: int) -> torch.Tensor:
    """softmax(q k^T * scale) v per head, float32; query row j sits at ``first_position + j`` (causal)."""
    scores = torch.einsum("jhd,nd->hjn", q.float(), k.float()) * scale
    seen = torch.arange(k.shape[0]) <= first_position + torch.arange(q.shape[0])[:, None]
    return scores.masked_fill(~seen, float("-inf")).softmax(-1).matmul(v.float()).transpose(0, 1)


def _amx_decode(query, k_buffer, v_buffer, output, key, value, loc, attn_logits, req_to_token, req_pool_indices,
                seq_lens, sm_scale, logit_cap, is_cross_attn, sliding_window_size, encoder_lens, sinks) -> None:  # fmt: skip
    """``decode_attention_cpu`` (AMX_MLA's decode): token b attends to its request's first seq_lens[b] rows."""
    for b in range(query.shape[0]):
        rows = req_to_token[req_pool_indices[b], : int(seq_lens[b])].long()
        out = _attend(query[b : b + 1], k_buffer[rows, 0], v_buffer[rows, 0], sm_scale, rows.numel() - 1)
        output[b] = out[0].to(output.dtype)


def _amx_extend(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                extend_seq_lens, extend_start_loc, max_len_extend, sm_scale, logit_cap, is_cross_attn,
                sliding_window_size, encoder_lens, sinks, tree_mask=None) -> None:  # fmt: skip
    """``extend_attention_cpu`` (AMX_MLA's prefill): each request's new tokens attend causally to its
    cached context and to themselves."""
    for i in range(extend_seq_lens.numel()):
        start, new, total = int(extend_start_loc[i]), int(extend_seq_lens[i]), int(seq_lens[i])
        context = req_to_token[req_pool_indices[i], : total - new].long()
        k = torch.cat([k_buffer[context, 0], k_extend[start : start + new, 0]])
        v = torch.cat([v_buffer[context, 0], v_extend[start : start + new, 0]])
        out = _attend(q_extend[start : start + new], k, v, sm_scale, total - new)
        o_extend[start : start + new] = out.to(o_extend.dtype)


def _amx_cache_write(kv_c, k_pe, kv_cache, slot_mapping) -> None:
    """``concat_and_cache_mla_cpu`` (AMX_MLA's cache update): row ``[kv_c | k_pe]`` at each slot >= 0."""
    rows = kv_cache.view(-1, kv_cache.shape[-1])
    slots = slot_mapping[: kv_c.shape[0]].long()
    valid = slots >= 0
    rows[slots[valid]] = torch.cat([kv_c, k_pe.reshape(kv_c.shape[0], -1)], dim=-1)[valid].to(rows.dtype)


def _amx_bmm(out, mat1, mat2, is_vnni, scale) -> None:
    """``bmm_cpu``: ``out[b] = mat1[b] @ mat2[b]^T`` (times ``scale``), mat2 "packed" by the identity below."""
    product = torch.bmm(mat1.float(), mat2.float().transpose(1, 2))
    out.copy_((product if scale is None else product * scale.float()).to(out.dtype))


def _amx_linear(out, x, packed_weight, bias, is_vnni) -> None:
    """``weight_packed_linear``: ``x @ W^T + bias`` with the identity-"packed" weight."""
    out.copy_(torch.nn.functional.linear(x, packed_weight.to(x.dtype), None if bias is None else bias.to(x.dtype)))


# The kernels vLLM's CPU platform calls once it believes the CPU has AMX: AMX_MLA (weight
# packing, its cache update, decode and prefill attention) and the packed bf16 linear layers.
# "Packing" is the identity, so each packed-weight op is the plain product. Only for the tests
# that run vLLM's AMX path on purpose (tests/vllm_plugin/test_amx.py); prepare() installs none.
AMX_STAND_INS: dict[str, tuple[str, Callable, str, str]] = {
    "convert_weight_packed": (
        "(Tensor weight) -> Tensor",
        lambda weight: weight.contiguous().clone(),
        "CPU",
        "AMX weight packing (AMX_MLA's W_UK/W_UV, bf16 linear layers)",
    ),
    "weight_packed_linear": (
        "(Tensor(a!) out, Tensor x, Tensor packed_weight, Tensor? bias, bool is_vnni) -> ()",
        _amx_linear,
        "CPU",
        "linear layers with packed weights",
    ),
    "bmm_cpu": (
        "(Tensor(a!) out, Tensor mat1, Tensor mat2, bool is_vnni, Tensor? scale) -> ()",
        _amx_bmm,
        "CPU",
        "AMX_MLA's W_UK absorption and W_UV projection",
    ),
    "concat_and_cache_mla_cpu": (
        "(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()",
        _amx_cache_write,
        "CPU",
        "AMX_MLA's KV-cache write",
    ),
    "decode_attention_cpu": (
        (
            "(Tensor query, Tensor k_buffer, Tensor v_buffer, Tensor(a!) output, Tensor? key, Tensor? value, "
            "Tensor? loc, Tensor(b!) attn_logits, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
            "float sm_scale, float logit_cap, bool is_cross_attn, int sliding_window_size, Tensor? encoder_lens, "
            "Tensor? sinks) -> ()"
        ),
        _amx_decode,
        "CPU",
        "AMX_MLA's decode attention",
    ),
    "extend_attention_cpu": (
        (
            "(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, Tensor k_buffer, "
            "Tensor v_buffer, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, "
            "Tensor extend_start_loc, int max_len_extend, float sm_scale, float logit_cap, bool is_cross_attn, "
            "int sliding_window_size, Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask=None) -> ()"
        ),
        _amx_extend,
        "CPU",
        "AMX_MLA's prefill (extend) attention",
    ),
}

# The attention backend pinned by name wherever the demo, the tests or the benchmark's smoke
# mode choose one on the CPU (point 3 of the module docstring).
ATTENTION_BACKEND = "CPU_MLA"

# torch's own answer, kept by hide_amx() (None until then).
_HOST_AMX: Callable[[], bool] | None = None


def hide_amx() -> None:
    """Make ``torch.cpu._is_amx_tile_supported()`` return False in this process (point 2 above). Idempotent."""
    global _HOST_AMX
    if _HOST_AMX is None:
        _HOST_AMX = torch.cpu._is_amx_tile_supported
        torch.cpu._is_amx_tile_supported = lambda: False


def host_has_amx() -> bool:
    """What torch reports about AMX tiles on this host (or what a simulation in this process makes it report)."""
    return bool((_HOST_AMX or torch.cpu._is_amx_tile_supported)())


def prepare(names: Iterable[str] = tuple(STAND_INS)) -> list[str]:
    """Points 1 and 2 above in this process: AMX hidden from vLLM, the stand-ins installed. Returns what was installed."""
    hide_amx()
    return install(names)


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
        schema, impl, key, _ = {**STAND_INS, **AMX_STAND_INS}[name]
        _LIBRARIES[namespace].define(name + schema)
        _LIBRARIES[namespace].impl(name, impl, key)
        installed.append(name)
    return installed
