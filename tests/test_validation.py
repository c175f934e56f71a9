"""Malformed input is rejected with a ValueError/TypeError naming the argument, before anything is written."""

from __future__ import annotations

import re

import pytest
import torch

import vllm_mla_fusion as mla
from vllm_mla_fusion import fp8, validation

from .conftest import OP_BACKENDS
from .mla_cases import make_case, out_of_range_slot_case
from .mla_reference import check_decode_rope_cache_write, check_prefill_rope_cache_write, check_rope_cache_write

ENTRY_POINTS = ["public", "custom_op"]


OPS = ("rope_cache_write", "decode", "prefill")


def _case(op, **kw):
    return make_case(decode=op == "decode", prefill=op == "prefill", **kw)


def _call(case, entry, backend, op):
    if op == "decode":
        args = case.decode_args()
        if entry == "public":
            mla.mla_decode_rope_cache_write(*args, is_nope_first=case.is_nope_first, backend=backend)
        else:
            torch.ops.mla_fusion.mla_decode_rope_cache_write(*args, case.is_nope_first, backend or "auto")
    elif op == "prefill":
        args = case.prefill_args()
        if entry == "public":
            mla.mla_prefill_rope_cache_write(*args, backend=backend)
        else:
            torch.ops.mla_fusion.mla_prefill_rope_cache_write(*args, backend or "auto")
    else:
        args = case.rope_args()
        if entry == "public":
            mla.mla_rope_cache_write(*args, backend=backend)
        else:
            torch.ops.mla_fusion.mla_rope_cache_write(*args, backend or "auto")


WRITABLE = ("q_pe", "k_pe", "kv_cache", "q_out", "k_out")


def _live(case):
    """The tensors the op could write, captured before a test swaps in a bad argument."""
    return {name: getattr(case, name) for name in WRITABLE if getattr(case, name) is not None}


def _unchanged(case, live=None):
    for name, t in (live or _live(case)).items():
        assert torch.equal(t.view(torch.uint8), case.originals[name].view(torch.uint8)), f"{name} was written"


def _set(name, fn):
    return lambda c: setattr(c, name, fn(getattr(c, name)))


def _meta(name):
    return _set(name, lambda t: t.to("meta"))


def _r_zero(c):
    c.q_pe, c.k_pe, c.cos_sin_cache = c.q_pe[..., :0], c.k_pe[..., :0], c.cos_sin_cache[:, :0]
    c.kv_cache = c.kv_cache[..., : c.kv_c.shape[-1]]


def _h_zero(c):
    c.q_pe = c.q_pe[:, :0]
    if c.q_out is not None:
        c.ql_nope, c.q_out = c.ql_nope[:, :0], c.q_out[:, :0]
    if c.k_out is not None:
        c.k_nope, c.k_out = c.k_nope[:, :0], c.k_out[:, :0]


def _l_zero(c):
    L = c.kv_c.shape[-1]
    c.kv_c, c.kv_cache = c.kv_c[:, :0], c.kv_cache[..., L:]
    if c.q_out is not None:
        c.ql_nope, c.q_out = c.ql_nope[..., :0], c.q_out[..., L:]


def _typed_fp8_cache(c):
    c.kv_cache = torch.zeros(c.kv_cache.shape, dtype=torch.float8_e4m3fn)
    c.kv_cache_dtype = "fp8_e5m2"


# Every rule of validation.py (and of fp8.cache_store_dtype) that both ops share:
# (id, mutation of a valid case, expected exception, words the message must contain).
COMMON_BAD = [
    # None where a tensor belongs (the dispatcher lets None through to our checks)
    *[(f"{n} None", _set(n, lambda t: None), TypeError, f"{n} must be a torch.Tensor")
      for n in ("positions", "q_pe", "k_pe", "kv_c", "cos_sin_cache", "slot_mapping", "kv_cache")],
    # dtypes
    ("positions float", _set("positions", torch.Tensor.double), TypeError, "positions must have dtype in"),
    ("slot_mapping float", _set("slot_mapping", torch.Tensor.float), TypeError, "slot_mapping must have dtype in"),
    ("slot_mapping half", _set("slot_mapping", torch.Tensor.half), TypeError, "slot_mapping must have dtype in"),
    ("q_pe int", _set("q_pe", lambda t: t.to(torch.int32)), TypeError, "q_pe must have dtype in"),
    ("k_pe dtype", _set("k_pe", torch.Tensor.half), TypeError, "must match q_pe dtype"),
    ("kv_c dtype", _set("kv_c", torch.Tensor.float), TypeError, "kv_c dtype torch.float32 must match"),
    ("cos_sin dtype", _set("cos_sin_cache", torch.Tensor.half), TypeError, "cos_sin_cache must be float32 or"),
    # ranks
    ("positions 2-D", _set("positions", lambda t: t[:, None]), ValueError, "positions must be 1-D"),
    ("slot_mapping 2-D", _set("slot_mapping", lambda t: t[:, None]), ValueError, "slot_mapping must be 1-D"),
    ("q_pe rank", _set("q_pe", lambda t: t[:, 0]), ValueError, "q_pe must be 3-D"),
    ("k_pe 1-D", _set("k_pe", lambda t: t[:, 0]), ValueError, "k_pe must be [num_tokens, rope_dim]"),
    ("k_pe 4-D", _set("k_pe", lambda t: t[:, None, None]), ValueError, "k_pe must be [num_tokens, rope_dim]"),
    ("kv_c 1-D", _set("kv_c", lambda t: t[:, 0]), ValueError, "kv_c must be [num_tokens, kv_lora_rank]"),
    ("kv_c 4-D", _set("kv_c", lambda t: t[:, None, None]), ValueError, "kv_c must be [num_tokens, kv_lora_rank]"),
    ("cos_sin 1-D", _set("cos_sin_cache", lambda t: t[0]), ValueError, "cos_sin_cache must be 2-D"),
    ("cache rank", _set("kv_cache", lambda t: t.flatten(0, 1)), ValueError, "kv_cache must be 3-D"),
    # heads of the single-head tensors: without the check a kernel would silently use head 0
    ("k_pe two heads", _set("k_pe", lambda t: torch.stack((t, t), 1)), ValueError, "k_pe must have a single head"),
    ("kv_c two heads", _set("kv_c", lambda t: torch.stack((t, t), 1)), ValueError, "kv_c must have a single head"),
    # sizes
    ("R odd", lambda c: (setattr(c, "q_pe", c.q_pe[..., :15]), setattr(c, "k_pe", c.k_pe[:, :15])), ValueError,
     "must be a positive even number"),
    ("R zero", _r_zero, ValueError, "must be a positive even number"),
    ("H zero", _h_zero, ValueError, "q_pe must have at least one head"),
    ("L zero", _l_zero, ValueError, "kv_c must have a positive last dimension"),
    ("k_pe rows", _set("k_pe", lambda t: t[:-1]), ValueError, "does not match q_pe's"),
    ("k_pe width", _set("k_pe", lambda t: t[:, :-2]), ValueError, "does not match q_pe's"),
    ("kv_c rows", _set("kv_c", lambda t: t[:-1]), ValueError, "kv_c has 5 rows but q_pe has T=6"),
    ("positions short", _set("positions", lambda t: t[:2]), ValueError, "positions has 2 entries, fewer than"),
    ("slot_mapping short", _set("slot_mapping", lambda t: t[:3]), ValueError, "slot_mapping has 3 entries, fewer than"),
    ("cos_sin width", _set("cos_sin_cache", lambda t: t[:, :8]), ValueError, "cos_sin_cache last dim must equal"),
    ("cos_sin no rows", _set("cos_sin_cache", lambda t: t[:0]), ValueError, "at least one position row"),
    ("cache last dim", _set("kv_cache", lambda t: t[..., :-2]), ValueError, "kv_cache last dim must be"),
    ("cache block size zero", _set("kv_cache", lambda t: t[:, :0]), ValueError, "block_size must be positive"),
    # devices (meta tensors stand for another device: no GPU needed)
    *[(f"{n} on another device", _meta(n), ValueError, f"{n} is on meta but q_pe is on cpu")
      for n in ("positions", "k_pe", "kv_c", "cos_sin_cache", "slot_mapping", "kv_cache")],
    # cache formats (fp8.cache_store_dtype)
    ("cache int16", _set("kv_cache", lambda t: t.view(torch.int16)), TypeError, "kv_cache dtype torch.int16 is not"),
    ("fp8 name on bf16 cache", lambda c: setattr(c, "kv_cache_dtype", "fp8"), ValueError, "does not match kv_cache dtype"),
    ("float name mismatch", lambda c: setattr(c, "kv_cache_dtype", "float16"), ValueError, "'float16' does not match"),
    ("unknown cache dtype name", lambda c: setattr(c, "kv_cache_dtype", "nvfp4_ds_mla"), ValueError,
     "kv_cache_dtype='nvfp4_ds_mla' is not supported"),
    ("fp8_ds_mla on a bf16 cache", lambda c: setattr(c, "kv_cache_dtype", "fp8_ds_mla"), TypeError,
     "kv_cache must be uint8 storage for kv_cache_dtype='fp8_ds_mla'"),  # the format's own: test_fp8_ds_mla.py
    ("uint8 cache with auto", _set("kv_cache", lambda t: t.view(torch.uint8)[..., : t.shape[-1]]), ValueError,
     "kv_cache is uint8 storage, so kv_cache_dtype must name"),
    ("fp8 name mismatch typed cache", _typed_fp8_cache, ValueError, "'fp8_e5m2' does not match kv_cache dtype"),
    # scale
    ("scale two elements", lambda c: setattr(c, "kv_cache_scale", torch.ones(2)), ValueError, "kv_cache_scale must have exactly one"),
    ("scale float64", lambda c: setattr(c, "kv_cache_scale", torch.ones(1, dtype=torch.float64)), TypeError,
     "kv_cache_scale must be a float32 tensor"),
    ("scale on another device", lambda c: setattr(c, "kv_cache_scale", torch.ones(1, device="meta")), ValueError,
     "kv_cache_scale is on meta"),
]  # fmt: skip

DECODE_BAD = [
    ("ql_nope None", _set("ql_nope", lambda t: None), TypeError, "ql_nope must be a torch.Tensor"),
    ("q_out None", _set("q_out", lambda t: None), TypeError, "q_out must be a torch.Tensor"),
    ("ql_nope dtype", _set("ql_nope", torch.Tensor.float), TypeError, "ql_nope dtype torch.float32 must match"),
    ("q_out int", _set("q_out", lambda t: t.view(torch.int16)), TypeError, "q_out must have dtype in"),
    ("ql_nope rank", _set("ql_nope", lambda t: t[:, 0]), ValueError, "ql_nope must be 3-D"),
    ("q_out rank", _set("q_out", lambda t: t[:, 0]), ValueError, "q_out must be 3-D"),
    ("ql_nope heads", _set("ql_nope", lambda t: t[:, :1]), ValueError, "ql_nope must have shape [T, H, L]"),
    ("ql_nope width", _set("ql_nope", lambda t: t[..., :-1]), ValueError, "ql_nope must have shape [T, H, L]"),
    ("q_out shape", _set("q_out", lambda t: t[..., :-1]), ValueError, "q_out must have shape [T, H, L + R]"),
    ("ql_nope on another device", _meta("ql_nope"), ValueError, "ql_nope is on meta but q_pe is on cpu"),
    ("q_out on another device", _meta("q_out"), ValueError, "q_out is on meta but q_pe is on cpu"),
    ("q_scale shape", lambda c: setattr(c, "q_scale", torch.ones(1, 2)), ValueError, "q_scale must have exactly one"),
    ("q_scale int", lambda c: setattr(c, "q_scale", torch.ones(1, dtype=torch.int32)), TypeError, "q_scale must be a float32 tensor"),
    ("q_scale on another device", lambda c: setattr(c, "q_scale", torch.ones(1, device="meta")), ValueError,
     "q_scale is on meta"),
]  # fmt: skip

# Python types that torch's dispatcher would reject with a RuntimeError (or coerce: is_neox=1):
# the public functions check them first (validation.check_argument_types).
PUBLIC_ONLY_BAD = [
    *[(f"{n} list", _set(n, torch.Tensor.tolist), TypeError, f"{n} must be a torch.Tensor")
      for n in ("positions", "q_pe", "k_pe", "kv_c", "cos_sin_cache", "slot_mapping", "kv_cache")],
    ("is_neox int", lambda c: setattr(c, "is_neox", 1), TypeError, "is_neox must be a bool"),
    ("kv_cache_dtype not a str", lambda c: setattr(c, "kv_cache_dtype", torch.bfloat16), TypeError,
     "kv_cache_dtype must be a str"),
    ("kv_cache_scale float", lambda c: setattr(c, "kv_cache_scale", 0.5), TypeError, "kv_cache_scale must be a float32 tensor or None"),
]  # fmt: skip
PUBLIC_ONLY_DECODE_BAD = [
    ("ql_nope list", _set("ql_nope", torch.Tensor.tolist), TypeError, "ql_nope must be a torch.Tensor"),
    ("q_out list", _set("q_out", torch.Tensor.tolist), TypeError, "q_out must be a torch.Tensor"),
    ("q_scale float", lambda c: setattr(c, "q_scale", 2.0), TypeError, "q_scale must be a float32 tensor or None"),
    ("is_nope_first int", lambda c: setattr(c, "is_nope_first", 0), TypeError, "is_nope_first must be a bool"),
]

PUBLIC_ONLY_PREFILL_BAD = [
    ("k_nope list", _set("k_nope", torch.Tensor.tolist), TypeError, "k_nope must be a torch.Tensor"),
    ("k_out list", _set("k_out", torch.Tensor.tolist), TypeError, "k_out must be a torch.Tensor"),
]
OP_ONLY_BAD = {"rope_cache_write": [], "decode": DECODE_BAD, "prefill": []}  # op 3's own: PREFILL_BAD below
OP_ONLY_PUBLIC_BAD = {"rope_cache_write": [], "decode": PUBLIC_ONLY_DECODE_BAD, "prefill": PUBLIC_ONLY_PREFILL_BAD}
OP_CASES = [
    (op, entry, *bad)
    for op in OPS
    for entry in ENTRY_POINTS
    for bad in COMMON_BAD + OP_ONLY_BAD[op] + (PUBLIC_ONLY_BAD + OP_ONLY_PUBLIC_BAD[op] if entry == "public" else [])
]


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize(
    "op,entry,what,mutate,exc,words", OP_CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in OP_CASES]
)  # fmt: skip
def test_rejects_bad_input_before_writing(backend, op, entry, what, mutate, exc, words):
    case = _case(op, T=6, H=2, seed=1)
    live = _live(case)
    mutate(case)
    with pytest.raises(exc, match=re.escape(words)):
        _call(case, entry, backend, op)
    _unchanged(case, live)


def test_shared_checks_refuse_what_the_dispatcher_would_coerce():
    """The flag and str checks inside the shared validation (used by the custom ops and their
    fakes as well) hold on their own, not only behind check_argument_types."""
    case = make_case(T=3, H=2, decode=True, seed=4)
    with pytest.raises(TypeError, match="is_neox must be a bool"):
        validation.check_rope_cache_write(*case.rope_args()[:5], 1, *case.rope_args()[6:])
    args = list(case.decode_args()) + [True]
    args[13] = 1
    with pytest.raises(TypeError, match="is_nope_first must be a bool"):
        validation.check_decode_rope_cache_write(*args)
    with pytest.raises(TypeError, match="kv_cache_dtype must be a str"):
        fp8.cache_store_dtype(case.kv_cache, None)
    with pytest.raises(ValueError, match="'nvfp4_ds_mla' is not supported"):
        fp8.cache_store_dtype(case.kv_cache.view(torch.uint8), "nvfp4_ds_mla")


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


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("op", OPS)
class TestDebugMode:
    """VLLM_MLA_FUSION_DEBUG=1 checks index values on the host and refuses bad ones before any write."""

    @pytest.fixture(autouse=True)
    def _debug(self, monkeypatch):
        monkeypatch.setenv("VLLM_MLA_FUSION_DEBUG", "1")

    def test_position_out_of_range(self, backend, op):
        case = _case(op, T=4, H=2, positions="out_of_range")
        with pytest.raises(ValueError, match="positions"):
            _call(case, "public", backend, op)
        _unchanged(case)

    @pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
    def test_slots_past_the_cache(self, backend, op, index_dtype):
        case, cap = out_of_range_slot_case(block_size=16, index_dtype=index_dtype, seed=3,
                                           make=lambda **kw: _case(op, **kw))  # fmt: skip
        with pytest.raises(ValueError, match=rf"slot_mapping\[1\]={cap} is past the cache's {cap} slots"):
            _call(case, "public", backend, op)
        _unchanged(case)
        guard = case.parents["kv_cache"]  # the cache and the canary rows after it
        assert torch.equal(guard.view(torch.uint8), case.originals["parent:kv_cache"].view(torch.uint8))

    def test_duplicate_slot(self, backend, op):
        case = _case(op, T=4, H=2, pad_every=0)
        case.slot_mapping[2] = case.slot_mapping[0]
        with pytest.raises(ValueError, match="same slot"):
            _call(case, "public", backend, op)
        _unchanged(case)

    def test_valid_input_passes(self, backend, op):
        case = _case(op, T=6, H=2, positions="edges")
        _call(case, "public", backend, op)
        {"rope_cache_write": check_rope_cache_write, "decode": check_decode_rope_cache_write,
         "prefill": check_prefill_rope_cache_write}[op](case)  # fmt: skip


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


# key_start (op 3's mixed batches): T = 5 tokens, and the key rows of T - key_start of them.
KEY_START_BAD = [
    ("negative", -1, 0, ValueError, r"key_start must be in \[0, T\] = \[0, 5\], got -1"),
    ("past T", 6, 0, ValueError, r"key_start must be in \[0, T\]"),
    ("bool", True, 1, TypeError, "key_start must be an int, got bool"),
    ("float", 1.5, 1, TypeError, "key_start must be an int, got float"),
    ("key rows of T", 2, 0, ValueError, r"k_nope must have shape \[T - key_start, H, P\] with T - key_start=3"),
    ("key rows short", 0, 2, ValueError, r"k_nope must have shape \[T, H, P\] with T=5"),
    ("k_out rows", 2, 2, ValueError, r"k_out must have shape \[T - key_start, H, P \+ R\] = \[3, 2, "),  # one short
]


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("what,key_start,rows_key_start,exc,words", KEY_START_BAD, ids=[b[0] for b in KEY_START_BAD])
def test_prefill_rejects_a_key_start_its_key_rows_do_not_match(backend, what, key_start, rows_key_start, exc, words):
    case = make_case(T=5, H=2, prefill=True, key_start=rows_key_start, seed=4)
    live = {**_live(case), "k_out": case.k_out}
    if what == "k_out rows":
        case.k_out = case.k_out[:-1]
    with pytest.raises(exc, match=words):
        mla.mla_prefill_rope_cache_write(*case.prefill_args(), key_start=key_start, backend=backend)
    _unchanged(case, live)


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_the_custom_op_takes_key_start_by_keyword_after_its_positional_backend(backend):
    """key_start is keyword-only and last in the schema: positional calls keep their meaning."""
    case = make_case(T=5, H=2, prefill=True, key_start=2, seed=6)
    torch.ops.mla_fusion.mla_prefill_rope_cache_write(*case.prefill_args(), backend, key_start=2)
    check_prefill_rope_cache_write(case)
    bad = make_case(T=5, H=2, prefill=True, key_start=2, seed=7)
    live = {**_live(bad), "k_out": bad.k_out}
    with pytest.raises(ValueError, match="k_nope"):
        torch.ops.mla_fusion.mla_prefill_rope_cache_write(*bad.prefill_args(), backend)  # key_start 0: T rows
    _unchanged(bad, live)


def _expanded(name: str, dim: int):
    """``name`` replaced by a view whose elements along ``dim`` all share the first one's memory."""

    def mutate(case):
        t = getattr(case, name)
        first = [slice(None)] * t.dim()
        first[dim] = slice(0, 1)
        setattr(case, name, t[tuple(first)].expand(t.shape))

    return mutate


# What each op writes (the rest it only reads), and a dimension along which to share one element's memory.
WRITTEN = {"rope_cache_write": [("q_pe", 1), ("k_pe", 0), ("kv_cache", 0)],
           "decode": [("q_out", 1), ("kv_cache", 1)],
           "prefill": [("q_pe", 1), ("k_pe", 0), ("kv_cache", 0), ("k_out", 1)]}  # fmt: skip
SHARED_MEMORY_CASES = [(op, entry, name, dim) for op in OPS for entry in ENTRY_POINTS for name, dim in WRITTEN[op]]


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("op,entry,name,dim", SHARED_MEMORY_CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in SHARED_MEMORY_CASES])
def test_rejects_a_written_tensor_whose_elements_share_memory(backend, op, entry, name, dim):
    """An expand()-ed output (stride 0) would be written by several programs at one address at once:
    refused as torch's in-place ops refuse it, naming the tensor, before anything is written."""
    case = _case(op, T=6, H=2, seed=2)
    live = _live(case)
    _expanded(name, dim)(case)
    with pytest.raises(ValueError, match=re.escape(f"{name} is written by the op, so no two of its elements")):
        _call(case, entry, backend, op)
    _unchanged(case, live)


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_decode_reads_expanded_inputs_as_their_copies(backend):
    """Op 2 only reads q_pe and k_pe: expand()-ed views of them are valid input, giving the bytes their
    contiguous copies give."""
    views, copies = _case("decode", T=6, H=2, seed=3), _case("decode", T=6, H=2, seed=3)
    for case in (views, copies):
        _expanded("q_pe", 1)(case)
        _expanded("k_pe", 0)(case)
    copies.q_pe, copies.k_pe = copies.q_pe.contiguous(), copies.k_pe.contiguous()
    _call(views, "public", backend, "decode")
    _call(copies, "public", backend, "decode")
    for name in ("q_out", "kv_cache"):
        a, b = getattr(views, name), getattr(copies, name)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
        assert not torch.equal(a.view(torch.uint8), views.originals[name].view(torch.uint8)), f"{name} not written"


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_a_token_dimension_of_stride_0_is_refused_at_any_token_count(backend):
    """One token with a stride-0 token dimension overlaps nothing, but the layout it binds serves every
    later token count without validating again (binding.py): refused at one token already."""
    case = _case("rope_cache_write", T=1, H=2, seed=5)
    live = _live(case)
    case.k_pe = case.k_pe.as_strided(case.k_pe.shape, (0, *case.k_pe.stride()[1:]))
    with pytest.raises(ValueError, match=re.escape("k_pe is written by the op, so no two of its elements")):
        _call(case, "public", backend, "rope_cache_write")
    _unchanged(case, live)
