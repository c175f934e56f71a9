"""Malformed input is rejected with a ValueError/TypeError naming the argument, before anything is written."""

from __future__ import annotations

import pytest
import torch

import vllm_mla_fusion as mla

from .conftest import OP_BACKENDS
from .mla_cases import make_case

ENTRY_POINTS = ["public", "custom_op"]


def _call(case, entry, backend, decode):
    if decode:
        args = case.decode_args()
        if entry == "public":
            mla.mla_decode_rope_cache_write(*args, backend=backend)
        else:
            torch.ops.mla_fusion.mla_decode_rope_cache_write(*args, True, backend)
    else:
        args = case.rope_args()
        if entry == "public":
            mla.mla_rope_cache_write(*args, backend=backend)
        else:
            torch.ops.mla_fusion.mla_rope_cache_write(*args, backend)


WRITABLE = ("q_pe", "k_pe", "kv_cache", "q_out")


def _live(case):
    """The tensors the op could write, captured before a test swaps in a bad argument."""
    return {name: getattr(case, name) for name in WRITABLE if getattr(case, name) is not None}


def _unchanged(case, live=None):
    for name, t in (live or _live(case)).items():
        assert torch.equal(t.view(torch.uint8), case.originals[name].view(torch.uint8)), f"{name} was written"


# (description, mutation of the case, expected exception, words the message must contain)
ROPE_BAD = [
    ("q_pe rank", lambda c: setattr(c, "q_pe", c.q_pe[:, 0]), ValueError, "q_pe"),
    ("k_pe rows", lambda c: setattr(c, "k_pe", c.k_pe[:-1]), ValueError, "k_pe"),
    ("k_pe two heads", lambda c: setattr(c, "k_pe", torch.stack((c.k_pe, c.k_pe), 1)), ValueError, "k_pe"),
    ("kv_c rows", lambda c: setattr(c, "kv_c", c.kv_c[:-1]), ValueError, "kv_c"),
    ("positions short", lambda c: setattr(c, "positions", c.positions[:2]), ValueError, "positions"),
    ("positions 2-D", lambda c: setattr(c, "positions", c.positions[:, None]), ValueError, "positions"),
    ("slot_mapping short", lambda c: setattr(c, "slot_mapping", c.slot_mapping[:3]), ValueError, "slot_mapping"),
    ("slot_mapping float", lambda c: setattr(c, "slot_mapping", c.slot_mapping.float()), TypeError, "slot_mapping"),
    ("positions float", lambda c: setattr(c, "positions", c.positions.double()), TypeError, "positions"),
    ("q_pe int", lambda c: setattr(c, "q_pe", c.q_pe.to(torch.int32)), TypeError, "q_pe"),
    ("k_pe dtype", lambda c: setattr(c, "k_pe", c.k_pe.half()), TypeError, "k_pe"),
    ("kv_c dtype", lambda c: setattr(c, "kv_c", c.kv_c.float()), TypeError, "kv_c"),
    ("cos_sin dtype", lambda c: setattr(c, "cos_sin_cache", c.cos_sin_cache.half()), TypeError, "cos_sin_cache"),
    ("cos_sin width", lambda c: setattr(c, "cos_sin_cache", c.cos_sin_cache[:, :8]), ValueError, "cos_sin_cache"),
    ("R odd", lambda c: (setattr(c, "q_pe", c.q_pe[..., :15]), setattr(c, "k_pe", c.k_pe[:, :15])), ValueError,
     "rope_dim"),
    ("cache last dim", lambda c: setattr(c, "kv_cache", c.kv_cache[..., :-2]), ValueError, "kv_cache"),
    ("cache rank", lambda c: setattr(c, "kv_cache", c.kv_cache.flatten(0, 1)), ValueError, "kv_cache"),
    ("cache int32", lambda c: setattr(c, "kv_cache", c.kv_cache.view(torch.int16)), TypeError, "kv_cache"),
    ("fp8 name on bf16 cache", lambda c: setattr(c, "kv_cache_dtype", "fp8"), ValueError, "kv_cache_dtype"),
    ("unknown cache dtype name", lambda c: setattr(c, "kv_cache_dtype", "fp8_ds_mla"), ValueError,
     "kv_cache_dtype"),
    ("uint8 cache with auto", lambda c: setattr(c, "kv_cache", c.kv_cache.view(torch.uint8)[..., : c.kv_cache.shape[-1]]),
     ValueError, "kv_cache"),
    ("scale two elements", lambda c: setattr(c, "kv_cache_scale", torch.ones(2)), ValueError, "kv_cache_scale"),
    ("scale float64", lambda c: setattr(c, "kv_cache_scale", torch.ones(1, dtype=torch.float64)), TypeError,
     "kv_cache_scale"),
    ("q_pe meta device", lambda c: setattr(c, "kv_c", c.kv_c.to("meta")), ValueError, "kv_c"),
]


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("what,mutate,exc,words", ROPE_BAD, ids=[b[0] for b in ROPE_BAD])
def test_rope_cache_write_rejects(backend, entry, what, mutate, exc, words):
    case = make_case(T=6, H=2, seed=1)
    live = _live(case)
    mutate(case)
    with pytest.raises(exc, match=words):
        _call(case, entry, backend, decode=False)
    _unchanged(case, live)


def test_fp8_name_must_match_typed_cache():
    case = make_case(T=4, H=2, cache_dtype=torch.float8_e4m3fn, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        mla.mla_rope_cache_write(*case.rope_args())
    _unchanged(case)


DECODE_BAD = [
    ("q_out shape", lambda c: setattr(c, "q_out", c.q_out[..., :-1]), ValueError, "q_out"),
    ("q_out int", lambda c: setattr(c, "q_out", c.q_out.view(torch.int16)), TypeError, "q_out"),
    ("ql_nope heads", lambda c: setattr(c, "ql_nope", c.ql_nope[:, :1]), ValueError, "ql_nope"),
    ("ql_nope dtype", lambda c: setattr(c, "ql_nope", c.ql_nope.float()), TypeError, "ql_nope"),
    ("q_scale shape", lambda c: setattr(c, "q_scale", torch.ones(1, 2)), ValueError, "q_scale"),
    ("q_scale int", lambda c: setattr(c, "q_scale", torch.ones(1, dtype=torch.int32)), TypeError, "q_scale"),
    ("slot_mapping float", lambda c: setattr(c, "slot_mapping", c.slot_mapping.half()), TypeError, "slot_mapping"),
]


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("what,mutate,exc,words", DECODE_BAD, ids=[b[0] for b in DECODE_BAD])
def test_decode_rejects(backend, entry, what, mutate, exc, words):
    case = make_case(T=5, H=2, decode=True, seed=2)
    live = _live(case)
    mutate(case)
    with pytest.raises(exc, match=words):
        _call(case, entry, backend, decode=True)
    _unchanged(case, live)


def test_bad_backend_name_is_a_value_error(monkeypatch):
    case = make_case(T=2, H=1)
    with pytest.raises(ValueError, match="backend"):
        mla.mla_rope_cache_write(*case.rope_args(), backend="cuda")
    monkeypatch.setenv("VLLM_MLA_FUSION_BACKEND", "nope")
    with pytest.raises(ValueError, match="VLLM_MLA_FUSION_BACKEND"):
        mla.mla_rope_cache_write(*case.rope_args())
    _unchanged(case)


def test_fake_tensor_validation_matches_eager():
    """Under torch.compile the fake implementation raises the same error at trace time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = make_case(T=4, H=2)
    case.slot_mapping = case.slot_mapping.float()
    mode = FakeTensorMode()
    fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in case.rope_args()]
    with mode:
        with pytest.raises(TypeError, match="slot_mapping"):
            torch.ops.mla_fusion.mla_rope_cache_write(*fake)


class TestDebugMode:
    """VLLM_MLA_FUSION_DEBUG=1 checks index values on the host and refuses bad ones."""

    @pytest.fixture(autouse=True)
    def _debug(self, monkeypatch):
        monkeypatch.setenv("VLLM_MLA_FUSION_DEBUG", "1")

    def test_position_out_of_range(self):
        case = make_case(T=4, H=2, positions="out_of_range")
        with pytest.raises(ValueError, match="positions"):
            mla.mla_rope_cache_write(*case.rope_args())
        _unchanged(case)

    def test_slot_past_cache(self):
        case = make_case(T=4, H=2, pad_every=0)
        case.slot_mapping[1] = case.kv_cache.shape[0] * case.kv_cache.shape[1]
        with pytest.raises(ValueError, match="slot_mapping"):
            mla.mla_rope_cache_write(*case.rope_args())
        _unchanged(case)

    @pytest.mark.parametrize("decode", [False, True])
    def test_duplicate_slot(self, decode):
        case = make_case(T=4, H=2, pad_every=0, decode=decode)
        case.slot_mapping[2] = case.slot_mapping[0]
        with pytest.raises(ValueError, match="same slot"):
            _call(case, "public", None, decode)
        _unchanged(case)

    def test_valid_input_passes(self):
        case = make_case(T=6, H=2, positions="edges")
        mla.mla_rope_cache_write(*case.rope_args())
        assert not torch.equal(case.q_pe, case.originals["q_pe"])



PREFILL_BAD = [
    ("k_out shape", lambda c: setattr(c, "k_out", c.k_out[..., :-1]), ValueError, "k_out"),
    ("k_out tokens", lambda c: setattr(c, "k_out", c.k_out[:-1]), ValueError, "k_out"),
    ("k_out int", lambda c: setattr(c, "k_out", c.k_out.view(torch.int16)), TypeError, "k_out"),
    ("k_out uint8", lambda c: setattr(c, "k_out", c.k_out.view(torch.uint8)[..., : c.k_out.shape[-1]]), TypeError,
     "k_out"),
    ("k_out other float", lambda c: setattr(c, "k_out", c.k_out.half()), TypeError, "k_out"),
    ("k_out 2-D", lambda c: setattr(c, "k_out", c.k_out[:, 0]), ValueError, "k_out"),
    ("k_nope heads", lambda c: setattr(c, "k_nope", c.k_nope[:, :1]), ValueError, "k_nope"),
    ("k_nope tokens", lambda c: setattr(c, "k_nope", c.k_nope[:-1]), ValueError, "k_nope"),
    ("k_nope dtype", lambda c: setattr(c, "k_nope", c.k_nope.float()), TypeError, "k_nope"),
    ("k_nope 2-D", lambda c: setattr(c, "k_nope", c.k_nope[:, 0]), ValueError, "k_nope"),
    ("k_nope empty", lambda c: (setattr(c, "k_nope", c.k_nope[..., :0]), setattr(c, "k_out", c.k_out[..., :16])),
     ValueError, "k_nope"),
    ("k_nope not a tensor", lambda c: setattr(c, "k_nope", None), TypeError, "k_nope"),
    ("k_out meta device", lambda c: setattr(c, "k_out", c.k_out.to("meta")), ValueError, "k_out"),
    ("q_pe rank", lambda c: setattr(c, "q_pe", c.q_pe[:, 0]), ValueError, "q_pe"),
    ("slot_mapping float", lambda c: setattr(c, "slot_mapping", c.slot_mapping.half()), TypeError, "slot_mapping"),
]


def _call_prefill(case, entry, backend):
    args = case.prefill_args()
    if entry == "public":
        mla.mla_prefill_rope_cache_write(*args, backend=backend)
    else:
        torch.ops.mla_fusion.mla_prefill_rope_cache_write(*args, backend)


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("what,mutate,exc,words", PREFILL_BAD, ids=[b[0] for b in PREFILL_BAD])
def test_prefill_rejects(backend, entry, what, mutate, exc, words):
    case = make_case(T=5, H=2, prefill=True, seed=4)
    live = {**_live(case), "k_out": case.k_out}
    mutate(case)
    with pytest.raises(exc, match=words):
        _call_prefill(case, entry, backend)
    _unchanged(case, live)


def test_prefill_keyword_names_are_the_documented_ones():
    """The op is keyword-callable with exactly the names of the issue's signature."""
    case = make_case(T=3, H=2, prefill=True, seed=5)
    names = ("positions", "q_pe", "k_pe", "kv_c", "k_nope", "cos_sin_cache", "is_neox", "slot_mapping", "kv_cache",
             "k_out", "kv_cache_dtype", "kv_cache_scale")  # fmt: skip
    mla.mla_prefill_rope_cache_write(**dict(zip(names, case.prefill_args(), strict=True)), backend="torch")
    assert not torch.equal(case.k_out.view(torch.uint8), case.originals["k_out"].view(torch.uint8))
