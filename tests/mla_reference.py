"""An independent float64 reference for the tests, and the checks built on it.

Written from the specification, not from the package: nothing here imports
``vllm_mla_fusion``. Rotation is done pair by pair through explicit index
lists, the cache write token by token, and every comparison carries its
tolerance contract:

- rotated values: within half a step of the output format's grid (one
  round-to-nearest) of the float64 value, divided by the scale and saturated
  for fp8, plus the error of float32 arithmetic (the spec computes in
  float32), never inf;
- copied latent values (kv_c, ql_nope): byte-identical to torch's own
  conversion of the input, ``x.to(dtype)``, or for fp8 ``saturate(x / scale)``
  with the division in float32 (the spec's definition, ties to even);
- slots outside ``[0, num_blocks * block_size)`` write nothing;
- everything the op must not write: byte-identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)
MANTISSA_BITS = {
    torch.float32: 23,
    torch.float16: 10,
    torch.bfloat16: 7,
    torch.float8_e4m3fn: 3,
    torch.float8_e4m3fnuz: 3,
    torch.float8_e5m2: 2,
}


def pair_indices(rope_dim: int, is_neox: bool) -> tuple[list[int], list[int]]:
    half = rope_dim // 2
    if is_neox:
        return list(range(half)), [i + half for i in range(half)]
    return [2 * i for i in range(half)], [2 * i + 1 for i in range(half)]


def rope64(x: torch.Tensor, pos: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool):
    """RoPE of ``x [T, ..., R]`` in float64. Returns (value, magnitude) where
    magnitude ``|x1 cos| + |x2 sin|`` bounds the float32 rounding error."""
    R = x.shape[-1]
    half = R // 2
    x = x.double()
    cs = cos_sin_cache.double()[pos]  # positions already clamped by the caller
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cs[:, :half].reshape(shape), cs[:, half:].reshape(shape)
    i1, i2 = pair_indices(R, is_neox)
    x1, x2 = x[..., i1], x[..., i2]
    out = torch.empty_like(x)
    mag = torch.empty_like(x)
    out[..., i1] = x1 * cos - x2 * sin
    out[..., i2] = x2 * cos + x1 * sin
    mag[..., i1] = (x1 * cos).abs() + (x2 * sin).abs()
    mag[..., i2] = (x2 * cos).abs() + (x1 * sin).abs()
    return out, mag


def clamp_positions(positions: torch.Tensor, T: int, max_pos: int) -> torch.Tensor:
    return positions[:T].long().clamp(0, max_pos - 1)


def fp8_dtype_of(cache: torch.Tensor, kv_cache_dtype: str) -> torch.dtype | None:
    if cache.dtype in FP8:
        return cache.dtype
    if cache.dtype == torch.uint8:
        # The tests run on CPU or NVIDIA, where vLLM's "fp8" means e4m3fn.
        return torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn
    return None


def grid_step(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype``'s representable values at ``|x|`` (float64): ``2**(e - mantissa bits)``
    in the binade ``[2**e, 2**(e+1))``, the subnormal step below the smallest normal."""
    e = torch.frexp(x.double().abs().clamp_min(torch.finfo(dtype).smallest_normal))[1] - 1
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), e - MANTISSA_BITS[dtype])


def assert_close_to_ref(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor | None, what: str,
                        scale: float = 1.0) -> None:  # fmt: skip
    """``out`` (any float or fp8 dtype) against the float64 ``ref`` (before scaling): one
    round-to-nearest of the float32 result, i.e. half a grid step plus the float32 error."""
    dtype = out.dtype
    got = out.double()
    assert torch.isfinite(got).all() or not torch.isfinite(ref).all(), f"{what}: non-finite output"
    want = ref / scale
    if dtype in FP8:
        fmax = torch.finfo(dtype).max
        want = want.clamp(-fmax, fmax)
    # float32 products and sum before the final rounding (also divided by the scale).
    f32_err = mag / scale * 2.0**-21 if mag is not None else torch.zeros_like(want)
    tol = grid_step(want.abs() + f32_err, dtype) / 2 + f32_err
    err = (got - want).abs()
    bad = err > tol
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} elements off; worst at "
        f"{tuple(int(i) for i in torch.nonzero(bad)[0])}: got {got[bad][0].item()}, want {want[bad][0].item()}"
    )


@dataclass
class Case:
    """Inputs of one call, and pristine copies of everything the op may write."""

    positions: torch.Tensor
    q_pe: torch.Tensor
    k_pe: torch.Tensor
    kv_c: torch.Tensor
    cos_sin_cache: torch.Tensor
    is_neox: bool
    slot_mapping: torch.Tensor
    kv_cache: torch.Tensor
    kv_cache_dtype: str = "auto"
    kv_cache_scale: torch.Tensor | None = None
    # decode op
    ql_nope: torch.Tensor | None = None
    q_out: torch.Tensor | None = None
    q_scale: torch.Tensor | None = None
    is_nope_first: bool = True
    # prefill op: k_nope / k_out rows are the key of tokens key_start .. T - 1
    k_nope: torch.Tensor | None = None
    k_out: torch.Tensor | None = None
    key_start: int = 0
    # parents of strided views, to check bytes around the views
    parents: dict = field(default_factory=dict)
    originals: dict = field(default_factory=dict)

    def snapshot(self) -> None:
        self.originals = {
            "q_pe": self.q_pe.clone(),
            "k_pe": self.k_pe.clone(),
            "kv_cache": self.kv_cache.clone(),
            **{f"parent:{k}": v.clone() for k, v in self.parents.items()},
        }
        if self.q_out is not None:
            self.originals["q_out"] = self.q_out.clone()
        if self.k_out is not None:
            self.originals["k_out"] = self.k_out.clone()

    def rope_args(self):
        return (self.positions, self.q_pe, self.k_pe, self.kv_c, self.cos_sin_cache, self.is_neox,
                self.slot_mapping, self.kv_cache, self.kv_cache_dtype, self.kv_cache_scale)  # fmt: skip

    def decode_args(self):
        return (self.positions, self.ql_nope, self.q_pe, self.k_pe, self.kv_c, self.cos_sin_cache, self.is_neox,
                self.slot_mapping, self.kv_cache, self.q_out, self.kv_cache_dtype, self.kv_cache_scale,
                self.q_scale)  # fmt: skip

    def prefill_args(self):
        return (self.positions, self.q_pe, self.k_pe, self.kv_c, self.k_nope, self.cos_sin_cache, self.is_neox,
                self.slot_mapping, self.kv_cache, self.k_out, self.kv_cache_dtype, self.kv_cache_scale)  # fmt: skip


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:  # an empty strided view stays "contiguous" with its strides, which view() refuses
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.contiguous().view(torch.uint8)


def _cpu(t):
    return None if t is None else t.cpu()


def stored_copy(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """What a copied (not rotated) value must store, exactly: torch's cast, or for fp8 torch's
    float32 ``x / scale`` saturated to the finite range and rounded to nearest even."""
    if dtype not in FP8:
        return x.to(dtype)
    y = x.float()
    if scale is not None:
        y = y / scale.cpu().float()
    fmax = torch.finfo(dtype).max
    return y.clamp(-fmax, fmax).to(dtype)


def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    if got.numel() == 0:
        return
    bad = _bytes(got).view(got.numel(), -1) != _bytes(want).view(want.numel(), -1)
    bad = bad.any(-1).view(got.shape)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} elements differ from torch's conversion; first at "
        f"{tuple(int(i) for i in torch.nonzero(bad)[0])}: got {got[bad][0].item()}, want {want[bad][0].item()}"
    )


def _check_cache(case: Case, k_rot: torch.Tensor, k_mag: torch.Tensor) -> None:
    T = case.q_pe.shape[0]
    cache, orig = _cpu(case.kv_cache), _cpu(case.originals["kv_cache"])
    L = case.kv_c.shape[-1]
    f8 = fp8_dtype_of(cache, case.kv_cache_dtype)
    scale = 1.0 if case.kv_cache_scale is None else float(case.kv_cache_scale.cpu().item())
    num_blocks, block_size = cache.shape[:2]
    slots = _cpu(case.slot_mapping)[:T].long()
    # Padding (< 0) and slots past the cache's capacity write nothing.
    keep = (slots >= 0) & (slots < num_blocks * block_size)
    tokens = keep.nonzero().flatten()
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    rows = cache[blocks, offsets]  # the written rows, in token order (slots are unique)
    kv_c = _cpu(case.kv_c).reshape(T, L)[tokens]
    k_rot, k_mag = k_rot[tokens], k_mag[tokens]
    rows = rows.view(f8) if f8 is not None and rows.dtype == torch.uint8 else rows
    assert_bytes_equal(rows[:, :L], stored_copy(kv_c, rows.dtype, _cpu(case.kv_cache_scale)), "kv_cache latent part")
    assert_close_to_ref(rows[:, L:], k_rot, k_mag, "kv_cache rope part", scale if f8 is not None else 1.0)
    untouched = torch.ones(cache.shape[:2], dtype=torch.bool)
    untouched[blocks, offsets] = False
    assert torch.equal(_bytes(cache[untouched]), _bytes(orig[untouched])), "a cache row that no slot names changed"


def _check_parents(case: Case) -> None:
    """Bytes of each view's parent outside the view must be unchanged."""
    for name, parent in case.parents.items():
        view = getattr(case, name)
        # Locate the view's elements in the parent by marking them in a same-shaped tensor.
        marker = torch.zeros(parent.shape, dtype=torch.float64, device=parent.device)
        mview = marker.as_strided(view.shape, view.stride(), view.storage_offset() - parent.storage_offset())
        mview.fill_(1)
        mask = marker == 0
        assert torch.equal(_bytes(parent[mask]), _bytes(case.originals[f"parent:{name}"][mask])), (
            f"{name}: bytes next to the view in its parent tensor changed"
        )


def check_rope_cache_write(case: Case) -> None:
    """After ``mla_rope_cache_write(*case.rope_args())``: q_pe, k_pe, kv_cache as specified."""
    o = {k: _cpu(v) for k, v in case.originals.items()}
    T, H, R = o["q_pe"].shape
    cos_sin_cache = _cpu(case.cos_sin_cache)
    pos = clamp_positions(_cpu(case.positions), T, cos_sin_cache.shape[0])
    q_rot, q_mag = rope64(o["q_pe"], pos, cos_sin_cache, case.is_neox)
    k_rot, k_mag = rope64(o["k_pe"].reshape(T, R), pos, cos_sin_cache, case.is_neox)
    assert_close_to_ref(_cpu(case.q_pe), q_rot, q_mag, "q_pe (rotated in place)")
    assert_close_to_ref(_cpu(case.k_pe).reshape(T, R), k_rot, k_mag, "k_pe (rotated in place)")
    _check_cache(case, k_rot, k_mag)
    _check_parents(case)


def check_decode_rope_cache_write(case: Case) -> None:
    """After ``mla_decode_rope_cache_write``: q_out assembled, cache written, q_pe/k_pe untouched."""
    o = {k: _cpu(v) for k, v in case.originals.items()}
    T, H, R = o["q_pe"].shape
    L = case.kv_c.shape[-1]
    assert torch.equal(_bytes(_cpu(case.q_pe)), _bytes(o["q_pe"])), "q_pe must not be modified by the decode op"
    assert torch.equal(_bytes(_cpu(case.k_pe)), _bytes(o["k_pe"])), "k_pe must not be modified by the decode op"
    cos_sin_cache = _cpu(case.cos_sin_cache)
    pos = clamp_positions(_cpu(case.positions), T, cos_sin_cache.shape[0])
    q_rot, q_mag = rope64(o["q_pe"], pos, cos_sin_cache, case.is_neox)
    k_rot, k_mag = rope64(o["k_pe"].reshape(T, R), pos, cos_sin_cache, case.is_neox)
    q_out, ql_nope = _cpu(case.q_out), _cpu(case.ql_nope)
    nope, rope = (q_out[..., :L], q_out[..., L:]) if case.is_nope_first else (q_out[..., R:], q_out[..., :R])
    fp8_q = q_out.dtype in FP8
    q_scale = 1.0 if case.q_scale is None or not fp8_q else float(case.q_scale.cpu().item())
    assert_bytes_equal(nope, stored_copy(ql_nope, q_out.dtype, _cpu(case.q_scale)), "q_out nope part")
    assert_close_to_ref(rope, q_rot, q_mag, "q_out rope part", q_scale)
    _check_cache(case, k_rot, k_mag)
    _check_parents(case)


def check_identity_rope_stores(case: Case) -> None:
    """With cos 1 and sin 0 the rotation is exact, so the rope parts of the written cache rows and
    of q_out must be byte-identical to torch's conversion of k_pe and q_pe themselves."""
    T, H, R = case.q_pe.shape
    L = case.kv_c.shape[-1]
    cache = _cpu(case.kv_cache)
    f8 = fp8_dtype_of(cache, case.kv_cache_dtype)
    nb, bs = cache.shape[:2]
    slots = _cpu(case.slot_mapping)[:T].long()
    keep = (slots >= 0) & (slots < nb * bs)
    rows = cache[slots[keep] // bs, slots[keep] % bs]
    rows = rows.view(f8) if f8 is not None and rows.dtype == torch.uint8 else rows
    k_pe = _cpu(case.originals["k_pe"]).reshape(T, R)[keep]
    assert_bytes_equal(rows[:, L:], stored_copy(k_pe, rows.dtype, _cpu(case.kv_cache_scale)), "kv_cache rope part")
    if case.q_out is not None:
        q_out = _cpu(case.q_out)
        rope = q_out[..., L:] if case.is_nope_first else q_out[..., :R]
        want = stored_copy(_cpu(case.originals["q_pe"]), q_out.dtype, _cpu(case.q_scale))
        assert_bytes_equal(rope, want, "q_out rope part")
def check_prefill_rope_cache_write(case: Case) -> None:
    """After ``mla_prefill_rope_cache_write``: everything op 1 guarantees, plus the key
    ``k_out[t - s, h] = [k_nope[t - s, h] | rope(k_pe[t])]`` for every token ``t >= s``
    (``s = case.key_start``; padding tokens included).

    Key contract: the nope part is an exact copy for a k_out of the input dtype, and for
    an fp8 key bit-identical to torch's round-to-nearest-even of the saturated value
    (``clamp(x, -max, max).to(fp8)``; no scale); the rope part is within one rounding of
    k_out's dtype of the float64 rotation (+ float32 arithmetic error), never inf.
    """
    check_rope_cache_write(case)
    o = {k: _cpu(v) for k, v in case.originals.items()}
    T, H, R = o["q_pe"].shape
    cos_sin_cache = _cpu(case.cos_sin_cache)
    pos = clamp_positions(_cpu(case.positions), T, cos_sin_cache.shape[0])
    k_rot, k_mag = rope64(o["k_pe"].reshape(T, R), pos, cos_sin_cache, case.is_neox)
    s = case.key_start
    k_rot, k_mag = k_rot[s:], k_mag[s:]  # the tokens with a key row
    k_out, k_nope = _cpu(case.k_out), _cpu(case.k_nope)
    rows = T - s
    assert k_out.shape[0] == k_nope.shape[0] == rows
    P = k_nope.shape[-1]
    nope, rope = k_out[..., :P], k_out[..., P:]
    if k_out.dtype in FP8:
        fmax = torch.finfo(k_out.dtype).max
        want = k_nope.float().clamp(-fmax, fmax).to(k_out.dtype)
        assert torch.equal(_bytes(nope), _bytes(want)), "k_out nope part is not saturate(k_nope) in fp8, bit for bit"
    else:
        assert torch.equal(nope, k_nope.to(k_out.dtype)), "k_out nope part must be an exact copy of k_nope"
    assert_close_to_ref(rope, k_rot[:, None, :].expand(rows, H, R), k_mag[:, None, :].expand(rows, H, R),
                        "k_out rope part")  # fmt: skip
