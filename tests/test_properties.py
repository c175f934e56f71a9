"""Property-based tests (hypothesis): random shapes, layouts (strides, ranks), dtypes, padding and positions,
every backend this machine runs, each result checked against the float64 reference
(written rows, untouched canary rows and neighbouring bytes, in-place outputs).

CI runs the deterministic "ci" profile (fixed seeds, bounded examples); set
HYPOTHESIS_PROFILE=dev for a longer random search.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vllm_mla_fusion as mla

from .conftest import OP_BACKENDS
from .mla_cases import make_case
from .mla_reference import check_decode_rope_cache_write, check_prefill_rope_cache_write, check_rope_cache_write

settings.register_profile("ci", max_examples=100, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
settings.register_profile("dev", max_examples=300, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

CACHE_KINDS = [
    (torch.bfloat16, "auto"),
    (torch.float16, "auto"),
    (torch.float32, "auto"),
    (torch.float8_e4m3fn, "auto"),
    (torch.float8_e4m3fnuz, "auto"),
    (torch.float8_e5m2, "fp8_e5m2"),
    (torch.uint8, "fp8"),
    (torch.uint8, "fp8_e4m3"),
    (torch.uint8, "fp8_e5m2"),
]


@st.composite
def layouts(draw, decode: bool = False, prefill: bool = False):
    cache_dtype, kv_cache_dtype = draw(st.sampled_from(CACHE_KINDS))
    fp8_cache = cache_dtype in (torch.uint8, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)
    act = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    kw = dict(
        T=draw(st.integers(0, 24)),
        H=draw(st.integers(1, 5)),
        L=draw(st.sampled_from([16, 32, 48, 80])),
        R=2 * draw(st.integers(1, 20)),
        block_size=draw(st.sampled_from([1, 2, 16])),
        block_pad=draw(st.sampled_from([0, 0, 24])),
        cache_dtype=cache_dtype,
        kv_cache_dtype=kv_cache_dtype,
        act_dtype=act,
        cs_dtype=draw(st.sampled_from([torch.float32, act])),
        is_neox=draw(st.booleans()),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        strided=draw(st.booleans()),
        k_pe_3d=draw(st.booleans()),
        kv_c_3d=draw(st.booleans()),
        # Mostly vLLM's layouts, sometimes a tensor with a non-unit inner stride or swapped dims.
        inner_stride=draw(st.sampled_from([(), (), (), ("q_pe", "kv_c"), ("kv_cache",), ("cos_sin_cache", "positions"),
                                           ("slot_mapping", "k_pe"), ("q_out", "ql_nope", "q_scale")])),
        transposed=draw(st.sampled_from([(), (), (), ("cos_sin_cache",), ("q_out", "ql_nope"), ("kv_cache",)])),
        pad_every=draw(st.integers(0, 4)),
        scale=draw(st.sampled_from([None, 0.1, 1.0, 3.7])) if fp8_cache else draw(st.sampled_from([None, 2.0])),
        positions=draw(st.sampled_from(["random", "edges", "out_of_range"])),
        extra_index=draw(st.integers(0, 5)),
        max_pos=draw(st.integers(1, 300)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    if decode:
        q_fp8 = fp8_cache and draw(st.booleans())
        q_dtype = torch.float8_e4m3fn if q_fp8 else draw(st.sampled_from([act, torch.float32]))
        kw.update(decode=True, q_out_dtype=q_dtype, q_scale=draw(st.sampled_from([None, 0.2, 5.0])),
                  is_nope_first=draw(st.booleans()))  # fmt: skip
    if prefill:
        k_fp8 = draw(st.booleans())
        k_dtype = draw(st.sampled_from([torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2])) if k_fp8 \
            else act  # fmt: skip
        kw.update(prefill=True, nope_dim=draw(st.integers(1, 40)), k_out_dtype=k_dtype,
                  k_out_strided=draw(st.booleans()))  # fmt: skip
    return kw


@pytest.mark.parametrize("backend", OP_BACKENDS)
@given(layout=layouts(decode=False))
def test_rope_cache_write_property(backend, layout):
    case = make_case(**layout)
    mla.mla_rope_cache_write(*case.rope_args(), backend=backend)
    check_rope_cache_write(case)


@pytest.mark.parametrize("backend", OP_BACKENDS)
@given(layout=layouts(decode=True))
def test_decode_rope_cache_write_property(backend, layout):
    case = make_case(**layout)
    mla.mla_decode_rope_cache_write(*case.decode_args(), is_nope_first=case.is_nope_first, backend=backend)
    check_decode_rope_cache_write(case)


@pytest.mark.parametrize("backend", OP_BACKENDS)
@given(layout=layouts(prefill=True))
def test_prefill_rope_cache_write_property(backend, layout):
    case = make_case(**layout)
    mla.mla_prefill_rope_cache_write(*case.prefill_args(), backend=backend)
    check_prefill_rope_cache_write(case)
