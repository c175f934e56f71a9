"""Both ops, on every backend this machine runs, against the float64 reference.

On a CPU-only machine "triton" is the real kernel run by Triton's interpreter
(conftest sets TRITON_INTERPRET=1), so shapes stay small. The same matrix at
DeepSeek-V3 sizes runs on a GPU in test_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

import vllm_mla_fusion as mla

from .conftest import OP_BACKENDS
from .mla_cases import make_case
from .mla_reference import check_decode_rope_cache_write, check_rope_cache_write

# (T, H): decode-sized, prefill-sized and odd shapes.
SIZES = [(1, 1), (2, 16), (5, 3), (8, 128), (37, 3), (64, 16)]
CACHES = [
    (torch.bfloat16, "auto", None),
    (torch.float16, "auto", None),
    (torch.float32, "auto", None),
    (torch.bfloat16, "bfloat16", None),
    (torch.float8_e4m3fn, "auto", 0.37),
    (torch.float8_e4m3fn, "fp8", 1.0),
    (torch.float8_e4m3fnuz, "fp8_e4m3", 0.21),
    (torch.float8_e5m2, "fp8_e5m2", 2.5),
    (torch.uint8, "fp8", 0.05),  # vLLM's fp8 storage: e4m3fn off MI300
    (torch.uint8, "fp8_e4m3", None),
    (torch.uint8, "fp8_e5m2", 3.0),
]
CACHE_IDS = [f"{str(d).removeprefix('torch.')}-{k}-{s}" for d, k, s in CACHES]


def _run_rope(case, backend):
    mla.mla_rope_cache_write(*case.rope_args(), backend=backend)
    check_rope_cache_write(case)


def _run_decode(case, backend):
    mla.mla_decode_rope_cache_write(*case.decode_args(), is_nope_first=case.is_nope_first, backend=backend)
    check_decode_rope_cache_write(case)


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("T,H", SIZES)
@pytest.mark.parametrize("is_neox", [False, True])
def test_rope_cache_write_sizes(backend, T, H, is_neox):
    case = make_case(T=T, H=H, is_neox=is_neox, seed=T * 1000 + H)
    _run_rope(case, backend)


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("cache_dtype,kv_cache_dtype,scale", CACHES, ids=CACHE_IDS)
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rope_cache_write_dtypes(backend, cache_dtype, kv_cache_dtype, scale, act_dtype):
    # The seed is a function of the parameters that is stable across processes (hash() of a str is not).
    seed = CACHES.index((cache_dtype, kv_cache_dtype, scale)) * 10 + act_dtype.itemsize
    case = make_case(T=9, H=2, cache_dtype=cache_dtype, kv_cache_dtype=kv_cache_dtype, scale=scale,
                     act_dtype=act_dtype, seed=seed)  # fmt: skip
    _run_rope(case, backend)


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize(
    "layout",
    [
        dict(block_size=1),
        dict(block_size=64, block_pad=40),
        dict(block_size=16, block_pad=8, strided=False),
        dict(k_pe_3d=True),
        dict(index_dtype=torch.int32),
        dict(cs_dtype=torch.bfloat16),
        dict(act_dtype=torch.float16, cs_dtype=torch.float16),
        dict(positions="edges"),
        dict(positions="out_of_range"),
        dict(pad_every=1),  # every token is padding: nothing written, q/k still rotated
        dict(pad_every=0, extra_index=0),
        dict(L=48, R=10),  # L, R not powers of two
        dict(L=16, R=128),
        dict(L=512, R=64, T=3, H=4),  # DeepSeek dims
        dict(R=2, L=32),
    ],
    ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()),
)
def test_rope_cache_write_layouts(backend, layout):
    layout = {"T": 11, "H": 3, **layout}
    case = make_case(seed=len(str(layout)), **layout)
    _run_rope(case, backend)


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("T,H", [(1, 1), (4, 16), (7, 3), (2, 128)])
@pytest.mark.parametrize("is_neox", [False, True])
@pytest.mark.parametrize("is_nope_first", [True, False])
def test_decode_sizes(backend, T, H, is_neox, is_nope_first):
    case = make_case(T=T, H=H, is_neox=is_neox, decode=True, is_nope_first=is_nope_first, seed=T + H)
    _run_decode(case, backend)


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize(
    "cache_dtype,kv_cache_dtype,scale,q_out_dtype,q_scale",
    [
        (torch.bfloat16, "auto", None, torch.bfloat16, None),
        (torch.bfloat16, "auto", None, torch.float32, None),
        (torch.float16, "auto", None, torch.float16, None),
        (torch.uint8, "fp8", 0.4, torch.float8_e4m3fn, 0.3),
        (torch.uint8, "fp8", 1.7, torch.bfloat16, None),
        (torch.float8_e4m3fnuz, "auto", 0.2, torch.float8_e4m3fnuz, 0.15),
        (torch.uint8, "fp8_e5m2", 2.0, torch.float8_e5m2, 0.5),
        (torch.float8_e4m3fn, "auto", None, torch.float8_e4m3fn, None),
    ],
    ids=str,
)
def test_decode_dtypes(backend, cache_dtype, kv_cache_dtype, scale, q_out_dtype, q_scale):
    act = torch.float16 if q_out_dtype == torch.float16 else torch.bfloat16
    case = make_case(T=6, H=3, decode=True, cache_dtype=cache_dtype, kv_cache_dtype=kv_cache_dtype, scale=scale,
                     q_out_dtype=q_out_dtype, q_scale=q_scale, act_dtype=act, seed=7)  # fmt: skip
    _run_decode(case, backend)


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize(
    "layout",
    [
        dict(block_size=1, positions="out_of_range"),
        dict(block_size=64, block_pad=24, index_dtype=torch.int32),
        dict(pad_every=1),  # padded tokens still get their q_out row
        dict(strided=False, k_pe_3d=True, cs_dtype=torch.bfloat16),
        dict(L=48, R=10, is_neox=True),
        dict(L=512, R=64, T=2, H=16),
    ],
    ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()),
)
def test_decode_layouts(backend, layout):
    layout = {"T": 9, "H": 2, **layout}
    case = make_case(decode=True, seed=3, **layout)
    _run_decode(case, backend)


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_fp8_saturates_instead_of_overflowing(backend):
    """Values far past the fp8 range (large inputs, tiny scale) store the finite max, not inf/NaN."""
    case = make_case(T=5, H=2, cache_dtype=torch.uint8, kv_cache_dtype="fp8", scale=1e-3, decode=True,
                     q_out_dtype=torch.float8_e4m3fn, q_scale=1e-3, seed=11)  # fmt: skip
    case.kv_c.mul_(1e3)
    case.snapshot()
    _run_decode(case, backend)
    slots = case.slot_mapping[:5].long()
    slots = slots[slots >= 0]
    bs = case.kv_cache.shape[1]
    written = case.kv_cache[slots // bs, slots % bs].view(torch.float8_e4m3fn).float()
    assert written.abs().max() == 448.0
    assert torch.isfinite(case.q_out.float()).all()


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_zero_tokens_is_a_no_op(backend):
    case = make_case(T=0, H=4, decode=True)
    mla.mla_rope_cache_write(*case.rope_args(), backend=backend)
    mla.mla_decode_rope_cache_write(*case.decode_args(), backend=backend)
    assert torch.equal(case.kv_cache.view(torch.uint8), case.originals["kv_cache"].view(torch.uint8))


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_backends_agree_bitwise_on_latent_and_fp8(backend):
    """The backends share one definition: the copied latent and fp8 bytes match the torch backend exactly."""
    a = make_case(T=13, H=2, cache_dtype=torch.uint8, kv_cache_dtype="fp8", scale=0.3, seed=5)
    b = make_case(T=13, H=2, cache_dtype=torch.uint8, kv_cache_dtype="fp8", scale=0.3, seed=5)
    mla.mla_rope_cache_write(*a.rope_args(), backend="torch")
    mla.mla_rope_cache_write(*b.rope_args(), backend=backend)
    L = a.kv_c.shape[-1]
    assert torch.equal(a.kv_cache[..., :L], b.kv_cache[..., :L])


def _fp8_probe_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of ``dtype``, the midpoints between neighbours (ties), values just
    either side of each midpoint, tiny values that round to (signed) zero, and overflows."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    finite = codes[torch.isfinite(codes)].unique()  # sorted
    mids = (finite[1:].double() + finite[:-1].double()) / 2
    around = torch.cat((mids, torch.nextafter(mids.float(), torch.tensor(-1e30)).double(),
                        torch.nextafter(mids.float(), torch.tensor(1e30)).double()))  # fmt: skip
    fmax = torch.finfo(dtype).max
    extra = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-9, -1e-9, fmax * 1.01, -fmax * 1.5, 1e30, -1e30])
    return torch.cat((finite.double(), around, extra.double())).float()


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2])
def test_fp8_rounding_matches_torch_bit_for_bit(backend, dtype):
    """The fp8 store is torch's round-to-nearest-even of the saturated float32 value, bit for bit:
    ties, subnormals, signed zeros (which e4m3fnuz does not have) and overflow included."""
    values = _fp8_probe_values(dtype)
    L, R = 512, 16
    T = -(-values.numel() // L)
    kv_c = torch.empty(T * L).uniform_(-2, 2)
    kv_c[: values.numel()] = values
    case = make_case(T=T, H=1, L=L, R=R, act_dtype=torch.float32, cache_dtype=dtype, pad_every=0, seed=13)
    case.kv_c = kv_c.view(T, L)
    mla.mla_rope_cache_write(*case.rope_args(), backend=backend)
    slots = case.slot_mapping[:T].long()
    bs = case.kv_cache.shape[1]
    got = case.kv_cache[slots // bs, slots % bs][:, :L].reshape(-1)
    fmax = torch.finfo(dtype).max
    want = case.kv_c.reshape(-1).clamp(-fmax, fmax).to(dtype)
    mismatch = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero().flatten()
    assert mismatch.numel() == 0, (
        f"{mismatch.numel()} fp8 codes differ, e.g. x={case.kv_c.reshape(-1)[mismatch[:4]].tolist()} "
        f"got {got[mismatch[:4]].view(torch.uint8).tolist()} want {want[mismatch[:4]].view(torch.uint8).tolist()}"
    )
