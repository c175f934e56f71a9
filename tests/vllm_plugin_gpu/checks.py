"""Checks over engine_worker.py's records, shared by the GPU tests and the CPU smoke test.

Each ``check_*`` raises AssertionError with the numbers when the property fails and
returns a short reading of what it compared. No vLLM or torch needed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .workload import GRAPH_ROPE

PLUGIN_CLASS = "FusedMultiHeadLatentAttentionWrapper"
VLLM_CLASS = "MultiHeadLatentAttentionWrapper"
# Kernels of vLLM's replaced chain that nothing else in the model launches.
MLA_ONLY_PATTERNS = ("rotary_embedding", "concat_and_cache_mla", "concat_mla_q")
CAT = "CatArrayBatchedCopy"
PREFILL_KEY_OP = "mla_fusion::mla_prefill_rope_cache_write"  # op 3, as the profiler names its calls
# CPU ops of vLLM's replaced chain (the CPU smoke run has no GPU kernels).
VLLM_CACHE_OP = "vllm::unified_mla_kv_cache_update"


def load_records(paths) -> list[dict]:
    recs = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            continue
        for line in p.read_text().splitlines():
            if line.strip():
                recs.append(json.loads(line))
    return recs


def engines(records) -> dict:
    """(case name, side) -> the engine's record (errors and skips included)."""
    return {(r["case"]["name"], r["side"]): r for r in records if "case" in r}


# ---------------------------------------------------------------------------
# numbers


def flat(nested) -> list[float]:
    return [x for row in nested for x in row]


def abs_diffs(a, b) -> list[float]:
    fa, fb = flat(a), flat(b)
    assert len(fa) == len(fb), f"different lengths: {len(fa)} vs {len(fb)}"
    return [abs(x - y) for x, y in zip(fa, fb)]


def quantile(xs, q: float) -> float:
    s = sorted(xs)
    if not s:
        return math.nan
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def stats(xs) -> dict:
    if not xs:
        return {"n": 0, "mean": math.nan, "p50": math.nan, "p99": math.nan, "max": math.nan}
    return {"n": len(xs), "mean": sum(xs) / len(xs), "p50": quantile(xs, 0.5), "p99": quantile(xs, 0.99),
            "max": max(xs)}  # fmt: skip


def fmt_stats(s: dict) -> str:
    return f"mean {s['mean']:.4g}, p50 {s['p50']:.4g}, p99 {s['p99']:.4g}, max {s['max']:.4g} over {s['n']}"


# ---------------------------------------------------------------------------
# checks


def check_sides(on: dict, off: dict, num_layers: int) -> str:
    """The plugin was really on in one engine and off in the other, on the asked backend."""
    case = on["case"]
    lay_on, lay_off = on["facts"]["layers"], off["facts"]["layers"]
    assert len(lay_on) == len(lay_off) == num_layers, (len(lay_on), len(lay_off))
    bad = [(l["prefix"], l["wrapper"], l["fusion_mode"]) for l in lay_on
           if l["wrapper"] != PLUGIN_CLASS or l["fusion_mode"] != "decode"]  # fmt: skip
    assert not bad, f"plugin on, but these MLA layers are not fused in decode mode: {bad}"
    bad = [(l["prefix"], l["wrapper"]) for l in lay_off if l["wrapper"] != VLLM_CLASS]
    assert not bad, f"plugin off, but these MLA layers are not vLLM's wrapper: {bad}"
    for rec in (on, off):
        for l in rec["facts"]["layers"]:
            assert l["backend"] == case["backend"], f"asked for {case['backend']}, vLLM built {l['backend']}"
            assert l["kv_cache_dtype"] == case["kv_cache_dtype"], (l["kv_cache_dtype"], case["kv_cache_dtype"])
    # The fused prefill key (op 3) is opt-in: on exactly where the case switched it on.
    want_key = ["VLLM_MLA_FUSION_PREFILL_KEY", "1"] in [list(kv) for kv in case["plugin_env"]]
    bad = [l["prefix"] for l in lay_on if bool(l["prefill_key_fused"]) != want_key]
    assert not bad, f"layers whose prefill key is {'not ' if want_key else ''}fused (op 3), against the case: {bad}"
    l0 = lay_on[0]
    return (f"on: {num_layers} x {PLUGIN_CLASS} mode decode; off: {num_layers} x {VLLM_CLASS}; backend {l0['backend']} "
            f"({l0['impl']}), cache {l0['kv_cache_dtype']} stored as {l0['cache_dtype']} {l0['cache_shape']}, "
            f"fp8 query {l0['fp8_query']}, reorder_batch_threshold {l0['reorder_batch_threshold']}")  # fmt: skip


def check_graph_mode(rec: dict) -> str:
    """Eager engines capture and replay no CUDA graph; compiled ones replay FULL graphs for decode."""
    f, p = rec["facts"], merged_paths(rec)
    mode = f.get("cudagraph_mode", "")
    if not rec["case"]["compiled"]:
        assert mode.endswith("NONE"), f"eager engine with CUDA-graph mode {mode}"
        assert p["full_replays"] == 0 and p["piecewise_replays"] == 0, p
    else:
        assert "FULL" in mode, f"compiled engine resolved CUDA-graph mode {mode}, expected full decode graphs"
        assert f.get("full_graphs"), f"no FULL graph was captured: {f.get('captured')}"
        assert p["full_replays"] > 0, f"no step replayed a FULL graph: {p}"
        if tuple(map(tuple, rec["case"]["plugin_env"])) == GRAPH_ROPE:
            # A graph-rope case: its prefill and mixed steps must run in piecewise graphs, or the
            # graph op it is about never ran in one.
            assert p["piecewise_replays"] > 0, f"no step replayed a piecewise graph: {p}"
    return (f"compilation mode {f.get('compilation_mode')}, CUDA graphs {mode}, captured {f.get('captured')}, "
            f"replays FULL {p['full_replays']} / PIECEWISE {p['piecewise_replays']}")  # fmt: skip


def merged_paths(rec: dict) -> dict:
    a, b = rec.get("paths", {}), rec.get("census_paths", {})
    return {k: a.get(k, 0) + b.get(k, 0) for k in set(a) | set(b)}


def check_paths(on: dict, off: dict, chunked_prefill: bool = True) -> str:
    """The probe took the prefill path, with chunked context where the platform chunks, and
    (backends with a reorder threshold above 1) multi-token batches down the decode path;
    both sides were scheduled identically."""
    pon, poff = on["paths"], off["paths"]
    assert pon == poff, f"plugin on and off took different attention paths: on {pon}, off {poff}"
    assert pon["forward_mha"] > 0, f"the prefill path never ran: {pon}"
    if chunked_prefill:
        assert pon["forward_mha_with_context"] > 0, f"no prefill chunk read earlier context back from the cache: {pon}"
    threshold = on["facts"]["layers"][0]["reorder_batch_threshold"] or 1
    if threshold > 1:
        assert pon["forward_mqa_multi_token"] > 0, f"threshold {threshold}: no multi-token batch took the decode path"
    return f"paths (calls summed over layers): {pon}"


def check_bf16_identical(on: dict, off: dict, tol: float = 0.0) -> str:
    """Same tokens; logprobs (sampled and teacher-forced) equal within ``tol`` (0: bit for bit)."""
    assert on["greedy"]["tokens"] == off["greedy"]["tokens"], (
        f"greedy tokens differ:\n on  {on['greedy']['tokens']}\n off {off['greedy']['tokens']}"
    )
    dg = abs_diffs(on["greedy"]["logprobs"], off["greedy"]["logprobs"])
    dt = abs_diffs(on["teacher"]["logprobs"], off["teacher"]["logprobs"])
    assert max(dg) <= tol and max(dt) <= tol, (
        f"logprobs differ beyond {tol}: greedy {fmt_stats(stats(dg))}; teacher-forced {fmt_stats(stats(dt))}"
    )
    return (f"tokens identical ({len(flat(on['greedy']['tokens']))}); max |logprob diff| greedy {max(dg):.3g}, "
            f"teacher-forced {max(dt):.3g} over {len(dt)} positions")  # fmt: skip


def check_eager_noise(on_eager: dict, off_eager: dict, off_compiled: dict, factor: float = 1.5,
                      eps: float = 2e-3) -> str:  # fmt: skip
    """Eager: the plugin's teacher-forced logprobs differ from vLLM's eager ones by no more than
    vLLM's own eager run differs from its compiled run (x factor + eps)."""
    d_plugin = abs_diffs(on_eager["teacher"]["logprobs"], off_eager["teacher"]["logprobs"])
    d_vllm = abs_diffs(off_eager["teacher"]["logprobs"], off_compiled["teacher"]["logprobs"])
    d_to_compiled = abs_diffs(on_eager["teacher"]["logprobs"], off_compiled["teacher"]["logprobs"])
    bound = factor * max(d_vllm) + eps
    reading = (f"|on_eager - off_eager|: {fmt_stats(stats(d_plugin))}; vLLM's own |eager - compiled|: "
               f"{fmt_stats(stats(d_vllm))}; |on_eager - off_compiled|: {fmt_stats(stats(d_to_compiled))}; "
               f"greedy tokens equal: {on_eager['greedy']['tokens'] == off_eager['greedy']['tokens']}")  # fmt: skip
    assert max(d_plugin) <= bound, f"eager plugin noise beyond {bound:.4g}: {reading}"
    return reading


def check_fp8(on8: dict, off8: dict, ref: dict, rel: float = 0.10, eps: float = 1e-3) -> str:
    """fp8 KV cache: against the bf16-cache engine (vLLM's path) of the same backend, the
    plugin's teacher-forced logprobs are no further off than vLLM's own fp8 path:
    mean |err_on| <= mean |err_off| * (1 + rel) + eps. Tokens may differ (rounding flips)."""
    for rec in (on8, off8):
        for l in rec["facts"]["layers"]:
            # vLLM keeps fp8 caches as uint8 storage (viewed as fp8 by the kernels).
            assert l["kv_cache_dtype"].startswith("fp8") and l["cache_dtype"] in ("torch.uint8", "torch.float8_e4m3fn"), l
    assert ref["case"]["kv_cache_dtype"] == "auto" and ref["side"] == "off", ref["case"]
    e_on = abs_diffs(on8["teacher"]["logprobs"], ref["teacher"]["logprobs"])
    e_off = abs_diffs(off8["teacher"]["logprobs"], ref["teacher"]["logprobs"])
    s_on, s_off = stats(e_on), stats(e_off)
    d = stats(abs_diffs(on8["teacher"]["logprobs"], off8["teacher"]["logprobs"]))
    reading = (f"error vs the bf16-cache engine: plugin {fmt_stats(s_on)}; vLLM {fmt_stats(s_off)}; "
               f"ratio of means {s_on['mean'] / max(s_off['mean'], 1e-30):.3f}; |on - off| {fmt_stats(d)}; "
               f"fp8 query {on8['facts']['layers'][0]['fp8_query']}")  # fmt: skip
    assert s_off["mean"] > 0, f"vLLM's fp8 engine matches the bf16 one exactly: was the cache fp8? {reading}"
    assert s_on["mean"] <= s_off["mean"] * (1 + rel) + eps, f"plugin's fp8 error is larger than vLLM's: {reading}"
    return reading


def _fused(step: dict, gpu: bool) -> int:
    return step["fused_kernels"] if gpu else step["fused_ops"]


def graph_kernels_visible(rec: dict) -> bool | None:
    """Whether the profiler reported kernels of CUDA-graph replays (None: no step replayed a graph)."""
    seen = None
    for s in rec["census"]["steps"]:
        if s["graph_launches"]:
            seen = bool(seen) or s["gpu_us"]["kernels"] > 0
    return seen


def query_concat_expected(rec: dict) -> bool:
    """vLLM 0.33 concatenates a bf16 decode query with torch.cat in FLASHMLA's and TRITON_MLA's
    ``forward_mqa``; FLASH_ATTN_MLA takes the (ql_nope, q_pe) pair as is, and an fp8 query is
    concatenated and quantised by ``_DecodeConcatQuantFP8`` (kernel names vary with the mode)."""
    layer = rec["facts"]["layers"][0]
    return layer["backend"] in ("FLASHMLA", "TRITON_MLA") and not layer["fp8_query"]


def decode_pair_taken(rec: dict) -> bool:
    """The backend's forward_mqa takes the (ql_nope, q_pe) pair as is (FLASH_ATTN_MLA, CUTLASS_MLA,
    without an fp8 query): a mixed step's decode rows then join the prefill op's launch."""
    layer = rec["facts"]["layers"][0]
    return layer["backend"] in ("FLASH_ATTN_MLA", "CUTLASS_MLA") and not layer["fp8_query"]


def check_no_plugin_compiles_after_warmup(rec: dict) -> str:
    """None of the plugin's kernels compiled after vLLM's warm-up: the profile run compiled every
    variant the steps launch (prewarm.py), for the block size vLLM settled for the backend.
    vLLM's own kernels are vLLM's business (the first engine of a worker compiles some). Triton's
    in-process cache and prewarm's memo outlive an engine: an engine that follows another of the
    same specialisations in one worker (the cases of one backend share a worker) is checked only
    for the variants the earlier one never compiled."""
    assert rec.get("jit_hook"), "the JIT hook was not installed: no compile could have been seen"
    ours = [(j["kernel"], round(j["compile_ms"], 1)) for j in rec["jit_after_warmup"]
            if j.get("module", "").startswith("vllm_mla_fusion")]  # fmt: skip
    assert not ours, f"the plugin's kernels compiled after warm-up, each a stall in a first request: {ours}"
    return f"none of the plugin's kernels compiled after warm-up ({len(rec['jit_after_warmup'])} of vLLM's)"


def mla_prefill_rows(step: dict, threshold: int) -> bool | None:
    """Whether MLA sends any of the step's context requests down its prefill path, or None where
    the step's totals cannot tell. vLLM's MLA backends split a step by query length
    (``split_decodes_and_prefills``): a request longer than their ``reorder_batch_threshold``
    (FLASH_ATTN_MLA 512, FLASHMLA 128) is a prefill; a shorter one is a decode row, unless the
    backend needs uniform decode lengths (FLASHMLA, TRITON_MLA) and its length differs from the
    first request's. The census has only the step's totals."""
    n, tokens = step["ctx_reqs"], step["ctx_tokens"]
    if n == 0:
        return False
    if tokens > n * threshold:
        return True  # some request is longer than the threshold
    return None


def check_census(on: dict, off: dict, num_layers: int, gpu: bool = True) -> str:
    """Per engine step, plugin on: our kernel once per MLA layer for decode-only and prefill-only
    steps, and for mixed steps (decode-path and prefill-path tokens) where the backend takes the
    decode pair as it is (one launch serves the decode and prefill rows: op 1, or op 3 where the
    case opted in); elsewhere twice in mixed steps (op 2 assembles the decode query, one such step
    at least). Op 3 once per layer in each step with prefill rows where the layers were built
    with it, never elsewhere (mla_prefill_rows). None of vLLM's RoPE,
    cache-write or query-concat kernels (and no more of anything chain-like than without the
    plugin); plugin off: none of ours, vLLM's cache write once per layer. Steps are compared one
    to one (in-process engines schedule identically)."""
    L = num_layers
    threshold = on["facts"]["layers"][0]["reorder_batch_threshold"] or 1
    query_concat = gpu and query_concat_expected(off)
    pair = decode_pair_taken(on)
    son = [s for s in on["census"]["steps"] if s["closed"]]
    soff = [s for s in off["census"]["steps"] if s["closed"]]
    assert [s["name"] for s in son] == [s["name"] for s in soff], "on and off were scheduled differently"
    kinds = {s["kind"] for s in son}
    assert {"prefill", "decode", "mixed"} <= kinds, f"census lacks a step kind: {kinds}"
    lines = []
    saw_two = False
    for a, b in zip(son, soff, strict=True):
        fa, fb = _fused(a, gpu), _fused(b, gpu)
        where = f"step {a['index']} {a['name']}"
        assert fb == 0, f"{where}: plugin off but our kernel ran {fb} times"
        if a["kind"] == "empty":  # nothing scheduled (async scheduling, requests finishing): no forward
            assert fa == 0, f"{where}: our kernel ran {fa} times in a step without tokens"
            continue
        if gpu:
            assert b["chain_kernels"]["concat_and_cache_mla"] == L, f"{where}: off, cache writes {b['chain_kernels']}"
            for pat in MLA_ONLY_PATTERNS:
                assert a["chain_kernels"][pat] == 0, f"{where}: plugin on, vLLM kernel {pat} ran: {a['chain_kernels']}"
            for pat, n_off in b["chain_kernels"].items():
                n_on = a["chain_kernels"][pat]
                assert n_on <= n_off, f"{where}: {pat} on {n_on} vs off {n_off}: the plugin added such kernels"
            if query_concat and a["kind"] == "decode":
                cat_on, cat_off = a["chain_kernels"][CAT], b["chain_kernels"][CAT]
                assert cat_off - cat_on >= L, (
                    f"{where}: vLLM concatenates the decode query ({CAT} {cat_off}); with the plugin {cat_on}, "
                    f"expected at least one fewer per layer"
                )
        else:
            assert b["cpu_ops"].get(VLLM_CACHE_OP, 0) == L, f"{where}: off, {VLLM_CACHE_OP} {b['cpu_ops']}"
            assert a["cpu_ops"].get(VLLM_CACHE_OP, 0) == 0, f"{where}: on, {VLLM_CACHE_OP} ran {a['cpu_ops']}"
        if a["kind"] in ("prefill", "mixed") and "cpu_ops" in a:
            # Prefill rows run outside CUDA graphs, so the profiler names each op call: op 3 builds
            # every layer's key where the layer was built with it and MLA has prefill rows, never
            # elsewhere (context requests no longer than the threshold are MLA decode rows).
            n_key = a["cpu_ops"].get(PREFILL_KEY_OP, 0)
            rows = mla_prefill_rows(a, threshold)
            fused = on["facts"]["layers"][0]["prefill_key_fused"]
            want = {L} if fused and rows else {0} if not fused or rows is False else {0, L}
            assert n_key in want, f"{where}: {PREFILL_KEY_OP} ran {n_key} times, expected {' or '.join(map(str, sorted(want)))}"
        if a["kind"] == "mixed" and pair:
            assert fa == L, f"{where}: our kernel {fa} times, expected once per layer ({L}) on a decode-pair backend"
        elif a["kind"] == "mixed":
            assert fa in (L, 2 * L), f"{where}: our kernel {fa} times, expected {L} or {2 * L}"
            saw_two |= fa == 2 * L
        else:
            assert fa == L, f"{where}: our kernel {fa} times, expected once per layer ({L})"
        if gpu and a["fused_ops"]:
            # Eagerly executed steps: each op call is one launch.
            assert fa == a["fused_ops"], f"{where}: {fa} launches of our kernel for {a['fused_ops']} op calls"
        lines.append(f"{where:52s} ours {fa}/{fb}  kernels {a['gpu_us']['kernels']}/{b['gpu_us']['kernels']}"
                     f"  graph launches {a['graph_launches']}/{b['graph_launches']}")  # fmt: skip
    assert saw_two or pair, (
        f"no mixed step launched our kernel twice per layer: {[(s['name'], _fused(s, gpu)) for s in son]}"
    )
    if gpu and not on["case"]["compiled"]:
        for a, b in zip(son, soff, strict=True):
            if a["kind"] == "decode":
                assert a["gpu_us"]["kernels"] <= b["gpu_us"]["kernels"] - L, (
                    f"eager decode step {a['index']}: {a['gpu_us']['kernels']} kernels with the plugin, "
                    f"{b['gpu_us']['kernels']} without; expected at least one fewer per layer"
                )
    return "\n".join(["step (on/off)"] + lines)


def check_host_syncs(on: dict, off: dict, gpu: bool = True) -> str:
    """vLLM's own sync check (engine_worker.py, ``VLLM_GPU_SYNC_CHECK=warn``; armed on CUDA only)
    over the probe's steps: no GPU<->CPU sync warned about with the plugin's code in the stack, and
    no more syncs with the plugin than without (vLLM's own, if any, happen on both sides). On a GPU,
    each engine's deliberate sync (``sync_check_control``) must have been recorded: the check saw."""
    if on.get("sync_check") is None or off.get("sync_check") is None:
        raise AssertionError("the engines ran without vLLM's sync check (VLLM_GPU_SYNC_CHECK)")
    if gpu:
        controls = (on.get("sync_check_control"), off.get("sync_check_control"))
        assert controls == (1, 1), f"the sync check recorded {controls} of the engines' one deliberate sync each"
    ours = [w for w in on["host_syncs"] if "vllm_mla_fusion" in w]
    assert not ours, f"the plugin's code synchronized with the GPU inside a step: {ours[:3]}"
    assert len(on["host_syncs"]) <= len(off["host_syncs"]), (
        f"{len(on['host_syncs'])} sync warnings with the plugin, {len(off['host_syncs'])} without: "
        f"{on['host_syncs'][:3]}"
    )
    return f"sync warnings {len(on['host_syncs'])} on / {len(off['host_syncs'])} off (mode {on['sync_check']})"


def kernel_reading(on: dict, off: dict, kind: str = "decode") -> str:
    """The on/off kernel lists of the first closed step of ``kind``, side by side."""
    a = next((s for s in on["census"]["steps"] if s["closed"] and s["kind"] == kind), None)
    b = next((s for s in off["census"]["steps"] if s["closed"] and s["kind"] == kind), None)
    if a is None or b is None:
        return f"(no closed {kind} step)"
    names = sorted(set(a["kernels"]) | set(b["kernels"]), key=lambda k: (-(a["kernels"].get(k, 0)), k))
    lines = [f"{kind} step {a['name']}: kernel launches on / off"]
    for k in names:
        x, y = a["kernels"].get(k, 0), b["kernels"].get(k, 0)
        mark = "  " if x == y else ("+ " if x > y else "- ")
        lines.append(f"  {mark}{x:4d} {y:4d}  {k[:110]}")
    lines.append(f"  total {sum(a['kernels'].values())} / {sum(b['kernels'].values())}; GPU us on {a['gpu_us']} "
                 f"off {b['gpu_us']}")  # fmt: skip
    return "\n".join(lines)
