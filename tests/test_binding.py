"""binding.BoundOp: validate a layout once, then only check that a call has that layout.

The reuse rule is what lets the plugin skip validation per step; these tests check that it
never lets a call through that validation would refuse, that bad input still fails before
anything is written, and that results stay the reference's.
"""

from __future__ import annotations

import pytest
import torch

from vllm_mla_fusion import binding, validation
from vllm_mla_fusion.binding import BoundOp
from vllm_mla_fusion.opcodes import OP_DECODE, OP_PREFILL, OP_ROPE_CACHE

from .conftest import OP_BACKENDS
from .mla_cases import make_case
from .mla_reference import check_decode_rope_cache_write, check_prefill_rope_cache_write, check_rope_cache_write


def _rope_args(c):
    return (c.positions, c.q_pe, c.k_pe, c.kv_c, c.cos_sin_cache, c.slot_mapping, c.kv_cache, c.kv_cache_scale)


def _decode_args(c):
    return (*_rope_args(c), c.ql_nope, c.q_out, c.q_scale)


def _prefill_args(c):
    return (*_rope_args(c), c.k_nope, c.k_out, None)


@pytest.fixture
def validations(monkeypatch):
    """Counts full validations per op."""
    counts = {OP_ROPE_CACHE: 0, OP_DECODE: 0, OP_PREFILL: 0}
    for op, name in ((OP_ROPE_CACHE, "check_rope_cache_write"), (OP_DECODE, "check_decode_rope_cache_write"),
                     (OP_PREFILL, "check_prefill_rope_cache_write")):  # fmt: skip
        original = getattr(validation, name)

        def counted(*a, _o=original, _op=op):
            counts[_op] += 1
            return _o(*a)

        monkeypatch.setattr(validation, name, counted)
    return counts


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_one_validation_per_layout_across_token_counts_and_results_stay_exact(backend, validations):
    bound = BoundOp(OP_ROPE_CACHE, is_neox=False, backend=backend)
    for step, T in enumerate((5, 1, 9, 5)):
        # Same layout every step (strides independent of T): fresh data, fresh addresses.
        c = make_case(T=T, H=3, strided=False, seed=10 + step)
        bound(*_rope_args(c))
        check_rope_cache_write(c)
    assert validations[OP_ROPE_CACHE] == 1
    assert bound.backend_of(*_rope_args(c)) == backend


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("op", [OP_DECODE, OP_PREFILL])
def test_decode_and_prefill_ops_reuse_their_layout(backend, op, validations):
    bound = BoundOp(op, is_neox=True, backend=backend)
    args, check = (_decode_args, check_decode_rope_cache_write) if op == OP_DECODE else \
        (_prefill_args, check_prefill_rope_cache_write)  # fmt: skip
    for step, T in enumerate((4, 7)):
        c = make_case(T=T, H=2, is_neox=True, strided=False, decode=op == OP_DECODE, prefill=op == OP_PREFILL,
                      seed=20 + step)  # fmt: skip
        bound(*args(c))
        check(c)
    assert validations[op] == 1


def test_a_new_layout_is_validated_again(validations):
    bound = BoundOp(OP_ROPE_CACHE, is_neox=False, backend="torch")
    bound(*_rope_args(make_case(T=4, H=2, strided=False, seed=1)))
    bound(*_rope_args(make_case(T=4, H=2, strided=True, seed=2)))  # other strides
    bound(*_rope_args(make_case(T=4, H=4, strided=False, seed=3)))  # other head count
    bound(*_rope_args(make_case(T=4, H=2, strided=False, act_dtype=torch.float16, seed=4)))
    assert validations[OP_ROPE_CACHE] == 4
    bound(*_rope_args(make_case(T=6, H=2, strided=True, seed=5)))  # a layout seen before
    assert validations[OP_ROPE_CACHE] == 4


def _poisoned(c):
    """Snapshots of everything the op may write, to check that a refused call wrote nothing."""
    return [t.clone() for t in (c.q_pe, c.k_pe, c.kv_cache)]


@pytest.mark.parametrize("bad", ["k_pe rows", "kv_c rows", "short positions", "short slot_mapping", "kv_c dtype",
                                 "cache width", "scale dtype", "not a tensor", "k_pe heads"])  # fmt: skip
def test_bad_input_after_a_good_call_still_fails_before_writing(bad):
    bound = BoundOp(OP_ROPE_CACHE, is_neox=False, backend="torch", kv_cache_dtype="auto")
    good = make_case(T=6, H=2, strided=False, seed=7)
    bound(*_rope_args(good))
    c = make_case(T=6, H=2, strided=False, seed=8)
    args = list(_rope_args(c))
    error, name = ValueError, None
    if bad == "k_pe rows":
        args[2], name = torch.cat((c.k_pe, c.k_pe[:1])), "k_pe"
    elif bad == "kv_c rows":
        args[3], name = c.kv_c[:5], "kv_c"
    elif bad == "short positions":
        args[0], name = c.positions[:5], "positions"
    elif bad == "short slot_mapping":
        args[5], name = c.slot_mapping[:5], "slot_mapping"
    elif bad == "kv_c dtype":
        args[3], error, name = c.kv_c.float(), TypeError, "kv_c"
    elif bad == "cache width":
        args[6], name = torch.zeros(*c.kv_cache.shape[:2], c.kv_cache.shape[2] + 2, dtype=c.kv_cache.dtype), "kv_cache"
    elif bad == "scale dtype":
        args[7], error, name = torch.ones(1, dtype=torch.float64), TypeError, "kv_cache_scale"
    elif bad == "not a tensor":
        args[1], error, name = c.q_pe.tolist(), TypeError, "q_pe"
    else:
        args[2], name = c.k_pe.unsqueeze(1).expand(-1, 2, -1), "k_pe"
    before = _poisoned(c)
    with pytest.raises(error, match=name):
        bound(*args)
    for t, snapshot in zip((c.q_pe, c.k_pe, c.kv_cache), before):
        assert torch.equal(t.view(torch.uint8), snapshot.view(torch.uint8))


def test_backend_and_debug_are_read_when_bound_not_per_call(monkeypatch):
    """The plugin's per-step path reads no environment: a BoundOp keeps what it was given."""
    monkeypatch.delenv("VLLM_MLA_FUSION_DEBUG", raising=False)
    bound = BoundOp(OP_ROPE_CACHE, is_neox=False, backend="torch")
    c = make_case(T=3, H=2, strided=False, seed=30)
    bound(*_rope_args(c))
    monkeypatch.setenv("VLLM_MLA_FUSION_BACKEND", "no-such-backend")
    monkeypatch.setenv("VLLM_MLA_FUSION_DEBUG", "1")
    c = make_case(T=3, H=2, strided=False, seed=31)
    c.slot_mapping[0] = 10**6  # past the cache: only debug mode would raise
    bound(*_rope_args(c))
    check_rope_cache_write(c)
    debug = BoundOp(OP_ROPE_CACHE, is_neox=False, backend="torch", debug=True)
    with pytest.raises(ValueError, match="slot_mapping"):
        debug(*_rope_args(c))


def test_layouts_kept_are_bounded(monkeypatch):
    monkeypatch.setattr(BoundOp, "MAX_SITES", 3)
    bound = BoundOp(OP_ROPE_CACHE, is_neox=False, backend="torch")
    for H in range(1, 8):
        bound(*_rope_args(make_case(T=2, H=H, strided=False, seed=H)))
    assert 1 <= len(bound.sites) <= 3


def test_zero_tokens_validates_and_launches_nothing(monkeypatch):
    calls = []
    real_load = binding.dispatch.load

    def load(name):
        module = real_load(name)

        class Recorder:
            @staticmethod
            def bind(*a):
                return lambda *args: calls.append(args)

        return Recorder if module else module

    monkeypatch.setattr(binding.dispatch, "load", load)
    c = make_case(T=0, H=2, strided=False, seed=40)
    BoundOp(OP_ROPE_CACHE, is_neox=False, backend="torch")(*_rope_args(c))
    assert calls == []
    with pytest.raises(ValueError, match="op"):
        BoundOp(4, is_neox=False)


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_key_start_varies_per_call_on_one_layout(backend, validations):
    """key_start is per step (a mixed batch's decode tokens): one validation for the layout, each
    call's key rows checked, results the reference's."""
    bound = BoundOp(OP_PREFILL, is_neox=False, backend=backend)
    for step, (T, s) in enumerate(((6, 2), (6, 0), (9, 5), (3, 3))):
        c = make_case(T=T, H=2, strided=False, prefill=True, key_start=s, seed=50 + step)
        bound(*_prefill_args(c), s)
        check_prefill_rope_cache_write(c)
    assert validations[OP_PREFILL] == 1


@pytest.mark.parametrize("bad", ["rows of another key_start", "negative", "past T", "bool", "float"])
def test_a_bad_key_start_after_a_good_call_still_fails_before_writing(bad):
    bound = BoundOp(OP_PREFILL, is_neox=False, backend="torch")
    bound(*_prefill_args(make_case(T=6, H=2, strided=False, prefill=True, key_start=2, seed=60)), 2)
    c = make_case(T=6, H=2, strided=False, prefill=True, key_start=2, seed=61)  # key rows of 4 tokens
    key_start, error, words = {
        "rows of another key_start": (1, ValueError, "k_nope must have shape"),
        "negative": (-2, ValueError, "key_start must be in"),  # T - key_start would match no rows either
        "past T": (8, ValueError, "key_start must be in"),
        "bool": (True, TypeError, "key_start must be an int"),
        "float": (2.0, TypeError, "key_start must be an int"),
    }[bad]
    before = [t.clone() for t in (c.q_pe, c.k_pe, c.kv_cache, c.k_out)]
    with pytest.raises(error, match=words):
        bound(*_prefill_args(c), key_start)
    for t, snapshot in zip((c.q_pe, c.k_pe, c.kv_cache, c.k_out), before):
        assert torch.equal(t.view(torch.uint8), snapshot.view(torch.uint8))


@pytest.mark.parametrize("op", [OP_ROPE_CACHE, OP_DECODE])
@pytest.mark.parametrize("key_start", [1, 0.0, False])
def test_key_start_belongs_to_the_prefill_op_only(op, key_start):
    """Anything but the int 0 on ops 1 and 2 is refused, also on a layout already validated (a
    float 0.0 would otherwise reach the launcher as a float)."""
    bound = BoundOp(op, is_neox=False, backend="torch")
    c = make_case(T=4, H=2, strided=False, decode=op == OP_DECODE, seed=70)
    args = _decode_args(c) if op == OP_DECODE else (*_rope_args(c), None, None, None)
    bound(*args)  # a layout validated with key_start 0
    before = c.kv_cache.clone()
    with pytest.raises(ValueError, match="key_start applies to mla_prefill_rope_cache_write only"):
        bound(*args, key_start)
    assert torch.equal(c.kv_cache, before)


# --- early index loads (issue 41, S2): a promise of the caller's, never of the public ops ----------

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _no_wait(USE_PDL: tl.constexpr):
        """The kernel's grid-dependency wait (``_wait_for_inputs``) in Triton's interpreter, which
        has no ``griddepcontrol``: nothing to wait for there."""
        pass

    _WAITS: list = []

    @triton.jit
    def _counted_wait(USE_PDL: tl.constexpr):
        """_no_wait, counting its calls (the interpreter runs a jitted function as Python)."""
        _WAITS.append(USE_PDL)

except ImportError:  # no Triton: its tests are skipped
    _no_wait = _counted_wait = None


def _triton_sites(bound: BoundOp) -> list:
    return [site for site, name in bound.sites.values() if name == "triton"]


@pytest.mark.skipif("triton" not in OP_BACKENDS, reason="the Triton kernel in its interpreter")
def test_the_public_ops_never_promise_early_index_loads(monkeypatch):
    """The public ops bind without binding.py's ``early_index_loads`` promise (a user may write
    the positions with the kernel launched just before the call): on an sm_90 GPU (programmatic
    dependent launch, simulated here) their launches read nothing before the grid-dependency
    wait. A BoundOps made with the promise (the vLLM plugin's) hands it to every launch."""
    import vllm_mla_fusion as mla
    from vllm_mla_fusion.backends import triton as tb

    binding._SHARED.clear()
    c = make_case(T=5, H=2, strided=False, seed=51)
    mla.mla_rope_cache_write(*c.rope_args(), backend="triton")
    c = make_case(T=5, H=2, strided=False, decode=True, seed=52)
    mla.mla_decode_rope_cache_write(*c.decode_args(), backend="triton")
    c = make_case(T=5, H=2, strided=False, prefill=True, seed=53)
    mla.mla_prefill_rope_cache_write(*c.prefill_args(), backend="triton")
    public = [bound for table in binding._SHARED.values() for bound in table._ops.values()]
    assert len(public) == 3 and not any(bound.early_index_loads for bound in public)
    promised = binding.BoundOps("triton", early_index_loads=True)
    for op, args, kind in ((OP_ROPE_CACHE, _rope_args, {}), (OP_DECODE, _decode_args, dict(decode=True)),
                           (OP_PREFILL, _prefill_args, dict(prefill=True))):  # fmt: skip
        bound = promised.get(op, "auto", False)
        assert bound.early_index_loads is True
        bound(*args(make_case(T=5, H=2, strided=False, seed=54, **kind)))
    monkeypatch.setattr(tb, "_pdl_ok", lambda device: True)  # as on an H100/H200
    for bounds, early in ((public, False), (promised._ops.values(), True)):
        sites = [site for bound in bounds for site in _triton_sites(bound)]
        assert len(sites) == 3
        for site in sites:
            c = site.plan(6).constexprs  # a token count not planned yet: decided with PDL on
            assert c["USE_PDL"] is True and c["EARLY_INDEX_LOADS"] is early and site.early_index_loads is early


# The layouts the early-ordered kernel runs on: padding, clamped positions, strides, NeoX, fp8
# with a scale, int32 indices, latent widths past one tile.
EARLY_CASES = [
    dict(T=9, H=3),
    dict(T=7, H=2, is_neox=True, positions="out_of_range", pad_every=2, index_dtype=torch.int32),
    dict(T=6, H=4, cache_dtype=torch.uint8, kv_cache_dtype="fp8", scale=0.37, block_size=1),
    dict(T=5, H=2, L=640, block_pad=8, k_pe_3d=True),
]


@pytest.mark.skipif("triton" not in OP_BACKENDS, reason="the Triton kernel in its interpreter")
@pytest.mark.parametrize("layout", EARLY_CASES, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("op", [OP_ROPE_CACHE, OP_DECODE, OP_PREFILL])
def test_early_index_loads_change_no_byte(monkeypatch, op, layout):
    """The kernel's early-index-loads order (positions, slots and the rope table before the
    grid-dependency wait, the data after) computes exactly what its usual order computes: run
    in the interpreter as on sm_90 (programmatic dependent launch simulated, its wait a no-op
    there), every output byte-identical to a launch without the promise, and the reference's."""
    from vllm_mla_fusion.backends import triton as tb

    monkeypatch.setattr(tb, "_pdl_ok", lambda device: True)
    monkeypatch.setattr(tb, "_wait_for_inputs", _no_wait)
    args, check = {OP_ROPE_CACHE: (_rope_args, check_rope_cache_write),
                   OP_DECODE: (_decode_args, check_decode_rope_cache_write),
                   OP_PREFILL: (_prefill_args, check_prefill_rope_cache_write)}[op]  # fmt: skip
    fp8_query = op == OP_DECODE and "scale" in layout
    kind = dict(decode=op == OP_DECODE, prefill=op == OP_PREFILL,
                q_out_dtype=torch.float8_e4m3fn if fp8_query else None, q_scale=0.7 if fp8_query else None)
    outputs = []
    for promised in (False, True):
        c = make_case(seed=61, **layout, **kind)
        bound = BoundOp(op, is_neox=c.is_neox, kv_cache_dtype=c.kv_cache_dtype, backend="triton",
                        early_index_loads=promised)  # fmt: skip
        bound(*args(c))
        (site,) = _triton_sites(bound)
        assert site.plan(c.q_pe.shape[0]).constexprs["EARLY_INDEX_LOADS"] is promised
        check(c)
        outputs.append([t.view(torch.uint8) if t.dtype.itemsize == 1 else t
                        for t in (c.q_pe, c.k_pe, c.kv_cache, c.q_out, c.k_out) if t is not None])  # fmt: skip
    for default, early in zip(*outputs, strict=True):
        assert torch.equal(default, early)


@pytest.mark.skipif("triton" not in OP_BACKENDS, reason="the Triton kernel in its interpreter")
@pytest.mark.parametrize("layout", EARLY_CASES, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("op", [OP_ROPE_CACHE, OP_DECODE, OP_PREFILL])
def test_small_forced_tiles_wait_once(monkeypatch, op, layout):
    """With small tiles (many programs of each kind) and the early index loads (programmatic
    dependent launch simulated): every program waits exactly once, and the outputs are the
    reference's."""
    from vllm_mla_fusion.backends import triton as tb

    monkeypatch.setattr(tb, "_pdl_ok", lambda device: True)
    monkeypatch.setattr(tb, "_wait_for_inputs", _counted_wait)
    args, check = {OP_ROPE_CACHE: (_rope_args, check_rope_cache_write),
                   OP_DECODE: (_decode_args, check_decode_rope_cache_write),
                   OP_PREFILL: (_prefill_args, check_prefill_rope_cache_write)}[op]  # fmt: skip
    c = make_case(seed=62, **layout, decode=op == OP_DECODE, prefill=op == OP_PREFILL)
    bound = BoundOp(op, is_neox=c.is_neox, kv_cache_dtype=c.kv_cache_dtype, backend="triton", early_index_loads=True)
    cfg = dict(BLOCK_T=2, BLOCK_ROWS=4, BLOCK_H=2, num_warps=4, USE_PDL=True)
    _WAITS.clear()
    with tb.forced_launch_config(cfg):
        bound(*args(c))
        (site,) = _triton_sites(bound)
        plan = site.plan(c.q_pe.shape[0])
    assert plan.constexprs["EARLY_INDEX_LOADS"] is True and plan.grid > 3
    assert len(_WAITS) == plan.grid  # one wait per program
    check(c)
