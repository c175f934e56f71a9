"""AITER's HIP kernel through the public op 2, on a ROCm GPU, against a float64 reference.

Skipped (with the reason) unless torch is a ROCm build, a GPU is visible and
``vllm_mla_fusion.backends.aiter.unavailable_reason`` finds a usable AITER.
Not run yet: this project has had no AMD GPU (docs/rocm.md).

The reference is written here from the op's definition (issue 2) and imports
nothing from the backends. Each case also records whether AITER's op really
ran (a counting wrapper around it), so a silent fallback to Triton cannot
pass for AITER. Tolerance contract:

- the latent parts (``q_out[..., :L]``, cache ``[..., :L]``) are copies:
  bit-exact for non-fp8 outputs;
- the rotated parts are computed in float32 and rounded once: within one
  unit in the last place of the output dtype of the float64 value;
- fp8 outputs: within one fp8 step (AITER multiplies by ``1/scale``);
- every cache row that no token targets keeps its canary bytes.
"""

from __future__ import annotations

import pytest
import torch

import vllm_mla_fusion as mla


def _skip_reason() -> str | None:
    if torch.version.hip is None:
        return "needs a ROCm build of torch (torch.version.hip is None)"
    if not torch.cuda.is_available():
        return "no ROCm GPU visible"
    from vllm_mla_fusion.backends import aiter as ab

    return ab.unavailable_reason(torch.device("cuda", torch.cuda.current_device()))


_REASON = _skip_reason()
pytestmark = [pytest.mark.rocm, pytest.mark.skipif(_REASON is not None, reason=f"AITER HIP op unavailable: {_REASON}")]

L, R = 512, 64
MAX_POS = 8192
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


@pytest.fixture
def aiter_calls(monkeypatch):
    """Counts launches of AITER's op (the adapter looks it up on the module at each call)."""
    import aiter

    from vllm_mla_fusion.backends import aiter as ab

    real = getattr(aiter, ab.AITER_OP)
    count = [0]

    def counting(*args):
        count[0] += 1
        return real(*args)

    monkeypatch.setattr(aiter, ab.AITER_OP, counting)
    return count


def rope_cache(dtype: torch.dtype) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, R, 2, dtype=torch.float64) / R))
    freqs = torch.outer(torch.arange(MAX_POS, dtype=torch.float64), inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype).cuda()


def reference64(positions, ql_nope, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, is_nope_first=True):
    """(q_out rows, cache rows) in float64, from the op's definition."""
    T = q_pe.shape[0]
    pos = positions[:T].long().clamp(0, cos_sin_cache.shape[0] - 1)
    cs = cos_sin_cache.double()[pos]
    cos, sin = cs[:, : R // 2], cs[:, R // 2 :]

    def rope(x, c, s):
        if is_neox:
            x1, x2 = x[..., : R // 2], x[..., R // 2 :]
            return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), -1).flatten(-2)

    q_rot = rope(q_pe.double(), cos[:, None], sin[:, None])
    k_rot = rope(k_pe.reshape(T, R).double(), cos, sin)
    parts = (ql_nope.double(), q_rot) if is_nope_first else (q_rot, ql_nope.double())
    return torch.cat(parts, -1), torch.cat((kv_c.reshape(T, L).double(), k_rot), -1)


def rope_scale(positions, q_pe, k_pe, cos_sin_cache, is_neox):
    """|x*cos| + |y*sin| per rotated element of q_out and of the cache rows (see assert_one_rounding)."""
    T = q_pe.shape[0]
    pos = positions[:T].long().clamp(0, cos_sin_cache.shape[0] - 1)
    cs = cos_sin_cache.double()[pos].abs()
    c, s = cs[:, : R // 2], cs[:, R // 2 :]
    if is_neox:
        c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)
        swap = lambda x: torch.cat((x[..., R // 2 :], x[..., : R // 2]), -1)  # noqa: E731
    else:
        c, s = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
        swap = lambda x: torch.stack((x[..., 1::2], x[..., 0::2]), -1).flatten(-2)  # noqa: E731
    q, k = q_pe.double().abs(), k_pe.reshape(T, R).double().abs()
    return q * c[:, None] + swap(q) * s[:, None], k * c + swap(k) * s


def assert_one_rounding(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str, scale=None):
    """|got - ref| <= one ulp of ``dtype`` at |ref| (float32 math rounded once).

    ``scale`` (|x*cos| + |y*sin| per element) adds the float32 error of the
    products, which exceeds an ulp of the result only where the sum nearly cancels.
    """
    mag = ref.abs().clamp_min(torch.finfo(dtype).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - MANTISSA_BITS[dtype])
    if scale is not None:
        ulp = ulp + 2.0**-22 * scale
    err = (got.double() - ref).abs()
    bad = err > ulp
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} values off by more than 1 ulp, max err {err.max()}"


def assert_fp8_step(got: torch.Tensor, ref: torch.Tensor, what: str):
    """Within one e4m3 step (3 mantissa bits) of ``ref`` (already divided by the scale)."""
    mag = ref.abs().clamp_min(2.0**-6)
    step = torch.exp2(torch.floor(torch.log2(mag)) - 3)
    err = (got.double() - ref).abs()
    assert (err <= step).all(), f"{what}: max err {err.max()}"


def make_inputs(T, H, dtype, num_blocks, block_size, seed=0):
    """vLLM-shaped decode inputs: strided q_pe/k_pe, heads-strided ql_nope, unique slots, padding."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, L + R, generator=g, device="cuda").to(dtype)
    q_pe = q[..., L:]
    ql_nope = torch.randn(H, T, L, generator=g, device="cuda").to(dtype).transpose(0, 1)
    kv_a = torch.randn(T, L + R, generator=g, device="cuda").to(dtype)
    kv_c, k_pe = kv_a[:, :L], kv_a[:, L:].unsqueeze(1)
    positions = torch.randint(0, MAX_POS, (T + 2,), generator=g, device="cuda")
    slots = torch.randperm(num_blocks * block_size, generator=g, device="cuda")[: T + 2]
    if T >= 3:
        slots[T // 2] = -1
        positions[T // 2] = MAX_POS + 100  # a padded token with a stale position: clamped
    slots[T:] = -1  # entries past T are ignored
    return positions, ql_nope, q_pe, k_pe, kv_c, slots


def expected_cache(canary, ref_rows, slots, T, to_cache):
    exp = canary.clone()
    flat = exp.view(-1, L + R)
    for t in range(T):
        s = int(slots[t])
        if s >= 0:
            flat[s] = to_cache(ref_rows[t])
    return exp


DTYPES = [torch.bfloat16, torch.float16]
SHAPES = [  # (T, H, block_size)
    (1, 16, 1),
    (7, 16, 16),
    (64, 128, 16),
    (255, 128, 64),
    (256, 16, 16),  # opt kernel
    (1024, 16, 1),  # opt kernel, page size 1
    (5, 2, 16),  # few heads: per-head kernel via the [-1, 1, 576] view
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [False, True])
@pytest.mark.parametrize("T, H, block_size", SHAPES)
def test_decode_matches_reference(aiter_calls, dtype, is_neox, T, H, block_size):
    from vllm_mla_fusion.backends import aiter as ab
    from vllm_mla_fusion.validation import check_decode_rope_cache_write

    num_blocks = (T + 8) // block_size + 2
    positions, ql_nope, q_pe, k_pe, kv_c, slots = make_inputs(T, H, dtype, num_blocks, block_size)
    cs = rope_cache(dtype)
    canary = torch.full((num_blocks, block_size, L + R), -3.5, dtype=dtype, device="cuda")
    kv_cache = canary.clone()
    q_out = torch.full((T, H, L + R), float("nan"), dtype=dtype, device="cuda")
    args = (positions, ql_nope, q_pe, k_pe, kv_c, cs, is_neox, slots, kv_cache, q_out)
    p = check_decode_rope_cache_write(*args, "auto", None, None, True)
    declined = ab.call_decline_reason(
        p, ql_nope, q_pe, k_pe, kv_c, cs, kv_cache, q_out, True, arch=ab._arch_of(q_pe.device)
    )  # fmt: skip

    mla.mla_decode_rope_cache_write(*args, backend="aiter")
    torch.cuda.synchronize()
    assert aiter_calls[0] == (0 if declined else 1), f"declined: {declined}"

    ref_q, ref_rows = reference64(positions, ql_nope, q_pe, k_pe, kv_c, cs, is_neox)
    q_scale_mag, k_scale_mag = rope_scale(positions, q_pe, k_pe, cs, is_neox)
    assert torch.equal(q_out[..., :L], ql_nope), "q_out latent part must be a bit-exact copy"
    assert_one_rounding(q_out[..., L:], ref_q[..., L:], dtype, "q_out rope part", q_scale_mag)
    exp = expected_cache(canary, ref_rows, slots, T, lambda row: row.to(dtype))
    assert torch.equal(kv_cache[..., :L], exp[..., :L]), "cache latent part and untouched rows must be bit-exact"
    written = torch.tensor([int(s) for s in slots[:T] if s >= 0], device="cuda", dtype=torch.long)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device="cuda")
    untouched[written] = False
    assert torch.equal(kv_cache.view(-1, L + R)[untouched], canary.view(-1, L + R)[untouched])
    rows = [t for t in range(T) if int(slots[t]) >= 0]
    assert_one_rounding(kv_cache.view(-1, L + R)[written][:, L:], ref_rows[rows][:, L:], dtype, "cache rope part",
                        k_scale_mag[rows])  # fmt: skip


@pytest.mark.parametrize("q_fp8", [False, True])
@pytest.mark.parametrize("storage", ["uint8", "typed"])
@pytest.mark.parametrize("T, H", [(7, 16), (300, 128)])
def test_fp8_cache_opt_in(aiter_calls, monkeypatch, q_fp8, storage, T, H):
    from vllm_mla_fusion.backends import aiter as ab

    monkeypatch.setenv(ab.ENV_FP8, "1")
    fp8 = ab.native_fp8_dtype(ab._arch_of(torch.device("cuda", torch.cuda.current_device())))
    dtype, block_size, num_blocks = torch.bfloat16, 16, (T + 8) // 16 + 2
    positions, ql_nope, q_pe, k_pe, kv_c, slots = make_inputs(T, H, dtype, num_blocks, block_size, seed=1)
    cs = rope_cache(dtype)
    canary = torch.full((num_blocks, block_size, L + R), 0x11, dtype=torch.uint8, device="cuda")
    kv_cache = canary.clone() if storage == "uint8" else canary.clone().view(fp8)
    q_out = torch.empty(T, H, L + R, dtype=fp8 if q_fp8 else dtype, device="cuda")
    k_scale = torch.tensor([0.37], device="cuda")  # not a power of two
    q_scale = torch.tensor([1.7], device="cuda")
    mla.mla_decode_rope_cache_write(
        positions, ql_nope, q_pe, k_pe, kv_c, cs, False, slots, kv_cache, q_out,
        "fp8" if storage == "uint8" else "auto", k_scale, q_scale, backend="aiter",
    )  # fmt: skip
    torch.cuda.synchronize()
    assert aiter_calls[0] == 1
    ref_q, ref_rows = reference64(positions, ql_nope, q_pe, k_pe, kv_c, cs, False)
    if q_fp8:
        assert_fp8_step(q_out.float(), ref_q / q_scale.double(), "fp8 q_out")
    else:
        assert torch.equal(q_out[..., :L], ql_nope)
        scale_mag, _ = rope_scale(positions, q_pe, k_pe, cs, False)
        assert_one_rounding(q_out[..., L:], ref_q[..., L:], dtype, "q_out rope part", scale_mag)
    cache = kv_cache.view(fp8).view(-1, L + R)
    rows = [t for t in range(T) if int(slots[t]) >= 0]
    written = slots[:T][slots[:T] >= 0].long()
    assert_fp8_step(cache[written].float(), ref_rows[rows] / k_scale.double(), "fp8 cache rows")
    untouched = torch.ones(cache.shape[0], dtype=torch.bool, device="cuda")
    untouched[written] = False
    assert torch.equal(kv_cache.view(torch.uint8).view(-1, L + R)[untouched], canary.view(-1, L + R)[untouched])


def test_declined_cases_still_match_through_triton(aiter_calls):
    """Forced ``aiter`` falls back per case; the results must not change."""
    T, H, dtype = 9, 16, torch.bfloat16
    positions, ql_nope, q_pe, k_pe, kv_c, slots = make_inputs(T, H, dtype, 4, 16, seed=2)
    for cs, nope_first in ((rope_cache(torch.float32), True), (rope_cache(dtype), False)):
        kv_cache = torch.zeros(4, 16, L + R, dtype=dtype, device="cuda")
        q_out = torch.empty(T, H, L + R, dtype=dtype, device="cuda")
        mla.mla_decode_rope_cache_write(
            positions, ql_nope, q_pe, k_pe, kv_c, cs, False, slots, kv_cache, q_out,
            is_nope_first=nope_first, backend="aiter",
        )  # fmt: skip
        ref_q, ref_rows = reference64(positions, ql_nope, q_pe, k_pe, kv_c, cs, False, nope_first)
        nope, pe = (slice(0, L), slice(L, L + R)) if nope_first else (slice(R, L + R), slice(0, R))
        assert torch.equal(q_out[..., nope], ql_nope)
        q_mag, k_mag = rope_scale(positions, q_pe, k_pe, cs, False)
        assert_one_rounding(q_out[..., pe], ref_q[..., pe], dtype, "fallback q_out rope part", q_mag)
        rows = [t for t in range(T) if int(slots[t]) >= 0]
        written = slots[:T][slots[:T] >= 0].long()
        cache_rows = kv_cache.view(-1, L + R)[written]
        assert torch.equal(cache_rows[:, :L], kv_c[rows]), "cache rows are [kv_c | rope] whatever is_nope_first"
        assert_one_rounding(cache_rows[:, L:], ref_rows[rows][:, L:], dtype, "fallback cache rope part", k_mag[rows])
    torch.cuda.synchronize()
    assert aiter_calls[0] == 0


def test_cuda_graph_replay_with_changing_indices(aiter_calls):
    """Capture once, replay with new positions/slots/values: no per-call allocation, results follow the inputs."""
    from vllm_mla_fusion.backends import aiter as ab

    T, H, dtype, nb, bs = 32, 16, torch.bfloat16, 8, 16
    positions, ql_nope, q_pe, k_pe, kv_c, slots = make_inputs(T, H, dtype, nb, bs, seed=3)
    cs = rope_cache(dtype)
    kv_cache = torch.zeros(nb, bs, L + R, dtype=dtype, device="cuda")
    q_out = torch.empty(T, H, L + R, dtype=dtype, device="cuda")
    args = (positions, ql_nope, q_pe, k_pe, kv_c, cs, False, slots, kv_cache, q_out)
    mla.mla_decode_rope_cache_write(*args, backend="aiter")  # warm-up: JIT build, rope split, scales
    torch.cuda.synchronize()
    misses = ab._ROPE_SPLITS.misses
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla.mla_decode_rope_cache_write(*args, backend="aiter")
    for seed in (4, 5, 6):
        new = make_inputs(T, H, dtype, nb, bs, seed=seed)
        for dst, src in zip((positions, ql_nope, q_pe, k_pe, kv_c, slots), new):
            dst.copy_(src)
        kv_cache.zero_()
        graph.replay()
        torch.cuda.synchronize()
        ref_q, ref_rows = reference64(positions, ql_nope, q_pe, k_pe, kv_c, cs, False)
        assert torch.equal(q_out[..., :L], ql_nope)
        q_mag, _ = rope_scale(positions, q_pe, k_pe, cs, False)
        assert_one_rounding(q_out[..., L:], ref_q[..., L:], dtype, f"replay {seed} q_out", q_mag)
        rows = [t for t in range(T) if int(slots[t]) >= 0]
        written = slots[:T][slots[:T] >= 0].long()
        assert torch.equal(kv_cache.view(-1, L + R)[written][:, :L], kv_c[rows])
    assert ab._ROPE_SPLITS.misses == misses, "the rope split must be cached, not recomputed per call"
    assert aiter_calls[0] >= 2
