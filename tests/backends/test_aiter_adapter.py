"""The AITER adapter's host-side logic, on the CPU, without AITER.

What runs here: probing (``unavailable_reason`` on this machine and on a
simulated ROCm machine), the policy (``select_kernel``, ``decline_reason``,
``call_decline_reason``) over tables of cases, the preparation (views, dtype
mapping per chip, cos/sin split and its cache, index conversion, scales), and
the whole adapter end to end against a Python model of AITER's kernel
(``emulate_hip_op``, written from ROCm/aiter csrc/kernels/cache_kernels.cu),
compared with the reference backend. Dispatch: forcing ``aiter`` here is a
clear error, and ``VLLM_ROCM_USE_AITER=1`` changes nothing without ROCm.

What cannot run here: the HIP kernel itself (tests/backends/test_aiter_rocm.py).
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

import vllm_mla_fusion as mla
from vllm_mla_fusion import dispatch
from vllm_mla_fusion.backends import aiter as ab
from vllm_mla_fusion.validation import Problem, check_decode_rope_cache_write

L, R = 512, 64
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}


@pytest.fixture(autouse=True)
def _fresh_probe(monkeypatch):
    monkeypatch.delenv(ab.ENV_FP8, raising=False)
    monkeypatch.delenv(dispatch.ENV_BACKEND, raising=False)
    monkeypatch.delenv("VLLM_ROCM_USE_AITER", raising=False)
    ab._clear_probe_caches()
    yield
    ab._clear_probe_caches()


def deepseek(T=8, H=16, cache=torch.bfloat16, q_out=None, L_=L, R_=R) -> Problem:
    return Problem(T, H, L_, R_, cache, q_out if q_out is not None else cache)


# --------------------------------------------------------------------------
# Chip and version helpers
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch, expected",
    [
        ("gfx942", torch.float8_e4m3fnuz),  # MI300X / MI325X
        ("gfx942:sramecc+:xnack-", torch.float8_e4m3fnuz),
        ("gfx950", torch.float8_e4m3fn),  # MI350X / MI355X
        ("gfx950:sramecc+:xnack-", torch.float8_e4m3fn),
        ("gfx90a", None),  # MI250: no fp8, kernel not targeted
        ("gfx1100", None),
        (None, None),
    ],
)
def test_native_fp8_dtype_per_chip(arch, expected):
    assert ab.native_fp8_dtype(arch) == expected


@pytest.mark.parametrize("gcn", ["gfx942:sramecc+:xnack-", "gfx950:sramecc+:xnack-"])
def test_native_fp8_matches_the_projects_platform_fp8(monkeypatch, gcn):
    # vLLM's "fp8" on uint8 storage (validation's platform_fp8_e4m3) must be the type AITER accepts there.
    from vllm_mla_fusion import fp8

    monkeypatch.setattr(torch.version, "hip", "7.0.1")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(gcnArchName=gcn))
    fp8.platform_fp8_e4m3.cache_clear()
    try:
        assert fp8.platform_fp8_e4m3(torch.device("cuda", 0)) == ab.native_fp8_dtype(gcn)
    finally:
        fp8.platform_fp8_e4m3.cache_clear()


@pytest.mark.parametrize(
    "text, expected",
    [("7.0.51831-a3e329ad8", (7, 0)), ("6.4.43482", (6, 4)), ("7.1", (7, 1)), ("", None), (None, None), ("x", None)],
)
def test_parse_hip_version(text, expected):
    assert ab.parse_hip_version(text) == expected


# Written in the form of AITER's ops/cache.py stubs (not copied from it).
_STUB_OLD = f"""
@compile_ops("module_cache", develop=True)
def {ab.AITER_OP}(
    q_nope: Tensor,
    kv_cache: Tensor,  # [num_blocks, block_size, (kv_lora_rank + pe_dim)]
    is_neox: bool,
    is_nope_first: bool,
) -> None: ...

def {ab.AITER_OP}_seg(q_nope: Tensor, compute_all_q_rope: bool = False) -> None: ...
"""
_STUB_NEW = _STUB_OLD.replace("is_nope_first: bool,\n)", "is_nope_first: bool,\n    compute_all_q_rope: bool = False,\n)")


def test_source_supports_compute_all():
    assert not ab.source_supports_compute_all(_STUB_OLD), "the _seg variant's parameter must not count"
    assert ab.source_supports_compute_all(_STUB_NEW)
    assert not ab.source_supports_compute_all("def something_else(x): pass")


# --------------------------------------------------------------------------
# unavailable_reason: this machine, then a simulated ROCm machine
# --------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "meta"])
def test_unavailable_reason_here_is_a_clear_string(device):
    if torch.version.hip is not None:
        pytest.skip("this machine has ROCm torch; the simulated cases below cover the logic")
    reason = ab.unavailable_reason(torch.device(device))
    assert isinstance(reason, str) and "ROCm" in reason


def test_probing_without_rocm_imports_nothing():
    # In a fresh interpreter: other tests in this session may have put a stub 'aiter' in sys.modules.
    code = (
        "import sys, torch\n"
        "from vllm_mla_fusion.backends import aiter as ab\n"
        "from vllm_mla_fusion import dispatch\n"
        "r = ab.unavailable_reason(torch.device('cuda'))\n"
        "assert r, r\n"
        "assert dispatch.available_backends('cpu')[-1] == 'torch'\n"
        "assert 'aiter' not in sys.modules, 'probing imported aiter'\n"
    )
    if torch.version.hip is not None:
        pytest.skip("ROCm torch: probing is allowed to import aiter here")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.fixture
def fake_rocm(monkeypatch, tmp_path):
    """A ROCm 7 torch on a gfx942, with an AITER package of our making under tmp_path."""
    monkeypatch.setattr(torch.version, "hip", "7.0.51831-a3e329ad8")
    monkeypatch.setattr(ab, "_device_arch", lambda index: "gfx942")
    monkeypatch.delitem(sys.modules, "aiter", raising=False)
    pkg = tmp_path / "aiter"

    def install(cache_py: str | None, init: str = "", version: str | None = "0.1.20"):
        (pkg / "ops").mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text(init)
        if cache_py is not None:
            (pkg / "ops" / "cache.py").write_text(cache_py)
        if version:
            (pkg / "_version.py").write_text(f"__version__ = '{version}'\n")
        monkeypatch.setattr(ab, "_aiter_package_dir", lambda: pkg)
        monkeypatch.syspath_prepend(str(tmp_path))
        ab._clear_probe_caches()

    yield install
    sys.modules.pop("aiter", None)


def _reason(device="cuda:0"):
    return ab.unavailable_reason(torch.device(device))


def test_simulated_rocm_old_hip(fake_rocm, monkeypatch):
    fake_rocm(_STUB_NEW, init=f"def {ab.AITER_OP}(*a): pass\n")
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    assert "older than 7.0" in _reason()


def test_simulated_rocm_unsupported_chip(fake_rocm, monkeypatch):
    fake_rocm(_STUB_NEW, init=f"def {ab.AITER_OP}(*a): pass\n")
    monkeypatch.setattr(ab, "_device_arch", lambda index: "gfx90a")
    assert "gfx90a" in _reason()


def test_simulated_rocm_cpu_tensor(fake_rocm):
    fake_rocm(_STUB_NEW, init=f"def {ab.AITER_OP}(*a): pass\n")
    assert "cpu" in _reason("cpu")


def test_simulated_rocm_not_installed(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "7.0.1")
    monkeypatch.setattr(ab, "_device_arch", lambda index: "gfx950")
    monkeypatch.setattr(ab, "_aiter_package_dir", lambda: None)
    reason = _reason()
    assert "not installed" in reason and ab.MIN_AITER_VERSION in reason


def test_simulated_rocm_unrelated_aiter_package(fake_rocm):
    fake_rocm(None)  # PyPI's async-iterator 'aiter' has no ops/cache.py
    assert "not AMD's AITER" in _reason()


def test_simulated_rocm_aiter_without_the_op(fake_rocm):
    fake_rocm("def something(): pass\n", version="0.1.7")
    reason = _reason()
    assert "0.1.7" in reason and "has no" in reason


def test_simulated_rocm_aiter_too_old(fake_rocm):
    fake_rocm(_STUB_OLD, version="0.1.19")
    reason = _reason()
    assert "too old" in reason and "compute_all_q_rope" in reason and "0.1.19" in reason


def test_simulated_rocm_import_failure_is_a_reason_not_a_crash(fake_rocm):
    fake_rocm(_STUB_NEW, init="raise RuntimeError('ROCm version file not found')\n")
    reason = _reason()
    assert "importing AITER" in reason and "ROCm version file not found" in reason


def test_simulated_rocm_available_and_cached(fake_rocm, monkeypatch):
    fake_rocm(_STUB_NEW, init=f"def {ab.AITER_OP}(*a): pass\n")
    assert _reason() is None
    # Probed once: a later change on disk is not re-read until the caches are cleared.
    monkeypatch.setattr(ab, "_aiter_package_dir", lambda: None)
    assert _reason() is None
    ab._clear_probe_caches()
    assert "not installed" in _reason()


# --------------------------------------------------------------------------
# Policy
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "T, H, L_, R_, bs, nope_first, expected",
    [
        (1, 16, 512, 64, 1, True, "per_head"),
        (255, 128, 512, 64, 1, True, "per_head"),
        (256, 128, 512, 64, 1, True, "opt"),  # T < 256 for per-head
        (1, 16, 512, 64, 16, True, "opt"),  # block size > 1
        (1, 16, 512, 64, 1, False, "opt"),  # per-head needs nope first
        (1, 4, 512, 64, 16, True, "opt"),  # 4 * 512 = 2048
        (1, 3, 512, 64, 16, True, "general"),
        (300, 2, 512, 64, 1, True, "general"),
        (1, 2, 512, 64, 1, True, "per_head"),
        (1, 16, 256, 64, 1, True, "per_head"),  # per-head takes L <= 512 (we still decline L != 512)
        (1, 16, 256, 64, 16, True, "general"),  # opt hard-codes 512
        (1, 16, 512, 128, 1, True, "general"),
    ],
)
def test_select_kernel_mirrors_aiter_host_code(T, H, L_, R_, bs, nope_first, expected):
    assert ab.select_kernel(T, H, L_, R_, bs, nope_first) == expected


E4FN, E4FNUZ, E5 = torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (id, decode, problem, arch, allow_fp8, None or a substring of the reason)
POLICY = [
    ("op1-never", False, deepseek(), "gfx950", True, "in place"),
    ("no-problem", True, None, "gfx950", True, "no call shape"),
    ("empty", True, deepseek(T=0), "gfx950", False, "no tokens"),
    ("bf16-decode-gfx942", True, deepseek(T=1, H=16), "gfx942", False, None),
    ("bf16-decode-gfx950", True, deepseek(T=64, H=128), "gfx950", False, None),
    ("bf16-unknown-chip-per-head", True, deepseek(T=8), None, False, None),
    ("fp16", True, deepseek(cache=FP16), "gfx942", False, None),
    ("fp32", True, deepseek(cache=FP32), "gfx942", False, None),
    ("bf16-T255-per-head", True, deepseek(T=255, H=128), "gfx942", False, None),
    ("bf16-T256-opt-gfx942-truncates", True, deepseek(T=256, H=128), "gfx942", False, "truncates"),
    ("bf16-T256-opt-unknown-chip", True, deepseek(T=256, H=128), None, False, "truncates"),
    ("bf16-T256-opt-gfx950", True, deepseek(T=256, H=128), "gfx950", False, None),
    ("fp16-T4096-opt-gfx942", True, deepseek(T=4096, H=16, cache=FP16), "gfx942", False, None),
    ("H4-T256-opt", True, deepseek(T=256, H=4), "gfx950", False, None),
    ("H3-T256-general", True, deepseek(T=256, H=3), "gfx950", False, "general decode kernel"),
    ("H1-T8-per-head", True, deepseek(T=8, H=1), "gfx950", False, None),
    ("rope-128", True, deepseek(R_=128), "gfx950", False, "rope_dim"),
    ("lora-256", True, deepseek(L_=256), "gfx950", False, "kv_lora_rank"),
    ("q_out-differs", True, deepseek(cache=BF16, q_out=FP32), "gfx950", False, "differ"),
    ("fp8-off-by-default", True, deepseek(cache=E4FNUZ, q_out=BF16), "gfx942", False, ab.ENV_FP8),
    ("fp8-native-gfx942", True, deepseek(cache=E4FNUZ, q_out=BF16), "gfx942", True, None),
    ("fp8-native-gfx950", True, deepseek(cache=E4FN, q_out=BF16), "gfx950", True, None),
    ("fp8-both-native", True, deepseek(cache=E4FN, q_out=E4FN), "gfx950", True, None),
    ("fp8-foreign-gfx942", True, deepseek(cache=E4FN, q_out=BF16), "gfx942", True, "takes only"),
    ("fp8-foreign-gfx950", True, deepseek(cache=E4FNUZ, q_out=BF16), "gfx950", True, "takes only"),
    ("fp8-e5m2", True, deepseek(cache=E5, q_out=BF16), "gfx950", True, "takes only"),
    ("fp8-q_out-foreign", True, deepseek(cache=E4FN, q_out=E4FNUZ), "gfx950", True, "takes only"),
    ("fp8-q_out-bf16-cache", True, deepseek(cache=BF16, q_out=E4FN), "gfx950", True, "non-fp8 cache"),
    ("fp8-unknown-chip", True, deepseek(cache=E4FN, q_out=BF16), None, True, "unknown"),
    ("fp8-opt-gfx942-ok", True, deepseek(T=512, cache=E4FNUZ, q_out=BF16), "gfx942", True, None),
]


@pytest.mark.parametrize("decode, problem, arch, allow_fp8, expected", [c[1:] for c in POLICY], ids=[c[0] for c in POLICY])
def test_decline_reason_table(decode, problem, arch, allow_fp8, expected):
    reason = ab.decline_reason(decode, problem, arch=arch, allow_fp8=allow_fp8)
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and expected in reason, reason


def test_applies_uses_the_chip_and_the_fp8_flag(monkeypatch):
    monkeypatch.setattr(ab, "_arch_of", lambda device: "gfx942")
    fp8_call = deepseek(cache=E4FNUZ, q_out=BF16)
    assert ab.applies(True, deepseek())
    assert not ab.applies(False, deepseek())
    assert not ab.applies(True, None)
    assert not ab.applies(True, fp8_call)
    monkeypatch.setenv(ab.ENV_FP8, "1")
    assert ab.applies(True, fp8_call)


def test_applies_without_rocm_declines_chip_dependent_cases():
    if torch.version.hip is not None:
        pytest.skip("ROCm torch")
    assert ab._arch_of(None) is None
    assert not ab.applies(True, deepseek(T=256, H=128))  # opt + bf16: needs to know the chip
    assert ab.applies(True, deepseek(T=8))  # per-head: same on every chip


# --------------------------------------------------------------------------
# Inputs shaped like vLLM's decode step
# --------------------------------------------------------------------------


def rope_cache(max_pos=4096, dtype=torch.float32, rotary=R):
    inv = 1.0 / (10000 ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def make_call(T=5, H=16, dtype=torch.bfloat16, num_blocks=8, block_size=16, cache_dtype=None, q_out_dtype=None,
              vllm_layout=True, seed=0, slots=None, positions=None, cos_dtype=None):  # fmt: skip
    """Arguments of op 2 with vLLM's strided views (q_pe from q[..., 512:], k_pe/kv_c from kv_a)."""
    g = torch.Generator().manual_seed(seed)
    if vllm_layout:
        q = torch.randn(T, H, L + R, generator=g).to(dtype)
        q_pe = q[..., L:]  # stride(1) = L + R
        ql_nope = torch.randn(H, T, L, generator=g).to(dtype).transpose(0, 1)  # bmm output, heads strided
        kv_a = torch.randn(T, L + R + 64, generator=g).to(dtype)  # row stride 640: 16-byte aligned rows
        kv_c, k_pe = kv_a[:, :L], kv_a[:, L : L + R].unsqueeze(1)
    else:
        q_pe = torch.randn(T, H, R, generator=g).to(dtype)
        ql_nope = torch.randn(T, H, L, generator=g).to(dtype)
        kv_c = torch.randn(T, L, generator=g).to(dtype)
        k_pe = torch.randn(T, R, generator=g).to(dtype)
    cs = rope_cache(dtype=cos_dtype or dtype)
    if positions is None:
        positions = torch.randint(0, cs.shape[0], (T + 3,), generator=g)  # longer than T, like vLLM's padded batch
    if slots is None:
        perm = torch.randperm(num_blocks * block_size, generator=g)[:T]
        slots = torch.cat((perm, torch.full((3,), -1)))
        if T > 2:
            slots[1] = -1  # a padding token in the middle
    cache_dtype = cache_dtype or dtype
    if cache_dtype == torch.uint8:  # vLLM's fp8 storage, canary bytes
        kv_cache = torch.full((num_blocks, block_size, L + R), 0x3C, dtype=torch.uint8)
    else:  # canary value: rows nobody writes must keep it
        kv_cache = torch.full((num_blocks, block_size, L + R), 0.75).to(cache_dtype)
    q_out = torch.full((T, H, L + R), float("nan")).to(q_out_dtype or dtype)
    return dict(positions=positions, ql_nope=ql_nope, q_pe=q_pe, k_pe=k_pe, kv_c=kv_c, cos_sin_cache=cs,
                is_neox=False, slot_mapping=slots, kv_cache=kv_cache, q_out=q_out)  # fmt: skip


def problem_of(call, kv_cache_dtype="auto", kv_cache_scale=None, q_scale=None, is_nope_first=True) -> Problem:
    c = call
    return check_decode_rope_cache_write(
        c["positions"], c["ql_nope"], c["q_pe"], c["k_pe"], c["kv_c"], c["cos_sin_cache"], c["is_neox"],
        c["slot_mapping"], c["kv_cache"], c["q_out"], kv_cache_dtype, kv_cache_scale, q_scale, is_nope_first,
    )  # fmt: skip


# --------------------------------------------------------------------------
# Preparation
# --------------------------------------------------------------------------


def test_cache_view_dense_paged_cache_becomes_block_size_one():
    cache = torch.randn(4, 16, L + R)
    view = ab.cache_view(cache)
    assert view.shape == (64, 1, L + R) and view.data_ptr() == cache.data_ptr()
    assert torch.equal(view[37, 0], cache[37 // 16, 37 % 16])


def test_cache_view_keeps_padded_blocks_and_block_size_one():
    padded = torch.randn(4, 17, L + R)[:, :16]  # block stride 17 rows: cannot be flattened
    assert ab.cache_view(padded) is padded
    one = torch.randn(64, 1, L + R)
    assert ab.cache_view(one) is one
    single_block = torch.randn(1, 16, L + R)
    assert ab.cache_view(single_block).shape == (16, 1, L + R)


def test_uint8_cache_is_viewed_as_the_chips_fp8_type():
    call = make_call(cache_dtype=torch.uint8)
    p = Problem(5, 16, L, R, torch.float8_e4m3fnuz, torch.bfloat16)  # what validation resolves "fp8" to on gfx942
    args = _prepare(p, call)
    assert args.kv_cache.dtype == torch.float8_e4m3fnuz
    assert args.kv_cache.data_ptr() == call["kv_cache"].data_ptr()
    assert args.kv_cache.shape == (8 * 16, 1, L + R)


def test_rope_split_is_made_once_and_is_contiguous():
    cache = ab.RopeSplitCache()
    cs = rope_cache(dtype=torch.bfloat16)
    cos, sin = cache.get(cs)
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == (cs.shape[0], R // 2)
    assert torch.equal(cos, cs[:, : R // 2]) and torch.equal(sin, cs[:, R // 2 :])
    cos2, sin2 = cache.get(cs)
    assert cos2 is cos and sin2 is sin and cache.misses == 1


def test_rope_split_invalidation():
    cache = ab.RopeSplitCache()
    cs = rope_cache()
    cos, _ = cache.get(cs)
    cs.mul_(0.5)  # in-place write bumps the version counter
    cos2, _ = cache.get(cs)
    assert cos2 is not cos and torch.equal(cos2, cs[:, : R // 2]) and cache.misses == 2
    other = cs.clone()  # same values, other storage: its own entry
    assert cache.get(other)[0] is not cos2 and cache.misses == 3
    narrower = cs[: cs.shape[0] // 2]  # same pointer, other shape
    assert cache.get(narrower)[0].shape[0] == cs.shape[0] // 2 and cache.misses == 4


def test_rope_split_inference_tensors_and_lru_bound():
    cache = ab.RopeSplitCache(max_entries=2)
    with torch.inference_mode():
        cs = rope_cache()  # no version counter
    cos, _ = cache.get(cs)
    assert cache.get(cs)[0] is cos
    tensors = [rope_cache(max_pos=16 + i) for i in range(3)]  # held here, so no address reuse
    for t in tensors:
        cache.get(t)
    assert len(cache) == 2
    assert cache.get(tensors[-1]) and cache.misses == 4  # still cached
    cache.get(cs)
    assert cache.misses == 5  # evicted earlier
    cache.clear()
    assert len(cache) == 0


def test_rope_split_entry_keeps_its_source_alive():
    import weakref

    cache = ab.RopeSplitCache()
    cs = rope_cache(max_pos=64)
    ref = weakref.ref(cs)
    cache.get(cs)
    del cs
    assert ref() is not None, "a freed source could hand its address (and so its key) to another tensor"


def test_index_conversion_policy():
    idx = torch.arange(10, dtype=torch.int64)
    out = ab.as_int64_index(idx, 7)
    assert out.shape == (7,) and out.data_ptr() == idx.data_ptr(), "int64 input must not be copied"
    i32 = torch.arange(10, dtype=torch.int32)
    out = ab.as_int64_index(i32, 7)
    assert out.dtype == torch.int64 and torch.equal(out, torch.arange(7))
    strided = torch.arange(20, dtype=torch.int64)[::2]
    out = ab.as_int64_index(strided, 6)
    assert out.is_contiguous() and torch.equal(out, torch.arange(0, 12, 2))


def test_guard_slots_turns_slots_past_the_cache_into_padding():
    slots = torch.tensor([0, 128, 5, 130, 10**9, 127, -1, 2**62])
    assert ab.guard_slots(slots, 128).tolist() == [0, -1, 5, -1, -1, 127, -1, -1]


@pytest.mark.parametrize("padded_blocks", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_prepare_decode_args_guards_slots_past_the_cache(padded_blocks, index_dtype):
    """The capacity is the cache's num_blocks * block_size, whether AITER gets the [num_slots, 1, 576]
    view (dense blocks) or the paged cache itself (padded blocks)."""
    call = make_call(T=7, H=16)
    if padded_blocks:
        call["kv_cache"] = torch.full((8, 17, L + R), 0.75).to(torch.bfloat16)[:, :16]
    cap = 8 * 16
    call["slot_mapping"] = torch.tensor([0, cap, 5, cap + 2, 10**9, cap - 1, 2**31 - 1, 9], dtype=index_dtype)
    a = _prepare(problem_of(call), call, rope_splits=ab.RopeSplitCache())
    assert a.kv_cache.shape[:2] == ((8, 16) if padded_blocks else (cap, 1))
    assert a.slot_mapping.dtype == torch.int64
    assert a.slot_mapping.tolist() == [0, -1, 5, -1, -1, cap - 1, -1]


def test_default_scales_are_cached_float32_ones():
    k1, q1 = ab.default_scales(torch.device("cpu"))
    k2, q2 = ab.default_scales(torch.device("cpu"))
    assert k1 is k2 and q1 is q2 and k1 is not q1
    for s in (k1, q1):
        assert s.dtype == torch.float32 and s.shape == (1,) and s.item() == 1.0


def _positional(call):
    """The public op 2's leading arguments from a make_call dict."""
    c = call
    return (c["positions"], c["ql_nope"], c["q_pe"], c["k_pe"], c["kv_c"], c["cos_sin_cache"], c["is_neox"],
            c["slot_mapping"], c["kv_cache"], c["q_out"])  # fmt: skip


def _prepare(p, call, kv_cache_scale=None, q_scale=None, **kwargs):
    """prepare_decode_args on a make_call dict, its tensors in binding.Site's order."""
    c = call
    return ab.prepare_decode_args(p, c["positions"], c["q_pe"], c["k_pe"], c["kv_c"], c["cos_sin_cache"],
                                  c["slot_mapping"], c["kv_cache"], kv_cache_scale, c["ql_nope"], c["q_out"], q_scale,
                                  is_neox=c["is_neox"], is_nope_first=True, **kwargs)  # fmt: skip


def test_prepare_decode_args_layout():
    call = make_call(T=5, H=16)
    p = problem_of(call)
    ks, qs = torch.tensor([0.5]), torch.tensor([2.0])
    a = _prepare(p, call, ks, qs, rope_splits=ab.RopeSplitCache())
    assert a.q_nope is call["ql_nope"] and a.q_pe is call["q_pe"] and a.q_out is call["q_out"]
    assert a.kv_c.shape == (5, L) and a.k_pe.shape == (5, R)
    assert a.k_pe.data_ptr() == call["k_pe"].data_ptr() and a.k_pe.stride(0) == call["k_pe"].stride(0)
    assert a.kv_cache.shape == (8 * 16, 1, L + R)
    assert a.slot_mapping.shape == (5,) and a.slot_mapping.dtype == torch.int64
    assert a.positions.shape == (5,) and a.positions.dtype == torch.int64
    assert a.cos_cache.dtype == a.q_pe.dtype and a.cos_cache.is_contiguous()
    assert a.k_scale is ks and a.q_scale is qs
    assert a.compute_all_q_rope is True and a.is_nope_first is True
    assert len(a.as_tuple()) == 15


# --------------------------------------------------------------------------
# call_decline_reason: what only the tensors show
# --------------------------------------------------------------------------


def _tensor_reason(call, arch="gfx950", is_nope_first=True, allow_fp8=False, p=None):
    c = call
    p = p or problem_of(call, is_nope_first=is_nope_first)
    return ab.call_decline_reason(
        p, c["ql_nope"], c["q_pe"], c["k_pe"], c["kv_c"], c["cos_sin_cache"], c["kv_cache"], c["q_out"],
        is_nope_first, arch=arch, allow_fp8=allow_fp8,
    )  # fmt: skip


def test_vllm_layout_is_accepted():
    assert _tensor_reason(make_call()) is None
    assert _tensor_reason(make_call(vllm_layout=False)) is None


def test_tensor_level_declines():
    assert "is_nope_first" in _tensor_reason(make_call(), is_nope_first=False)
    assert "cos_sin_cache" in _tensor_reason(make_call(cos_dtype=torch.float32))
    # Cache and q_out agree with each other but not with the activations.
    c = make_call(cache_dtype=torch.float32, q_out_dtype=torch.float32)
    assert "input dtype" in _tensor_reason(c)

    c = make_call(vllm_layout=False)
    c["q_pe"] = torch.randn(5, 16, 2 * R).to(torch.bfloat16)[..., ::2]
    assert "last-dim stride" in _tensor_reason(c)

    c = make_call()
    c["q_out"] = torch.empty(5, 16, L + R + 8, dtype=torch.bfloat16)[..., : L + R]
    assert "densely packed" in _tensor_reason(c)

    c = make_call(vllm_layout=False)
    c["kv_c"] = torch.randn(5, L + 1).to(torch.bfloat16)[:, 1:]  # rows start 2 bytes in
    assert "aligned" in _tensor_reason(c)


def test_cache_layout_decides_the_kernel():
    c = make_call(T=5, H=2)
    c["kv_cache"] = torch.zeros(8, 17, L + R, dtype=torch.bfloat16)[:, :16]  # padded blocks: stays block size 16
    assert "general decode kernel" in _tensor_reason(c)  # 2 heads * 512 < 2048
    c = make_call(T=5, H=16)
    c["kv_cache"] = torch.zeros(8, 17, L + R, dtype=torch.bfloat16)[:, :16]
    assert _tensor_reason(c, arch="gfx950") is None  # opt kernel honours the block strides
    assert "truncates" in _tensor_reason(c, arch="gfx942")
    assert _tensor_reason(make_call(T=5, H=16), arch="gfx942") is None  # dense: per-head via the [-1, 1, 576] view


# --------------------------------------------------------------------------
# End to end against a model of AITER's kernel
# --------------------------------------------------------------------------


def emulate_hip_op(q_nope, q_pe, kv_c, k_pe, kv_cache, q_out, slot_mapping, k_scale, q_scale, positions,
                   cos_cache, sin_cache, is_neox, is_nope_first, compute_all_q_rope=False):  # fmt: skip
    """What AITER's per-head/opt decode kernels compute (ROCm/aiter csrc/kernels/cache_kernels.cu), in torch.

    Mirrors the kernels' addressing: token count from ``slot_mapping``,
    int64 indices read raw, cos/sin read at ``pos * R/2`` from contiguous
    half-width tensors of the input dtype, ``block = slot // block_size``,
    position clamp, no q_out for slot < 0 unless ``compute_all_q_rope``, fp8
    as ``x * (1/scale)`` (nope clamped to the fp8 range, rope not). The cache
    row is addressed from the tensor's data pointer with no upper bound, as
    the kernels do (only ``slot < 0`` is tested): a slot past the cache lands
    in the memory after it, and one past the allocation fails here.
    """
    assert kv_c.dim() == 2 and k_pe.dim() == 2, "decode path takes 2-D kv_c/k_pe"
    assert is_nope_first
    assert slot_mapping.dtype == torch.int64 and positions.dtype == torch.int64
    assert cos_cache.is_contiguous() and sin_cache.is_contiguous()
    assert cos_cache.dtype == q_pe.dtype == sin_cache.dtype
    assert kv_cache.dtype != torch.uint8, "AITER: kv cache data type is not supported"
    assert k_scale.dtype == q_scale.dtype == torch.float32
    T, Lr, half = slot_mapping.shape[0], kv_c.shape[-1], cos_cache.shape[-1]
    bs = kv_cache.shape[1]
    cos_flat, sin_flat = cos_cache.reshape(-1), sin_cache.reshape(-1)
    cache_fp8 = kv_cache.dtype in FP8_MAX
    q_fp8 = q_out.dtype in FP8_MAX
    inv_k = (1.0 / k_scale.float()).item()
    inv_q = (1.0 / q_scale.float()).item() if cache_fp8 else 1.0

    def rot(x, c, s):
        x = x.float()
        if is_neox:
            x1, x2 = x[..., :half], x[..., half:]
            return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), -1).flatten(-2)

    def store(x, dtype, inv, clamp):
        if dtype in FP8_MAX:
            x = x.float() * inv
            if clamp:
                x = x.clamp(-FP8_MAX[dtype], FP8_MAX[dtype])
        return x.to(dtype)

    for t in range(T):
        slot = int(slot_mapping[t])
        if slot < 0 and not compute_all_q_rope:
            continue
        pos = min(max(int(positions[t]), 0), cos_cache.shape[0] - 1)
        c = cos_flat[pos * half : (pos + 1) * half].float()
        s = sin_flat[pos * half : (pos + 1) * half].float()
        q_out[t, :, :Lr] = store(q_nope[t], q_out.dtype, inv_q, True)
        q_out[t, :, Lr:] = store(rot(q_pe[t], c, s), q_out.dtype, inv_q, False)
        if slot >= 0:
            flat = torch.empty(0, dtype=kv_cache.dtype).set_(kv_cache.untyped_storage())
            start = kv_cache.storage_offset() + (slot // bs) * kv_cache.stride(0) + (slot % bs) * kv_cache.stride(1)
            width = kv_cache.shape[-1]
            assert start + width <= flat.numel(), f"slot {slot}: AITER would write past the cache's allocation"
            row = flat[start : start + width]
            row[:Lr] = store(kv_c[t], kv_cache.dtype, inv_k, True)
            row[Lr:] = store(rot(k_pe[t], c, s), kv_cache.dtype, inv_k, False)
    assert not q_fp8 or cache_fp8


def run_reference(call, **kw):
    c = {k: (v.clone() if isinstance(v, torch.Tensor) and k in ("kv_cache", "q_out") else v) for k, v in call.items()}
    mla.mla_decode_rope_cache_write(*_positional(c), backend="torch", **kw)
    return c["q_out"], c["kv_cache"]


def assert_matches_reference(q_out, kv_cache, ref_q, ref_cache, fp8_out=False):
    if fp8_out:
        # One fp8 rounding apart at most (AITER multiplies by 1/scale, the spec divides).
        torch.testing.assert_close(q_out.float(), ref_q.float(), rtol=0.125, atol=2**-9)
        torch.testing.assert_close(kv_cache.float(), ref_cache.float(), rtol=0.125, atol=2**-9)
        return
    Lr = q_out.shape[-1] - R
    assert torch.equal(q_out[..., :Lr], ref_q[..., :Lr]), "q_out nope part must be bit-exact"
    assert torch.equal(kv_cache[..., :Lr], ref_cache[..., :Lr]), "cache nope part (and untouched rows) bit-exact"
    rtol = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-22}[q_out.dtype]
    torch.testing.assert_close(q_out[..., Lr:].float(), ref_q[..., Lr:].float(), rtol=rtol, atol=1e-5)
    torch.testing.assert_close(kv_cache[..., Lr:].float(), ref_cache[..., Lr:].float(), rtol=rtol, atol=1e-5)


@pytest.fixture
def fake_aiter(monkeypatch):
    """``import aiter`` yields a module whose op is ``emulate_hip_op``; calls to it are recorded."""
    calls = []

    def op(*args):
        calls.append(args)
        emulate_hip_op(*args)

    module = types.ModuleType("aiter")
    setattr(module, ab.AITER_OP, op)
    monkeypatch.setitem(sys.modules, "aiter", module)
    monkeypatch.setattr(ab, "_arch_of", lambda device: "gfx950")
    return calls


def _run_adapter(call, p, kv_cache_scale=None, q_scale=None, fallback=None):
    c = call
    tensors = (c["positions"], c["q_pe"], c["k_pe"], c["kv_c"], c["cos_sin_cache"], c["slot_mapping"], c["kv_cache"],
               kv_cache_scale, c["ql_nope"], c["q_out"], q_scale)  # fmt: skip
    bound = ab.BoundDecode(p, c["is_neox"], True, fallback, torch.device("cpu"))
    bound(p.num_tokens, *tensors)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("is_neox", [False, True])
@pytest.mark.parametrize("T, H, block_size", [(1, 16, 1), (5, 16, 16), (7, 2, 16), (9, 128, 64)])
def test_adapter_end_to_end_matches_reference(fake_aiter, dtype, is_neox, T, H, block_size):
    call = make_call(T=T, H=H, dtype=dtype, block_size=block_size, num_blocks=max(2, 64 // block_size))
    call["is_neox"] = is_neox
    call["positions"][0] = 10**6  # out of range: clamped by both
    ref_q, ref_cache = run_reference(call)
    p = problem_of(call)
    _run_adapter(call, p)
    assert len(fake_aiter) == 1, "the call must have gone to AITER, not to the fallback"
    args = fake_aiter[0]
    assert args[14] is True and args[4].shape[1] == 1  # compute_all_q_rope, per-head cache view
    assert_matches_reference(call["q_out"], call["kv_cache"], ref_q, ref_cache)


def _guarded_call(T=7, H=16, block_size=16, num_blocks=4, guard_rows=40):
    """A call whose cache is a view into a larger buffer with canary rows after it, and whose
    slot_mapping names slots at and past the capacity (inside those rows, and far beyond)."""
    call = make_call(T=T, H=H, num_blocks=num_blocks, block_size=block_size)
    width = L + R
    buffer = torch.full(((num_blocks * block_size + guard_rows) * width,), 0.75).to(torch.bfloat16)
    buffer[num_blocks * block_size * width :] = 1.5  # the guard rows
    call["kv_cache"] = buffer[: num_blocks * block_size * width].view(num_blocks, block_size, width)
    cap = num_blocks * block_size
    call["slot_mapping"] = torch.tensor([0, cap, 5, cap + 2, 10**9, cap - 1, cap + guard_rows - 1, -1])
    return call, buffer, cap


def test_emulated_aiter_writes_past_the_cache_without_the_guard():
    """The model reproduces the hazard the guard prevents: AITER's kernels given such slots write
    into the memory after the cache (and past the allocation for 10**9)."""
    call, buffer, cap = _guarded_call()
    args = list(_prepare(problem_of(call), call, rope_splits=ab.RopeSplitCache()).as_tuple())
    args[6] = ab.as_int64_index(call["slot_mapping"], 7)  # the raw slots, without guard_slots
    with pytest.raises(AssertionError, match="past the cache's allocation"):
        emulate_hip_op(*args)
    assert (buffer[cap * (L + R) :] != 1.5).any(), "the slots inside the guard rows were written"


def test_adapter_end_to_end_slots_past_the_cache_write_nothing(fake_aiter):
    call, buffer, cap = _guarded_call()
    guard_before = buffer[cap * (L + R) :].clone()
    keep = call["slot_mapping"][:7].clone()
    ref_call = dict(call, slot_mapping=torch.where(keep < cap, keep, -1))  # the reference semantics
    ref_q, ref_cache = run_reference(ref_call)
    _run_adapter(call, problem_of(call))
    assert len(fake_aiter) == 1, "the call must have gone to AITER"
    assert torch.equal(buffer[cap * (L + R) :], guard_before), "AITER wrote past the cache"
    assert_matches_reference(call["q_out"], call["kv_cache"], ref_q, ref_cache)


@pytest.mark.parametrize("q_fp8", [False, True])
def test_adapter_end_to_end_fp8_uint8_storage(fake_aiter, monkeypatch, q_fp8):
    monkeypatch.setenv(ab.ENV_FP8, "1")
    monkeypatch.setattr(ab, "_arch_of", lambda device: "gfx950")
    call = make_call(T=6, H=16, cache_dtype=torch.uint8, q_out_dtype=torch.float8_e4m3fn if q_fp8 else None)
    ks, qs = torch.tensor([0.5]), torch.tensor([2.0])  # powers of two: x * (1/s) == x / s exactly
    ref_q, ref_cache = run_reference(call, kv_cache_dtype="fp8", kv_cache_scale=ks, q_scale=qs)
    p = problem_of(call, kv_cache_dtype="fp8", kv_cache_scale=ks, q_scale=qs)
    assert p.cache_dtype == torch.float8_e4m3fn  # "fp8" off gfx94x
    _run_adapter(call, p, ks, qs)
    assert len(fake_aiter) == 1
    got_cache = call["kv_cache"].view(torch.float8_e4m3fn)
    assert_matches_reference(call["q_out"], got_cache, ref_q, ref_cache.view(torch.float8_e4m3fn), fp8_out=True)


def test_adapter_falls_back_to_triton_for_tensor_reasons(fake_aiter, monkeypatch):
    seen = []
    call = make_call(cos_dtype=torch.float32)  # fp32 cos/sin with bf16 activations: AITER would round them
    _run_adapter(call, problem_of(call), fallback=lambda *a: seen.append(a))
    assert not fake_aiter and len(seen) == 1 and seen[0][10] is call["q_out"]


@pytest.mark.parametrize("op", [1, 3])
def test_ops_1_and_3_go_to_triton(monkeypatch, op):
    from vllm_mla_fusion.backends import triton as triton_backend

    monkeypatch.setattr(triton_backend, "bind", lambda *a: ("triton", a[1]))
    assert ab.bind(None, op, False, True, *range(11)) == ("triton", op)


# --------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------


def _public_call(call, **kw):
    mla.mla_decode_rope_cache_write(*_positional(call), **kw)


@pytest.mark.skipif(torch.version.hip is not None, reason="ROCm torch: AITER may be available")
def test_forcing_aiter_without_rocm_is_a_clear_error(monkeypatch):
    call = make_call(T=2, vllm_layout=False)
    with pytest.raises(RuntimeError, match="backend 'aiter' was requested but cannot run: .*ROCm"):
        _public_call(call, backend="aiter")
    monkeypatch.setenv(dispatch.ENV_BACKEND, "aiter")
    with pytest.raises(RuntimeError, match="backend 'aiter' was requested"):
        _public_call(call)
    with pytest.raises(RuntimeError, match="backend 'aiter' was requested"):
        c = call
        mla.mla_rope_cache_write(c["positions"], c["q_pe"].clone(), c["k_pe"].clone(), c["kv_c"],
                                 c["cos_sin_cache"], False, c["slot_mapping"], c["kv_cache"])  # fmt: skip
    assert "aiter" not in dispatch.available_backends("cpu")


@pytest.mark.skipif(torch.version.hip is not None, reason="ROCm torch")
def test_use_aiter_flag_changes_nothing_without_rocm(monkeypatch):
    p = deepseek()
    before = [dispatch.resolve(None, torch.device(d), True, p) for d in ("cpu", "cuda")]
    monkeypatch.setenv("VLLM_ROCM_USE_AITER", "1")
    after = [dispatch.resolve(None, torch.device(d), True, p) for d in ("cpu", "cuda")]
    assert before == after == ["torch", "triton"]
    call = make_call(T=3)
    ref_q, ref_cache = run_reference(call)
    _public_call(call)  # CPU tensors: the reference, flag or not
    assert torch.equal(call["q_out"], ref_q) and torch.equal(call["kv_cache"], ref_cache)


def test_dispatch_on_simulated_rocm(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "7.0.1")
    monkeypatch.setattr(ab, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(ab, "_arch_of", lambda device: "gfx942")
    gpu = torch.device("cuda", 0)
    decode, big_bf16 = deepseek(T=8), deepseek(T=256, H=128)
    assert dispatch.resolve(None, gpu, True, decode) == "triton", "AITER only with VLLM_ROCM_USE_AITER=1"
    monkeypatch.setenv("VLLM_ROCM_USE_AITER", "1")
    assert dispatch.resolve(None, gpu, True, decode) == "aiter"
    assert dispatch.resolve(None, gpu, False, decode) == "triton"  # op 1
    assert dispatch.resolve(None, gpu, True, big_bf16) == "triton"  # gfx942 opt kernel truncates
    assert dispatch.resolve("aiter", gpu, True, big_bf16) == "triton"  # forced: per-case fallback
    assert dispatch.resolve("aiter", gpu, True, decode) == "aiter"
    monkeypatch.setattr(ab, "unavailable_reason", lambda device: "AITER is not installed")
    assert dispatch.resolve(None, gpu, True, decode) == "triton"
    with pytest.raises(RuntimeError, match="not installed"):
        dispatch.resolve("aiter", gpu, True, decode)
