"""AITER's Triton MLA op against this project's op 2 (Triton backend), on the same inputs.

AITER's ``fused_qk_rope_cat_and_cache_mla`` is loaded only from the folder
that ``scripts/fetch_aiter_triton.sh`` fills (``benchmarks/kernels/aiter_triton_peer.py``);
without it, or without a GPU, these tests skip and say which is missing.
They prove that the two agree where their semantics overlap:

- bf16 activations and cache, DeepSeek-V3 shapes (H 16/128, L 512, R 64),
  T 1..256, both rotation styles, the model's strided views;
- a cache of page size 1, and a paged cache (block 16) that AITER gets
  viewed as ``[-1, 1, 576]``;
- padding slots (-1): both skip the cache row and still write the ``q_out``
  row (AITER's ``k_pe_out`` row is left unwritten; it is not compared).
  AITER has no position clamp, so every position is in range here.

Tolerance contract: the latent parts (``q_out[..., :512]`` and the cache's
``[..., :512]``) are bit-exact, and so is every cache row nobody targets.
The rotated parts: with float32 cos/sin AITER's math is float32 like ours, so
the two are within one bf16 ulp of each other (rounding of the same fp32
value; fused multiply-adds may differ, so a few float32 ulps of the products
are allowed on top, which only matters where the sum nearly cancels). With bf16 cos/sin AITER rounds each
product to bf16 before the sum (about one ulp off on a fifth of the values),
so the bound adds one ulp of each product's magnitude.
"""

from __future__ import annotations

import pytest
import torch

import vllm_mla_fusion as mla
from benchmarks.kernels import aiter_triton_peer as peer
from vllm_mla_fusion import dispatch

L, R = 512, 64
MAX_POS = 4096


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA or ROCm GPU"
    reason = dispatch._triton_unavailable_reason(torch.device("cuda"))
    if reason:
        return f"this project's Triton backend cannot run: {reason}"
    return peer.unavailable_reason()


def ulp(x: torch.Tensor, mantissa_bits: int = 7) -> torch.Tensor:
    """One unit in the last place of a bf16 (default) number of magnitude |x|."""
    mag = x.double().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - mantissa_bits)


def rope_terms(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool):
    """Per output element, the two products AITER sums: ``x * cos`` and ``rotated(x) * sin`` (float64)."""
    x = x.double()
    half = R // 2
    if is_neox:
        c, s = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        partner = torch.cat((-x[..., half:], x[..., :half]), -1)
    else:
        c, s = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        partner = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
    return x * c, partner * s


def assert_pe_close(ours, theirs, x, cos, sin, is_neox, bf16_math: bool, what: str):
    p1, p2 = rope_terms(x, cos, sin, is_neox)
    bound = ulp(torch.maximum(ours.double().abs(), theirs.double().abs()))
    # Two float32 evaluations of x*c + y*s (fused or not) differ by a few float32 ulps of the products,
    # which only matters when the sum nearly cancels.
    bound = bound + 2.0**-22 * (p1.abs() + p2.abs())
    if bf16_math:
        bound = bound + ulp(p1) + ulp(p2)
    err = (ours.double() - theirs.double()).abs()
    bad = err > bound
    frac = float((err > 0).double().mean())
    assert not bad.any(), f"{what}: {int(bad.sum())} values beyond the bound (max err {err.max()}, {frac:.1%} differ)"


def make_case(T, H, block_size, seed, device, dtype=torch.bfloat16, cos_dtype=torch.float32, padded=True):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(T, H, L + R, generator=g, device=device).to(dtype)
    q_pe = q[..., L:]  # the model's q[..., 512:] view
    ql_nope = torch.randn(H, T, L, generator=g, device=device).to(dtype).transpose(0, 1)  # bmm output
    kv_a = torch.randn(T, L + R, generator=g, device=device).to(dtype)
    kv_c, k_pe = kv_a[:, :L], kv_a[:, L:].unsqueeze(1)
    positions = torch.randint(0, MAX_POS, (T,), generator=g, device=device)
    num_blocks = T // block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=g, device=device)[:T]
    if padded:
        slots[::3] = -1  # CUDA-graph padding anywhere, including token 0
    inv = 1.0 / (10000 ** (torch.arange(0, R, 2, dtype=torch.float64) / R))
    freqs = torch.outer(torch.arange(MAX_POS, dtype=torch.float64), inv)
    cs = torch.cat((freqs.cos(), freqs.sin()), -1).to(cos_dtype).to(device)
    canary = torch.full((num_blocks, block_size, L + R), -7.25, dtype=dtype, device=device)
    return dict(positions=positions, ql_nope=ql_nope, q_pe=q_pe, k_pe=k_pe, kv_c=kv_c, cos_sin_cache=cs,
                slot_mapping=slots, canary=canary)  # fmt: skip


def run_both(op, c, is_neox, cache_dtype=None, kv_cache_scale=None):
    T, H = c["q_pe"].shape[:2]
    dtype = c["q_pe"].dtype
    ours_cache = c["canary"].clone().to(cache_dtype or dtype)
    theirs_cache = ours_cache.clone()
    ours_q = torch.full((T, H, L + R), float("nan"), dtype=dtype, device=c["q_pe"].device)
    theirs_q = ours_q.clone()
    args = (c["positions"], c["ql_nope"], c["q_pe"], c["k_pe"], c["kv_c"], c["cos_sin_cache"], is_neox,
            c["slot_mapping"])  # fmt: skip
    mla.mla_decode_rope_cache_write(*args, ours_cache, ours_q, "auto", kv_cache_scale, backend="triton")
    returned = peer.mla_decode(op, *args, theirs_cache, theirs_q, kv_cache_scale=kv_cache_scale)
    assert returned.data_ptr() == theirs_q.data_ptr(), "AITER must write the q_out it was given"
    if c["q_pe"].is_cuda:
        torch.cuda.synchronize()
    return ours_q, theirs_q, ours_cache, theirs_cache


def check_agreement(c, ours_q, theirs_q, ours_cache, theirs_cache, is_neox):
    T = ours_q.shape[0]
    bf16_math = c["cos_sin_cache"].dtype == torch.bfloat16
    assert torch.equal(ours_q[..., :L], theirs_q[..., :L]), "q_out latent parts must be bit-exact"
    assert torch.equal(ours_q[..., :L], c["ql_nope"])
    pos = c["positions"][:T].long()
    cos = c["cos_sin_cache"][pos, : R // 2].double()
    sin = c["cos_sin_cache"][pos, R // 2 :].double()
    assert_pe_close(ours_q[..., L:], theirs_q[..., L:], c["q_pe"], cos[:, None], sin[:, None], is_neox, bf16_math,
                    "q_out rope part")  # fmt: skip
    assert torch.equal(ours_cache[..., :L], theirs_cache[..., :L]), "cache latent parts, untouched rows: bit-exact"
    slots = c["slot_mapping"][:T]
    rows = (slots >= 0).nonzero().flatten()
    ours_rows = ours_cache.view(-1, L + R)[slots[rows].long()]
    theirs_rows = theirs_cache.view(-1, L + R)[slots[rows].long()]
    assert_pe_close(ours_rows[:, L:], theirs_rows[:, L:], c["k_pe"].reshape(T, R)[rows], cos[rows], sin[rows],
                    is_neox, bf16_math, "cache rope part")  # fmt: skip
    untouched = torch.ones(ours_cache.shape[0] * ours_cache.shape[1], dtype=torch.bool, device=ours_cache.device)
    untouched[slots[rows].long()] = False
    assert torch.equal(theirs_cache.view(-1, L + R)[untouched], c["canary"].view(-1, L + R)[untouched].to(
        theirs_cache.dtype)), "AITER wrote a row no token targets"  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("T", [1, 7, 64, 256])
@pytest.mark.parametrize("is_neox", [False, True])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("cos_dtype", [torch.float32, torch.bfloat16], ids=["cos_fp32", "cos_bf16"])
@pytest.mark.parametrize("padded", [False, True], ids=["no_pad", "pad"])
def test_aiter_triton_op_agrees_with_ours(H, T, is_neox, block_size, cos_dtype, padded):
    reason = _gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    op = peer.load()
    c = make_case(T, H, block_size, seed=T * 1000 + H, device="cuda", cos_dtype=cos_dtype, padded=padded)
    check_agreement(c, *run_both(op, c, is_neox), is_neox)


@pytest.mark.gpu
@pytest.mark.parametrize("T, H", [(7, 16), (256, 128)])
def test_aiter_triton_op_fp8_cache(T, H):
    """e4m3fn cache, bf16 q_out: AITER's Triton op runs it on NVIDIA (sm89+) as the 0.1.7 wheel has no dtype assert.

    kv_cache_scale 0.5: AITER's ``x * (1/scale)`` equals our ``x / scale`` exactly, so
    the latent part must be byte-identical; the rotated part within one fp8 step.
    """
    reason = _gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    if torch.version.hip is not None or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs an NVIDIA GPU with e4m3fn support (sm89+)")
    op = peer.load()
    fp8 = torch.float8_e4m3fn
    c = make_case(T, H, 16, seed=7, device="cuda")
    scale = torch.tensor([0.5], device="cuda")
    ours_q, theirs_q, ours_cache, theirs_cache = run_both(op, c, False, cache_dtype=fp8, kv_cache_scale=scale)
    assert torch.equal(ours_q[..., :L], theirs_q[..., :L])
    assert torch.equal(ours_cache.view(torch.uint8)[..., :L], theirs_cache.view(torch.uint8)[..., :L])
    a, b = ours_cache[..., L:].double(), theirs_cache[..., L:].double()
    step = torch.exp2(torch.floor(torch.log2(torch.maximum(a.abs(), b.abs()).clamp_min(2.0**-6))) - 3)
    assert ((a - b).abs() <= step).all(), f"fp8 rope part: max diff {(a - b).abs().max()}"


@pytest.mark.parametrize("is_neox", [False, True])
def test_aiter_triton_op_in_the_interpreter(is_neox):
    """The same cross-check on the CPU, float32 only (the interpreter's bf16 is not faithful).

    Runs where the AITER files are unpacked and TRITON_INTERPRET=1; it checks
    this test's harness (views, cos/sin halves, slot addressing, padding)
    without a GPU.
    """
    if not dispatch.triton_interpreting():
        pytest.skip("runs only under TRITON_INTERPRET=1 (the GPU tests above cover real hardware)")
    if peer.unavailable_reason():
        pytest.skip(peer.unavailable_reason())
    op = peer.load()
    c = make_case(5, 4, 16, seed=11, device="cpu", dtype=torch.float32, cos_dtype=torch.float32)
    ours_q, theirs_q, ours_cache, theirs_cache = run_both(op, c, is_neox)
    check_agreement(c, ours_q, theirs_q, ours_cache, theirs_cache, is_neox)
    torch.testing.assert_close(ours_q, theirs_q, rtol=2**-20, atol=1e-6)
