"""The three ops, on every backend this machine runs, against the float64 reference.

On a CPU-only machine "triton" is the real kernel run by Triton's interpreter
(conftest sets TRITON_INTERPRET=1), so shapes stay small. The same matrix at
DeepSeek-V3 sizes runs on a GPU in test_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

import vllm_mla_fusion as mla

from .conftest import OP_BACKENDS
from .mla_cases import (
    FP8_DTYPES,
    LAYOUT_NAMES,
    WIDE_ROWS,
    fp8_near_ties,
    make_case,
    out_of_range_slot_case,
    scaled_fp8_case,
    widen_rows,
)
from .mla_reference import (
    check_decode_rope_cache_write,
    check_identity_rope_stores,
    check_prefill_rope_cache_write,
    check_rope_cache_write,
)

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


def _run_prefill(case, backend):
    mla.mla_prefill_rope_cache_write(*case.prefill_args(), key_start=case.key_start, backend=backend)
    check_prefill_rope_cache_write(case)


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
        # Latent wider than one tile (BLOCK_L is capped at 512): the kernel's tail loop.
        dict(L=640, R=64, T=3, H=2),
        dict(L=1024, R=16, T=2, H=2, cache_dtype=torch.uint8, kv_cache_dtype="fp8", scale=0.3),
        # Both documented ranks of kv_c and k_pe.
        dict(kv_c_3d=True),
        dict(kv_c_3d=True, k_pe_3d=True),
        dict(kv_c_3d=True, k_pe_3d=True, strided=False, T=1),
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
        dict(L=640, R=64, T=3, H=2),
        dict(L=1024, R=16, T=2, H=3, cache_dtype=torch.uint8, kv_cache_dtype="fp8", scale=0.3,
             q_out_dtype=torch.float8_e4m3fn, q_scale=0.4),
        dict(kv_c_3d=True),
        dict(kv_c_3d=True, k_pe_3d=True, is_nope_first=False),
    ],
    ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()),
)
def test_decode_layouts(backend, layout):
    layout = {"T": 9, "H": 2, **layout}
    case = make_case(decode=True, seed=3, **layout)
    _run_decode(case, backend)


OPS = ("rope_cache_write", "decode", "prefill")
_RUN = {"rope_cache_write": _run_rope, "decode": _run_decode, "prefill": _run_prefill}
# The tensors only one op takes.
OP_ONLY = {"ql_nope": "decode", "q_out": "decode", "q_scale": "decode", "k_nope": "prefill", "k_out": "prefill"}


def _op_case(op: str, store: str, **kw):
    """A case for ``op`` with bf16 outputs, or with an fp8 cache and fp8 q_out/k_out (scaled where
    the op takes a scale: the key has none)."""
    if store == "fp8":
        kw = dict(dict(cache_dtype=torch.uint8, kv_cache_dtype="fp8", scale=0.37), **kw)  # kw may set the scale
        if op == "decode":
            kw = dict(dict(q_out_dtype=torch.float8_e4m3fn, q_scale=0.7), **kw)
        if op == "prefill":
            kw.update(k_out_dtype=torch.float8_e4m3fn)
    return make_case(decode=op == "decode", prefill=op == "prefill", **kw)


# (tensor, relayout) for every tensor argument: a last-dim stride of 2 at an odd offset into a
# wider parent, or the first two dims swapped in memory (column-major cos/sin, ql_nope as a
# per-head bmm output, a head-major q_out or k_out, a block-minor cache).
RELAYOUTS = [(name, "inner_stride") for name in LAYOUT_NAMES] + [
    (name, "transposed")
    for name in ("q_pe", "k_pe", "kv_c", "cos_sin_cache", "kv_cache", "ql_nope", "q_out", "k_nope", "k_out")
]
# Only combinations that mean something: a tensor of another op's signature is not an argument, a
# scale is read only for fp8 outputs.
RELAYOUT_CASES = [
    (op, store, name, how)
    for op in OPS
    for store in ("bf16", "fp8")
    for name, how in RELAYOUTS
    if OP_ONLY.get(name, op) == op and (store == "fp8" or not name.endswith("scale"))
]


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("op,store,name,how", RELAYOUT_CASES, ids=["-".join(c) for c in RELAYOUT_CASES])
def test_every_tensor_in_any_layout(backend, op, store, name, how):
    """Each tensor argument with a non-unit inner stride (or non-contiguous), one at a time:
    results as specified, and the parent's bytes around the view untouched."""
    case = _op_case(op, store, T=7, H=3, seed=RELAYOUTS.index((name, how)), **{how: (name,)})
    t = getattr(case, name)
    assert not t.is_contiguous() or t.numel() <= 1 and t.storage_offset() == 1, f"{name} was not relaid out"
    _RUN[op](case, backend)


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("far", [False, True], ids=["in_guard_rows", "far_past"])
def test_slots_past_the_cache_write_nothing(backend, op, index_dtype, block_size, cache, far):
    """A slot >= num_blocks * block_size is treated like a negative slot: no write, no crash, and
    the rest of the batch (its q/k rotation, q_out or k_out, the in-range rows) unaffected."""
    case, cap = out_of_range_slot_case(
        make=lambda **kw: _op_case(op, cache, **kw), block_size=block_size, index_dtype=index_dtype, far=far,
        seed=block_size + index_dtype.itemsize,
    )  # fmt: skip
    _RUN[op](case, backend)  # checks the guard rows through the parent
    rows = case.kv_cache.view(-1, case.kv_cache.shape[-1])
    before = case.originals["kv_cache"].view(rows.shape)
    for slot in (0, 5, cap - 1):  # the in-range slots really were written (not left as canary)
        assert not torch.equal(rows[slot], before[slot]), f"slot {slot} was not written"


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
def test_addressing_past_2_to_the_31_elements(backend, op, index_dtype):
    """A bf16 cache of more than 2**31 elements written near its end: slot arithmetic must be
    64-bit. ~4.3 GB allocated with torch.empty, but only the touched pages become resident
    (under 1 GB with the interpreter), so this runs on a CPU in a few seconds."""
    L, R, bs = 512, 64, 64
    num_blocks = (2**31 // (bs * (L + R))) + 8
    kv_cache = torch.empty(num_blocks, bs, L + R, dtype=torch.bfloat16)
    assert kv_cache.numel() > 2**31
    T, H = 4, 2
    case = _op_case(op, "bf16", T=T, H=H, L=L, R=R, block_size=bs, pad_every=0, seed=5)
    last = num_blocks * bs - 1
    slots = torch.tensor([last - 3 * i for i in range(T)], dtype=index_dtype)
    flat = kv_cache.view(-1, L + R)
    canary = {r: float(i + 2) for i, r in enumerate((0, 1, last - 1, last - 2, last - 4, last - 5))}
    for r, v in canary.items():
        flat[r].fill_(v)
    c = case
    if op == "decode":
        mla.mla_decode_rope_cache_write(c.positions, c.ql_nope, c.q_pe, c.k_pe, c.kv_c, c.cos_sin_cache, False, slots,
                                        kv_cache, c.q_out, backend=backend)  # fmt: skip
    elif op == "prefill":
        mla.mla_prefill_rope_cache_write(c.positions, c.q_pe, c.k_pe, c.kv_c, c.k_nope, c.cos_sin_cache, False, slots,
                                         kv_cache, c.k_out, backend=backend)  # fmt: skip
    else:
        mla.mla_rope_cache_write(c.positions, c.q_pe, c.k_pe, c.kv_c, c.cos_sin_cache, False, slots, kv_cache,
                                 backend=backend)  # fmt: skip
    rows = flat[slots.long()]
    assert torch.equal(rows[:, :L], case.kv_c), "rows near the end of the cache hold kv_c"
    for r, v in canary.items():  # neighbours, and the start a wrapped 32-bit index would hit
        assert (flat[r] == v).all(), f"row {r} changed"


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("op", OPS)
def test_token_rows_beyond_int32_offsets(backend, op):
    """A token-indexed tensor (q_pe rotated in place, q_out, k_out) whose rows lie 2**27 elements
    apart, rows from token 16 on at or past 2**31 elements: token and row offsets must be 64-bit
    (32-bit ones wrap 2**32 elements back, far outside the allocation: the interpreter's process
    crashes), every row as specified, the canary around the rows untouched. ~5 GB allocated with
    torch.empty, little of it resident (test_gpu.py's twin runs on a GPU)."""
    T, stride = 20, 2**27
    case = _op_case(op, "bf16", T=T, H=2, L=64, R=16, seed=21)
    check_bands = widen_rows(case, WIDE_ROWS[op], stride)
    _RUN[op](case, backend)
    check_bands()


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


# Tiles forced small (2 tokens per cache program, 4 rows per query program), so that the last
# program of each kind lies partly past the tokens.
# (op, T, key_start, more of the case): a latent width past one 512-column step (the stores' tail
# loops) and fp8 scales that are powers of two (the programs specialized to them) too.
TILED_CASES = [(op, T, 0, {}) for op in OPS for T in (1, 7)] + [("prefill", 9, 3, {})] + [
    (op, 5, 0, {"L": 640, "is_neox": True}) for op in OPS] + [(op, 7, 0, {"pow2_scales": True}) for op in OPS]
TILED_IDS = [f"{op}-T{T}-s{s}" + "".join(f"-{k}" for k in kw) for op, T, s, kw in TILED_CASES]


@pytest.mark.parametrize("op,T,key_start,more", TILED_CASES, ids=TILED_IDS)
@pytest.mark.parametrize("store", ["bf16", "fp8"])
def test_small_forced_tiles(op, T, key_start, more, store):
    """Every op and store with tiles of 2 tokens (cache programs) and 4 rows (query programs), the
    last program's tile partly past the tokens: results as specified, nothing else written
    (test_triton_launch checks the grid)."""
    pytest.importorskip("triton")
    from vllm_mla_fusion.backends import triton as tb

    more = dict(more)
    if more.pop("pow2_scales", False) and store == "fp8":  # (bf16 outputs have no scale)
        more.update(scale=1.0, **({"q_scale": 2.0} if op == "decode" else {}))
    case = _op_case(op, store, T=T, H=3, seed=100 + T, key_start=key_start, **more)
    cfg = dict(BLOCK_T=2, BLOCK_ROWS=4, BLOCK_H=2, num_warps=4, USE_PDL=False)
    with tb.forced_launch_config(cfg):
        _RUN[op](case, "triton")


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


# 0.37 and 1/3: the reciprocal product rounds to the other side of a boundary for dozens of the
# near-tie values (asserted below); 2.5 has few significant bits, so x / 2.5 hits ties exactly.
SCALES = [0.37, 1 / 3, 2.5]


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("scale", SCALES, ids=lambda s: f"{s:.3g}")
def test_scaled_fp8_stores_match_torch_bit_for_bit(backend, dtype, scale):
    """With a scale, every fp8 store (cache latent and rope parts, q_out nope and rope parts) is
    byte-identical to torch's saturate(x / scale) with the float32 division, on values whose
    quotient is on or next to an fp8 rounding boundary. (The interpreter's fma is made exact by
    tests/exact_interpreter.py, so this runs the kernel's reciprocal + residual algorithm as a GPU
    does; test_gpu.py repeats it on the GPU.)"""
    x = fp8_near_ties(dtype, scale)
    s = torch.tensor(scale, dtype=torch.float32)
    fmax = torch.finfo(dtype).max
    exact = (x / s).clamp(-fmax, fmax).to(dtype).view(torch.uint8)
    if scale == 2.5:
        assert ((x.double() / s.double()) == (x / s).double()).sum() >= 100, "2.5 must give exact ties"
    else:  # the values distinguish a correctly rounded quotient from the bare reciprocal product
        assert ((x * (1 / s)).clamp(-fmax, fmax).to(dtype).view(torch.uint8) != exact).sum() >= 20
    case = scaled_fp8_case(dtype, scale, T=4, H=2, L=512, R=16, seed=31)
    _run_decode(case, backend)  # latent parts byte-exact, rope within one rounding
    check_identity_rope_stores(case)  # rope parts byte-exact too


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.5, 2.0**-100, 2.0**100, 1 - 2.0**-24, 1 + 2.0**-23], ids=lambda s: f"{s:.9g}")
def test_every_fp8_store_at_power_of_two_scales_and_next_to_them(backend, dtype, scale):
    """As above at powers of two (the Triton kernel's programs take the bare reciprocal product
    there) and the scales next to 1 (the residual step), with the cache's scale and q_scale both
    set: every store of op 2, the cache's and q_out's, latent and rope parts, byte-identical to
    torch's saturate(x / scale). (The largest scales would overflow the case's values: the latent
    test below covers 2**126 and 2**127.)"""
    case = scaled_fp8_case(dtype, scale, T=4, H=2, L=512, R=16, seed=37)
    _run_decode(case, backend)
    check_identity_rope_stores(case)


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("T,H", [(1, 1), (3, 16), (7, 3), (2, 128), (33, 2)])
@pytest.mark.parametrize("is_neox", [False, True])
def test_prefill_sizes(backend, T, H, is_neox):
    case = make_case(T=T, H=H, is_neox=is_neox, prefill=True, seed=100 + 7 * T + H)
    _run_prefill(case, backend)


# Scales at and around powers of two store the correctly rounded division too: 1.0 (vLLM's default),
# 2**-126 and 2**126 (reciprocal normal), 2**127 (reciprocal subnormal), subnormal scales, and the
# non-powers of two next to 1, where the bare product with the reciprocal would store other codes
# than the division (1 - 2**-24: ~120 of each format's near-ties). A faster path for powers of two
# (issue 41's S1) must keep this.
EDGE_SCALES = [1.0, 0.5, 2.0**-126, 2.0**126, 2.0**127, 2.0**-127, 1.5 * 2.0**-127, 1 - 2.0**-24, 1 + 2.0**-23]


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("scale", EDGE_SCALES, ids=lambda s: f"{s:.9g}")
def test_power_of_two_scales_and_their_edges_store_the_division(backend, dtype, scale):
    """The cache's latent part at values whose quotient is on or next to an fp8 rounding boundary
    (plus zeros, overflows and infinities) is byte-identical to the float64 reference:
    saturate(x / scale) rounded once to float32 (53 >= 2 * 24 + 2 bits, so the same as torch's
    float32 division), then to fp8."""
    special = torch.tensor([0.0, -0.0, 1.0, -3.0, 1e30, -1e30, float("inf"), -float("inf")])
    x = torch.cat((fp8_near_ties(dtype, scale), special))
    L, R = 512, 16
    T = -(-x.numel() // L)
    kv_c = (torch.empty(T * L).uniform_(-2, 2).double() * scale).float()
    kv_c[: x.numel()] = x
    case = make_case(T=T, H=1, L=L, R=R, act_dtype=torch.float32, cache_dtype=dtype, scale=scale, pad_every=0,
                     seed=17)  # fmt: skip
    case.kv_c = kv_c.view(T, L)
    mla.mla_rope_cache_write(*case.rope_args(), backend=backend)
    slots = case.slot_mapping[:T].long()
    bs = case.kv_cache.shape[1]
    got = case.kv_cache[slots // bs, slots % bs][:, :L].reshape(-1).view(torch.uint8)
    fmax = torch.finfo(dtype).max
    want = (kv_c.double() / scale).float().clamp(-fmax, fmax).to(dtype).view(torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, (f"{bad.numel()} fp8 codes differ, e.g. x={kv_c[bad[:4]].tolist()} "
                              f"got {got[bad[:4]].tolist()} want {want[bad[:4]].tolist()}")  # fmt: skip


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize(
    "cache_dtype,kv_cache_dtype,scale,k_out_dtype,act_dtype",
    [
        (torch.bfloat16, "auto", None, torch.bfloat16, torch.bfloat16),
        (torch.float16, "auto", None, torch.float16, torch.float16),
        (torch.float32, "auto", None, torch.float32, torch.float32),
        (torch.uint8, "fp8", 0.4, torch.bfloat16, torch.bfloat16),
        (torch.uint8, "fp8", 0.4, torch.float8_e4m3fn, torch.bfloat16),
        (torch.float8_e4m3fnuz, "auto", 0.2, torch.float8_e4m3fnuz, torch.bfloat16),
        (torch.uint8, "fp8_e5m2", 2.0, torch.float8_e5m2, torch.float16),
        (torch.bfloat16, "auto", None, torch.float8_e4m3fn, torch.bfloat16),
    ],
    ids=str,
)
def test_prefill_dtypes(backend, cache_dtype, kv_cache_dtype, scale, k_out_dtype, act_dtype):
    case = make_case(T=6, H=3, prefill=True, cache_dtype=cache_dtype, kv_cache_dtype=kv_cache_dtype, scale=scale,
                     k_out_dtype=k_out_dtype, act_dtype=act_dtype, seed=17)  # fmt: skip
    _run_prefill(case, backend)


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize(
    "layout",
    [
        dict(block_size=1, positions="out_of_range"),
        dict(block_size=64, block_pad=24, index_dtype=torch.int32),
        dict(pad_every=1),  # padded tokens write no cache row but still get their key row
        dict(strided=False, k_pe_3d=True, cs_dtype=torch.bfloat16),
        dict(k_out_strided=True),
        dict(L=48, R=10, nope_dim=20, is_neox=True),
        dict(nope_dim=700, H=2, T=3),  # a nope width past one 512-column tile
        dict(L=512, R=64, nope_dim=128, T=2, H=16),  # DeepSeek dims
        dict(L=640, R=64, nope_dim=128, T=3, H=2),  # a latent width past one tile
        dict(kv_c_3d=True, k_pe_3d=True),  # both documented ranks
    ],
    ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()),
)
def test_prefill_layouts(backend, layout):
    layout = {"T": 9, "H": 2, **layout}
    case = make_case(prefill=True, seed=29, **layout)
    _run_prefill(case, backend)


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2])
def test_prefill_fp8_key_saturates(backend, dtype):
    """An fp8 key clamps values past the format's range, where tensor.to(fp8) gives NaN
    (e4m3fnuz) or inf (e5m2); NaN stays NaN."""
    case = make_case(T=4, H=2, prefill=True, k_out_dtype=dtype, pad_every=0, seed=31)
    case.k_nope.mul_(1e5)
    case.k_nope[0, 0, 0] = float("nan")
    case.snapshot()
    mla.mla_prefill_rope_cache_write(*case.prefill_args(), backend=backend)
    nope = case.k_out[..., : case.k_nope.shape[-1]].float()
    assert nope.isnan().sum() == 1 and nope[0, 0, 0].isnan()
    assert nope.nan_to_num().abs().max() == torch.finfo(dtype).max
    check_prefill_rope_cache_write(case)


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_prefill_matches_op1_plus_concat(backend):
    """Op 3 is op 1 followed by vLLM's key concat: same q_pe, k_pe and cache bytes, and the key
    torch.cat would build from the rotated k_pe (for a k_out of the input dtype)."""
    a = make_case(T=11, H=4, prefill=True, cache_dtype=torch.uint8, kv_cache_dtype="fp8", scale=0.3, seed=37)
    b = make_case(T=11, H=4, prefill=True, cache_dtype=torch.uint8, kv_cache_dtype="fp8", scale=0.3, seed=37)
    mla.mla_prefill_rope_cache_write(*a.prefill_args(), backend=backend)
    mla.mla_rope_cache_write(*b.rope_args(), backend=backend)
    for name in ("q_pe", "k_pe", "kv_cache"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    key = torch.cat((b.k_nope, b.k_pe[:, None, :].expand(-1, 4, -1)), dim=-1)
    assert torch.equal(a.k_out, key)


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("T,H,key_start", [(9, 2, 1), (9, 2, 4), (9, 2, 8), (9, 2, 9), (5, 16, 3), (40, 3, 17)])
@pytest.mark.parametrize("is_neox", [False, True])
def test_prefill_key_start(backend, T, H, key_start, is_neox):
    """A mixed batch in one launch: every token rotated and cached, key rows for tokens from
    key_start on only (key_start = T: op 1 alone). k_out is a view into a wider buffer, so a key
    row written for a token before key_start, or past the last, lands where the check sees it."""
    case = make_case(T=T, H=H, is_neox=is_neox, prefill=True, key_start=key_start, k_out_strided=True,
                     seed=200 + T + key_start)  # fmt: skip
    _run_prefill(case, backend)


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_prefill_key_start_is_op1_on_the_decode_rows_plus_op3_on_the_rest(backend):
    """key_start = s gives the bytes op 1 on tokens [0, s) and op 3 on tokens [s, T) give."""
    T, H, s = 13, 4, 5
    kw = dict(T=T, H=H, prefill=True, cache_dtype=torch.uint8, kv_cache_dtype="fp8", scale=0.3, key_start=s,
              pad_every=0, seed=41)  # fmt: skip
    a, b = make_case(**kw), make_case(**kw)
    mla.mla_prefill_rope_cache_write(*a.prefill_args(), key_start=s, backend=backend)
    head = [t[:s] for t in (b.positions, b.q_pe, b.k_pe, b.kv_c)]
    mla.mla_rope_cache_write(*head, b.cos_sin_cache, b.is_neox, b.slot_mapping[:s], b.kv_cache, b.kv_cache_dtype,
                             b.kv_cache_scale, backend=backend)  # fmt: skip
    tail = [t[s:T] for t in (b.positions, b.q_pe, b.k_pe, b.kv_c)]
    mla.mla_prefill_rope_cache_write(*tail, b.k_nope, b.cos_sin_cache, b.is_neox, b.slot_mapping[s:T], b.kv_cache,
                                     b.k_out, b.kv_cache_dtype, b.kv_cache_scale, backend=backend)  # fmt: skip
    for name in ("q_pe", "k_pe", "kv_cache", "k_out"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
