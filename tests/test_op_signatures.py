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
    assert [a.name for a in schema] == [n for n in public if n != "key_start"] + (["key_start"] if "key_start" in public else [])
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


def test_a_call_may_leave_out_trailing_defaults_or_name_its_arguments(monkeypatch):
    """As torch.ops callers and ``ops.eager`` pass them: the schema's trailing defaults left out,
    arguments by name, or positionally in full, map onto the same BoundOp call; a missing required
    argument or an unknown name is a TypeError naming it."""
    flags = []
    monkeypatch.setattr(ops, "bound_op", lambda *f: flags.append(f) or f)
    t = [torch.zeros(1) for _ in range(10)]
    call = ops.OP_CALLS["mla_decode_rope_cache_write"]
    full = (*t[:6], True, *t[6:9], "auto", None, None, True, "auto")
    names = list(call.signature.parameters)
    results = [call.bind(full, {}), call.bind(full[:10], {}), call.bind(full[:14], {}),
               call.bind(full[:8], dict(zip(names[8:10], full[8:10])))]  # fmt: skip
    for op, tensors in results[1:]:
        assert op == results[0][0] and all(a is b for a, b in zip(tensors, results[0][1], strict=True))
    assert results[0][0] == (ops.OP_DECODE, True, "auto", True, "auto")
    assert call.bind((*full[:13], False), {})[0][3] is False  # is_nope_first, where the op has it
    prefill = ops.OP_CALLS["mla_prefill_rope_cache_write"]
    assert prefill.bind((*t[:6], False, *t[6:9]), {"key_start": 3})[1][-1] == 3
    with pytest.raises(TypeError, match="q_out"):
        call.bind(full[:9], {})
    with pytest.raises(TypeError, match="nope_first"):
        call.bind(full[:10], {"nope_first": False})
