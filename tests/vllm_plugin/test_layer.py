"""A DeepSeek-V3-shaped MLA layer built by vLLM, plugin on versus off, over a schedule of steps.

Tolerance contract (bf16 model):

- latent part of every written cache row (``kv_c_normed``): bit-identical,
  both paths copy the same bf16 values;
- rope part of a written row and the rotated query: vLLM's native RoPE
  rounds each bf16 product and sum, the fused op computes in float32 and
  rounds once, so each value may differ by about one bf16 ulp of its
  rotation pair's norm; the bound is 2^-6 times that norm (two ulps);
- cache rows no slot names: bit-identical to the canary they started with;
- attention outputs: those rounding differences, carried through softmax and
  two projections, stay within a few ulps of the largest output:
  2^-6 relative plus 2^-6 times the largest magnitude.
"""

from __future__ import annotations

import copy

import pytest
import torch

from demo import cpu_stand_ins
from vllm_mla_fusion import dispatch

from . import harness as H

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

L, R = 512, 64
HIDDEN = H.DSV3_CONFIG["hidden_size"]


def rope_pair_norm(x: torch.Tensor) -> torch.Tensor:
    """Per element, the norm of its GPT-J rotation pair (DeepSeek rotates interleaved pairs)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    return pairs.norm(dim=-1, keepdim=True).expand_as(pairs).flatten(-2)


def assert_rope_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    tol = 2.0**-6 * torch.maximum(rope_pair_norm(got), rope_pair_norm(want)) + 2.0**-20
    err = (got.float() - want.float()).abs()
    assert (err <= tol).all(), f"{what}: worst error {err.max().item()} (tolerance there {tol.flatten()[err.argmax()]})"


def assert_output_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    bound = 2.0**-6 * want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-6, atol=bound, msg=lambda m: f"{what}: {m}")


def schedule() -> tuple[dict[int, H.Request], list[H.Step]]:
    """A prefill, decodes, a mixed batch, decodes + a chunked prefill, padded batches."""
    requests = {
        0: H.Request([5, 2, 9, 12]),
        1: H.Request([0, 7, 3, 14]),
        2: H.Request([1, 10, 4, 6]),
        3: H.Request([11, 8, 13, 15]),
    }
    steps = [
        H.Step("prefill", [(0, 13), (1, 29)]),
        H.Step("decode", [(0, 1), (1, 1)]),
        H.Step("decode", [(0, 1), (1, 1)]),
        H.Step("mixed", [(0, 1), (1, 1), (2, 20)]),
        H.Step("decode+chunked prefill", [(0, 1), (1, 1), (2, 15)]),
        H.Step("padded decode", [(0, 1), (1, 1), (2, 1)], pad_to=8),
        H.Step("padded mixed", [(0, 1), (2, 1), (3, 7)], pad_to=16),
    ]
    return requests, steps


def take_all(counters) -> int:
    return sum(c.take() for c in counters)


class Counter:
    """Counts calls of a function it replaces, by attribute, for the duration of a test."""

    def __init__(self, monkeypatch, owner, name: str):
        self.calls = 0
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    def take(self) -> int:
        n, self.calls = self.calls, 0
        return n


class LaunchCounter:
    """Counts a backend's launches per op (1, 2, 3): wraps each site its ``bind`` returns."""

    def __init__(self, monkeypatch, backend_module):
        self.calls = {1: 0, 2: 0, 3: 0}
        original = backend_module.bind

        def bind(p, op, *rest):
            site = original(p, op, *rest)

            def counted(*args):
                self.calls[op] += 1
                return site(*args)

            return counted

        monkeypatch.setattr(backend_module, "bind", bind)

    def of(self, op: int):
        counter = self

        class One:
            @staticmethod
            def take() -> int:
                n, counter.calls[op] = counter.calls[op], 0
                return n

        return One


# (fused mode, q_lora_rank, prefill key fused, backend takes the decode pair as it is):
# DeepSeek-V3 (q_lora_rank 1536) in both modes, the DeepSeek-V2-Lite layout without a q
# LoRA (q_proj instead of q_a/q_b projections), decode mode with vLLM building the prefill
# key (op 1 + its concat), and decode mode as on FLASH_ATTN_MLA / CUTLASS_MLA, whose
# forward_mqa takes (ql_nope, q_pe) unconcatenated (CPU_MLA stands in: it concatenates
# a pair itself).
# "decode+graph-rope": decode mode with VLLM_MLA_FUSION_GRAPH_ROPE=1 and piecewise graphs configured;
# its schedule alternates steps that capture or replay piecewise graphs (op 1 in the graph op,
# vLLM's forward_impl as is) with steps that run without graphs (decode mode as usual).
LAYOUTS = [("decode", 1536, True, False), ("rope_cache", 1536, False, False), ("decode", None, True, False),
           ("decode", 1536, False, False), ("decode", 1536, True, True), ("decode", 1536, False, True),
           ("decode+graph-rope", 1536, True, False), ("decode+graph-rope", 1536, True, True)]  # fmt: skip
LAYOUT_IDS = ["decode", "rope_cache", "decode-no-q-lora", "decode-prefill-key-off", "decode-pair-backend",
              "decode-pair-backend-prefill-key-off", "decode-graph-rope", "decode-pair-backend-graph-rope"]  # fmt: skip


@pytest.fixture
def layer_pair(vllm_cpu, plugin_off, monkeypatch, request):
    """(vLLM's layer, the plugin's layer) with the same random weights and canary-filled caches."""
    from vllm_mla_fusion.vllm_plugin import register

    mode, q_lora_rank, prefill_key, pair_backend, *backend = request.param
    if backend:  # read when the layer is built (eligibility.load_backend) and at every call (dispatch)
        monkeypatch.setenv("VLLM_MLA_FUSION_BACKEND", backend[0])
    hf_config = copy.copy(vllm_cpu.model_config.hf_config)
    hf_config.q_lora_rank = q_lora_rank
    off = vllm_cpu.build_attention(hf_config)
    state = vllm_cpu.finish_weights(off, seed=0)
    if mode == "rope_cache":
        monkeypatch.setenv("VLLM_MLA_FUSION_DECODE", "0")
    elif prefill_key:
        monkeypatch.setenv("VLLM_MLA_FUSION_PREFILL_KEY", "1")  # op 3 is opt-in; the others test the default
    graph_rope = mode == "decode+graph-rope"
    if graph_rope:
        from vllm.config import CUDAGraphMode

        monkeypatch.setenv("VLLM_MLA_FUSION_GRAPH_ROPE", "1")
        monkeypatch.setattr(vllm_cpu.config.compilation_config, "cudagraph_mode", CUDAGraphMode.FULL_AND_PIECEWISE)
        mode = "decode"
    if pair_backend:
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

        from vllm_mla_fusion.vllm_plugin import eligibility

        monkeypatch.setattr(eligibility, "_DECODE_PAIR_BACKENDS", {(CPUMLAImpl.__module__, CPUMLAImpl.__qualname__)})
    register()
    on = vllm_cpu.build_attention(hf_config)
    vllm_cpu.finish_weights(on, state)
    assert type(off.mla_attn).__name__ == "MultiHeadLatentAttentionWrapper"
    assert on.mla_attn.fusion_mode == mode
    assert getattr(on.mla_attn.mla_attn, "_prefill_key_fused", False) == prefill_key
    if mode == "decode":
        assert on.mla_attn.mla_attn._decode_assembles_query == (not pair_backend)
        assert on.mla_attn.mla_attn._graph_rope == graph_rope
    assert (on.mla_attn.q_proj is None) == (q_lora_rank is not None)
    for attn in (off, on):
        H.mla_layer(attn)[1].bind_kv_cache(H.new_kv_cache(seed=7))
    return off, on


@pytest.mark.parametrize("layer_pair", LAYOUTS, ids=LAYOUT_IDS, indirect=True)
def test_schedule_matches_vllm(vllm_cpu, layer_pair, monkeypatch):
    from vllm_mla_fusion.backends import reference

    _run_schedule(vllm_cpu, layer_pair, monkeypatch, reference)


# The same schedule with the Triton kernel (in its interpreter on a CPU): the plugin's calls reach
# the kernel with vLLM's real strides, slot mappings and padding. Decode mode with the prefill key
# runs ops 2 and 3, without it ops 1 and 2; on a backend taking the decode pair, op 3 alone (mixed
# steps with key_start); rope_cache mode op 1 over the padded batch. ~4 s each.
TRITON_LAYOUTS = [("decode", 1536, True, False, "triton"), ("decode", 1536, False, False, "triton"),
                  ("decode", 1536, True, True, "triton"), ("rope_cache", 1536, False, False, "triton")]  # fmt: skip


@pytest.mark.parametrize("layer_pair", TRITON_LAYOUTS,
                         ids=["decode", "decode-prefill-key-off", "decode-pair-backend", "rope_cache"],
                         indirect=True)  # fmt: skip
def test_schedule_matches_vllm_with_the_triton_kernel(vllm_cpu, layer_pair, monkeypatch):
    if not dispatch.triton_interpreting() and not torch.cuda.is_available():
        raise AssertionError("tests/conftest.py runs Triton in its interpreter on a CPU; TRITON_INTERPRET is off")
    from vllm_mla_fusion.backends import reference
    from vllm_mla_fusion.backends import triton as triton_backend

    names = ("rope_cache_write", "decode_rope_cache_write", "prefill_rope_cache_write")
    untouched = [Counter(monkeypatch, reference, name) for name in names]
    _run_schedule(vllm_cpu, layer_pair, monkeypatch, triton_backend)
    assert take_all(untouched) == 0, "the torch backend ran instead of the Triton kernel"


def _run_schedule(vllm_cpu, layer_pair, monkeypatch, backend_module):
    from vllm.config import CUDAGraphMode

    off, on = layer_pair
    mode = on.mla_attn.fusion_mode
    prefill_key = getattr(on.mla_attn.mla_attn, "_prefill_key_fused", False)
    assembles = getattr(on.mla_attn.mla_attn, "_decode_assembles_query", False)
    graph_rope = getattr(on.mla_attn.mla_attn, "_graph_rope", False)
    from vllm.model_executor.layers.attention.mla_attention import MLACommonBaseImpl
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    # vLLM caches rope modules by parameters, so both layers may share one.
    ropes = {id(a.rotary_emb): a.rotary_emb for a in (off, on)}
    rope_counters = [Counter(monkeypatch, rope, "forward") for rope in ropes.values()]
    vllm_cache_writes = Counter(monkeypatch, CPUMLAImpl, "do_kv_cache_update")
    fused = LaunchCounter(monkeypatch, backend_module)
    fused_rope_cache, fused_decode, fused_prefill = (fused.of(op) for op in (1, 2, 3))
    # vLLM's key concat: the step's own prefill tokens, plus one per chunk of cached context.
    vllm_key_concat = Counter(monkeypatch, MLACommonBaseImpl, "_concat_k_nope_k_pe")

    caches = {name: H.mla_layer(a)[1].kv_cache for name, a in (("off", off), ("on", on))}
    builder = vllm_cpu.builder([H.mla_layer(a)[1].layer_name for a in (off, on)])
    requests, steps = schedule()
    written = torch.zeros(caches["off"].shape[:2], dtype=torch.bool)
    canary = caches["off"].clone()
    g = torch.Generator().manual_seed(3)
    for index, step in enumerate(steps):
        # Graph-rope layers: every other step as if piecewise graphs were captured or replayed.
        in_graph = graph_rope and index % 2 == 0
        common = H.prepare_step(step, requests)
        with vllm_cpu.active():
            metadata = builder.build(0, common)
        num_decode, T = metadata.num_decode_tokens, step.num_tokens
        hidden = torch.randn((step.positions.numel(), HIDDEN), generator=g).to(H.DTYPE)

        cpu_stand_ins.DECODE_QUERIES.clear()
        want = H.run_step(vllm_cpu, off, metadata, step, hidden)
        queries_off = list(cpu_stand_ins.DECODE_QUERIES)
        assert (take_all(rope_counters), vllm_cache_writes.take()) == (1, 1), step.name
        assert (fused_rope_cache.take(), fused_decode.take(), fused_prefill.take()) == (0, 0, 0), step.name
        concats_off = vllm_key_concat.take()
        if step.name == "decode+chunked prefill":
            assert concats_off >= 2, "the chunked prefill must read its context back from the cache"

        cpu_stand_ins.DECODE_QUERIES.clear()
        got = H.run_step(vllm_cpu, on, metadata, step, hidden,
                         cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE if in_graph else None)  # fmt: skip
        queries_on = list(cpu_stand_ins.DECODE_QUERIES)
        # Launches of the fused ops, and no separate RoPE or cache write.
        assert (take_all(rope_counters), vllm_cache_writes.take()) == (0, 0), step.name
        has_prefill, has_decode = T > num_decode, num_decode > 0
        if in_graph:
            # Op 1 over the padded batch in the graph op; vLLM's forward_impl does the rest as without us.
            expected = (1, 0, 0)
        elif mode == "decode":
            # (op 1, op 2, op 3): prefill rows through op 3, or op 1 when vLLM builds the key.
            # The decode rows, when the backend takes the pair as it is, join op 3's launch
            # (key_start) if there is one, else op 1's, which also takes the prefill rows when
            # vLLM builds the key: one launch per step.
            op3 = has_prefill and prefill_key
            op1_rows = (has_prefill and not prefill_key) or (has_decode and not assembles and not op3)
            expected = (int(op1_rows), int(has_decode and assembles), int(op3))
        else:
            expected = (1, 0, 0)
        assert (fused_rope_cache.take(), fused_decode.take(), fused_prefill.take()) == expected, step.name
        # With op 3, vLLM no longer builds the step's own key; context chunks still use its concat.
        assert vllm_key_concat.take() == concats_off - int(has_prefill and prefill_key and not in_graph), step.name

        assert_output_close(got[:T], want[:T], f"{step.name}: attention output")
        # The decode query the backend's decode kernel received.
        assert len(queries_on) == len(queries_off) == int(has_decode), step.name
        for q_on, q_off in zip(queries_on, queries_off, strict=True):
            assert q_on.shape == q_off.shape == (num_decode, 4, L + R)
            assert torch.equal(q_on[..., :L], q_off[..., :L]), f"{step.name}: decode query latent part"
            assert_rope_close(q_on[..., L:], q_off[..., L:], f"{step.name}: decode query rope part")

        # The cache: every row this step wrote, and nothing else.
        slots = step.slots[:T]
        blocks, offsets = slots // H.BLOCK_SIZE, slots % H.BLOCK_SIZE
        written[blocks, offsets] = True
        rows_on, rows_off = caches["on"][blocks, offsets], caches["off"][blocks, offsets]
        assert torch.equal(rows_on[:, :L], rows_off[:, :L]), f"{step.name}: cache latent part"
        assert_rope_close(rows_on[:, L:], rows_off[:, L:], f"{step.name}: cache rope part")
        for name, cache in caches.items():
            untouched = ~written
            assert torch.equal(cache[untouched], canary[untouched]), f"{step.name}: {name} wrote elsewhere"


@pytest.mark.parametrize("layer_pair", [TRITON_LAYOUTS[0], TRITON_LAYOUTS[3]], ids=["decode", "rope_cache"],
                         indirect=True)  # fmt: skip
def test_fused_layers_bind_their_ops_with_the_early_index_loads_promise(vllm_cpu, layer_pair, monkeypatch):
    """A fused layer's ops are bound with binding.py's ``early_index_loads`` promise
    (custom_ops.EARLY_INDEX_LOADS says why vLLM keeps it), in both modes: on an sm_90 GPU every
    launch they make reads its positions, slots and rope-table rows before the grid-dependency
    wait, with the cache's block size a constexpr. (The public ops never promise it:
    tests/test_binding.py.)"""
    from vllm_mla_fusion.backends import triton as triton_backend
    from vllm_mla_fusion.vllm_plugin import custom_ops

    _, on = layer_pair
    mla = H.mla_layer(on)[1]
    builder = vllm_cpu.builder([mla.layer_name])
    requests, steps = schedule()
    for step, metadata, hidden in H.step_inputs(vllm_cpu, builder, steps[:4], requests, seed=11):
        H.run_step(vllm_cpu, on, metadata, step, hidden)  # a prefill, two decodes, a mixed batch
    assert custom_ops.EARLY_INDEX_LOADS is True and mla._bound_ops.early_index_loads is True
    bound = list(mla._bound_ops._ops.values())
    launches = [site for op in bound for site, _ in op.sites.values()]
    assert bound and all(op.early_index_loads for op in bound)
    assert len(launches) >= (2 if on.mla_attn.fusion_mode == "decode" else 1)  # ops 2 and 3, or op 1
    assert all(isinstance(launch, triton_backend.BoundLaunch) and launch.early_index_loads for launch in launches)
    monkeypatch.setattr(triton_backend, "_pdl_ok", lambda device: True)  # as on an H100/H200
    for launch in launches:
        c = launch.plan(3).constexprs
        assert c["USE_PDL"] is True and c["EARLY_INDEX_LOADS"] is True and c["BLOCK_SIZE"] == H.BLOCK_SIZE


@pytest.mark.parametrize("layer_pair", [TRITON_LAYOUTS[0], TRITON_LAYOUTS[3]], ids=["decode", "rope_cache"],
                         indirect=True)  # fmt: skip
def test_a_models_fused_layers_share_their_launch_plans(vllm_cpu, layer_pair, monkeypatch):
    """Two fused layers of one model (the next layer built as vLLM builds it): every step the
    second runs after the first binds no layout and builds no launch plan of its own, whatever the
    step's token count. Per layer, a step with a new token count (most steps that admit a prompt,
    issue 40) rebuilt the same plan in each of a model's 61 layers; and each first launch of a
    configuration took Triton's own launch path in every layer."""
    from vllm_mla_fusion.backends import triton as triton_backend

    _, first = layer_pair
    second = vllm_cpu.build_attention()
    vllm_cpu.finish_weights(second, seed=1)
    assert H.mla_layer(second)[0].fusion_mode == H.mla_layer(first)[0].fusion_mode
    H.mla_layer(second)[1].bind_kv_cache(H.new_kv_cache(seed=8))
    binds, plans = Counter(monkeypatch, triton_backend, "bind"), Counter(monkeypatch, triton_backend, "_launch_config")
    builder = vllm_cpu.builder([H.mla_layer(a)[1].layer_name for a in (first, second)])
    requests, steps = schedule()
    caches = [H.mla_layer(a)[1].kv_cache for a in (first, second)]
    for step, metadata, hidden in H.step_inputs(vllm_cpu, builder, steps, requests, seed=12):
        H.run_step(vllm_cpu, first, metadata, step, hidden)
        made_by_first = (binds.take(), plans.take())
        before = [c.clone() for c in caches]
        H.run_step(vllm_cpu, second, metadata, step, hidden)
        assert (binds.take(), plans.take()) == (0, 0), f"{step.name}: the second layer bound or planned again"
        if step is steps[0]:
            assert made_by_first[0] >= 1 and made_by_first[1] >= 1, "the first layer's first step binds and plans"
        # Shared launches, each layer's own cache: the second wrote its rows, the first's stayed as they were.
        slots = step.slots[: step.num_tokens]
        blocks, offsets = slots // H.BLOCK_SIZE, slots % H.BLOCK_SIZE
        assert torch.equal(caches[0], before[0]), f"{step.name}: the second layer wrote the first layer's cache"
        assert not torch.equal(caches[1][blocks, offsets], before[1][blocks, offsets]), step.name


@pytest.mark.parametrize("layer_pair", [*LAYOUTS[:2], LAYOUTS[6]], ids=[*LAYOUT_IDS[:2], LAYOUT_IDS[6]], indirect=True)
def test_compiled_forward_matches_eager(vllm_cpu, layer_pair):
    """The fused forward traces into one graph (the ops are custom ops with fakes) and computes the same."""
    off, on = layer_pair
    _, mla = H.mla_layer(on)
    builder = vllm_cpu.builder([mla.layer_name])
    requests, steps = schedule()
    graph_ops: set[str] = set()

    def recording_backend(gm, example_inputs):
        graph_ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()  # each case compiles the same forward anew: earlier cases' entries would hit the cache limit
    compiled = torch.compile(on, backend=recording_backend, fullgraph=True, dynamic=False)
    for step, metadata, hidden in H.step_inputs(vllm_cpu, builder, steps[:4], requests, seed=5):  # prefill, decodes, mixed
        before = mla.kv_cache.clone()
        want = H.run_step(vllm_cpu, on, metadata, step, hidden)
        cache_eager = mla.kv_cache.clone()
        mla.kv_cache.copy_(before)
        got = H.run_step(vllm_cpu, compiled, metadata, step, hidden)
        T = step.num_tokens
        # Same ops on the same inputs: only eager-vs-traced op grouping may differ.
        torch.testing.assert_close(got[:T], want[:T], rtol=0, atol=0, msg=lambda m, name=step.name: f"{name}: {m}")
        assert torch.equal(mla.kv_cache, cache_eager), step.name
    # One custom op of ours in the graph; vLLM's separate cache update is not issued.
    fused_op = {
        "decode": "mla_fusion_vllm.mla_attention_with_output",
        "rope_cache": "mla_fusion_vllm.rope_kv_cache_update",
    }[on.mla_attn.fusion_mode]
    assert any(fused_op in t for t in graph_ops), sorted(graph_ops)
    # A graph-rope layer's graph op stands before its attention op (a no-op without piecewise graphs).
    graph_op = any("mla_fusion_vllm.piecewise_rope_kv_cache_update" in t for t in graph_ops)
    assert graph_op == H.mla_layer(on)[1]._graph_rope if on.mla_attn.fusion_mode == "decode" else not graph_op
    assert not any("unified_mla_kv_cache_update" in t for t in graph_ops)


def test_decode_mode_splits_its_attention_op_where_vllm_splits_its_own(vllm_cpu, plugin_on, monkeypatch):
    """Piecewise CUDA graphs must leave the fused attention op eager, as they leave vLLM's."""
    cc = vllm_cpu.config.compilation_config
    monkeypatch.setattr(cc, "splitting_ops", ["vllm::unified_mla_attention_with_output"])
    assert vllm_cpu.build_attention().mla_attn.fusion_mode == "decode"
    assert cc.splitting_ops == ["vllm::unified_mla_attention_with_output", "mla_fusion_vllm::mla_attention_with_output"]
    vllm_cpu.build_attention()
    assert cc.splitting_ops.count("mla_fusion_vllm::mla_attention_with_output") == 1
    # Where vLLM captures its attention op in the graph (full graphs), so is the fused one.
    monkeypatch.setattr(cc, "splitting_ops", [])
    vllm_cpu.build_attention()
    assert cc.splitting_ops == []


@pytest.mark.parametrize("layer_pair", LAYOUTS[:2], ids=LAYOUT_IDS[:2], indirect=True)
def test_no_slot_mapping_entry_writes_nothing(vllm_cpu, layer_pair):
    """As in vLLM: a layer without a slot-mapping entry writes no cache row; its RoPE still happens."""
    from vllm.forward_context import set_forward_context

    off, on = layer_pair
    builder = vllm_cpu.builder([H.mla_layer(a)[1].layer_name for a in (off, on)])
    requests, steps = schedule()
    step = steps[0]  # a prefill: attention uses the step's own (rotated) keys, not the cache
    common = H.prepare_step(step, requests)
    with vllm_cpu.active():
        metadata = builder.build(0, common)
    hidden = torch.randn((step.positions.numel(), HIDDEN), generator=torch.Generator().manual_seed(8)).to(H.DTYPE)
    outs = []
    for attn in (off, on):
        mla = H.mla_layer(attn)[1]
        before = mla.kv_cache.clone()
        with vllm_cpu.active(), set_forward_context({mla.layer_name: metadata}, vllm_cpu.config, slot_mapping={}):
            outs.append(attn(step.positions, hidden, None))
        assert torch.equal(mla.kv_cache, before)
    assert_output_close(outs[1], outs[0], "attention output without a slot mapping")


@pytest.mark.parametrize("layer_pair", [LAYOUTS[4]], ids=[LAYOUT_IDS[4]], indirect=True)
def test_decode_attention_before_the_prefill_key_fails_loudly(vllm_cpu, layer_pair):
    """On a backend that takes the decode pair, a mixed step's decode rows are rotated and cached
    by the prefill op's launch in forward_mha, which vLLM 0.33 runs first. A forward_impl that
    ran the decode attention first would read them un-rotated: it must raise instead."""
    from vllm_mla_fusion.vllm_plugin.attention import _PrefillStep

    _, on = layer_pair
    attn = on.mla_attn.mla_attn
    assert attn._prefill_key_fused and not attn._decode_assembles_query
    attn._steps.prefill = _PrefillStep(*([None] * 9), key_start=2)
    with pytest.raises(RuntimeError, match="decode attention ran before forward_mha built the prefill key"):
        attn.impl.forward_mqa(None, None, None, attn)
    attn._steps.prefill = None


@pytest.mark.parametrize("layer_pair", [LAYOUTS[4]], ids=[LAYOUT_IDS[4]], indirect=True)
def test_an_unexpected_prefill_key_input_writes_nothing_it_cannot_account_for(vllm_cpu, layer_pair):
    """The prefill key's fallback (a key input this step was not prepared for) rotates and caches
    the step's rows itself; when even vLLM's k_pe has other rows than the step's prefill tokens,
    it raises before writing anything."""
    from vllm_mla_fusion.vllm_plugin.attention import _PrefillStep

    _, on = layer_pair
    attn = on.mla_attn.mla_attn
    rows, s, heads = 6, 2, attn.num_heads
    g = torch.Generator().manual_seed(9)
    q = torch.randn((rows, heads, 192), generator=g).to(H.DTYPE)
    kv = torch.randn((rows, L + R), generator=g).to(H.DTYPE)
    before = (attn.kv_cache.clone(), q.clone(), kv.clone())
    attn._steps.prefill = _PrefillStep(torch.arange(rows), q[..., 128:], kv[:, L:].unsqueeze(1), kv[:, :L],
                                       torch.arange(rows), attn.kv_cache, "auto", on.mla_attn.rotary_emb.cos_sin_cache,
                                       False, s)  # fmt: skip
    k_nope = torch.zeros((rows - s, heads + 1, 128), dtype=H.DTYPE)  # another head count: the fallback
    try:
        with pytest.raises(RuntimeError, match="built a key from 3 rows of k_pe for 4 prefill tokens"):
            attn.assemble_prefill_key(k_nope, kv[:3, L:].unsqueeze(1), lambda *a: None)
    finally:
        attn._steps.prefill = None
    for got, want in zip((attn.kv_cache, q, kv), before, strict=True):
        assert torch.equal(got, want)
