"""The fp8_ds_mla cache format (sparse MLA, DeepSeek-V3.2): the torch reference against a model of the format.

The model below is written from the format's description (docs/vllm.md, "The fp8_ds_mla cache
format"), not from the package: per token, each group of 128 latent values gets the scale
``2**k``, ``k`` the least integer with ``2**k >= max(amax / 448, float32(1e-4))`` (exact
rationals), and each value the e4m3fn code nearest to ``x / 2**k`` (ties to the even code,
saturated at 448), from a table decoded from e4m3fn's bit layout; the written bytes are decoded
back with ``struct`` (little-endian) and compared code for code, scale for scale; the bf16 RoPE
part against the float64 rotation (tests/mla_reference.py). The query and key outputs must be
byte-identical to the same call with a plain bf16 cache: the format changes the cache only.

Caches start filled with a sentinel byte, with padding between blocks and guard rows after the
cache in the same allocation: every byte no valid slot names must keep it.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vllm_mla_fusion as mla
from vllm_mla_fusion import binding, dispatch, fp8
from vllm_mla_fusion.backends import aiter as aiter_backend
from vllm_mla_fusion.validation import Problem

from .conftest import OP_BACKENDS
from .mla_reference import assert_close_to_ref, clamp_positions, rope64

SENTINEL = 0xA5
GROUP = 128
FP8_MAX = 448
FLOOR = Fraction(struct.unpack("<f", struct.pack("<f", 1e-4))[0])  # vLLM's 1e-4f
OPS = ("rope", "decode", "prefill")


# --- the model ------------------------------------------------------------------------------


def _e4m3fn_magnitudes() -> torch.Tensor:
    """The finite e4m3fn magnitudes, indexed by code 0..126 (0x7F is NaN): bias 7, 3 mantissa bits,
    subnormals ``m/8 * 2**-6`` below exponent field 1. Increasing with the code."""
    vals = [(m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7) for e in range(16) for m in range(8)]
    return torch.tensor(vals[:127], dtype=torch.float64)


E4M3 = _e4m3fn_magnitudes()
assert E4M3[-1] == FP8_MAX


def model_codes(y: torch.Tensor) -> torch.Tensor:
    """e4m3fn codes (uint8) of float64 ``y``: nearest, ties to the even code, saturated to +-448."""
    mag = y.abs().clamp(max=FP8_MAX)
    hi = torch.searchsorted(E4M3, mag).clamp(max=126)  # first magnitude >= mag
    lo = (hi - 1).clamp(min=0)
    d_hi, d_lo = E4M3[hi] - mag, mag - E4M3[lo]
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(take_hi, hi, lo)
    return (code | (torch.signbit(y).long() << 7)).to(torch.uint8)


def model_scale_exponent(amax: float) -> int:
    """The least k with 2**k >= max(amax / 448, float32(1e-4)), in exact arithmetic."""
    s = max(Fraction(amax) / FP8_MAX, FLOOR)
    k = math.frexp(float(s))[1]
    while Fraction(2) ** (k - 1) >= s:
        k -= 1
    while Fraction(2) ** k < s:
        k += 1
    return k


def model_row(latent: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """(codes [L], scales) the model gives one token's latent (float64, exact bf16 values)."""
    codes, scales = [], []
    for g in latent.view(-1, GROUP):
        scale = 2.0 ** model_scale_exponent(g.abs().max().item())
        codes.append(model_codes(g / scale))
        scales.append(scale)
    return torch.cat(codes), scales


def decode_row(row: torch.Tensor, L: int, R: int) -> tuple[torch.Tensor, list[float], torch.Tensor]:
    """(fp8 codes [L], float32 scales, bf16 RoPE values [R] as float64) of one written row's bytes."""
    raw = bytes(row.tolist())
    assert len(raw) == L + 4 * (L // GROUP) + 2 * R
    scales = list(struct.unpack(f"<{L // GROUP}f", raw[L : L + 4 * (L // GROUP)]))
    halves = struct.unpack(f"<{R}H", raw[L + 4 * (L // GROUP) :])
    rope = [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in halves]  # bf16 = the top half of a float32
    return row[:L].clone(), scales, torch.tensor(rope, dtype=torch.float64)


# --- cases ---------------------------------------------------------------------------------


class DsCase:
    """One call's inputs (vLLM's strided views), an fp8_ds_mla cache poisoned with SENTINEL inside a
    larger allocation (block padding, guard rows after it), and a plain bf16 cache twin."""

    def __init__(self, *, T, H=2, L=512, R=64, block_size=16, op="rope", latent=None, pad_every=3, past=True,
                 block_pad=24, guard_rows=2, seed=0):  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        self.op, self.L, self.R = op, L, R
        kv_parent = (torch.randn(T, 8 + L + R, generator=gen) * 2).bfloat16()  # [kv_c | k_pe] of kv_a's output
        if latent is not None:
            kv_parent[:, 8 : 8 + L] = latent.bfloat16()
        self.kv_c, self.k_pe = kv_parent[:, 8 : 8 + L], kv_parent[:, 8 + L :]
        self.q_pe = (torch.randn(T, H, 24 + R, generator=gen) * 2).bfloat16()[..., 24:]
        max_pos = 50
        angles = torch.rand(max_pos, R // 2, generator=gen) * 6.3
        self.cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1) * 1.1
        self.positions = torch.randint(0, max_pos, (T + 2,), generator=gen)
        self.width = L + 4 * (L // GROUP) + 2 * R  # written out, not fp8.ds_mla_row_bytes
        num_blocks = max(1, -(-T // block_size) + 1)
        capacity = num_blocks * block_size
        slots = torch.randperm(capacity, generator=gen)[: T + 2]
        if pad_every and T:
            slots[int(torch.randint(0, pad_every, (), generator=gen)) : T : pad_every] = -1
        if past and T > 1:
            slots[1] = capacity + int(torch.randint(0, 5, (), generator=gen))  # past the cache: writes nothing
        self.slot_mapping = slots
        per_block = block_size * self.width + block_pad
        self.parent = torch.full((num_blocks * per_block + guard_rows * self.width,), SENTINEL, dtype=torch.uint8)
        self.kv_cache = self.parent.as_strided((num_blocks, block_size, self.width), (per_block, self.width, 1))
        self.plain_cache = torch.randn(num_blocks, block_size, L + R, generator=gen).bfloat16()
        self.ql_nope = (torch.randn(T, H, L, generator=gen) * 2).bfloat16() if op == "decode" else None
        self.k_nope = (torch.randn(T, H, 24, generator=gen) * 2).bfloat16() if op == "prefill" else None
        self.originals = {"q_pe": self.q_pe.clone(), "k_pe": self.k_pe.clone()}

    def out(self):
        """A fresh output tensor of the op (q_out or k_out), filled with a sentinel too."""
        T, H, _ = self.q_pe.shape
        if self.op == "decode":
            return torch.full((T, H, self.L + self.R), -7.0, dtype=torch.bfloat16)
        if self.op == "prefill":
            return torch.full((T, H, 24 + self.R), -7.0, dtype=torch.bfloat16)
        return None

    def call(self, q_pe, k_pe, kv_cache, kv_cache_dtype, out=None, kv_cache_scale=None, backend="torch"):
        common = (self.positions, q_pe, k_pe, self.kv_c, self.cos_sin_cache, False, self.slot_mapping, kv_cache)
        if self.op == "decode":
            mla.mla_decode_rope_cache_write(self.positions, self.ql_nope, *common[1:], out, kv_cache_dtype,
                                            kv_cache_scale, backend=backend)  # fmt: skip
        elif self.op == "prefill":
            p, q, k, c, cs, neox, s, kv = common
            mla.mla_prefill_rope_cache_write(p, q, k, c, self.k_nope, cs, neox, s, kv, out, kv_cache_dtype,
                                             kv_cache_scale, backend=backend)  # fmt: skip
        else:
            mla.mla_rope_cache_write(*common, kv_cache_dtype, kv_cache_scale, backend=backend)

    def run(self, backend="torch", kv_cache_scale=None):
        """The call on the fp8_ds_mla cache, and on the bf16 twin with copies of the in-place inputs."""
        self.q_pe_plain, self.k_pe_plain = self.q_pe.clone(), self.k_pe.clone()
        self.out_ds, self.out_plain = self.out(), self.out()
        self.call(self.q_pe_plain, self.k_pe_plain, self.plain_cache, "auto", self.out_plain)
        self.call(self.q_pe, self.k_pe, self.kv_cache, "fp8_ds_mla", self.out_ds, kv_cache_scale, backend)

    def written(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token indices, slots) of the rows the call must write: valid slots inside the cache."""
        T = self.q_pe.shape[0]
        nb, bs = self.kv_cache.shape[:2]
        slots = self.slot_mapping[:T]
        keep = (slots >= 0) & (slots < nb * bs)
        return keep.nonzero().flatten(), slots[keep]


def check(case: DsCase) -> None:
    """Everything the call must have done, and nothing else."""
    L, R = case.L, case.R
    T = case.q_pe.shape[0]
    # The query/key outputs and the in-place rotation are those of a plain bf16 cache.
    assert torch.equal(case.q_pe.view(torch.uint8), case.q_pe_plain.view(torch.uint8)), "q_pe"
    assert torch.equal(case.k_pe.view(torch.uint8), case.k_pe_plain.view(torch.uint8)), "k_pe"
    if case.out_ds is not None:
        assert torch.equal(case.out_ds.view(torch.uint8), case.out_plain.view(torch.uint8)), "q_out / k_out"
    tokens, slots = case.written()
    nb, bs = case.kv_cache.shape[:2]
    pos = clamp_positions(case.positions, T, case.cos_sin_cache.shape[0])
    k_rot, k_mag = rope64(case.originals["k_pe"], pos, case.cos_sin_cache, False)
    for t, slot in zip(tokens.tolist(), slots.tolist(), strict=True):
        codes, scales, rope = decode_row(case.kv_cache[slot // bs, slot % bs], L, R)
        want_codes, want_scales = model_row(case.kv_c[t].double())
        assert scales == want_scales, f"token {t}: scales {scales}, model {want_scales}"
        bad = (codes != want_codes).nonzero().flatten()
        assert not bad.numel(), (f"token {t}: {bad.numel()} fp8 codes differ, first at {int(bad[0])}: "
                                 f"{int(codes[bad[0]]):#04x}, model {int(want_codes[bad[0]]):#04x}")  # fmt: skip
        assert_close_to_ref(rope.to(torch.bfloat16), k_rot[t], k_mag[t], f"token {t}: bf16 rope part")
        # ... and rounded as op 1 rounds the k_pe it rotates in place (the plain cache's rope part).
        plain = case.plain_cache[slot // bs, slot % bs, L:].double()
        assert torch.equal(rope, plain), f"token {t}: rope part is not bf16(rope(k_pe))"
    # Every other byte of the allocation keeps the sentinel: unnamed rows, block padding, guard rows.
    marker = torch.zeros_like(case.parent, dtype=torch.bool)
    rows = marker.as_strided(case.kv_cache.shape, case.kv_cache.stride())
    rows[slots // bs, slots % bs] = True
    assert (case.parent[~marker] == SENTINEL).all(), "a byte no valid slot names was written"


def _untouched(case: DsCase, out: torch.Tensor | None = None) -> None:
    assert (case.parent == SENTINEL).all(), "the cache was written"
    assert out is None or (out == -7.0).all(), "q_out / k_out was written"
    assert torch.equal(case.q_pe.view(torch.uint8), case.originals["q_pe"].view(torch.uint8)), "q_pe was written"
    assert torch.equal(case.k_pe.view(torch.uint8), case.originals["k_pe"].view(torch.uint8)), "k_pe was written"


# --- the format, on random data ------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "L,R,block_size,T", [(512, 64, 64, 37), (512, 64, 1, 9), (256, 16, 16, 20), (128, 2, 3, 7)], ids=str
)  # fmt: skip
def test_cache_rows_match_the_model(op, L, R, block_size, T):
    case = DsCase(T=T, L=L, R=R, block_size=block_size, op=op, seed=T + L)
    case.run()
    check(case)
    assert len(case.written()[0]) >= T // 2  # the case writes rows (and skips padding and the slot past the cache)


def test_dsv3_row_is_656_bytes():
    assert fp8.ds_mla_row_bytes(512, 64) == 656
    case = DsCase(T=4, op="rope", seed=1)
    assert case.kv_cache.shape[-1] == 656
    case.run()
    check(case)


def test_kv_cache_scale_is_ignored():
    """vLLM's writer takes the layer's k_scale and does not read it: the format scales itself."""
    a, b = DsCase(T=6, seed=2), DsCase(T=6, seed=2)
    a.run()
    b.run(kv_cache_scale=torch.tensor([0.37]))
    assert torch.equal(a.parent, b.parent)


def test_auto_backend_on_cpu_is_the_reference():
    case = DsCase(T=5, op="decode", seed=3)
    case.run(backend=None)
    check(case)


# --- the format's corners ------------------------------------------------------------------------


def _group(kind: str, gen: torch.Generator) -> torch.Tensor:
    """128 float64 values of one kind of group (before rounding to bf16)."""
    x = torch.randn(GROUP, generator=gen, dtype=torch.float64)
    e = int(torch.randint(-20, 21, (), generator=gen))
    i = int(torch.randint(0, GROUP, (), generator=gen))
    if kind == "normal":
        return x * 2.0**e
    if kind == "zero":
        return torch.zeros(GROUP, dtype=torch.float64)
    if kind == "negative zero":  # -0.0 must stay -0.0 (code 0x80), as vLLM's cvt keeps the sign
        return -torch.zeros(GROUP, dtype=torch.float64)
    if kind == "at fp8 max":  # amax = 448 * 2**e: the scale is exactly 2**e, the largest value code 0x7e
        y = x.clamp(-2, 2) * 2.0**e
        y[i] = math.copysign(FP8_MAX * 2.0**e, x[i].item())
        return y
    if kind == "just above a power of two":  # amax / 448 one bf16 step above 2**e: the next scale up
        y = x.clamp(-2, 2) * 2.0**e
        y[i] = FP8_MAX * 2.0**e * (1 + 2.0**-7)
        return y
    if kind == "beyond fp8 max":  # raw values far past 448 (up to ~1e30)
        return x * 10.0 ** float(torch.randint(3, 31, (), generator=gen))
    if kind == "tiny":  # amax / 448 under the 1e-4 floor: scale 2**-13, codes subnormal or zero
        return x * 10.0 ** -float(torch.randint(3, 30, (), generator=gen))
    if kind == "one value":
        y = torch.zeros(GROUP, dtype=torch.float64)
        y[i] = x[i] * 2.0**e
        return y
    raise ValueError(kind)


KINDS = ["normal", "zero", "negative zero", "at fp8 max", "just above a power of two", "beyond fp8 max", "tiny",
         "one value"]  # fmt: skip


def _latent(kinds: list[list[str]], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.cat([_group(k, gen) for k in row]) for row in kinds])


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_of_group(kind):
    """Each corner in every group position, next to ordinary groups (scales are per group, not per token)."""
    rows = [[kind if g == t else "normal" for g in range(4)] for t in range(4)] + [[kind] * 4]
    case = DsCase(T=5, latent=_latent(rows, seed=KINDS.index(kind)), pad_every=0, past=False, seed=4)
    case.run()
    check(case)


def test_zero_group_scale_and_codes():
    """An all-zero group: scale 2**-13 (the 1e-4 floor rounded up to a power of two), all codes 0."""
    case = DsCase(T=1, latent=_latent([["zero", "normal", "zero", "normal"]], 5), pad_every=0, past=False, seed=5)
    case.run()
    check(case)
    slot = int(case.slot_mapping[0])
    codes, scales, _ = decode_row(case.kv_cache[slot // 16, slot % 16], 512, 64)
    assert scales[0] == scales[2] == 2.0**-13
    assert not codes[:GROUP].any() and not codes[2 * GROUP : 3 * GROUP].any()


def test_largest_value_is_the_fp8_maximum():
    """amax = 448 * 2**k: scale 2**k exactly and that value stored as 448 (code 0x7e)."""
    latent = torch.randn(1, 512, dtype=torch.float64).clamp(-1, 1)
    latent[0, 5], latent[0, 130] = 448 * 2.0**-3, -448.0 * 2**6
    case = DsCase(T=1, latent=latent, pad_every=0, past=False, seed=6)
    case.run()
    check(case)
    slot = int(case.slot_mapping[0])
    codes, scales, _ = decode_row(case.kv_cache[slot // 16, slot % 16], 512, 64)
    assert scales[:2] == [2.0**-3, 2.0**6]
    assert int(codes[5]) == 0x7E and int(codes[130]) == 0xFE


def test_a_nan_spoils_only_itself():
    """vLLM's group maximum (fmaxf) skips NaN: the group's other values keep their scale and codes."""
    latent = torch.randn(1, 512, dtype=torch.float64)
    latent[0, 7] = float("nan")
    case = DsCase(T=1, latent=latent, pad_every=0, past=False, seed=11)
    case.run()
    slot = int(case.slot_mapping[0])
    codes, scales, _ = decode_row(case.kv_cache[slot // 16, slot % 16], 512, 64)
    finite = case.kv_c[0].double().clone()
    finite[7] = 0.0
    want_codes, want_scales = model_row(finite)
    assert scales == want_scales
    assert int(codes[7]) & 0x7F == 0x7F  # e4m3fn's NaN
    codes[7] = want_codes[7]
    assert torch.equal(codes, want_codes)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_groups_property(data):
    """Random mixes of group kinds, widths, RoPE dims, block sizes and ops."""
    L = data.draw(st.sampled_from([128, 256, 512]))
    T = data.draw(st.integers(1, 5))
    kinds = [[data.draw(st.sampled_from(KINDS)) for _ in range(L // GROUP)] for _ in range(T)]
    case = DsCase(T=T, L=L, R=data.draw(st.sampled_from([2, 16, 64])),
                  block_size=data.draw(st.sampled_from([1, 4, 16])), op=data.draw(st.sampled_from(OPS)),
                  latent=_latent(kinds, data.draw(st.integers(0, 2**16))),
                  pad_every=data.draw(st.sampled_from([0, 2, 3])), seed=data.draw(st.integers(0, 2**16)))  # fmt: skip
    case.run()
    check(case)


def test_the_model_itself():
    """The model's rounding on known values, so that the checks above rest on a checked model."""
    # 0, -0, 1, ties to the even code (1.0, 1.25), the maximum, saturation (464 and past), the least
    # subnormal, ties between subnormals (to 0, to 2 * 2**-9), a value nearer the least subnormal than 0
    y = torch.tensor([0.0, -0.0, 1.0, 1.0625, 1.1875, 448.0, 464.0, 1e9, -1e9, 2.0**-9, 2.0**-10, 3 * 2.0**-10,
                      0.75 * 2.0**-9])  # fmt: skip
    want = [0x00, 0x80, 0x38, 0x38, 0x3A, 0x7E, 0x7E, 0x7E, 0xFE, 0x01, 0x00, 0x02, 0x01]
    assert model_codes(y).tolist() == want
    assert model_scale_exponent(0.0) == -13 and model_scale_exponent(448.0) == 0 and model_scale_exponent(449.0) == 1


# --- bad input -----------------------------------------------------------------------------------


def _mutated(mutate, op="rope", **kw):
    case = DsCase(T=6, op=op, seed=7, **kw)
    out = case.out()
    mutate(case)
    case.originals = {"q_pe": case.q_pe.clone(), "k_pe": case.k_pe.clone()}  # what the call gets must stay so
    return case, out


BAD = [
    ("row one byte short", lambda c: setattr(c, "kv_cache", c.kv_cache[..., :-1]), ValueError, "kv_cache last dim"),
    ("plain row width", lambda c: setattr(c, "kv_cache", c.kv_cache[..., : c.L + c.R]), ValueError,
     "kv_cache last dim must be 512 fp8 + 4 float32 scales + 64 bf16 = 656 bytes"),
    ("bf16 cache", lambda c: setattr(c, "kv_cache", torch.zeros(c.kv_cache.shape, dtype=torch.bfloat16)), TypeError,
     "kv_cache must be uint8 storage"),
    ("typed fp8 cache", lambda c: setattr(c, "kv_cache", c.kv_cache.view(torch.float8_e4m3fn)), TypeError,
     "kv_cache must be uint8 storage"),
    ("fp16 activations", lambda c: [setattr(c, n, getattr(c, n).half()) for n in ("q_pe", "k_pe", "kv_c", "ql_nope",
     "k_nope") if getattr(c, n) is not None], TypeError, "kv_c, k_pe and q_pe must be bfloat16"),
]  # fmt: skip


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("what,mutate,exc,words", BAD, ids=[b[0] for b in BAD])
def test_rejects_bad_input_before_writing(op, what, mutate, exc, words):
    case, out = _mutated(mutate, op)
    with pytest.raises(exc, match=words.replace("+", r"\+")):
        case.call(case.q_pe, case.k_pe, case.kv_cache, "fp8_ds_mla", out)
    _untouched(case, out)


@pytest.mark.parametrize("L", [64, 192, 320])
def test_rejects_a_latent_not_in_whole_groups(L):
    case = DsCase(T=4, L=L, seed=8)  # the cache row sized by the formula, so only L is wrong
    with pytest.raises(ValueError, match=rf"kv_c's last dimension \(kv_lora_rank\) must be a multiple of 128.*got {L}"):
        case.call(case.q_pe, case.k_pe, case.kv_cache, "fp8_ds_mla")
    _untouched(case)


def test_mi300_fp8_is_refused(monkeypatch):
    """On gfx94x vLLM's writer stores e4m3fnuz with a divisor of 224: not this format."""
    monkeypatch.setattr(fp8, "platform_fp8_e4m3", lambda device: torch.float8_e4m3fnuz)
    monkeypatch.setattr(binding, "_SHARED", {})  # no layout bound by an earlier test: validated afresh
    case = DsCase(T=3, block_size=7, seed=9)
    with pytest.raises(ValueError, match="'fp8_ds_mla' is not implemented on cpu"):
        case.call(case.q_pe, case.k_pe, case.kv_cache, "fp8_ds_mla")
    _untouched(case)


# --- backends: only the reference writes the format ------------------------------------------------


@pytest.mark.parametrize("backend", [b for b in OP_BACKENDS if b != "torch"] or ["triton"])
@pytest.mark.parametrize("op", OPS)
def test_a_named_backend_without_the_format_refuses_before_writing(backend, op):
    if backend not in OP_BACKENDS:
        pytest.skip("the Triton kernel runs here only in Triton's interpreter (TRITON_INTERPRET=1)")
    case = DsCase(T=5, op=op, seed=10)
    out = case.out()
    with pytest.raises(ValueError, match="backend 'triton' does not write kv_cache_dtype='fp8_ds_mla'; only"):
        case.call(case.q_pe, case.k_pe, case.kv_cache, "fp8_ds_mla", out, backend=backend)
    _untouched(case, out)


def test_the_fake_refuses_too():
    """Under torch.compile the op's fake raises the same error at trace time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = DsCase(T=4, seed=12)
    args = (case.positions, case.q_pe, case.k_pe, case.kv_c, case.cos_sin_cache, False, case.slot_mapping,
            case.kv_cache, "fp8_ds_mla", None)  # fmt: skip
    mode = FakeTensorMode()
    fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args]
    with mode:
        torch.ops.mla_fusion.mla_rope_cache_write(*fake, "torch")
        with pytest.raises(ValueError, match="backend 'triton' does not write kv_cache_dtype='fp8_ds_mla'"):
            torch.ops.mla_fusion.mla_rope_cache_write(*fake, "triton")


def test_resolution_on_a_gpu(monkeypatch):
    """On a GPU, "auto" takes the reference for this format; Triton or AITER named refuse it (no GPU needed:
    resolution looks at the device type only, and AITER's availability is stubbed)."""
    cuda = torch.device("cuda")
    packed = Problem(1, 16, 512, 64, fp8.DS_MLA_FP8, torch.bfloat16, cache_format=fp8.FP8_DS_MLA)
    plain = Problem(1, 16, 512, 64, torch.bfloat16, torch.bfloat16)
    assert dispatch.resolve("auto", cuda, decode=True, problem=packed) == "torch"
    assert dispatch.resolve("auto", cuda, decode=True, problem=plain) == "triton"
    assert dispatch.resolve("torch", cuda, decode=True, problem=packed) == "torch"
    with pytest.raises(ValueError, match="backend 'triton' does not write"):
        dispatch.resolve("triton", cuda, decode=True, problem=packed)
    monkeypatch.setattr(aiter_backend, "unavailable_reason", lambda device: None)
    with pytest.raises(ValueError, match="backend 'aiter' does not write"):
        dispatch.resolve("aiter", cuda, decode=True, problem=packed)


def test_the_plugins_format_list_is_unchanged():
    """The vLLM plugin fuses layers whose kv_cache_dtype is in KV_CACHE_DTYPES: sparse layers stay declined."""
    assert fp8.FP8_DS_MLA not in fp8.KV_CACHE_DTYPES
