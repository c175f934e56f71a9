"""Random inputs shaped the way vLLM hands them over, for every test that calls the ops.

Fresh random data per case (never zeros), caches filled with random canary
bytes, strided views into larger parents, padding slots (-1) at random places,
index tensors longer than T whose extra entries point at real rows (they must
be ignored).

Layout options beyond vLLM's own (the ops accept any strides, so each must be
exercised): ``inner_stride`` gives the named tensors a last-dim stride of 2 (a
view at offset 1 into a canary-filled parent twice as wide, whose other bytes
are checked), ``transposed`` stores them with their first two dims swapped
(ql_nope as a per-head bmm output, column-major cos/sin), ``kv_c_3d``/``k_pe_3d``
use the ``[T, 1, X]`` rank, and ``guard_rows`` puts canary rows after the cache
inside its allocation, so a write past the cache's capacity is seen.
"""

from __future__ import annotations

import torch

from .mla_reference import Case


# Tensors that may be given a non-default layout, and which of them the ops write.
LAYOUT_NAMES = ("positions", "slot_mapping", "q_pe", "k_pe", "kv_c", "cos_sin_cache", "kv_cache", "kv_cache_scale",
                "ql_nope", "q_out", "q_scale", "k_nope", "k_out")  # fmt: skip


def _canary(gen, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` random values of ``dtype``: finite floats, random bytes for fp8/uint8, random ints."""
    if dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        # Random finite values (random bytes could be NaN, which is fine for byte
        # checks but makes failure messages unreadable).
        return torch.randn(numel, generator=gen).to(dtype)
    if dtype.itemsize == 1:
        return torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=gen).view(dtype)
    return torch.randint(-(2**20), 2**20, (numel,), generator=gen).to(dtype)


def _cache_tensor(gen, num_blocks, block_size, width, cache_dtype, block_pad, guard_rows=0):
    """A canary-filled cache ``[num_blocks, block_size, width]`` whose block stride may be padded,
    followed in its allocation by ``guard_rows`` canary rows."""
    per_block = block_size * width + block_pad
    parent = _canary(gen, num_blocks * per_block + guard_rows * width, cache_dtype)
    cache = parent.as_strided((num_blocks, block_size, width), (per_block, width, 1))
    return parent, cache


def _relayout(gen, t: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(parent, view)``: a copy of ``t`` as a view into a fresh canary-filled ``parent``.

    ``"inner_stride"``: last-dim stride 2, starting one element into the parent, so that a
    kernel ignoring the stride or the storage offset reads (or writes) canary elements.
    ``"transposed"``: the first two dims swapped in memory.
    """
    if how == "inner_stride":
        shape = (*t.shape[:-1], 2 * t.shape[-1] + 1)
        parent = _canary(gen, torch.Size(shape).numel(), t.dtype).view(shape)
        view = parent[..., 1::2]
    elif how == "transposed":
        parent = _canary(gen, t.numel(), t.dtype).view(t.transpose(0, 1).shape)
        view = parent.transpose(0, 1)
    else:
        raise ValueError(how)
    assert view.shape == t.shape
    view.copy_(t)
    return parent, view


def make_case(
    *,
    T: int,
    H: int,
    L: int = 64,
    R: int = 16,
    block_size: int = 16,
    cache_dtype: torch.dtype = torch.bfloat16,
    kv_cache_dtype: str = "auto",
    act_dtype: torch.dtype = torch.bfloat16,
    cs_dtype: torch.dtype = torch.float32,
    is_neox: bool = False,
    index_dtype: torch.dtype = torch.int64,
    strided: bool = True,
    k_pe_3d: bool = False,
    pad_every: int = 3,
    scale: float | None = None,
    block_pad: int = 0,
    max_pos: int = 97,
    extra_index: int = 3,
    positions: str = "random",
    decode: bool = False,
    q_out_dtype: torch.dtype | None = None,
    q_scale: float | None = None,
    is_nope_first: bool = True,
    prefill: bool = False,
    nope_dim: int = 24,
    k_out_dtype: torch.dtype | None = None,
    k_out_strided: bool = False,
    key_start: int = 0,
    spare_blocks: int = 2,
    kv_c_3d: bool = False,
    inner_stride: tuple[str, ...] = (),
    transposed: tuple[str, ...] = (),
    guard_rows: int = 0,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=act_dtype):
        return (torch.randn(*shape, generator=gen) * 2).to(dtype)

    parents = {}
    if strided:
        # vLLM: q_pe = q[..., qk_nope_head_dim:] of [T, H, 128 + R]; k_pe and kv_c are
        # slices of the [T, L + R] kv_a output (plus q_c in front when fused).
        q_parent = randn(T, H, 24 + R)
        q_pe = q_parent[..., 24:]
        kv_parent = randn(T, 8 + L + R + 8)
        k_pe = kv_parent[:, 8 + L : 8 + L + R]
        kv_c = kv_parent[:, 8 : 8 + L]
        parents = {"q_pe": q_parent, "k_pe": kv_parent}
    else:
        q_pe, k_pe, kv_c = randn(T, H, R), randn(T, R), randn(T, L)
    if k_pe_3d:
        k_pe = k_pe.unsqueeze(1)
    if kv_c_3d:
        kv_c = kv_c.unsqueeze(1)

    # Rows of [cos | sin] with realistic magnitudes (|cos|, |sin| <= 1, some mscale).
    angles = torch.rand(max_pos, R // 2, generator=gen) * 6.3
    mscale = 1.0 + torch.rand((), generator=gen).item() * 0.3
    cos_sin_cache = (torch.cat((angles.cos(), angles.sin()), dim=-1) * mscale).to(cs_dtype)

    n_idx = T + extra_index
    pos = torch.randint(0, max_pos, (n_idx,), generator=gen)
    if positions == "edges" and T:
        pos[0] = 0
        pos[T - 1] = max_pos - 1
    elif positions == "out_of_range" and T:
        pos[: T : 2] = torch.randint(-2 * max_pos, -1, ((T + 1) // 2,), generator=gen)
        pos[1:T:2] = torch.randint(max_pos, 3 * max_pos, (T // 2,), generator=gen)

    num_blocks = max(1, -(-n_idx // block_size) + spare_blocks)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n_idx]
    if pad_every and T:
        start = int(torch.randint(0, pad_every, (), generator=gen))
        slots[start:T:pad_every] = -1
    parent_cache, kv_cache = _cache_tensor(gen, num_blocks, block_size, L + R, cache_dtype, block_pad, guard_rows)
    if block_pad or guard_rows:
        parents["kv_cache"] = parent_cache

    case = Case(
        positions=pos.to(index_dtype),
        q_pe=q_pe,
        k_pe=k_pe,
        kv_c=kv_c,
        cos_sin_cache=cos_sin_cache,
        is_neox=is_neox,
        slot_mapping=slots.to(index_dtype),
        kv_cache=kv_cache,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_scale=None if scale is None else torch.tensor([scale], dtype=torch.float32),
        parents=parents,
    )
    if decode:
        # ql_nope as a strided view: heads of a wider buffer, as a bmm output sliced per head would be.
        nope_parent = randn(T, H, L + 16)
        case.ql_nope = nope_parent[..., 16:] if strided else randn(T, H, L)
        q_out_dtype = q_out_dtype or act_dtype
        raw = torch.randint(0, 256, (T * H * (L + R) * q_out_dtype.itemsize,), dtype=torch.uint8, generator=gen)
        case.q_out = raw.view(q_out_dtype).view(T, H, L + R)
        case.q_scale = None if q_scale is None else torch.tensor([q_scale], dtype=torch.float32)
        case.is_nope_first = is_nope_first
    if prefill:
        # k_nope as vLLM hands it over: the first P columns of kv_b_proj's [T, H, P + V] output;
        # one row per token from key_start on (a mixed batch's decode tokens have none).
        rows = T - key_start
        case.key_start = key_start
        kv_nope = randn(rows, H, nope_dim + 8)
        case.k_nope = kv_nope[..., :nope_dim] if strided else randn(rows, H, nope_dim)
        k_out_dtype = k_out_dtype or act_dtype
        width = nope_dim + R
        # A view into a wider buffer with a guard row before and after, to check what it must not
        # touch (a key row for a token before key_start would land in the first).
        pad, guard = (5, 1) if k_out_strided else (0, 0)
        n = (rows + 2 * guard) * H * (width + pad) * k_out_dtype.itemsize
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        k_out_parent = raw.view(k_out_dtype).view(rows + 2 * guard, H, width + pad)
        case.k_out = k_out_parent[guard : guard + rows, :, pad:]
        if k_out_strided:
            parents["k_out"] = k_out_parent
    for how, names in (("inner_stride", inner_stride), ("transposed", transposed)):
        for name in names:
            assert name in LAYOUT_NAMES, name
            t = getattr(case, name)
            if t is None:
                continue
            case.parents[name], view = _relayout(gen, t, how)
            setattr(case, name, view)
    return to_device(case, device)


# A token-indexed tensor of each op whose rows test_*::test_token_rows_beyond_int32_offsets spreads
# past 2**31 elements: q_pe (rotated in place), q_out, k_out.
WIDE_ROWS = {"rope_cache_write": "q_pe", "decode": "q_out", "prefill": "k_out"}


def widen_rows(case: Case, name: str, stride: int, canary: float = 3.0, band: int = 4096):
    """Put ``case.<name>`` (a ``[T, ...]`` tensor) into a fresh allocation whose token rows lie
    ``stride`` elements apart (``torch.empty``: the pages between the rows are never touched, so a
    CPU holds little of it), with ``band`` canary elements on each side of every row. Returns a
    function that asserts the bands still hold the canary."""
    t = getattr(case, name)
    T, row = t.shape[0], t[0].numel()
    parent = torch.empty(((T - 1) * stride + row + band,), dtype=t.dtype, device=t.device)
    wide = parent.as_strided(t.shape, (stride, *torch.empty(t.shape[1:]).stride()))
    bands = [(i * stride + row, i * stride + row + band) for i in range(T - 1)]
    bands += [((i + 1) * stride - band, (i + 1) * stride) for i in range(T - 1)] + [((T - 1) * stride + row, parent.numel())]
    for lo, hi in bands:
        parent[lo:hi].fill_(canary)
    wide.copy_(t)
    setattr(case, name, wide)
    case.parents.pop(name, None)  # the bands stand for the bytes around the rows

    def check_bands() -> None:
        for lo, hi in bands:
            assert bool((parent[lo:hi] == canary).all()), f"{name}: canary between rows [{lo}, {hi}) changed"

    return check_bands


def to_device(case: Case, device) -> Case:
    device = torch.device(device)
    if device.type == "cpu":
        case.snapshot()
        return case
    moved = {}
    for name, parent in case.parents.items():
        moved[name] = parent.to(device)
    # A view moves with the parent that owns its storage (kv_c shares k_pe's), keeping its strides.
    owner = {parent.untyped_storage().data_ptr(): name for name, parent in case.parents.items()}
    for name in LAYOUT_NAMES:
        t = getattr(case, name)
        if t is None:
            continue
        key = owner.get(t.untyped_storage().data_ptr())
        if key is not None:
            # Parents are fresh tensors (storage offset 0), so the view's offsets carry over.
            setattr(case, name, moved[key].as_strided(t.shape, t.stride(), t.storage_offset()))
        else:
            setattr(case, name, t.to(device))
    case.parents = moved
    case.snapshot()
    return case


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)


def fp8_near_ties(dtype: torch.dtype, scale: float, steps: int = 3) -> torch.Tensor:
    """float32 values ``x`` whose quotient ``x / scale`` lies on, or within ``steps`` float32 steps
    of, a rounding boundary of ``dtype`` (the midpoint between two neighbouring finite values),
    for every boundary in range.

    A rounding that is merely within one float32 ulp of ``x / scale`` (the reciprocal without
    its residual step, a truncating division) or that breaks ties the wrong way changes the
    stored code of some of these; correct rounding of ``x / scale``, then to nearest even,
    matches torch on all of them. When ``scale`` has few significant bits (2.5), ``x / scale``
    hits the midpoints exactly: true ties.
    """
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    finite = codes[torch.isfinite(codes)].unique()  # sorted
    mids = (finite[1:].double() + finite[:-1].double()) / 2
    x = (mids * torch.tensor(scale, dtype=torch.float32).double()).float()
    out, up, down = [x], x, x
    for _ in range(steps):
        up, down = torch.nextafter(up, torch.tensor(float("inf"))), torch.nextafter(down, torch.tensor(-float("inf")))
        out += [up, down]
    return torch.cat(out)


def scaled_fp8_case(dtype: torch.dtype, scale: float, *, T: int, H: int, L: int, R: int, device="cpu", seed=0):
    """A decode case whose fp8 cache and q_out (both ``dtype``, both scaled by ``scale``) receive
    the near-tie values of :func:`fp8_near_ties` in every stored part, latent and rotated.

    cos/sin are the identity rotation (cos 1, sin 0): the rotated values are then exactly the
    inputs (``x1 * 1 - x2 * 0``, fused or not), so the rope parts must be bit-exact too.
    Zeros and non-finite values go only into the latent parts (0 * inf is NaN, and -0 - 0 is +0).
    """
    case = make_case(T=T, H=H, L=L, R=R, decode=True, act_dtype=torch.float32, cache_dtype=dtype, scale=scale,
                     q_out_dtype=dtype, q_scale=scale, pad_every=0, strided=False, seed=seed)  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 1)
    ties = fp8_near_ties(dtype, scale)
    fmax = torch.finfo(dtype).max
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, fmax * scale * 1.01, -fmax * scale * 3, 1e30, -1e30,
                            float("inf"), -float("inf")])  # fmt: skip

    def fill(t: torch.Tensor, latent: bool) -> None:
        flat = t.reshape(-1)
        vals = torch.cat((special, ties)) if latent else ties
        vals = vals[torch.randperm(vals.numel(), generator=gen)]
        # Past the crafted values: random magnitudes over the whole fp8 range and beyond.
        rest = torch.randn(flat.numel(), generator=gen) * torch.exp2(torch.randint(-12, 10, (flat.numel(),),
                                                                                   generator=gen).float())  # fmt: skip
        rest[: min(vals.numel(), flat.numel())] = vals[: flat.numel()]
        if not latent:
            rest[rest == 0] = 1.0
        flat.copy_(rest.to(flat.device))

    for name, latent in (("kv_c", True), ("ql_nope", True), ("k_pe", False), ("q_pe", False)):
        fill(getattr(case, name), latent)
    half = R // 2
    max_pos = case.cos_sin_cache.shape[0]
    case.cos_sin_cache = torch.cat((torch.ones(max_pos, half), torch.zeros(max_pos, half)), -1)
    return to_device(case, device)  # built on the CPU (its generators are), then moved whole


def out_of_range_slot_case(*, T: int = 7, H: int = 2, block_size: int, index_dtype: torch.dtype, far: bool = True,
                           make=None, **kw):  # fmt: skip
    """``(case, capacity)``: a cache that is a view into a larger buffer with canary rows after
    it (checked through its parent), and slot_mapping ``[0, capacity, 5, capacity + 2, 10**9,
    capacity - 1, huge, ...]``. Entries at or past the capacity must write nothing: neither into
    the guard rows nor anywhere past the allocation (10**9 and ``huge`` are far beyond it).
    ``far=False`` keeps every bad slot inside the guard rows, so that an unguarded kernel fails
    an assertion instead of crashing the process. ``make`` (default :func:`make_case`) builds the
    case from the keyword arguments."""
    guard_rows = 3 * block_size + 4
    case = (make or make_case)(T=T, H=H, block_size=block_size, index_dtype=index_dtype, pad_every=0,
                               guard_rows=guard_rows, **kw)  # fmt: skip
    cap = case.kv_cache.shape[0] * case.kv_cache.shape[1]
    huge = 2**31 - 1 if index_dtype == torch.int32 else 2**62
    far_slots = (10**9, huge) if far else (cap + 1, cap + guard_rows // block_size - 1)
    bad = torch.tensor([0, cap, 5, cap + 2, far_slots[0], cap - 1, far_slots[1]], dtype=index_dtype)
    n = min(T, bad.numel())
    # The other entries: distinct valid slots, none of the three the bad list writes.
    pool = torch.tensor([s for s in range(cap) if s not in (0, 5, cap - 1)], dtype=index_dtype)
    gen = torch.Generator().manual_seed(kw.get("seed", 0) + 7)
    rest = pool[torch.randperm(pool.numel(), generator=gen)][: case.slot_mapping.numel() - n]
    case.slot_mapping.copy_(torch.cat((bad[:n], rest)).to(case.slot_mapping.device))
    case.snapshot()
    return case, cap
