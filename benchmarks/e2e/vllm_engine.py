"""vLLM engines with the plugin on or off, and what they report about themselves.

The one engine harness of this repository, imported as ``benchmarks.e2e.vllm_engine``:
shared by the GPU integration tests (tests/vllm_plugin_gpu/), the AMX test
(tests/vllm_plugin/amx_mla_engine.py), the end-to-end benchmarks of this section
(bench_vllm_e2e.py) and the serving benchmark's profiler settings,
and exercised on the CPU by their smoke runs.

Turning the plugin on or off between engines of one process (``set_plugin``):
vLLM calls general plugins once per process (``vllm/plugins/__init__.py``,
``load_general_plugins``: a module-level ``plugins_loaded`` flag), so the
environment switch ``VLLM_MLA_FUSION`` alone cannot change a process that has
already loaded them. ``set_plugin`` therefore sets the environment *and* puts
vLLM's out-of-tree registry (``op_registry_oot``, key
``MultiHeadLatentAttentionWrapper``) in the matching state. An engine core
started by ``fork`` (vLLM's default on CUDA, ``vllm/utils/system_utils.py``
``get_mp_context``) inherits the registry and the ``plugins_loaded`` flag; one
started by ``spawn`` (forced on vLLM's CPU platform, or when CUDA is already
initialised) loads the plugins again and reads the environment. Either way the
engine builds what was asked; ``mla_facts`` reports what it actually built.

The functions marked *remote* run inside the engine's worker, through
``LLM.apply_model`` (argument: the model) or ``LLM.collective_rpc`` (argument:
the worker). They live in this importable module because vLLM pickles them
(``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` is needed across processes) and a
spawned worker must be able to import them by name. State they keep (counters,
the JIT log) lives on the worker object, in the process that runs the model.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import os
import time

from . import vllm_trace  # stdlib only: this module still imports no vLLM at import

PLUGIN_KEY = "MultiHeadLatentAttentionWrapper"
PLUGIN_CLASS = "FusedMultiHeadLatentAttentionWrapper"
ENTRY_POINT = ("mla_fusion", "vllm_mla_fusion.vllm_plugin:register")

# cpu_op names counted per step by the census (torch.library ops are recorded by name).
CENSUS_CPU_OPS = (
    "mla_fusion::mla_rope_cache_write",
    "mla_fusion::mla_decode_rope_cache_write",
    "mla_fusion::mla_prefill_rope_cache_write",
    "mla_fusion_vllm::mla_attention_with_output",
    "mla_fusion_vllm::rope_kv_cache_update",
    "vllm::unified_mla_kv_cache_update",
    "vllm::unified_mla_attention_with_output",
    "_C::concat_and_cache_mla",
    "_C::rotary_embedding",
    "_C::concat_mla_q",
)
FUSED_CPU_OP_PREFIX = "mla_fusion::"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------
# Driver side


def entry_points() -> dict:
    """The ``vllm.general_plugins`` entry points visible to this interpreter (name -> value)."""
    from importlib.metadata import entry_points as eps

    return {ep.name: ep.value for ep in eps(group="vllm.general_plugins")}


def load_plugins_through_vllm() -> str | None:
    """Let vLLM's own loader find and call the entry point; the class it registered, or None."""
    os.environ["VLLM_MLA_FUSION"] = "1"
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    cls = op_registry_oot.get(PLUGIN_KEY)
    return cls.__qualname__ if cls is not None else None


def set_plugin(on: bool, decode: bool = True) -> str | None:
    """Plugin on/off for the next engine this process builds (see the module docstring).

    Returns the class now registered for vLLM's MLA wrapper (None: vLLM's own).
    """
    os.environ["VLLM_MLA_FUSION"] = "1" if on else "0"
    if decode:
        os.environ.pop("VLLM_MLA_FUSION_DECODE", None)
    else:
        os.environ["VLLM_MLA_FUSION_DECODE"] = "0"
    from vllm.model_executor.custom_op import op_registry_oot

    op_registry_oot.pop(PLUGIN_KEY, None)
    if on:
        from vllm_mla_fusion.vllm_plugin import register

        register()
    cls = op_registry_oot.get(PLUGIN_KEY)
    return cls.__qualname__ if cls is not None else None


def profiler_config(directory: str) -> dict:
    """vLLM 0.33 ``ProfilerConfig`` (vllm/config/profiler.py) for a torch-profiler session.

    No Python stacks and no shapes (smaller, faster traces); no key_averages table dump
    (it prints hundreds of lines and takes seconds at stop). Activities: vLLM's platform
    default (CPU + CUDA on CUDA; CPU on CPU), so step annotations are recorded.
    """
    return {
        "profiler": "torch",
        "torch_profiler_dir": directory,
        "torch_profiler_with_stack": False,
        "torch_profiler_record_shapes": False,
        "torch_profiler_dump_cuda_time_total": False,
        "torch_profiler_use_gzip": True,
    }


def profile(llm, directory: str, prefix: str, work, wait_s: float = 60.0) -> str:
    """Run ``work()`` inside one profiling session; the path of the trace it wrote."""
    before = set(vllm_trace.find_traces(directory, prefix))
    llm.start_profile(profile_prefix=prefix)
    try:
        work()
    finally:
        llm.stop_profile()
    deadline = time.monotonic() + wait_s
    while True:
        new = [p for p in vllm_trace.find_traces(directory, prefix) if p not in before]
        if new:
            path = new[-1]
            # The worker writes the file in place; wait until its size settles.
            size = -1
            while size != os.path.getsize(path) and time.monotonic() < deadline:
                size = os.path.getsize(path)
                time.sleep(0.2)
            return path
        if time.monotonic() > deadline:
            raise RuntimeError(f"no trace with prefix {prefix!r} appeared in {directory}")
        time.sleep(0.2)


def census(trace_path: str) -> dict:
    """Per engine step: kind, token counts, the kernels it launched (short name -> count),
    our kernel's launches, vLLM's chain kernels, the counted CPU ops and GPU time."""
    trace = vllm_trace.load(trace_path)
    steps = vllm_trace.parse_steps(trace, CENSUS_CPU_OPS)
    out = []
    for s in steps:
        row = s.summary()
        row["fused_kernels"] = s.count_matching(vllm_trace.FUSED_KERNEL)
        row["chain_kernels"] = {p: s.count_matching(p) for p in vllm_trace.VLLM_CHAIN_PATTERNS}
        row["kernels"] = dict(s.kernel_counts())
        row["cpu_ops"] = dict(s.cpu_ops)
        row["fused_ops"] = sum(v for k, v in s.cpu_ops.items() if k.startswith(FUSED_CPU_OP_PREFIX))
        out.append(row)
    return {"trace": os.path.basename(trace_path), "steps": out,
            "unattributed_gpu_events": vllm_trace.unattributed_gpu_events(trace, steps)}  # fmt: skip


def shutdown(llm) -> float:
    """Stop the engine (its process, for a multiprocessing engine) and drop it; seconds taken."""
    t0 = time.perf_counter()
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001 - a failed teardown must not hide the results
        log(f"engine shutdown raised {type(e).__name__}: {e}")
    del llm
    gc.collect()
    return time.perf_counter() - t0


def wait_gpu_memory_released(max_used_mib: float, timeout_s: float = 60.0) -> float | None:
    """Poll nvidia-smi (never CUDA: the driver must stay fork-safe) until the GPU's used
    memory drops below ``max_used_mib``; the last reading, None without nvidia-smi."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    deadline = time.monotonic() + timeout_s
    used = None
    while True:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=10,
            ).stdout  # fmt: skip
            used = float(out.split()[0])
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            return used
        if used <= max_used_mib or time.monotonic() > deadline:
            return used
        time.sleep(0.5)


# ---------------------------------------------------------------------------
# Remote: run in the engine's worker


def mla_facts(model) -> dict:
    """(remote, apply_model) What every MLA layer of the built model is and uses."""
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper
    from vllm.v1.kv_cache_interface import is_quantized_kv_cache

    layers = []
    for prefix, m in model.named_modules():
        if not isinstance(m, MultiHeadLatentAttentionWrapper):
            continue
        attn = m.mla_attn
        kv = getattr(attn, "kv_cache", None)
        if isinstance(kv, (list, tuple)):
            kv = kv[0] if kv else None
        builder = attn.attn_backend.get_builder_cls()
        layers.append({
            "prefix": prefix,
            "wrapper": type(m).__qualname__,
            "fusion_mode": getattr(m, "fusion_mode", None),
            "attention": type(attn).__qualname__,
            "backend": attn.attn_backend.get_name(),
            "impl": type(attn.impl).__qualname__,
            "kv_cache_dtype": attn.kv_cache_dtype,
            "cache_dtype": str(kv.dtype) if kv is not None else None,
            "cache_shape": list(kv.shape) if kv is not None else None,
            "fp8_query": bool(is_quantized_kv_cache(attn.kv_cache_dtype) and attn.impl.supports_quant_query_input),
            # The plugin's decode rows: op 2 assembles the query, op 1 rotates them where the
            # backend takes (ql_nope, q_pe) as is (vllm_plugin/eligibility.decode_pair_reason).
            "decode_op": (None if getattr(m, "fusion_mode", None) != "decode"
                          else "op2" if getattr(attn, "_decode_assembles_query", True) else "op1"),
            "prefill_key_fused": getattr(attn, "_prefill_key_fused", None),
            "reorder_batch_threshold": getattr(builder, "reorder_batch_threshold", None),
            "num_heads": attn.num_heads,
        })  # fmt: skip
    return {"layers": layers, "dtype": str(next(model.parameters()).dtype)}


def runner_facts(worker) -> dict:
    """(remote, collective_rpc) How the worker compiled and captured the model."""
    import dataclasses

    runner = worker.model_runner
    vcfg = worker.vllm_config
    cc = vcfg.compilation_config
    facts = {
        "pid": os.getpid(),
        "runner": type(runner).__qualname__,
        "compilation_mode": str(cc.mode),
        "cudagraph_mode_config": str(cc.cudagraph_mode),
        "cudagraph_capture_sizes": list(cc.cudagraph_capture_sizes or []),
        "splitting_ops": list(cc.splitting_ops or []),
        "cache_dir": cc.cache_dir,
        "local_cache_dir": cc.local_cache_dir,
        "async_scheduling": vcfg.scheduler_config.async_scheduling,
        "max_num_batched_tokens": vcfg.scheduler_config.max_num_batched_tokens,
        "block_size": vcfg.cache_config.block_size,
        "mp_method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"),
        "vllm_cache_root": os.environ.get("VLLM_CACHE_ROOT"),
    }
    mgr = getattr(runner, "cudagraph_manager", None)  # model runner V2 (vllm/v1/worker/gpu/model_runner.py)
    if mgr is not None:
        facts["cudagraph_mode"] = str(mgr.cudagraph_mode)
        descs = getattr(mgr, "_capture_descs", {}) or {}
        facts["captured"] = {str(mode): sorted({d.num_tokens for d in ds}) for mode, ds in descs.items()}
        facts["full_graphs"] = sorted({d.num_tokens for d in getattr(mgr, "graphs", {})})
    else:
        dispatcher = getattr(runner, "cudagraph_dispatcher", None)  # V1 runner
        facts["cudagraph_mode"] = str(getattr(dispatcher, "cudagraph_mode", cc.cudagraph_mode))
    try:
        from vllm.compilation.counter import compilation_counter

        facts["compilation_counter"] = {
            k: v for k, v in dataclasses.asdict(compilation_counter).items() if isinstance(v, int)
        }
    except Exception:  # noqa: BLE001 - optional detail
        pass
    return facts


def install_counters(worker) -> int:
    """(remote, collective_rpc) Count which attention paths and CUDA-graph routes run from now on.

    Wraps, per MLA layer, the backend's ``forward_mha`` (prefill path; ``with_context``:
    the batch has a chunked context read back from the cache) and ``forward_mqa`` (decode
    path; ``multi_token``: more query rows than decode requests, i.e. a short prefill or a
    chunk sent down the decode path), and the V2 runner's FULL and PIECEWISE replays.
    Calls made inside a FULL CUDA-graph replay run no Python and are not counted as
    paths (they are counted as ``full_replays``). Returns the number of MLA layers wrapped.
    """
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    st = worker.__dict__.setdefault("_mla_probe_counts", {})
    st.update(forward_mha=0, forward_mha_with_context=0, forward_mqa=0, forward_mqa_multi_token=0,
              full_replays=0, piecewise_replays=0)  # fmt: skip
    n = 0
    for m in worker.get_model().modules():
        if not isinstance(m, MLAAttention) or getattr(m.impl, "_mla_probe_wrapped", False):
            n += isinstance(m, MLAAttention)
            continue
        impl = m.impl
        mha, mqa = impl.forward_mha, impl.forward_mqa

        def forward_mha(*args, _orig=mha, **kwargs):
            st["forward_mha"] += 1
            md = args[4] if len(args) > 4 else kwargs.get("attn_metadata")
            if getattr(getattr(md, "prefill", None), "chunked_context", None) is not None:
                st["forward_mha_with_context"] += 1
            return _orig(*args, **kwargs)

        def forward_mqa(q, kv_cache, attn_metadata, layer, _orig=mqa):
            st["forward_mqa"] += 1
            rows = q[0].shape[0] if isinstance(q, tuple) else q.shape[0]
            if rows > getattr(attn_metadata, "num_decodes", rows):
                st["forward_mqa_multi_token"] += 1
            return _orig(q, kv_cache, attn_metadata, layer)

        impl.forward_mha, impl.forward_mqa = forward_mha, forward_mqa
        impl._mla_probe_wrapped = True
        n += 1
    mgr = getattr(worker.model_runner, "cudagraph_manager", None)
    if mgr is not None and not getattr(mgr, "_mla_probe_wrapped", False):
        full, pw = mgr.run_fullgraph, mgr.run_pw_graph

        def run_fullgraph(*args, _orig=full, **kwargs):
            st["full_replays"] += 1
            return _orig(*args, **kwargs)

        def run_pw_graph(*args, _orig=pw, **kwargs):
            st["piecewise_replays"] += 1
            return _orig(*args, **kwargs)

        mgr.run_fullgraph, mgr.run_pw_graph = run_fullgraph, run_pw_graph
        mgr._mla_probe_wrapped = True
    return n


def read_counters(worker) -> dict:
    """(remote, collective_rpc) The counts ``install_counters`` has collected, then zeroed."""
    st = worker.__dict__.get("_mla_probe_counts", {})
    out = dict(st)
    for k in st:
        st[k] = 0
    return out


def install_jit_hook(worker) -> bool:
    """(remote, collective_rpc) Record every Triton JIT compilation from now on.

    Triton 3.8 (``triton/runtime/jit.py``, ``JITFunction._do_compile``) calls
    ``knobs.runtime.jit_cache_hook`` before and ``jit_post_compile_hook`` after
    compiling a specialization not yet in the process's kernel cache (also when the
    binary comes from the on-disk cache: that still costs host time). Both hooks chain to
    whatever was installed before (vLLM's own JIT monitor, ``vllm/utils/jit_monitor.py``,
    installs a post-compile hook after warm-up). The pre-hook never returns a true value
    (that would skip the compile). False without Triton.
    """
    try:
        from triton import knobs
        from triton.runtime import jit as triton_jit
    except ImportError:
        return False
    if getattr(worker, "_mla_jit_log", None) is not None:
        return True
    log_ = worker._mla_jit_log = []
    orig = triton_jit.serialize_specialization_data
    if not (getattr(orig, "_vllm_guarded", False) or getattr(orig, "_mla_guarded", False)):
        # _call_hook serializes the specialization for any hook; some kernels' constexprs
        # are not JSON-serializable (vLLM's monitor guards this the same way).
        def guarded(*args, **kwargs):
            try:
                return orig(*args, **kwargs)
            except (TypeError, ValueError):
                return None

        guarded._mla_guarded = True
        triton_jit.serialize_specialization_data = guarded
    prev_pre, prev_post = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    started: dict = {}

    def pre(**kwargs):
        started[str(kwargs.get("key"))] = time.perf_counter()
        return prev_pre(**kwargs) if prev_pre is not None else None

    def post(**kwargs):
        now = time.perf_counter()
        fn = kwargs.get("fn")
        log_.append({
            "kernel": getattr(fn, "name", "?"),
            "module": getattr(fn, "module", "?"),
            "compile_ms": 1e3 * (now - started.pop(str(kwargs.get("key")), now)),
            "t": now,
            "signature": str(kwargs.get("repr", ""))[:400],
            # Triton's specialization key in full: diffed against the variants compiled ahead
            # (kernel_cache_keys) it names what the warm-up did not cover.
            "key": str(kwargs.get("key", "")),
        })  # fmt: skip
        return prev_post(**kwargs) if prev_post is not None else None

    knobs.runtime.jit_cache_hook = pre
    knobs.runtime.jit_post_compile_hook = post
    return True


def read_jit_log(worker) -> list:
    """(remote, collective_rpc) The compilations recorded so far (kept)."""
    return list(getattr(worker, "_mla_jit_log", None) or [])


_REQUEST_IDS = itertools.count()


def add_request(llm, prompt: dict, params, prefix: str = "req") -> str:
    """Queue one request on ``llm``'s engine (``LLMEngine.add_request``); its id."""
    rid = f"{prefix}-{next(_REQUEST_IDS)}"
    llm.llm_engine.add_request(rid, prompt, params)
    return rid


def engine_steps(llm, steps: int | None = None, until=None, limit: int = 10_000) -> set:
    """Engine steps (``LLMEngine.step``): ``steps`` of them, or until ``until(finished ids)`` holds;
    the ids of the requests that finished."""
    finished: set = set()
    for n in range(limit):
        if (steps is not None and n >= steps) or (until is not None and until(finished)):
            return finished
        finished |= {o.request_id for o in llm.llm_engine.step() if o.finished}
    raise RuntimeError(f"the engine did not get there in {limit} steps")


@contextlib.contextmanager
def running_decoders(llm, prompts: list[dict], params, prefix: str = "dec"):
    """``prompts`` decoding for the body's duration: queued, their prefill step and two decode
    steps taken before it, aborted and the engine drained after it. A prompt queued in the body
    joins a batch of decodes: the step that admits it is a mixed step."""
    rids = [add_request(llm, p, params, prefix) for p in prompts]
    engine_steps(llm, steps=3)
    try:
        yield rids
    finally:
        llm.llm_engine.abort_request(rids)
        engine_steps(llm, until=lambda _: not llm.llm_engine.has_unfinished_requests())


def _timed(fn, record):
    """``fn`` wrapped to call ``record(args, start, seconds)`` after every call (host clock)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record(args, t, time.perf_counter() - t)

    return call


def install_host_timer(worker) -> bool:
    """(remote, collective_rpc) Time the model runner's ``execute_model`` and ``sample_tokens`` on
    the host from now on, and every garbage collection of the worker's process.

    Host clock only (``perf_counter``, no device sync): with async scheduling these calls
    return once their work is launched, so their span is the host's share of a step, the
    profiler's step span without the profiler's overhead. Each call: (name, start, seconds,
    scheduled tokens); each collection: (generation, start, seconds). With the region timer
    (``install_region_timer``) each ``execute_model`` call also gets the regions timed inside it
    (``step_regions``: one step's own regions where a request runs several steps).
    ``read_host_timer`` returns and clears them.
    """
    if getattr(worker, "_mla_host_log", None) is not None:
        return True
    log_ = worker._mla_host_log = {"calls": [], "gc": [], "step_regions": [], "regions_seen": {}}
    runner = worker.model_runner

    def record_call(name):
        def record(args, t, seconds):
            tokens = getattr(args[0], "total_num_scheduled_tokens", None) if args else None
            log_["calls"].append((name, t, seconds, tokens))
            if name == "execute_model" and "regions" in log_:
                # The region totals grew by this call's own regions since the previous call ended.
                seen, totals = log_["regions_seen"], log_["regions"]
                zero = (0, 0.0)
                log_["step_regions"].append({k: (n - seen.get(k, zero)[0], sec - seen.get(k, zero)[1])
                                             for k, (n, sec) in totals.items() if n != seen.get(k, zero)[0]})  # fmt: skip
                seen.clear()
                seen.update({k: (n, sec) for k, (n, sec) in totals.items()})

        return record

    for name in ("execute_model", "sample_tokens"):
        setattr(runner, name, _timed(getattr(runner, name), record_call(name)))
    started: list = []

    def on_gc(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            t = started.pop()
            log_["gc"].append((info.get("generation"), t, time.perf_counter() - t))

    gc.callbacks.append(on_gc)
    return True


def read_host_timer(worker) -> dict:
    """(remote, collective_rpc) What ``install_host_timer`` recorded since the last read (then cleared)."""
    log_ = getattr(worker, "_mla_host_log", None) or {"calls": [], "gc": []}
    out = {k: (dict(v) if isinstance(v, dict) else list(v)) for k, v in log_.items() if k != "regions_seen"}
    for v in log_.values():
        v.clear()
    return out


def host_summary(log_: dict) -> dict:
    """Driver side: one request's host record in ms (``read_host_timer``'s output)."""
    calls = log_.get("calls", [])
    execs = [c for c in calls if c[0] == "execute_model"]
    samples = [c for c in calls if c[0] == "sample_tokens"]
    out = {
        "execute_model_ms": [round(1e3 * c[2], 3) for c in execs],
        "execute_model_tokens": [c[3] for c in execs],
        "sample_tokens_ms": [round(1e3 * c[2], 3) for c in samples],
        "gc_ms": [round(1e3 * g[2], 3) for g in log_.get("gc", [])],
        "gc_generations": [g[0] for g in log_.get("gc", [])],
    }
    if log_.get("regions"):
        out["regions_ms"] = {k: [n, round(1e3 * s, 3)] for k, (n, s) in sorted(log_["regions"].items())}
    if log_.get("step_regions") and len(log_["step_regions"]) == len(execs):
        # Per execute_model call, in the order of execute_model_ms.
        out["execute_model_regions_ms"] = [{k: [n, round(1e3 * s, 3)] for k, (n, s) in sorted(r.items())}
                                           for r in log_["step_regions"]]  # fmt: skip
    if calls:
        first, last = min(c[1] for c in calls), max(c[1] + c[2] for c in calls)
        out["engine_span_ms"] = round(1e3 * (last - first), 3)  # first call's start to last call's end
    return out


# Host regions of a step that install_region_timer times (where the plugin and vLLM differ):
# (module, class or None, attribute, region name).
HOST_REGIONS = (
    ("vllm.compilation.piecewise_backend", "PiecewiseBackend", "__call__", "compiled piece"),
    ("vllm.model_executor.layers.attention.mla_attention", "MLAAttention", "forward_impl", "MLAAttention.forward_impl"),
    ("vllm.model_executor.layers.attention.mla_attention", "MLAAttention", "update_kv_cache", "vLLM cache write"),
    ("vllm.model_executor.layers.attention.mla_attention", "MLACommonBaseImpl", "forward_mha", "forward_mha"),
    ("vllm.model_executor.layers.attention.mla_attention", "MLACommonBaseImpl", "_concat_k_nope_k_pe",
     "vLLM key concat"),
    ("vllm_mla_fusion.vllm_plugin.attention", "FusedMLAAttention", "forward_fused", "plugin forward_fused"),
    # The plugin's counterpart of vLLM's key concat inside forward_mha: op 3 and its output.
    ("vllm_mla_fusion.vllm_plugin.attention", "FusedMLAAttention", "assemble_prefill_key", "plugin prefill key (op 3)"),
    ("vllm_mla_fusion.vllm_plugin.attention", "FusedMLAAttention", "assemble_decode_query", "plugin decode query (op 2)"),
    ("vllm_mla_fusion.binding", "BoundOp", "__call__", "plugin bound ops (all)"),
)


_REGION_TOTALS: dict = {}


def install_region_timer(worker) -> list:
    """(remote, collective_rpc) Time, on the host, every call of the ``HOST_REGIONS`` (inclusive:
    a region inside another counts in both). Costs ~1 us per call on both sides; for diagnosis
    runs only (``--host-regions``). ``read_host_timer`` returns the totals since its last read.
    Returns the regions it wrapped."""
    import importlib

    if getattr(worker, "_mla_host_log", None) is None:
        install_host_timer(worker)
    # Module-level totals: the wrappers are installed on classes, once per process, and an
    # in-process engine after another (--inproc) reuses them.
    worker._mla_host_log["regions"] = totals = _REGION_TOTALS
    wrapped = []
    for module, owner, attr, region in HOST_REGIONS:
        try:
            obj = getattr(importlib.import_module(module), owner)
        except (ImportError, AttributeError):
            continue
        fn = obj.__dict__.get(attr) if isinstance(obj, type) else getattr(obj, attr, None)
        if fn is None:
            continue
        if getattr(fn, "_mla_region", None):
            wrapped.append(region)
            continue

        def add_to(region):
            def record(args, t, seconds):
                row = totals.setdefault(region, [0, 0.0])
                row[0] += 1
                row[1] += seconds

            return record

        timed = _timed(fn, add_to(region))
        timed._mla_region = True
        setattr(obj, attr, timed)
        wrapped.append(region)
    return wrapped


def host_speed_probe(worker) -> dict:
    """(remote, collective_rpc) The engine process's host speed on fixed work that no code of
    vLLM's or the plugin's runs: a pure-Python loop and torch's CPU dispatch (slicing a small CPU
    tensor). Median of 5 rounds, in us per 1000 loop iterations and per slice. It tells "this
    process runs all Python slower" apart from "the plugin's code costs more": only the first
    moves it (docs/performance-history.md, "Where the TTFT goes"). ~10 ms a call."""
    import torch

    def python_round() -> float:
        t = time.perf_counter()
        d: dict = {}
        for i in range(5000):
            d[i & 63] = d.get((i * 7) & 63, 0) + i
        return (time.perf_counter() - t) / 5

    x = torch.empty(64)

    def torch_round() -> float:
        t = time.perf_counter()
        for _ in range(500):
            x[1:3]
        return (time.perf_counter() - t) / 500

    python_round(), torch_round()  # warm
    py = sorted(python_round() for _ in range(5))[2]
    tor = sorted(torch_round() for _ in range(5))[2]
    return {"python_us_per_1k": 1e6 * py, "torch_slice_us": 1e6 * tor}


def kernel_cache_keys(worker) -> list:
    """(remote, collective_rpc) Triton's specialization keys of the project's kernel compiled in
    this process so far (``JITFunction.device_caches``; empty where Triton keeps them otherwise)."""
    try:
        from vllm_mla_fusion.backends import triton as tb
    except ImportError:
        return []
    out = []
    for kernel in tb._KERNELS.values():
        for caches in getattr(kernel, "device_caches", {}).values():
            out += [str(k) for k in caches[0]]
    return out
