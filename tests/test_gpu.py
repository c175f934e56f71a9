"""The op matrix on a real GPU at DeepSeek-V3 sizes, CUDA-graph capture/replay, 64-bit addressing,
slots past the cache, every tensor layout, and bit-exact scaled fp8 stores.

Marked ``gpu``: skipped (with the reason) on machines without one. Run on an
H200 by scripts/gpu_check.sh.
"""

from __future__ import annotations

import pytest
import torch

import vllm_mla_fusion as mla
from vllm_mla_fusion import binding

pytest.importorskip("triton", reason="the GPU tests run the Triton kernel")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from vllm_mla_fusion.backends import triton as triton_backend  # noqa: E402

from .mla_cases import (  # noqa: E402
    FP8_DTYPES,
    WIDE_ROWS,
    make_case,
    out_of_range_slot_case,
    scaled_fp8_case,
    widen_rows,
)
from .mla_reference import (  # noqa: E402
    check_decode_rope_cache_write,
    check_identity_rope_stores,
    check_prefill_rope_cache_write,
    check_rope_cache_write,
)

pytestmark = pytest.mark.gpu

DSV3 = dict(L=512, R=64)
DSV3_PREFILL = dict(L=512, R=64, nope_dim=128, prefill=True)
CACHES = [
    (torch.bfloat16, "auto", None),
    (torch.float16, "auto", None),
    (torch.float32, "auto", None),
    (torch.uint8, "fp8", 0.37),
    (torch.float8_e4m3fn, "auto", 1.0),
    (torch.uint8, "fp8_e5m2", 2.0),
    (torch.float8_e4m3fnuz, "auto", 0.2),  # no native type on NVIDIA: the kernel encodes the bits
]


@pytest.mark.parametrize("T", [1, 3, 16, 64, 257, 2048])
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("block_size", [1, 64])
@pytest.mark.parametrize("is_neox", [False, True])
def test_rope_cache_write_dsv3(T, H, block_size, is_neox):
    case = make_case(T=T, H=H, block_size=block_size, is_neox=is_neox, device="cuda", seed=T + H, **DSV3)
    mla.mla_rope_cache_write(*case.rope_args(), backend="triton")
    check_rope_cache_write(case)


@pytest.mark.parametrize("cache_dtype,kv_cache_dtype,scale", CACHES, ids=str)
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
def test_rope_cache_write_dtypes_dsv3(cache_dtype, kv_cache_dtype, scale, act_dtype):
    case = make_case(T=100, H=16, cache_dtype=cache_dtype, kv_cache_dtype=kv_cache_dtype, scale=scale,
                     act_dtype=act_dtype, block_pad=64, index_dtype=torch.int32, positions="out_of_range",
                     device="cuda", seed=1, **DSV3)  # fmt: skip
    mla.mla_rope_cache_write(*case.rope_args(), backend="triton")
    check_rope_cache_write(case)


@pytest.mark.parametrize("T,H", [(16384, 16), (4096, 128)])
def test_rope_cache_write_large_prefill(T, H):
    case = make_case(T=T, H=H, block_size=64, pad_every=97, device="cuda", seed=2, **DSV3)
    mla.mla_rope_cache_write(*case.rope_args(), backend="triton")
    check_rope_cache_write(case)


@pytest.mark.parametrize("T", [1, 8, 64, 512])
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("q_out", [(torch.bfloat16, None), (torch.float8_e4m3fn, 0.3)], ids=str)
@pytest.mark.parametrize("is_nope_first", [True, False])
def test_decode_dsv3(T, H, q_out, is_nope_first):
    fp8 = q_out[0] == torch.float8_e4m3fn
    case = make_case(T=T, H=H, decode=True, q_out_dtype=q_out[0], q_scale=q_out[1], is_nope_first=is_nope_first,
                     cache_dtype=torch.uint8 if fp8 else torch.bfloat16, kv_cache_dtype="fp8" if fp8 else "auto",
                     scale=0.5 if fp8 else None, block_size=64, device="cuda", seed=T * H, **DSV3)  # fmt: skip
    mla.mla_decode_rope_cache_write(*case.decode_args(), is_nope_first=is_nope_first, backend="triton")
    check_decode_rope_cache_write(case)


@pytest.mark.parametrize("T", [1, 3, 16, 64, 257, 2048])
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("k_out_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("block_size", [1, 64])
def test_prefill_dsv3(T, H, k_out_dtype, block_size):
    case = make_case(T=T, H=H, k_out_dtype=k_out_dtype, block_size=block_size, device="cuda", seed=T + 3 * H,
                     **DSV3_PREFILL)  # fmt: skip
    mla.mla_prefill_rope_cache_write(*case.prefill_args(), backend="triton")
    check_prefill_rope_cache_write(case)


@pytest.mark.parametrize("cache_dtype,kv_cache_dtype,scale", CACHES, ids=str)
@pytest.mark.parametrize("k_out_dtype", [None, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz], ids=str)
def test_prefill_dtypes_dsv3(cache_dtype, kv_cache_dtype, scale, k_out_dtype):
    case = make_case(T=100, H=16, cache_dtype=cache_dtype, kv_cache_dtype=kv_cache_dtype, scale=scale,
                     k_out_dtype=k_out_dtype, k_out_strided=True, block_pad=64, index_dtype=torch.int32,
                     positions="out_of_range", device="cuda", seed=4, **DSV3_PREFILL)  # fmt: skip
    mla.mla_prefill_rope_cache_write(*case.prefill_args(), backend="triton")
    check_prefill_rope_cache_write(case)


@pytest.mark.parametrize("T,key_start", [(2, 1), (64, 63), (300, 17), (2048, 1500)])
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("k_out_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_prefill_key_start_dsv3(T, key_start, H, k_out_dtype):
    """A mixed step in one launch: decode tokens first (no key row), then the prefill tokens."""
    case = make_case(T=T, H=H, k_out_dtype=k_out_dtype, key_start=key_start, k_out_strided=True, block_size=64,
                     device="cuda", seed=T + key_start, **DSV3_PREFILL)  # fmt: skip
    mla.mla_prefill_rope_cache_write(*case.prefill_args(), key_start=key_start, backend="triton")
    check_prefill_rope_cache_write(case)


@pytest.mark.parametrize("T,H", [(16384, 16), (4096, 128)])
def test_prefill_large(T, H):
    case = make_case(T=T, H=H, block_size=64, pad_every=97, device="cuda", seed=6, **DSV3_PREFILL)
    mla.mla_prefill_rope_cache_write(*case.prefill_args(), backend="triton")
    check_prefill_rope_cache_write(case)


@pytest.mark.parametrize("cache_dtype,kv_cache_dtype,scale", CACHES, ids=str)
def test_fp8_bit_encoder_matches_native_conversion(monkeypatch, cache_dtype, kv_cache_dtype, scale):
    """The kernel's own fp8 encoder (used by the interpreter and for e4m3fnuz on NVIDIA) and the
    GPU's conversion instructions produce the same bytes."""
    outs = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(triton_backend, "_native_fp8_ok", lambda device, dtype: False)
        case = make_case(T=300, H=16, decode=True, q_out_dtype=torch.float8_e4m3fn, q_scale=0.1,
                         cache_dtype=cache_dtype, kv_cache_dtype=kv_cache_dtype, scale=scale, pad_every=0,
                         device="cuda", seed=3, **DSV3)  # fmt: skip
        mla.mla_decode_rope_cache_write(*case.decode_args(), backend="triton")
        key = make_case(T=300, H=16, k_out_dtype=torch.float8_e5m2, cache_dtype=cache_dtype,
                        kv_cache_dtype=kv_cache_dtype, scale=scale, pad_every=0, device="cuda", seed=3,
                        **DSV3_PREFILL)  # fmt: skip
        mla.mla_prefill_rope_cache_write(*key.prefill_args(), backend="triton")
        outs.append((case.kv_cache.view(torch.uint8).clone(), case.q_out.view(torch.uint8).clone(),
                     key.kv_cache.view(torch.uint8).clone(), key.k_out.view(torch.uint8).clone()))  # fmt: skip
    for native, encoded in zip(outs[0], outs[1], strict=True):
        assert torch.equal(native, encoded)


def test_torch_backend_on_gpu_matches_reference():
    case = make_case(T=33, H=16, cache_dtype=torch.uint8, kv_cache_dtype="fp8", scale=0.7, device="cuda", **DSV3)
    mla.mla_rope_cache_write(*case.rope_args(), backend="torch")
    check_rope_cache_write(case)


def test_auto_dispatch_on_gpu_is_triton(monkeypatch):
    calls = []
    original = triton_backend.bind
    monkeypatch.setattr(triton_backend, "bind", lambda *a: (calls.append(1), original(*a))[1])
    case = make_case(T=4, H=16, device="cuda", **DSV3)
    mla.mla_rope_cache_write(*case.rope_args())
    assert calls == [1]
    check_rope_cache_write(case)


@pytest.mark.parametrize("op", ["rope_cache", "decode", "prefill"])
def test_cuda_graph_replay_with_changing_inputs(op):
    """Capture once, then change positions, slots (incl. -1 padding) and activations in place
    between replays, as vLLM's padded batches do; every replay must match the reference."""
    T, H = 32, 16
    kind = dict(decode=op == "decode", prefill=op == "prefill", nope_dim=128)
    base = make_case(T=T, H=H, cache_dtype=torch.uint8, kv_cache_dtype="fp8", scale=0.5, q_out_dtype=torch.bfloat16,
                     block_size=16, device="cuda", seed=0, **kind, **DSV3)  # fmt: skip
    run, check = {
        "rope_cache": (lambda: mla.mla_rope_cache_write(*base.rope_args(), backend="triton"), check_rope_cache_write),
        "decode": (lambda: mla.mla_decode_rope_cache_write(*base.decode_args(), backend="triton"),
                   check_decode_rope_cache_write),
        "prefill": (lambda: mla.mla_prefill_rope_cache_write(*base.prefill_args(), backend="triton"),
                    check_prefill_rope_cache_write),
    }[op]  # fmt: skip
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for step in range(4):
        fresh = make_case(T=T, H=H, cache_dtype=torch.uint8, kv_cache_dtype="fp8", scale=0.5,
                          q_out_dtype=torch.bfloat16, block_size=16, pad_every=step + 2, device="cuda",
                          seed=100 + step, positions="out_of_range" if step == 3 else "random", **kind,
                          **DSV3)  # fmt: skip
        for name in ("positions", "q_pe", "k_pe", "kv_c", "slot_mapping", "kv_cache", "ql_nope", "q_out", "k_nope",
                     "k_out"):  # fmt: skip
            dst = getattr(base, name)
            if dst is not None:
                dst.copy_(getattr(fresh, name))
        base.kv_cache_scale.copy_(fresh.kv_cache_scale)
        base.cos_sin_cache.copy_(fresh.cos_sin_cache)
        base.snapshot()
        graph.replay()
        torch.cuda.synchronize()
        check(base)


def _misaligned_copy(t: torch.Tensor, elements: int = 1) -> torch.Tensor:
    """``t``'s values and strides, starting ``elements`` past a 16-byte boundary."""
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    base = torch.empty(span + 16, dtype=t.dtype, device=t.device)
    view = torch.as_strided(base, t.shape, t.stride(), storage_offset=elements)
    view.copy_(t)
    assert view.data_ptr() % 16 != 0
    return view


@pytest.mark.parametrize("op", ["rope_cache", "decode", "prefill"])
def test_direct_launch_reuses_binaries_only_when_safe(op, monkeypatch):
    """Back-to-back calls as a serving loop makes them, so that the direct launcher
    (backends/triton.py) reuses compiled binaries: repeated shapes, token counts that change
    what Triton specializes on (1, a multiple of 16, neither), and read-only inputs moved off
    16-byte alignment with their strides kept. Each call must match the reference; a binary
    compiled for aligned pointers, reused for misaligned ones, would fail here."""
    binding._SHARED.clear()
    direct = []
    original = triton_backend.BoundLaunch._launch
    monkeypatch.setattr(triton_backend.BoundLaunch, "_launch", lambda *a: (direct.append(1), original(*a))[1])
    kind = dict(decode=op == "decode", prefill=op == "prefill", nope_dim=128)
    run, check = {
        "rope_cache": (lambda c: mla.mla_rope_cache_write(*c.rope_args(), backend="triton"), check_rope_cache_write),
        "decode": (lambda c: mla.mla_decode_rope_cache_write(*c.decode_args(), backend="triton"),
                   check_decode_rope_cache_write),
        "prefill": (lambda c: mla.mla_prefill_rope_cache_write(*c.prefill_args(), backend="triton"),
                    check_prefill_rope_cache_write),
    }[op]  # fmt: skip
    schedule = [(1, False), (1, False), (5, False), (16, False), (16, True), (5, True), (1, True), (300, False),
                (16, False), (1, False)]  # fmt: skip
    for step, (T, misalign) in enumerate(schedule):
        case = make_case(T=T, H=16, block_size=16, device="cuda", seed=1000 + step, **kind, **DSV3)
        if misalign:
            for name in ("positions", "slot_mapping", "kv_c", "cos_sin_cache"):
                setattr(case, name, _misaligned_copy(getattr(case, name)))
            case.snapshot()
        run(case)
        torch.cuda.synchronize()
        check(case)
    assert direct, "no call took the compiled kernel's own launcher"


@pytest.mark.parametrize("op", ["rope_cache", "prefill"])
def test_index_tensors_off_alignment_compile_no_new_variant(op):
    """A mixed step's prefill rows start at row num_decode of vLLM's positions and slot
    mapping: 8 bytes off a 16-byte boundary when num_decode is odd. They must run the variant
    compiled for aligned index tensors (the one vLLM's profile run compiled ahead,
    vllm_plugin/prewarm.py), not compile another inside a request."""
    kind = dict(prefill=op == "prefill", nope_dim=128)
    run, check = {
        "rope_cache": (lambda c: mla.mla_rope_cache_write(*c.rope_args(), backend="triton"), check_rope_cache_write),
        "prefill": (lambda c: mla.mla_prefill_rope_cache_write(*c.prefill_args(), backend="triton"),
                    check_prefill_rope_cache_write),
    }[op]  # fmt: skip
    caches = triton_backend._KERNELS[3 if op == "prefill" else 1].device_caches
    run(make_case(T=64, H=16, block_size=16, device="cuda", seed=71, **kind, **DSV3))
    torch.cuda.synchronize()
    compiled = sum(len(c[0]) for c in caches.values())
    case = make_case(T=64, H=16, block_size=16, device="cuda", seed=72, **kind, **DSV3)
    for name in ("positions", "slot_mapping"):
        setattr(case, name, _misaligned_copy(getattr(case, name)))
    case.snapshot()
    run(case)
    torch.cuda.synchronize()
    check(case)
    assert sum(len(c[0]) for c in caches.values()) == compiled, "off-alignment index tensors compiled a new variant"


def test_addressing_past_2_to_the_31_elements():
    """A bf16 cache of more than 2**31 elements, written near its end: indices must be 64-bit."""
    L, R, bs = 512, 64, 64
    num_blocks = (2**31 // (bs * (L + R))) + 8  # ~2.15e9 elements, ~4.3 GB
    kv_cache = torch.empty(num_blocks, bs, L + R, dtype=torch.bfloat16, device="cuda")
    assert kv_cache.numel() > 2**31
    T, H = 8, 16
    case = make_case(T=T, H=H, L=L, R=R, block_size=bs, pad_every=0, device="cuda", seed=5)
    last = num_blocks * bs - 1
    slots = torch.tensor([last - 3 * i for i in range(T)], device="cuda")
    tail = kv_cache[-2:]
    tail.fill_(7.0)
    kv_cache[:1].fill_(3.0)
    mla.mla_rope_cache_write(case.positions, case.q_pe, case.k_pe, case.kv_c, case.cos_sin_cache, False, slots,
                             kv_cache, backend="triton")  # fmt: skip
    flat = kv_cache.view(-1, L + R)
    rows = flat[slots]
    torch.testing.assert_close(rows[:, :L], case.kv_c.to(torch.bfloat16), rtol=0, atol=0)
    # Rows between the written ones still hold the canary, and the start was not hit by a wrapped index.
    assert (flat[last - 1] == 7.0).all() and (kv_cache[0] == 3.0).all()


@pytest.mark.parametrize("op", list(WIDE_ROWS))
def test_token_rows_beyond_int32_offsets(op):
    """A token-indexed tensor (q_pe rotated in place, q_out, k_out) whose rows lie 2**26 elements
    apart, so that rows from token 32 on start at or past 2**31 elements (~5 GB of bf16): token and
    row offsets must be 64-bit (32-bit ones wrap 2**32 elements back, an illegal address), every row
    is as specified, and the canary around the rows is untouched (test_ops.py's twin runs on a CPU)."""
    T, stride = 40, 2**26
    case = _gpu_case(op, "bf16", T=T, H=16)
    check_bands = widen_rows(case, WIDE_ROWS[op], stride)
    _run_and_check(op, case)
    check_bands()


def _gpu_case(op: str, store: str, **kw):
    """A DeepSeek-V3-sized case for ``op`` on the GPU: bf16, or an fp8 cache and fp8 q_out/k_out."""
    kw = {**DSV3, "nope_dim": 128, **kw}
    if store == "fp8":
        kw.update(cache_dtype=torch.uint8, kv_cache_dtype="fp8", scale=0.37)
        kw.update({"decode": dict(q_out_dtype=torch.float8_e4m3fn, q_scale=0.7),
                   "prefill": dict(k_out_dtype=torch.float8_e4m3fn)}.get(op, {}))  # fmt: skip
    return make_case(decode=op == "decode", prefill=op == "prefill", device="cuda", **kw)


def _run_and_check(op: str, case) -> None:
    if op == "decode":
        mla.mla_decode_rope_cache_write(*case.decode_args(), is_nope_first=case.is_nope_first, backend="triton")
        check_decode_rope_cache_write(case)
    elif op == "prefill":
        mla.mla_prefill_rope_cache_write(*case.prefill_args(), backend="triton")
        check_prefill_rope_cache_write(case)
    else:
        mla.mla_rope_cache_write(*case.rope_args(), backend="triton")
        check_rope_cache_write(case)


# (op, block size, index dtype, store kind): every op, both block sizes, both index dtypes and
# both store kinds, pairwise, so that compute-sanitizer runs them all in seconds.
SLOT_CASES = [("rope_cache_write", 1, torch.int64, "bf16"), ("decode", 64, torch.int32, "fp8"),
              ("prefill", 64, torch.int32, "fp8"), ("rope_cache_write", 64, torch.int32, "fp8"),
              ("decode", 1, torch.int64, "bf16"), ("prefill", 1, torch.int64, "bf16")]  # fmt: skip


@pytest.mark.parametrize("op,block_size,index_dtype,store", SLOT_CASES, ids=str)
def test_out_of_range_slots_write_nothing(op, block_size, index_dtype, store):
    """slot_mapping [0, capacity, 5, capacity + 2, 10**9, capacity - 1, huge, random valid...]:
    the slots at or past the cache's capacity write nothing (canary rows after the cache stay
    byte-identical; scripts/gpu_check.sh's memcheck sees no access past the allocation), the
    rest of the batch is as specified."""
    case, cap = out_of_range_slot_case(T=40, H=16, block_size=block_size, index_dtype=index_dtype, seed=block_size,
                                       make=lambda **kw: _gpu_case(op, store, **kw))  # fmt: skip
    _run_and_check(op, case)


# Layouts the CPU tests cover one tensor at a time, here grouped at DeepSeek-V3 sizes: on a GPU
# Triton specializes unit strides, so a non-unit stride compiles a different kernel. Names of
# tensors another op does not take are dropped for it.
GPU_LAYOUTS = [
    (dict(inner_stride=("positions", "slot_mapping", "q_pe", "k_pe", "kv_c", "cos_sin_cache", "ql_nope", "q_out",
                        "k_nope", "k_out")), "bf16"),
    (dict(transposed=("q_pe", "cos_sin_cache", "ql_nope", "q_out", "k_nope", "k_out")), "bf16"),
    (dict(inner_stride=("kv_cache",)), "bf16"),
    (dict(transposed=("kv_cache", "kv_c")), "fp8"),
    (dict(inner_stride=("kv_cache_scale", "q_scale", "k_out")), "fp8"),
    (dict(kv_c_3d=True, k_pe_3d=True), "bf16"),
    (dict(L=640), "bf16"),
    (dict(L=1024), "fp8"),
]  # fmt: skip
_OTHER_OPS_TENSORS = {"rope_cache_write": ("ql_nope", "q_out", "q_scale", "k_nope", "k_out"),
                      "decode": ("k_nope", "k_out"), "prefill": ("ql_nope", "q_out", "q_scale")}  # fmt: skip


@pytest.mark.parametrize("op", ["rope_cache_write", "decode", "prefill"])
@pytest.mark.parametrize("layout,store", GPU_LAYOUTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items())
                         if isinstance(v, dict) else v)  # fmt: skip
def test_layouts_dsv3(op, layout, store):
    layout = {k: tuple(n for n in v if n not in _OTHER_OPS_TENSORS[op]) if k in ("inner_stride", "transposed") else v
              for k, v in layout.items()}  # fmt: skip
    _run_and_check(op, _gpu_case(op, store, T=33, H=16, seed=17, **layout))


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("scale", [0.37, 1 / 3, 2.5], ids=lambda s: f"{s:.3g}")
@pytest.mark.parametrize("native", [True, False], ids=["native_conversion", "bit_encoder"])
def test_scaled_fp8_stores_are_bit_exact(monkeypatch, dtype, scale, native):
    """Every scaled fp8 store (cache latent and rope parts, q_out nope and rope parts) is
    byte-identical to torch's saturate(x / scale) on the GPU (float32 division), over random
    inputs and crafted near-ties and ties of the fp8 grid (tests/mla_cases.py, fp8_near_ties),
    through the GPU's fp8 conversion and through the kernel's bit encoder. Identity cos/sin make
    the rotated values exact, so the rope parts are compared bit for bit too."""
    if not native:
        monkeypatch.setattr(triton_backend, "_native_fp8_ok", lambda device, dtype: False)
    case = scaled_fp8_case(dtype, scale, T=64, H=16, L=512, R=64, device="cuda", seed=41)
    mla.mla_decode_rope_cache_write(*case.decode_args(), backend="triton")
    check_decode_rope_cache_write(case)  # latent parts byte-exact
    check_identity_rope_stores(case)


SANITIZE_CASES = [
    dict(T=1, H=16, block_size=1),
    dict(T=257, H=16, block_size=64, block_pad=64, positions="out_of_range"),
    dict(T=33, H=128, cache_dtype=torch.uint8, kv_cache_dtype="fp8", scale=0.4, k_pe_3d=True),
    dict(T=20, H=16, cache_dtype=torch.float8_e4m3fnuz, scale=0.2, is_neox=True, index_dtype=torch.int32),
    dict(T=64, H=16, pad_every=1),
]


@pytest.mark.parametrize("layout", SANITIZE_CASES, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_sanitize_core_cases(layout):
    """A compact set covering the three ops, every store mode and the padding/clamping paths;
    scripts/gpu_check.sh runs these under compute-sanitizer (memcheck and racecheck)."""
    case = make_case(device="cuda", seed=21, **DSV3, **layout)
    mla.mla_rope_cache_write(*case.rope_args(), backend="triton")
    check_rope_cache_write(case)
    fp8 = layout.get("cache_dtype") in (torch.uint8, torch.float8_e4m3fnuz)
    case = make_case(device="cuda", seed=22, decode=True, q_out_dtype=torch.float8_e4m3fn if fp8 else None,
                     q_scale=0.3 if fp8 else None, **DSV3, **layout)  # fmt: skip
    mla.mla_decode_rope_cache_write(*case.decode_args(), backend="triton")
    check_decode_rope_cache_write(case)
    for key_start in sorted({0, layout["T"] // 3}):  # a prefill-only step, and a mixed one's decode rows first
        case = make_case(device="cuda", seed=23, prefill=True, nope_dim=128, k_out_strided=True, key_start=key_start,
                         k_out_dtype=torch.float8_e4m3fn if fp8 else None, **DSV3, **layout)  # fmt: skip
        mla.mla_prefill_rope_cache_write(*case.prefill_args(), key_start=key_start, backend="triton")
        check_prefill_rope_cache_write(case)


@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_native_fp8_store_saturates(q_dtype):
    """The GPU's own fp8 conversion path stores the finite max for overflowing values
    (huge inputs, tiny scales, infinities) and keeps NaN, like the reference."""
    case = make_case(T=40, H=16, decode=True, cache_dtype=torch.uint8, kv_cache_dtype="fp8", scale=1e-4,
                     q_out_dtype=q_dtype, q_scale=1e-4, pad_every=0, device="cuda", seed=8, **DSV3)  # fmt: skip
    case.ql_nope[0, 0, :4] = torch.tensor([float("inf"), -float("inf"), 1e30, -1e30], dtype=case.ql_nope.dtype)
    case.snapshot()
    mla.mla_decode_rope_cache_write(*case.decode_args(), backend="triton")
    fmax = torch.finfo(q_dtype).max
    assert case.q_out[0, 0, :4].float().tolist() == [fmax, -fmax, fmax, -fmax]
    # The rest (most of it past the fp8 range too, at this scale) against the reference:
    # replace the four non-finite probes by zeros on both sides first.
    case.ql_nope[0, 0, :4] = 0
    case.q_out[0, 0, :4] = 0
    check_decode_rope_cache_write(case)  # saturated cache rows included


def test_torch_compile_with_cuda_graphs():
    """Inductor + CUDA graphs ("reduce-overhead"), fullgraph: the three ops inside one compiled step
    that slices its inputs the way vLLM's MLA forward does; replays match eager calls."""
    torch._dynamo.reset()
    T, H, L, R, nope = 24, 16, 512, 64, 128

    def step(q, kv_a, ql_nope, kv_nope, positions, cos_sin_cache, slot_mapping, kv_cache, q_out, k_out, scale):
        kv_c, k_pe = kv_a.split([L, R], dim=-1)
        kv_c = kv_c * 1.0
        a, b = T // 3, 2 * T // 3  # decode tokens first, then prefill tokens (op 1, then op 3)
        mla.mla_decode_rope_cache_write(positions[:a], ql_nope[:a], q[:a, :, nope:], k_pe[:a], kv_c[:a],
                                        cos_sin_cache, False, slot_mapping[:a], kv_cache, q_out[:a], "fp8", scale,
                                        scale)  # fmt: skip
        mla.mla_rope_cache_write(positions[a:b], q[a:b, :, nope:], k_pe[a:b], kv_c[a:b], cos_sin_cache, False,
                                 slot_mapping[a:b], kv_cache, "fp8", scale)  # fmt: skip
        mla.mla_prefill_rope_cache_write(positions[b:], q[b:, :, nope:], k_pe[b:], kv_c[b:], kv_nope[b:, :, :nope],
                                         cos_sin_cache, False, slot_mapping[b:], kv_cache, k_out[b:], "fp8",
                                         scale)  # fmt: skip

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def inputs(seed):
        g = gen.manual_seed(seed)
        mk = lambda *s: torch.randn(*s, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
        nb = 4
        return [mk(T, H, nope + R), mk(T, L + R), mk(T, H, L), mk(T, H, nope + 128),
                torch.randint(0, 4096, (T,), generator=g).cuda(),
                torch.randn(4096, R, generator=g).cuda(), torch.randperm(nb * 64, generator=g)[:T].cuda(),
                torch.zeros(nb, 64, L + R, dtype=torch.uint8, device="cuda"),
                torch.zeros(T, H, L + R, dtype=torch.float8_e4m3fn, device="cuda"),
                torch.zeros(T, H, nope + R, dtype=torch.bfloat16, device="cuda"),
                torch.tensor([0.3], device="cuda")]  # fmt: skip

    for seed in range(4):
        eager_args, compiled_args = inputs(seed), inputs(seed)
        step(*eager_args)
        compiled(*compiled_args)
        torch.cuda.synchronize()
        for a, b in zip(eager_args, compiled_args):  # q rotated in place, the cache, q_out and k_out written
            assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(torch.uint8)
                               if b.dtype.itemsize == 1 else b)  # fmt: skip


@pytest.mark.parametrize("op", ["rope_cache", "decode", "prefill", "prefill-mixed"])
def test_bound_ops_never_synchronize_with_the_gpu(op):
    """What a fused vLLM layer calls per step (binding.BoundOp, then the public op) makes no call
    that waits for the GPU: under torch's sync debug mode "error" any synchronizing CUDA call
    (a .item(), a host copy, a nonzero) raises. First calls of a layout (validation, Triton's
    compile) are included; every result is then checked against the reference."""
    from vllm_mla_fusion.binding import BoundOp
    from vllm_mla_fusion.opcodes import OP_DECODE, OP_PREFILL, OP_ROPE_CACHE

    kind = dict(decode=op == "decode", prefill=op.startswith("prefill"), nope_dim=128)
    code = {"rope_cache": OP_ROPE_CACHE, "decode": OP_DECODE}.get(op, OP_PREFILL)
    bound = BoundOp(code, is_neox=False, backend="triton")
    cases = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step, T in enumerate((1, 7, 64, 300, 7)):
            s = T // 3 if op == "prefill-mixed" else 0
            torch.cuda.set_sync_debug_mode(0)  # building the case copies from the host
            case = make_case(T=T, H=16, block_size=16, device="cuda", seed=2000 + step, key_start=s, **kind, **DSV3)
            torch.cuda.set_sync_debug_mode("error")
            base = (case.positions, case.q_pe, case.k_pe, case.kv_c, case.cos_sin_cache, case.slot_mapping,
                    case.kv_cache, case.kv_cache_scale)  # fmt: skip
            if code == OP_DECODE:
                bound(*base, case.ql_nope, case.q_out, case.q_scale)
            elif code == OP_PREFILL:
                bound(*base, case.k_nope, case.k_out, None, s)
            else:
                bound(*base)
            cases.append(case)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    check = {OP_ROPE_CACHE: check_rope_cache_write, OP_DECODE: check_decode_rope_cache_write,
             OP_PREFILL: check_prefill_rope_cache_write}[code]  # fmt: skip
    for case in cases:
        check(case)


# --- early index loads (issue 41, S2): safe only where the kernel before ours does not write them ---


@triton.jit
def _late_writer(dst_ptr, src_ptr, n, DELAY_NS: tl.constexpr, BLOCK: tl.constexpr):
    """``dst[:n] = src[:n]``, written ``DELAY_NS`` after this kernel starts, having let the next
    kernel start at once (``griddepcontrol.launch_dependents`` first, as kernels that trigger
    their dependents early do): a launch of ours right after it that read ``dst`` before its
    grid-dependency wait would read the old values."""
    tl.extra.cuda.gdc_launch_dependents()
    start = tl.extra.cuda.globaltimer()
    now = start
    while now - start < DELAY_NS:
        now = tl.extra.cuda.globaltimer()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=m), mask=m)


def _stale(name: str, new: torch.Tensor, max_pos: int) -> torch.Tensor:
    """Values of ``name`` that give other results than ``new``: other positions, padding slots
    (no row written), another rope table."""
    if name == "positions":
        return (new + 1) % max_pos
    if name == "slot_mapping":
        return torch.full_like(new, -1)
    return torch.roll(new, 1, 0) * 0.5


@pytest.mark.parametrize("promised", [False, True], ids=["public", "promised-racy"])
@pytest.mark.parametrize("written", ["positions", "slot_mapping", "cos_sin_cache"])
@pytest.mark.parametrize("op", ["rope_cache", "decode", "prefill"])
def test_early_index_loads_only_where_the_kernel_before_writes_none_of_them(op, written, promised, record_property):
    """The kernel launched just before ours writes the positions, the slot mapping or the rope
    table (late: it lets ours start first, then writes 200 us later). Bound as the public ops
    bind it (no ``early_index_loads`` promise), our launch reads them only after its
    grid-dependency wait, so every iteration must match the reference computed with the new
    values: a launch that read them early (the promise ignored, or the flag on by default)
    would read the old ones and fail here. Bound with the promise, which this sequence breaks,
    the reads are early and expected to race: those iterations are only run, and the number
    that read the old values is recorded (``racy_iterations``: above 0 shows that this test
    sees the race it guards against)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    from vllm_mla_fusion.binding import BoundOp
    from vllm_mla_fusion.opcodes import OP_DECODE, OP_PREFILL, OP_ROPE_CACHE

    code = {"rope_cache": OP_ROPE_CACHE, "decode": OP_DECODE, "prefill": OP_PREFILL}[op]
    kind = dict(decode=op == "decode", prefill=op == "prefill", nope_dim=128)
    bound = BoundOp(code, is_neox=False, backend="triton", early_index_loads=promised)
    args, check = {
        OP_ROPE_CACHE: (lambda c: (), check_rope_cache_write),
        OP_DECODE: (lambda c: (c.ql_nope, c.q_out, c.q_scale), check_decode_rope_cache_write),
        OP_PREFILL: (lambda c: (c.k_nope, c.k_out, None), check_prefill_rope_cache_write),
    }[code]  # fmt: skip

    def launch(case):
        bound(case.positions, case.q_pe, case.k_pe, case.kv_c, case.cos_sin_cache, case.slot_mapping, case.kv_cache,
              case.kv_cache_scale, *args(case))  # fmt: skip

    def make(seed):
        return make_case(T=16, H=16, strided=False, block_size=16, device="cuda", seed=seed, **kind, **DSV3)

    launch(make(3000))  # compiles: the iterations below take the direct launcher
    torch.cuda.synchronize()
    (site, _), = bound.sites.values()
    constexprs = site.plan(16).constexprs
    assert constexprs["USE_PDL"] is True and constexprs["EARLY_INDEX_LOADS"] is promised
    racy = 0
    for step in range(20):
        case = make(3001 + step)
        target = getattr(case, written)
        assert target.is_contiguous()
        new = target.clone()
        target.copy_(_stale(written, new, case.cos_sin_cache.shape[0]))
        torch.cuda.synchronize()
        n = new.numel()
        _late_writer[(triton.cdiv(n, 1024),)](target.view(-1), new.view(-1), n, DELAY_NS=200_000, BLOCK=1024)
        launch(case)  # right after it, on the same stream
        torch.cuda.synchronize()
        assert torch.equal(target, new)
        if not promised:
            check(case)
            continue
        try:
            check(case)
        except AssertionError:
            racy += 1
    record_property("racy_iterations", racy)
    print(f"{op} {written} promised={promised}: {racy} of 20 iterations read the old values")
