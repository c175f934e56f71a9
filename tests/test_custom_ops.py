"""torch.library registration: opcheck, torch.compile(fullgraph=True) without graph breaks, backend dispatch."""

from __future__ import annotations

import os

import pytest
import torch
from torch.library import opcheck

import vllm_mla_fusion as mla
from vllm_mla_fusion import binding, dispatch, environment

from .conftest import OP_BACKENDS
from .mla_cases import make_case
from .mla_reference import check_decode_rope_cache_write, check_prefill_rope_cache_write, check_rope_cache_write


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("cache", [(torch.bfloat16, "auto"), (torch.uint8, "fp8")])
def test_opcheck_rope_cache_write(backend, cache):
    case = make_case(T=5, H=2, cache_dtype=cache[0], kv_cache_dtype=cache[1], scale=0.5, seed=1)
    opcheck(torch.ops.mla_fusion.mla_rope_cache_write, (*case.rope_args(), backend))


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_opcheck_decode_rope_cache_write(backend):
    # A bf16 q_out: opcheck's own comparison of outputs has no fp8 kernels on the CPU
    # (fp8 q_out is covered against the reference in test_ops.py).
    case = make_case(T=5, H=2, decode=True, cache_dtype=torch.uint8, kv_cache_dtype="fp8", scale=0.5, seed=2)
    opcheck(torch.ops.mla_fusion.mla_decode_rope_cache_write, (*case.decode_args(), True, backend))


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_opcheck_prefill_rope_cache_write(backend):
    case = make_case(T=5, H=2, prefill=True, cache_dtype=torch.uint8, kv_cache_dtype="fp8", scale=0.5, seed=6)
    opcheck(torch.ops.mla_fusion.mla_prefill_rope_cache_write, (*case.prefill_args(), backend))


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_compile_fullgraph_like_vllm(backend):
    """The shape of vLLM's MLA forward: q_pe and k_pe are slices of larger activations,
    mutated in place, then read again by later ops in the same graph."""
    torch._dynamo.reset()
    T, H, L, R, nope = 6, 2, 32, 16, 24
    case = make_case(T=T, H=H, L=L, R=R, strided=False, seed=3)
    q = torch.randn(T, H, nope + R, dtype=torch.bfloat16)
    kv_a = torch.randn(T, L + R, dtype=torch.bfloat16)

    def step(q, kv_a, positions, cos_sin_cache, slot_mapping, kv_cache):
        kv_c, k_pe = kv_a.split([L, R], dim=-1)
        kv_c = kv_c * 1.0  # stands for the layernorm: a fresh contiguous tensor
        mla.mla_rope_cache_write(positions, q[..., nope:], k_pe, kv_c, cos_sin_cache, False, slot_mapping,
                                 kv_cache, backend=backend)  # fmt: skip
        return q.sum(-1), k_pe.float().sum()

    eager_q, eager_kv, eager_cache = q.clone(), kv_a.clone(), case.kv_cache.clone()
    want = step(eager_q, eager_kv, case.positions, case.cos_sin_cache, case.slot_mapping, eager_cache)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(q, kv_a, case.positions, case.cos_sin_cache, case.slot_mapping, case.kv_cache)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(q, eager_q) and torch.equal(kv_a, eager_kv)
    assert torch.equal(case.kv_cache.view(torch.uint8), eager_cache.view(torch.uint8))


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_compile_inductor_decode(backend):
    torch._dynamo.reset()
    case = make_case(T=4, H=3, decode=True, seed=4)

    @torch.compile(fullgraph=True)
    def step(*args):
        mla.mla_decode_rope_cache_write(*args, backend=backend)

    step(*case.decode_args())
    check_decode_rope_cache_write(case)


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_compile_prefill_like_vllm(backend):
    """vLLM's prefill: k_nope is a split view of kv_b_proj's output, k_out a fresh tensor
    read by the attention that follows, q_pe a slice of q mutated in place."""
    torch._dynamo.reset()
    case = make_case(T=5, H=3, prefill=True, seed=8)
    T, H = 5, 3
    P, R = case.k_nope.shape[-1], case.q_pe.shape[-1]

    def step(q, kv_nope, k_pe, kv_c, positions, cos_sin_cache, slot_mapping, kv_cache):
        k_nope = kv_nope[..., :P]
        k = torch.empty((T, H, P + R), dtype=q.dtype)
        mla.mla_prefill_rope_cache_write(positions, q[..., P:], k_pe, kv_c, k_nope, cos_sin_cache, False,
                                         slot_mapping, kv_cache, k, backend=backend)  # fmt: skip
        return (q.float() @ k.float().transpose(-1, -2)).sum(), k

    q = torch.randn(T, H, P + R).bfloat16()
    kv_nope = torch.cat((case.k_nope, torch.randn(T, H, 8).bfloat16()), dim=-1)
    args = lambda: (q.clone(), kv_nope, case.k_pe.clone(), case.kv_c, case.positions, case.cos_sin_cache,  # noqa: E731
                    case.slot_mapping, case.kv_cache.clone())  # fmt: skip
    want = step(*args())
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(*args())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_auto_dispatch_on_cpu_uses_torch(monkeypatch):
    assert dispatch.resolve(None, torch.device("cpu"), decode=False) == "torch"
    monkeypatch.setenv("VLLM_MLA_FUSION_BACKEND", "triton")
    expected = "triton" if dispatch.triton_interpreting() else None
    if expected:
        assert dispatch.resolve(None, torch.device("cpu"), decode=False) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        dispatch.resolve(None, torch.device("cpu"), decode=False)


@pytest.mark.parametrize("value", [None, "", "0", "1", " Triton ", "caf\u00e9", "\udcff-undecodable"])
def test_the_fast_environment_read_answers_what_os_environ_answers(monkeypatch, value):
    """The public ops' per-call read of their switches (environment.environment_value) sees every
    write through os.environ at once, decodes as os.environ does, and falls back to the mapping
    when os.environ is no CPython _Environ."""
    name = "VLLM_MLA_FUSION_TEST_SWITCH"
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    assert environment.environment_value(name) == os.environ.get(name) == value
    monkeypatch.setenv(name, "changed")
    assert environment.environment_value(name) == "changed"
    monkeypatch.delenv(name)
    assert environment.environment_value(name) is None
    monkeypatch.setattr(os, "environ", {name: "from a plain mapping"})
    assert environment.environment_value(name) == "from a plain mapping"


def test_the_public_ops_follow_their_switches_between_calls(monkeypatch):
    case = make_case(T=2, H=1, seed=4)
    monkeypatch.setenv("VLLM_MLA_FUSION_BACKEND", "no-such-backend")
    with pytest.raises(ValueError, match="VLLM_MLA_FUSION_BACKEND"):
        mla.mla_rope_cache_write(*case.rope_args())
    monkeypatch.setenv("VLLM_MLA_FUSION_BACKEND", "torch")
    mla.mla_rope_cache_write(*case.rope_args())
    check_rope_cache_write(case)


def test_keyword_overrides_environment(monkeypatch):
    monkeypatch.setenv("VLLM_MLA_FUSION_BACKEND", "triton")
    assert dispatch.resolve("torch", torch.device("cpu"), decode=True) == "torch"


def test_forced_backend_runs_that_backend(monkeypatch):
    """VLLM_MLA_FUSION_BACKEND really selects the implementation (no silent fallback)."""
    # The public ops keep their BoundOps (and the sites they bound) for the process: start from none,
    # so that this layout is bound here, through the wrapped backends, whatever ran before.
    monkeypatch.setattr(binding, "_SHARED", {})
    calls = []
    for name in OP_BACKENDS:
        module = dispatch.load(name)

        def bind(*a, _bind=module.bind, _name=name):
            site = _bind(*a)
            return lambda *args: (calls.append(_name), site(*args))

        monkeypatch.setattr(module, "bind", bind)
    for name in OP_BACKENDS:
        monkeypatch.setenv("VLLM_MLA_FUSION_BACKEND", name)
        case = make_case(T=3, H=2, seed=9)
        mla.mla_rope_cache_write(*case.rope_args())
        check_rope_cache_write(case)
    assert calls == list(OP_BACKENDS)


def test_forcing_aiter_without_rocm_is_a_clear_error():
    case = make_case(T=2, H=1, decode=True)
    with pytest.raises(RuntimeError, match="aiter"):
        mla.mla_decode_rope_cache_write(*case.decode_args(), backend="aiter")


def test_available_backends_on_cpu():
    names = mla.available_backends("cpu")
    assert "torch" in names
    assert ("triton" in names) == dispatch.triton_interpreting()


def test_aiter_is_offered_for_gpu_tensors_only(monkeypatch):
    """Even where AITER's HIP op could run, CPU tensors are never offered it; GPU tensors get it first."""
    from vllm_mla_fusion.backends import aiter as aiter_backend

    monkeypatch.setattr(aiter_backend, "unavailable_reason", lambda device: None)  # "AITER installed, ROCm GPU"
    assert "aiter" not in mla.available_backends("cpu")
    assert mla.available_backends("cuda")[0] == "aiter"
