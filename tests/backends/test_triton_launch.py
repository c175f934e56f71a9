"""The Triton backend's host side: block arithmetic, cached launch configurations, and the
direct launcher's rule for reusing a compiled binary.

The direct launcher only runs on NVIDIA GPUs (test_gpu.py exercises it through every kernel
test there, and ``test_direct_launch_alignment_and_sizes`` on purpose). Here its key is
checked against a stand-in for Triton's JIT function: a call may reuse a binary only when
everything Triton specializes on is the same, and must hand the arguments over in the
kernel's signature order.
"""

from __future__ import annotations

import dataclasses
import inspect
import random

import pytest
import torch
import triton

from vllm_mla_fusion.backends import triton as tb
from vllm_mla_fusion.validation import Problem


def test_block_arithmetic_matches_triton():
    rng = random.Random(7)
    for n in [1, 2, 3, 4, 5, 63, 64, 65, 511, 512, 513, 4096] + [rng.randrange(1, 1 << 20) for _ in range(200)]:
        assert tb._pow2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 128):
            assert tb._cdiv(n, d) == triton.cdiv(n, d), (n, d)


def _problem(T: int, op: int) -> Problem:
    return Problem(num_tokens=T, num_heads=16, kv_lora_rank=512, rope_dim=64, cache_dtype=torch.bfloat16,
                   nope_dim=128 if op == 3 else None, k_out_dtype=torch.bfloat16 if op == 3 else None)  # fmt: skip


@pytest.mark.parametrize("op", [1, 2, 3])
def test_launch_config_is_cached_but_never_shared(op):
    device = torch.device("cpu")
    for T in (1, 7, 64, 4096):
        p = _problem(T, op)
        first = tb._launch_config(p, op, device)
        first["BLOCK_T"] = -1  # a caller mutating its copy must not change the next answer
        again = tb._launch_config(p, op, device)
        assert again["BLOCK_T"] > 0
        assert again == tb._launch_config_for.__wrapped__(p, op, tb._num_sms(device), tb._pdl_ok(device))


def test_forced_launch_config_bypasses_the_cache():
    p, device = _problem(64, 1), torch.device("cpu")
    normal = tb._launch_config(p, 1, device)
    forced = dict(normal, BLOCK_ROWS=1, BLOCK_T=1)
    with tb.forced_launch_config(forced):
        assert tb._launch_config(p, 1, device) == forced
    assert tb._launch_config(p, 1, device) == normal


# --- the direct launcher, against a stand-in for Triton's JITFunction ---------------------


@dataclasses.dataclass
class _Param:
    name: str
    is_constexpr: bool
    do_not_specialize: bool = False


class _Binary:
    """A compiled kernel as Triton returns it: ``run`` is the binary's launcher."""

    def __init__(self, launches: list):
        self.function, self.packed_metadata, self.launches = object(), object(), launches

    def run(self, *args):
        self.launches.append(args)


class _FakeJIT:
    """``kernel[grid](*args, **kwargs)`` binds, 'compiles' (a new _Binary per distinct Triton
    key) and returns the binary, like Triton's JITFunction.run."""

    # ptr_a, ptr_b, n (unspecialized), stride (specialized), then constexprs
    params = [_Param("ptr_a", False), _Param("ptr_b", False), _Param("n", False, True), _Param("stride", False),
              _Param("BLOCK", True), _Param("MODE", True)]  # fmt: skip

    def __init__(self):
        self.slow_calls, self.launches, self.binaries = 0, [], {}

    def triton_key(self, args, kwargs):
        a, b, n, stride = args
        spec = [(t.dtype, t.data_ptr() % 16 == 0) for t in (a, b)]
        spec += [n < 2**31, (stride, stride % 16 == 0, stride == 1)]
        return tuple(spec), tuple(sorted(kwargs.items()))

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.slow_calls += 1
            binary = self.binaries.setdefault(self.triton_key(args, kwargs), _Binary(self.launches))
            # Triton's run hands the binary every bound argument, constexprs included, in order.
            bound = inspect.signature(lambda ptr_a, ptr_b, n, stride, BLOCK, MODE, num_warps, **o: None).bind(
                *args, **kwargs)  # fmt: skip
            binary.run(grid[0], 1, 1, "stream", binary.function, binary.packed_metadata, None, None, None,
                       *[bound.arguments[p.name] for p in self.params])  # fmt: skip
            return binary

        return run


class _FakeDriver:
    class active:  # noqa: N801 - the attribute path Triton's driver module has
        @staticmethod
        def get_current_stream(device_index):
            return "stream"


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(tb, "_triton_driver", _FakeDriver)
    monkeypatch.setattr(tb, "_hooks_unset", lambda: True)
    fn = _FakeJIT()
    return fn, tb._DirectLauncher(fn, num_pointers=2)


def _buf(n=64, offset=0, dtype=torch.float32):
    return torch.empty(n + 8, dtype=dtype)[offset : offset + n]


def test_reuses_the_binary_with_arguments_in_signature_order(fake):
    fn, launcher = fake
    a, b = _buf(), _buf()
    cx = {"MODE": 2, "BLOCK": 32}  # keyword order differs from the signature's
    launcher(5, (a, b, 100, 64), cx, 4, False, 0)
    launcher(6, (a, b, 101, 64), cx, 4, False, 0)  # another n: Triton does not specialize it
    assert fn.slow_calls == 1 and len(fn.launches) == 2
    direct = fn.launches[1]
    assert direct[0] == 6 and direct[3] == "stream"
    assert direct[9:] == (a, b, 101, 64, 32, 2)


@pytest.mark.parametrize(
    "change",
    ["misaligned pointer", "pointer dtype", "stride value", "n == 1", "n past 2**31", "constexpr", "num_warps",
     "pdl", "device"],
)  # fmt: skip
def test_any_change_triton_specializes_on_takes_tritons_path(fake, change):
    fn, launcher = fake
    a, b = _buf(), _buf()
    args, cx, nw, pdl, dev = (a, b, 100, 64), {"BLOCK": 32, "MODE": 2}, 4, False, 0
    launcher(1, args, cx, nw, pdl, dev)
    if change == "misaligned pointer":
        args = (_buf(offset=1), b, 100, 64)  # 4 bytes past an aligned start
    elif change == "pointer dtype":
        args = (a, _buf(dtype=torch.int32), 100, 64)
    elif change == "stride value":
        args = (a, b, 100, 48)
    elif change == "n == 1":
        args = (a, b, 1, 64)
    elif change == "n past 2**31":
        args = (a, b, 2**31, 64)
    elif change == "constexpr":
        cx = {"BLOCK": 64, "MODE": 2}
    elif change == "num_warps":
        nw = 8
    elif change == "pdl":
        pdl = True
    else:
        dev = 1
    launcher(1, args, cx, nw, pdl, dev)
    assert fn.slow_calls == 2


def test_no_direct_path_without_a_device_or_with_hooks(fake, monkeypatch):
    fn, launcher = fake
    args, cx = (_buf(), _buf(), 100, 64), {"BLOCK": 32, "MODE": 2}
    for _ in range(2):
        launcher(1, args, cx, 4, False, None)  # CPU tensors / ROCm / switched off
    assert fn.slow_calls == 2
    monkeypatch.setattr(tb, "_hooks_unset", lambda: False)  # a profiler's launch hook must be called
    for _ in range(2):
        launcher(1, args, cx, 4, False, 0)
    assert fn.slow_calls == 4


def test_binary_cache_is_bounded(fake, monkeypatch):
    fn, launcher = fake
    monkeypatch.setattr(tb._DirectLauncher, "MAX_ENTRIES", 4)
    a, b = _buf(), _buf()
    for stride in range(16, 16 * 12, 16):
        launcher(1, (a, b, 100, stride), {"BLOCK": 32, "MODE": 2}, 4, False, 0)
    assert len(launcher.kernels) <= 4


def test_hooks_unset_reads_tritons_knobs(monkeypatch):
    knobs = pytest.importorskip("triton.knobs")
    assert tb._hooks_unset() in (True, False)
    chain = knobs.runtime.launch_enter_hook
    if type(chain).__name__ == "HookChain":  # Triton 3.8: an empty chain means no hook
        assert tb._hooks_unset()
        hook = lambda metadata: None  # noqa: E731
        chain.add(hook)
        try:
            assert not tb._hooks_unset()
        finally:
            chain.remove(hook)
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
        assert not tb._hooks_unset()


def _kernel_params() -> list[tuple[str, bool]]:
    """(name, is constexpr) of the kernel's parameters, from its Python source (any Triton mode)."""
    sig = inspect.signature(tb._mla_rope_cache_kernel.fn)
    return [(name, "constexpr" in str(p.annotation)) for name, p in sig.parameters.items()]


def test_the_kernel_takes_pointers_and_integers_first_then_constexprs():
    params = _kernel_params()
    constexpr = [c for _, c in params]
    n = constexpr.index(True)
    assert n == 11 + 23 and all(constexpr[n:])


def _call_backend(op: int, T: int, H: int, L: int, R: int, P: int, is_neox: bool) -> None:
    """One call of the Triton backend's op ``op`` on small CPU tensors (the launch itself is the
    caller's stand-in for ``tb._launcher``)."""
    p = Problem(num_tokens=T, num_heads=H, kv_lora_rank=L, rope_dim=R, cache_dtype=torch.bfloat16,
                q_out_dtype=torch.bfloat16 if op == 2 else None, nope_dim=P if op == 3 else None,
                k_out_dtype=torch.bfloat16 if op == 3 else None)  # fmt: skip
    pos, slots = torch.arange(T), torch.arange(T)
    q_pe, k_pe, kv_c = torch.randn(T, H, R), torch.randn(T, 1, R), torch.randn(T, L)
    cos, cache = torch.randn(32, R), torch.empty(4, 4, L + R, dtype=torch.bfloat16)
    if op == 1:
        tb.rope_cache_write(p, pos, q_pe, k_pe, kv_c, cos, is_neox, slots, cache, None)
    elif op == 2:
        tb.decode_rope_cache_write(p, pos, torch.randn(T, H, L), q_pe, k_pe, kv_c, cos, is_neox, slots, cache,
                                   torch.empty(T, H, L + R), None, None, is_neox)  # fmt: skip
    else:
        tb.prefill_rope_cache_write(p, pos, q_pe, k_pe, kv_c, torch.randn(T, H, P), cos, is_neox, slots, cache,
                                    torch.empty(T, H, P + R), None)  # fmt: skip


@pytest.mark.parametrize("op", [1, 2, 3])
def test_launch_hands_every_parameter_over(op, monkeypatch):
    """What _launch passes is exactly the kernel's parameter list: runtime ones in order, then
    every constexpr by name (the direct launcher reorders those by signature)."""
    captured = {}
    monkeypatch.setattr(tb, "_launcher", lambda grid, runtime, constexprs, *a: captured.update(r=runtime, c=constexprs))
    _call_backend(op, T=3, H=2, L=16, R=8, P=4, is_neox=True)
    params = _kernel_params()
    runtime_names = [name for name, c in params if not c]
    assert len(captured["r"]) == len(runtime_names)
    assert all(isinstance(x, torch.Tensor) for x in captured["r"][:11])
    assert all(isinstance(x, int) for x in captured["r"][11:])
    assert sorted(captured["c"]) == sorted(name for name, c in params if c)
    assert captured["r"][11] == 3  # num_tokens


# --- Triton's own specialization of the kernel's arguments ---------------------------------


def _compiled_kernel():
    """The project's kernel as a compiled-mode JITFunction (under TRITON_INTERPRET=1 one is
    built from the same function and decorator arguments): its real parameter list."""
    from triton.runtime.jit import JITFunction

    fn = tb._mla_rope_cache_kernel
    return fn if isinstance(fn, JITFunction) else JITFunction(fn.fn, **fn.kwargs)


def _triton_specialization(monkeypatch, positions, slots, misaligned_nope: bool = False):
    """What Triton's binder (for an sm_90 target; no GPU needed) specializes an op 3 launch on,
    for CPU tensors laid out as vLLM's prefill rows of a mixed step."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    T, H, L, R, P = positions.shape[0], 16, 512, 64, 128
    g = torch.Generator().manual_seed(3)
    q = torch.randn(T, H, P + R, generator=g, dtype=torch.bfloat16)
    kv = torch.randn(T, L + R, dtype=torch.bfloat16, generator=g)
    k_nope = torch.randn(T * H * P + 1, dtype=torch.bfloat16, generator=g)[int(misaligned_nope):][: T * H * P]
    k_nope = k_nope.view(T, H, P)
    k_out = torch.empty(T, H, P + R, dtype=torch.bfloat16)
    cos_sin = torch.randn(4096, R, generator=g)
    cache = torch.empty(8, 16, L + R, dtype=torch.bfloat16)
    calls = []
    monkeypatch.setattr(tb, "_launcher", lambda grid, runtime, constexprs, *rest: calls.append((runtime, constexprs)))
    p = Problem(T, H, L, R, torch.bfloat16, nope_dim=P, k_out_dtype=torch.bfloat16)
    tb.prefill_rope_cache_write(p, positions, q[..., P:], kv[:, L:].unsqueeze(1), kv[:, :L], k_nope, cos_sin, True,
                                slots, cache, k_out, None)  # fmt: skip
    (runtime, constexprs), = calls
    fn = _compiled_kernel()
    binder = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    return binder(*runtime, **constexprs)[1]


def test_index_tensors_at_any_offset_share_one_compiled_variant(monkeypatch):
    """The prefill rows of a mixed step start at row num_decode of vLLM's positions and slot
    mapping: with an odd number of decode tokens their int64 pointers are 8 bytes off a
    16-byte boundary. The kernel's variants are compiled ahead in vLLM's profile run with
    aligned index tensors, so Triton must not specialize on the index pointers' alignment
    (it did: a 0.4-0.9 s compile inside the first such step on the H200, fp8 run of
    2026-12-01), while it still does on the data pointers, whose vector loads it speeds up."""
    T = 64
    positions, slots = torch.arange(T + 1) + 5, torch.arange(T + 1) * 3
    aligned = _triton_specialization(monkeypatch, positions[:T], slots[:T])
    assert positions[1:].data_ptr() % 16 == 8
    assert _triton_specialization(monkeypatch, positions[1:], slots[1:]) == aligned
    assert _triton_specialization(monkeypatch, positions[1:].int(), slots[1:].int()) != aligned  # int32: a dtype
    # A data pointer's alignment still selects a variant (the check above can see alignment).
    assert _triton_specialization(monkeypatch, positions[:T], slots[:T], misaligned_nope=True) != aligned


def test_plans_hand_constexprs_over_in_the_kernels_order():
    """A launch plan's ``values`` are its constexprs in the order the compiled kernel's launcher
    takes them (Triton's parameter list), and plans are shared only between equal calls."""
    jit = _compiled_kernel()
    assert tb._CONSTEXPR_NAMES == tuple(prm.name for prm in jit.params if prm.is_constexpr)
    cpu = torch.device("cpu")
    p = _problem(64, 3)
    plan = tb._plan(p, 3, 128, True, True, False, torch.bfloat16, False, cpu)
    assert plan.values == tuple(plan.constexprs[n] for n in tb._CONSTEXPR_NAMES)
    assert tb._plan(p, 3, 128, True, True, False, torch.bfloat16, False, cpu) is plan
    other = tb._plan(p, 3, 128, False, True, False, torch.bfloat16, False, cpu)
    assert other.constexprs["IS_NEOX"] is False and plan.constexprs["IS_NEOX"] is True
    fp8_out = tb._plan(p, 3, 128, True, True, False, torch.float8_e4m3fn, False, cpu)
    assert fp8_out.out_view == "bytes" and fp8_out.constexprs["OUT_MODE"] != plan.constexprs["OUT_MODE"]
    forced = dict(tb._launch_config(p, 3, cpu), BLOCK_ROWS=1)
    with tb.forced_launch_config(forced):
        assert tb._plan(p, 3, 128, True, True, False, torch.bfloat16, False, cpu).constexprs["BLOCK_ROWS"] == 1
    assert tb._plan(p, 3, 128, True, True, False, torch.bfloat16, False, cpu) is plan


@pytest.mark.parametrize("op", [1, 2, 3])
def test_direct_launch_of_the_real_kernel_passes_what_triton_would_bind(op, monkeypatch):
    """The launch plan's constexpr values, handed to a compiled binary by the direct launcher,
    are the kernel's parameters in its own order: the binary's launcher receives exactly what
    binding the same call to the kernel's signature gives (stand-ins for the binary and the
    driver; the kernel's real parameter list)."""
    real = _compiled_kernel()
    sig = inspect.signature(real.fn)
    launches = []

    class Compiled:  # Triton's JITFunction for the launcher: binds, 'compiles', returns a binary
        params = real.params

        def __getitem__(self, grid):
            def run(*args, num_warps, launch_pdl=False, **kwargs):
                binary = _Binary(launches)
                bound = sig.bind(*args, **kwargs).arguments
                binary.run(grid[0], 1, 1, "stream", binary.function, binary.packed_metadata, None, None, None,
                           *bound.values())  # fmt: skip
                return binary

            return run

    calls = []
    monkeypatch.setattr(tb, "_launcher", lambda *a: calls.append(a))
    _call_backend(op, T=5, H=4, L=32, R=16, P=8, is_neox=False)
    (grid, runtime, constexprs, num_warps, pdl, _, values), = calls
    monkeypatch.setattr(tb, "_triton_driver", _FakeDriver)
    monkeypatch.setattr(tb, "_hooks_unset", lambda: True)
    launcher = tb._DirectLauncher(Compiled(), num_pointers=11)
    assert launcher.usable
    for _ in range(2):  # Triton's path (binds by name), then the direct one (by position)
        launcher(grid, runtime, constexprs, num_warps, pdl, 0, values)
    assert len(launches) == 2 and launches[0] == launches[1]
    assert launches[1][9:] == tuple(sig.bind(*runtime, **constexprs).arguments.values())
