"""The kernel self-check's float64 reference (vllm_mla_fusion/selfcheck.py): independent, and it catches errors."""

from __future__ import annotations

import pytest
import torch

from vllm_mla_fusion import selfcheck as S

from .conftest import OP_BACKENDS
from .mla_reference import rope64

CPU = torch.device("cpu")


@pytest.mark.parametrize("is_neox", [False, True])
def test_rotation_agrees_with_the_tests_reference(is_neox):
    """Two float64 RoPEs written separately (complex products here, index lists in tests/) agree."""
    x = S._inputs(7, 3, CPU, fp8=False, seed=1)
    got, got_mag = S._rotate64(x["q_pe"], x["positions"], x["cos_sin_cache"], is_neox)
    want, want_mag = rope64(x["q_pe"], x["positions"][:7].long(), x["cos_sin_cache"], is_neox)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_mag, want_mag, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("op", ["rope_cache_write", "decode", "prefill"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_backends_pass(backend, op, fp8):
    pristine = S._inputs(5, 4, CPU, fp8, seed=9)
    x = S._inputs(5, 4, CPU, fp8, seed=9)
    S._call(op, x, backend)
    err = S._compare(op, x, pristine, S._expected(op, pristine))
    # 0.5 ulp: correctly rounded, the Triton kernel too: conftest.py installs the exact-rounding
    # interpreter (tests/exact_interpreter.py: bf16 rounded to nearest even, exact fma, as on a GPU).
    # The self-check's own bound (1 ulp, selfcheck.main) is for the demo, which runs Triton's stock
    # interpreter (it truncates float32 to bf16).
    assert err <= 0.5 + 1e-3, err


def test_errors_are_caught():
    op = "rope_cache_write"
    pristine = S._inputs(5, 4, CPU, fp8=False, seed=9)
    want = S._expected(op, pristine)

    x = S._inputs(5, 4, CPU, fp8=False, seed=9)
    S._call(op, x, "torch")
    x["q_pe"][2, 1, 7] = x["q_pe"][2, 1, 7].float() * (1 + 2**-6)  # two bf16 ulps
    assert S._compare(op, x, pristine, want) > 1

    y = S._inputs(5, 4, CPU, fp8=False, seed=9)
    S._call(op, y, "torch")
    named = set(y["slot_mapping"][:5].tolist())
    unnamed = next(s for s in range(y["kv_cache"].shape[0] * y["kv_cache"].shape[1]) if s not in named)
    y["kv_cache"].view(-1, y["kv_cache"].shape[-1])[unnamed, 0] += 1  # a row no slot names
    assert S._compare(op, y, pristine, want) == float("inf")

    z = S._inputs(5, 4, CPU, fp8=False, seed=9)
    S._call("decode", z, "torch")
    z["k_pe"][0, 0] += 1  # the decode op must leave k_pe alone
    assert S._compare("decode", z, pristine, S._expected("decode", pristine)) == float("inf")


def test_prefill_key_errors_are_caught():
    """The key's nope part, one head's rope part, and a q_pe left unrotated are each noticed."""
    op = "prefill"
    pristine = S._inputs(5, 4, CPU, fp8=False, seed=9)
    want = S._expected(op, pristine)
    for damage in ("nope", "rope of one head", "q_pe"):
        x = S._inputs(5, 4, CPU, fp8=False, seed=9)
        S._call(op, x, "torch")
        assert S._compare(op, x, pristine, want) <= 0.5 + 1e-3
        if damage == "nope":
            x["k_out"][1, 2, 3] = x["k_out"][1, 2, 3].float() * (1 + 2**-6)
        elif damage == "rope of one head":
            x["k_out"][3, 1, -5] = x["k_out"][3, 1, -5].float() * (1 + 2**-6)
        else:
            x["q_pe"].copy_(pristine["q_pe"])
        assert S._compare(op, x, pristine, want) > 1, damage
