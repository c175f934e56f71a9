"""Each op's signature is defined once, by its public function (ops.py): the custom op's schema and
its kernel's argument mapping are derived from it. The schemas are what torch.ops callers,
torch.compile and CUDA-graph capture see: they stay exactly as first published."""

from __future__ import annotations

import inspect

import pytest
import torch

import vllm_mla_fusion as mla
from vllm_mla_fusion import ops

SCHEMAS = {
    "mla_rope_cache_write": (
        "mla_fusion::mla_rope_cache_write(Tensor positions, Tensor(a1!) q_pe, Tensor(a2!) k_pe, Tensor kv_c, "
        "Tensor cos_sin_cache, bool is_neox, Tensor slot_mapping, Tensor(a7!) kv_cache, "
        'str kv_cache_dtype="auto", Tensor? kv_cache_scale=None, str backend="auto") -> ()'
    ),
    "mla_decode_rope_cache_write": (
        "mla_fusion::mla_decode_rope_cache_write(Tensor positions, Tensor ql_nope, Tensor q_pe, Tensor k_pe, "
        "Tensor kv_c, Tensor cos_sin_cache, bool is_neox, Tensor slot_mapping, Tensor(a8!) kv_cache, "
        'Tensor(a9!) q_out, str kv_cache_dtype="auto", Tensor? kv_cache_scale=None, Tensor? q_scale=None, '
        'bool is_nope_first=True, str backend="auto") -> ()'
    ),
    "mla_prefill_rope_cache_write": (
        "mla_fusion::mla_prefill_rope_cache_write(Tensor positions, Tensor(a1!) q_pe, Tensor(a2!) k_pe, "
        "Tensor kv_c, Tensor k_nope, Tensor cos_sin_cache, bool is_neox, Tensor slot_mapping, "
        'Tensor(a8!) kv_cache, Tensor(a9!) k_out, str kv_cache_dtype="auto", Tensor? kv_cache_scale=None, '
        'str backend="auto", *, SymInt key_start=0) -> ()'
    ),
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_the_schemas_are_as_published(name):
    assert str(getattr(torch.ops.mla_fusion, name).default._schema) == SCHEMAS[name]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_the_schema_is_the_public_functions_signature(name):
    """Same parameters in the same order (keyword-only flags, and the backend as a name, come
    positional in the schema: torch.ops callers pass them so), same defaults but the backend's."""
    public = inspect.signature(getattr(mla, name)).parameters
    schema = getattr(torch.ops.mla_fusion, name).default._schema.arguments
    keyword = ["key_start"] if "key_start" in public else []
    assert [a.name for a in schema] == [n for n in public if n != "key_start"] + keyword
    for a in schema:
        p = public[a.name]
        if a.name != "backend":
            assert (a.has_default_value(), a.default_value if a.has_default_value() else None) == (
                p.default is not p.empty, None if p.default is p.empty else p.default), a.name  # fmt: skip


def test_an_op_without_a_public_function_cannot_be_registered():
    """The registration reads each op's signature from the public function named after it."""
    assert set(ops.OP_CALLS) == set(SCHEMAS)
    for name, call in ops.OP_CALLS.items():
        assert call.public is getattr(mla, name)


def test_a_call_maps_onto_its_boundop_by_name(monkeypatch):
    """The kernel passes the flags, then the tensors in BoundOp's order, the op's own three in the
    places of ``nope``, ``out``, ``out_scale``, then op 3's ``key_start``; trailing defaults left out,
    arguments by name or in full are one call; a missing required argument or an unknown name is a
    TypeError naming it (the fake maps the same way onto ``validate``)."""
    calls = []

    class Recorder:
        def __init__(self, *flags):
            self.flags = flags

        def __call__(self, *args):
            calls.append((self.flags, args))

        def validate(self, *args):
            calls.append((self.flags, args, "validate"))

    monkeypatch.setattr(ops, "bound_op", Recorder)
    # Distinct values: tuples of tensors compare by value, and each argument must land in its place.
    t = [torch.full((1,), float(i)) for i in range(9)]
    decode = ops.OP_CALLS["mla_decode_rope_cache_write"]
    # positions, ql_nope, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, q_out, ...
    full = (t[0], t[1], t[2], t[3], t[4], t[5], True, t[6], t[7], t[8], "fp8", t[4], t[5], False, "torch")
    decode.kernel(*full)
    assert calls[-1] == ((ops.OP_DECODE, True, "fp8", False, "torch"),
                         (t[0], t[2], t[3], t[4], t[5], t[6], t[7], t[4], t[1], t[8], t[5], 0))  # fmt: skip
    decode.kernel(*full[:10])
    assert calls[-1][0] == (ops.OP_DECODE, True, "auto", True, "auto") and calls[-1][1][7:] == (None, t[1], t[8],
                                                                                                None, 0)  # fmt: skip
    decode.kernel(*full[:8], kv_cache=t[7], q_out=t[8], q_scale=t[5])
    assert calls[-1][1][-2] is t[5]
    decode.fake(*full)
    assert calls[-1][2] == "validate" and calls[-1][1] == calls[0][1]
    prefill = ops.OP_CALLS["mla_prefill_rope_cache_write"]
    # positions, q_pe, k_pe, kv_c, k_nope, cos_sin_cache, is_neox, slot_mapping, kv_cache, k_out
    prefill.kernel(t[0], t[1], t[2], t[3], t[4], t[5], False, t[6], t[7], t[8], key_start=3)
    assert calls[-1] == ((ops.OP_PREFILL, False, "auto", True, "auto"),
                         (t[0], t[1], t[2], t[3], t[5], t[6], t[7], None, t[4], t[8], None, 3))  # fmt: skip
    rope = ops.OP_CALLS["mla_rope_cache_write"]
    rope.kernel(*t[:5], True, *t[5:7])
    assert calls[-1][1][8:] == (None, None, None, 0)
    with pytest.raises(TypeError, match="q_out"):
        decode.kernel(*full[:9])
    with pytest.raises(TypeError, match="nope_first"):
        decode.kernel(*full[:10], nope_first=False)
    with pytest.raises(TypeError, match="key_start"):
        rope.kernel(*t[:5], True, *t[5:7], key_start=0)


def test_a_public_parameter_that_reaches_no_boundop_argument_is_refused():
    """A parameter added to a public function must be passed on: the registration refuses one that
    no flag, tensor role or ``key_start`` takes (it would reach the schema and never the kernel)."""

    def op_with_extra(positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor, kv_c: torch.Tensor,
                      cos_sin_cache: torch.Tensor, is_neox: bool, slot_mapping: torch.Tensor, kv_cache: torch.Tensor,
                      kv_cache_dtype: str = "auto", kv_cache_scale: torch.Tensor | None = None, *,
                      backend: str | None = None, margin: int = 0) -> None: ...  # fmt: skip

    with pytest.raises(TypeError, match="margin"):
        ops.OpCall(op_with_extra, ops.OP_ROPE_CACHE, ("q_pe",), (None, None, None))
