"""An independent float64 reference for the tests, and the checks built on it.

Written from the specification, not from the package: nothing here imports
``vllm_mla_fusion``. Rotation is done pair by pair through explicit index
lists, the cache write token by token, and every comparison carries its
tolerance contract:

- non-fp8 outputs: within one rounding of the output dtype of the float64
  value, plus the error of float32 arithmetic (the spec computes in float32);
- fp8 outputs: within one fp8 ulp of ``saturate(ref / scale)``, never inf;
- copied latent values (kv_c, ql_nope) into a non-fp8 output: exact when the
  output dtype holds the input dtype;
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


def assert_close_to_ref(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor | None, what: str,
                        scale: float = 1.0) -> None:  # fmt: skip
    """``out`` (any float or fp8 dtype) against the float64 ``ref`` (before scaling)."""
    dtype = out.dtype
    got = out.double()
    assert torch.isfinite(got).all() or not torch.isfinite(ref).all(), f"{what}: non-finite output"
    if dtype in FP8:
        fmax = torch.finfo(dtype).max
        want = (ref / scale).clamp(-fmax, fmax)
        ulp = 2.0 ** -MANTISSA_BITS[dtype]
        tiny = torch.finfo(dtype).smallest_normal * ulp  # the smallest subnormal step
        tol = want.abs() * ulp + tiny
        if mag is not None:
            tol = tol + mag / scale * 2.0**-21
    else:
        want = ref
        eps = 2.0 ** -MANTISSA_BITS[dtype]
        tol = want.abs() * eps + torch.finfo(dtype).smallest_normal
        if mag is not None:
            tol = tol + mag * 2.0**-21  # float32 products and sum, before the final rounding
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
    # prefill op
    k_nope: torch.Tensor | None = None
    k_out: torch.Tensor | None = None
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
    return t.contiguous().view(torch.uint8)


def _cpu(t):
    return None if t is None else t.cpu()


def _check_cache(case: Case, k_rot: torch.Tensor, k_mag: torch.Tensor) -> None:
    T = case.q_pe.shape[0]
    cache, orig = _cpu(case.kv_cache), _cpu(case.originals["kv_cache"])
    L = case.kv_c.shape[-1]
    f8 = fp8_dtype_of(cache, case.kv_cache_dtype)
    scale = 1.0 if case.kv_cache_scale is None else float(case.kv_cache_scale.cpu().item())
    block_size = cache.shape[1]
    slots = _cpu(case.slot_mapping)[:T].long()
    keep = slots >= 0
    tokens = keep.nonzero().flatten()
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    rows = cache[blocks, offsets]  # the written rows, in token order (slots are unique)
    kv_c = _cpu(case.kv_c).reshape(T, L)[tokens]
    k_rot, k_mag = k_rot[tokens], k_mag[tokens]
    if f8 is not None:
        rows = rows.view(f8) if rows.dtype == torch.uint8 else rows
        assert_close_to_ref(rows[:, :L], kv_c.double(), None, "kv_cache latent part", scale)
        assert_close_to_ref(rows[:, L:], k_rot, k_mag, "kv_cache rope part", scale)
    else:
        if rows.dtype in (kv_c.dtype, torch.float32):  # the cache holds every kv_c value exactly
            assert torch.equal(rows[:, :L].to(kv_c.dtype), kv_c), "kv_cache latent part is not an exact copy of kv_c"
        else:
            assert_close_to_ref(rows[:, :L], kv_c.double(), None, "kv_cache latent part")
        assert_close_to_ref(rows[:, L:], k_rot, k_mag, "kv_cache rope part")
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
    q_scale = 1.0 if case.q_scale is None else float(case.q_scale.cpu().item())
    if q_out.dtype in FP8:
        assert_close_to_ref(nope, ql_nope.double(), None, "q_out nope part", q_scale)
        assert_close_to_ref(rope, q_rot, q_mag, "q_out rope part", q_scale)
    else:
        if q_out.dtype in (ql_nope.dtype, torch.float32):
            assert torch.equal(nope.to(ql_nope.dtype), ql_nope), "q_out nope part must be an exact copy of ql_nope"
        else:
            assert_close_to_ref(nope, ql_nope.double(), None, "q_out nope part")
        assert_close_to_ref(rope, q_rot, q_mag, "q_out rope part")
    _check_cache(case, k_rot, k_mag)
    _check_parents(case)


def check_prefill_rope_cache_write(case: Case) -> None:
    """After ``mla_prefill_rope_cache_write``: everything op 1 guarantees, plus the key
    ``k_out[t, h] = [k_nope[t, h] | rope(k_pe[t])]`` for every token (padding included).

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
    k_out, k_nope = _cpu(case.k_out), _cpu(case.k_nope)
    P = k_nope.shape[-1]
    nope, rope = k_out[..., :P], k_out[..., P:]
    if k_out.dtype in FP8:
        fmax = torch.finfo(k_out.dtype).max
        want = k_nope.float().clamp(-fmax, fmax).to(k_out.dtype)
        assert torch.equal(_bytes(nope), _bytes(want)), "k_out nope part is not saturate(k_nope) in fp8, bit for bit"
    else:
        assert torch.equal(nope, k_nope.to(k_out.dtype)), "k_out nope part must be an exact copy of k_nope"
    assert_close_to_ref(rope, k_rot[:, None, :].expand(T, H, R), k_mag[:, None, :].expand(T, H, R),
                        "k_out rope part")  # fmt: skip
