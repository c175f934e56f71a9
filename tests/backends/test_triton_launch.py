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
        low = tb._pow2_floor(n)
        assert low <= n < 2 * low and low & (low - 1) == 0, n
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


@pytest.mark.parametrize(("H", "T", "block_t", "block_h"), [
    (16, 16384, 4, 8), (16, 1024, 4, 8),  # the tuner's fastest on an H200 (docs/performance-history.md)
    (16, 256, 2, 16), (16, 64, 1, 16),  # small batches: fewer tokens per program, more programs
    (128, 16384, 1, 32),  # one token already exceeds ~8K elements
])  # fmt: skip
def test_prefill_cache_programs_take_about_8k_elements(H, T, block_t, block_h):
    """Op 3's cache programs: the most tokens within ~8K elements (each token L + R + H * R),
    shrunk while the grid would leave most of an H200's 132 SMs idle; key stores in ~2K-element
    tiles. Ops 1 and 2 keep ~4K elements (8 tokens of 576)."""
    p = dataclasses.replace(_problem(T, 3), num_heads=H)
    cfg = tb._launch_config_for.__wrapped__(p, 3, 132, True)
    assert (cfg["BLOCK_T"], cfg["BLOCK_H"]) == (block_t, block_h)
    if T >= 1024:
        for op in (1, 2):
            other = tb._launch_config_for.__wrapped__(dataclasses.replace(_problem(T, op), num_heads=H), op, 132, True)
            assert (other["BLOCK_T"], other["BLOCK_H"]) == (8, 1)


@pytest.mark.parametrize("op", [1, 2, 3])
@pytest.mark.parametrize("T", [1, 5, 9])
def test_each_kind_of_grid_is_counted_in_its_own_tiles(op, T):
    """One program per tile of each kind (cache: BLOCK_T tokens; query: BLOCK_ROWS (token, head)
    rows), each count rounded up on its own: the query programs start right after the last cache
    program."""
    t = _tensors(op, T)
    p = Problem(num_tokens=T, num_heads=4, kv_lora_rank=32, rope_dim=16, cache_dtype=torch.float32,
                nope_dim=8 if op == 3 else None)  # fmt: skip
    launch = tb.bind(p, op, True, True, *t.values())
    cfg = dict(BLOCK_T=2, BLOCK_ROWS=3, BLOCK_H=2, num_warps=4, USE_PDL=False)
    with tb.forced_launch_config(cfg):
        plan = launch.plan(T)
    assert plan.n_cache == -(-T // 2)
    assert plan.grid == plan.n_cache + -(-T * 4 // 3)


def test_forced_launch_config_bypasses_the_cache():
    p, device = _problem(64, 1), torch.device("cpu")
    normal = tb._launch_config(p, 1, device)
    forced = dict(normal, BLOCK_ROWS=1, BLOCK_T=1)
    with tb.forced_launch_config(forced):
        assert tb._launch_config(p, 1, device) == forced
    assert tb._launch_config(p, 1, device) == normal


# --- the bound launch's reuse rule, against stand-ins for Triton's kernel and launcher ---------


class _Compiled:
    """A compiled kernel as Triton returns it: ``run`` is its launcher (called by position, as
    Triton's JIT path calls it) and ``kernel[grid]`` the launch that builds metadata and calls
    hooks. Both record ``(grid, stream, args, route)``."""

    def __init__(self, launches: list, values: tuple):
        self.launches, self.values = launches, values
        self.function, self.packed_metadata = object(), object()

    def run(self, gx, gy, gz, stream, function, packed, launch_metadata, enter_hook, exit_hook, *args):
        assert (gy, gz, function, packed) == (1, 1, self.function, self.packed_metadata)
        assert (launch_metadata, enter_hook, exit_hook) == (None, None, None)
        self.launches.append(((gx, gy, gz), stream, args, "run"))

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            self.launches.append((grid, stream, args, "runner"))

        return runner


def _addresses(value):
    """``value`` with every tensor replaced by its address, tuples kept (as a launcher takes them)."""
    if isinstance(value, tuple):
        return tuple(_addresses(v) for v in value)
    return value.data_ptr() if isinstance(value, torch.Tensor) else value


class _FakeJIT:
    """One op's ``kernel[grid](*args, **constexprs)``: binds by the real entry point's signature,
    'compiles' (a new _Compiled per distinct Triton key) and returns it, like Triton's
    JITFunction.run; its own launch is recorded too, with the arguments bound as Triton hands
    them over. The op's fakes share their records (``records``)."""

    def __init__(self, kernel, records=None):
        self.sig = inspect.signature(kernel.fn)
        self.slow, self.launches, self.compiled = records or ([], [], {})

    def __getitem__(self, grid):
        def run(*args, num_warps, launch_pdl=False, **constexprs):
            bound = self.sig.bind(*args, **constexprs).arguments
            data = [v for v in bound.values() if isinstance(v, torch.Tensor)]  # the index tensors first
            key = (tuple((t.dtype, t.data_ptr() % 16 == 0) for t in data[2:]), tuple(sorted(constexprs.items())),
                   num_warps, launch_pdl)  # fmt: skip
            values = _addresses(tuple(bound.values()))
            self.slow.append((grid[0], values))
            return self.compiled.setdefault(key, _Compiled(self.launches, values))

        return run


def _fake_kernels(monkeypatch) -> dict:
    """Each op's entry point stood in by a _FakeJIT, all recording into the same lists."""
    records = ([], [], {})
    fakes = {op: _FakeJIT(kernel, records) for op, kernel in tb._KERNELS.items()}
    monkeypatch.setattr(tb, "_KERNELS", fakes)  # a launch takes its op's when it is bound
    return fakes


def _tensors(op: int, T: int, H=4, L=32, R=16, P=8, misalign: str | None = None, slots=None):
    g = torch.Generator().manual_seed(T)
    q = torch.randn(T, H, P + R, generator=g)
    buf = torch.randn(T * (L + R) + 4, generator=g)
    kv = buf[(1 if misalign == "kv" else 0):][: T * (L + R)].view(T, L + R)
    t = dict(positions=torch.arange(T), q_pe=q[..., P:], k_pe=kv[:, L:].unsqueeze(1), kv_c=kv[:, :L],
             cos_sin_cache=torch.randn(64, R, generator=g), slot_mapping=torch.arange(T) if slots is None else slots,
             kv_cache=torch.empty(4, 16, L + R), kv_cache_scale=None, nope=None, out=None, out_scale=None)  # fmt: skip
    if op == 2:
        t.update(nope=torch.randn(T, H, L, generator=g), out=torch.empty(T, H, L + R))
    elif op == 3:
        t.update(nope=torch.randn(T, H, P, generator=g), out=torch.empty(T, H, P + R))
    return t


@pytest.fixture
def fake_gpu(monkeypatch):
    """A BoundLaunch as on a GPU (compiled kernels), with Triton's kernel and driver stood in."""
    fakes = _fake_kernels(monkeypatch)
    fn = fakes[1]  # their shared records

    def bound(op: int, **kw):
        t = _tensors(op, **kw)
        p = Problem(num_tokens=t["q_pe"].shape[0], num_heads=4, kv_lora_rank=32, rope_dim=16,
                    cache_dtype=torch.float32, nope_dim=8 if op == 3 else None)  # fmt: skip
        launch = tb.bind(p, op, True, True, *t.values())
        launch.compiled, launch.device_index = True, 0
        launch._current_stream = lambda device: f"stream{device}"
        launch._current_device = lambda: 0
        return launch

    return fn, bound


def _call(launch, op: int, T: int, **kw):
    launch(T, *_tensors(op, T, **kw).values())


@pytest.mark.parametrize("op", [1, 2, 3])
def test_first_launch_per_configuration_goes_through_triton_then_its_compiled_kernel(fake_gpu, op):
    fn, bound = fake_gpu
    launch = bound(op, T=5)
    t = _tensors(op, 5)
    launch(5, *t.values())
    launch(5, *t.values())
    _call(launch, op, 6)  # another token count of the same configuration: no new binding
    assert len(fn.slow) == 1 and len(fn.launches) == 2
    (grid, stream, args, route), (grid6, _, args6, _) = fn.launches
    assert route == "run"  # no launch hook installed: the launcher itself, by position
    assert stream == "stream0" and grid == (launch.plan(5).grid, 1, 1) and grid6 == (launch.plan(6).grid, 1, 1)
    # The compiled kernel's launcher gets exactly what Triton bound for the same call: every
    # parameter, constexprs included, in the kernel's order (addresses as integers).
    assert fn.slow[0] == (launch.plan(5).grid, args)
    names = list(launch.kernel.sig.parameters)
    assert args6[names.index("num_tokens")] == 6 and args6[names.index("n_cache_programs")] == launch.plan(6).n_cache


def test_a_launch_hook_takes_the_launch_that_calls_it(fake_gpu, monkeypatch):
    """A profiler's launch hook must see our launches: with one installed, the compiled kernel is
    launched through ``kernel[grid]``, which builds the launch metadata and calls the hooks."""
    fn, bound = fake_gpu
    launch = bound(2, T=4)
    t = _tensors(2, 4)
    launch(4, *t.values())  # Triton's path: compiles
    monkeypatch.setattr(tb, "_no_launch_hooks", lambda: False)
    launch(4, *t.values())
    assert [route for *_, route in fn.launches] == ["runner"]
    assert fn.launches[0][2] == fn.slow[0][1]


def test_no_launch_hooks_reads_tritons_knobs(monkeypatch):
    knobs = pytest.importorskip("triton.knobs")
    assert tb._no_launch_hooks()
    chain = knobs.runtime.launch_enter_hook
    if type(chain).__name__ == "HookChain":  # Triton 3.8: an empty chain means no hook
        hook = lambda metadata: None  # noqa: E731
        chain.add(hook)
        try:
            assert not tb._no_launch_hooks()
        finally:
            chain.remove(hook)
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
        assert not tb._no_launch_hooks()


@pytest.mark.parametrize("change", ["misaligned data pointer", "cache past 2**31 slots", "forced configuration"])
def test_anything_triton_would_specialize_differently_takes_tritons_path(fake_gpu, change):
    fn, bound = fake_gpu
    launch = bound(1, T=8)
    _call(launch, 1, 8)
    assert len(fn.slow) == 1
    if change == "misaligned data pointer":
        _call(launch, 1, 8, misalign="kv")  # kv_c and k_pe 4 bytes off: Triton picks another variant
        assert len(fn.slow) == 2 and len(fn.launches) == 0
        _call(launch, 1, 8)
        assert len(fn.launches) == 1  # aligned again: the kept variant
    elif change == "cache past 2**31 slots":
        t = _tensors(1, 8)
        t["kv_cache"] = torch.empty(1).expand(2**27, 16, 48)  # 2**31 slots: a 64-bit count
        launch(8, *t.values())
        assert len(fn.slow) == 2 and len(fn.launches) == 0
    else:
        cfg = dict(tb._launch_config(dataclasses.replace(launch.p, num_tokens=8), 1, torch.device("cpu")),
                   BLOCK_ROWS=1)  # fmt: skip
        with tb.forced_launch_config(cfg):
            _call(launch, 1, 8)
            assert fn.slow[-1][0] == launch.plan(8).grid  # the forced grid
        assert len(fn.slow) == 2
        _call(launch, 1, 8)  # the normal configuration again: its kept variant, no rebinding
        assert len(fn.slow) == 2 and len(fn.launches) == 1


def test_interpreter_always_takes_tritons_path(monkeypatch):
    fn = _fake_kernels(monkeypatch)[1]
    t = _tensors(1, 3)
    p = Problem(3, 4, 32, 16, torch.float32)
    launch = tb.bind(p, 1, False, True, *t.values())
    assert not launch.compiled  # CPU tensors
    for _ in range(3):
        launch(3, *t.values())
    assert len(fn.slow) == 3 and not fn.launches


def test_plans_are_bounded(fake_gpu, monkeypatch):
    fn, bound = fake_gpu
    monkeypatch.setattr(tb.BoundLaunch, "MAX_PLANS", 4)
    launch = bound(1, T=1)
    for T in range(1, 12):
        _call(launch, 1, T)
    assert len(launch.plans) <= 4


def _kernel_params(op: int) -> list[tuple[str, bool]]:
    """(name, is constexpr) of an op's entry point's parameters, from its Python source (any Triton mode)."""
    sig = inspect.signature(tb._KERNELS[op].fn)
    return [(name, "constexpr" in str(p.annotation)) for name, p in sig.parameters.items()]


# (pointers, sizes, constexprs) of each op's entry point; after the sizes, one tuple of the data
# tensors' strides.
ENTRY_POINTS = {1: (8, 4, 10), 2: (11, 5, 12), 3: (10, 5, 13)}


@pytest.mark.parametrize("op", [1, 2, 3])
def test_each_op_has_an_entry_point_of_fewer_than_31_parameters(op):
    """Issue 41's S3: one entry point per op, under 31 parameters: pointers, sizes, the strides,
    then constexprs."""
    params = _kernel_params(op)
    constexpr = [c for _, c in params]
    pointers, sizes, constexprs = ENTRY_POINTS[op]
    assert all(name.endswith("_ptr") for name, _ in params[:pointers]) and params[pointers + sizes][0] == "strides"
    n = constexpr.index(True)
    assert n == pointers + 1 + sizes and all(constexpr[n:]) and len(params) == n + constexprs < 31


def test_no_kernel_helper_takes_more_than_10_arguments():
    """Below the entry points, every @triton.jit helper of the backend takes at most 10 arguments
    (tensors travel with their strides as tuples). Found from the module, so a new helper is covered
    too."""
    entry_points = {k.fn for k in tb._KERNELS.values()}
    helpers = {name: obj.fn for name, obj in vars(tb).items()
               if hasattr(obj, "fn") and inspect.isfunction(obj.fn) and obj.fn not in entry_points
               and obj.fn.__module__ == tb.__name__}  # fmt: skip
    assert {"_mla_rope_cache", "_cache_program", "_query_program", "_load_cos_sin"} <= set(helpers)
    too_many = {name: n for name, fn in helpers.items() if (n := len(inspect.signature(fn).parameters)) > 10}
    assert not too_many, too_many

# --- Triton's own specialization of the kernel's arguments ---------------------------------


def _compiled_kernel(op: int):
    """An op's entry point as a compiled-mode JITFunction (under TRITON_INTERPRET=1 one is
    built from the same function and decorator arguments): its real parameter list."""
    from triton.runtime.jit import JITFunction

    fn = tb._KERNELS[op]
    return fn if isinstance(fn, JITFunction) else JITFunction(fn.fn, **fn.kwargs)


def _triton_specialization(monkeypatch, op: int, positions, slots, misaligned_data: bool = False):
    """What Triton's binder (for an sm_90 target; no GPU needed) specializes an ``op`` launch on,
    for CPU tensors laid out as vLLM's rows of a mixed step; ``misaligned_data``: one data tensor
    (op 1's kv_c and k_pe, ops 2 and 3's nope input) 2 bytes off its 16-byte boundary."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    T, H, L, R, P = positions.shape[0], 16, 512, 64, 128
    g = torch.Generator().manual_seed(3)
    off = int(misaligned_data)
    q = torch.randn(T, H, P + R, generator=g, dtype=torch.bfloat16)
    kv = torch.randn(T * (L + R) + 1, dtype=torch.bfloat16, generator=g)[off if op == 1 else 0:][: T * (L + R)]
    kv = kv.view(T, L + R)
    nope = out = None
    if op != 1:
        width = L if op == 2 else P
        nope = torch.randn(T * H * width + 1, dtype=torch.bfloat16, generator=g)[off:][: T * H * width]
        nope, out = nope.view(T, H, width), torch.empty(T, H, width + R, dtype=torch.bfloat16)
    cos_sin = torch.randn(4096, R, generator=g)
    cache = torch.empty(8, 16, L + R, dtype=torch.bfloat16)
    calls = []

    class Recorder:  # Triton's kernel[grid](...) as the launch calls it
        def __getitem__(self, grid):
            return lambda *args, num_warps, launch_pdl=False, **constexprs: calls.append((args, constexprs))

    monkeypatch.setitem(tb._KERNELS, op, Recorder())
    p = Problem(T, H, L, R, torch.bfloat16, nope_dim=P if op == 3 else None,
                k_out_dtype=torch.bfloat16 if op == 3 else None)  # fmt: skip
    tensors = (positions, q[..., P:], kv[:, L:].unsqueeze(1), kv[:, :L], cos_sin, slots, cache, None, nope, out, None)
    tb.bind(p, op, True, True, *tensors)(T, *tensors)
    (runtime, constexprs), = calls
    monkeypatch.undo()
    fn = _compiled_kernel(op)
    binder = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    return binder(*runtime, **constexprs)[1]


@pytest.mark.parametrize("op", [1, 2, 3])
def test_index_tensors_at_any_offset_share_one_compiled_variant(monkeypatch, op):
    """The prefill rows of a mixed step start at row num_decode of vLLM's positions and slot
    mapping: with an odd number of decode tokens their int64 pointers are 8 bytes off a
    16-byte boundary. The kernel's variants are compiled ahead in vLLM's profile run with
    aligned index tensors, so Triton must not specialize on the index pointers' alignment
    (it did: a 0.4-0.9 s compile inside the first such step on the H200, fp8 run of
    2026-12-01), while it still does on the data pointers, whose vector loads it speeds up.
    Each op's entry point."""
    T = 64
    positions, slots = torch.arange(T + 1) + 5, torch.arange(T + 1) * 3
    aligned = _triton_specialization(monkeypatch, op, positions[:T], slots[:T])
    assert positions[1:].data_ptr() % 16 == 8
    assert _triton_specialization(monkeypatch, op, positions[1:], slots[1:]) == aligned
    assert _triton_specialization(monkeypatch, op, positions[1:].int(), slots[1:].int()) != aligned  # a dtype
    # A data pointer's alignment still selects a variant (the check above can see alignment).
    assert _triton_specialization(monkeypatch, op, positions[:T], slots[:T], misaligned_data=True) != aligned


@pytest.mark.parametrize("op", [1, 2, 3])
def test_plans_hand_their_ops_constexprs_over_in_its_order(op):
    """A plan's ``values`` are its entry point's constexprs in the order the compiled kernel's
    launcher takes them (Triton's parameter list), and nothing else."""
    jit = _compiled_kernel(op)
    assert tb._CONSTEXPR_NAMES[op] == tuple(prm.name for prm in jit.params if prm.is_constexpr)
    t = _tensors(op, 64)
    p = Problem(64, 4, 32, 16, torch.float32, nope_dim=8 if op == 3 else None)
    plan = tb.bind(p, op, True, True, *t.values()).plan(64)
    assert tuple(plan.constexprs) == tb._CONSTEXPR_NAMES[op]
    assert plan.values == tuple(plan.constexprs[n] for n in tb._CONSTEXPR_NAMES[op])


def test_the_prefill_key_plan():
    t = _tensors(3, 64)
    p = Problem(64, 4, 32, 16, torch.float32, nope_dim=8)
    plan = tb.bind(p, 3, True, True, *t.values()).plan(64)
    assert plan.constexprs["IS_NEOX"] is True
    assert tb.bind(p, 3, False, True, *t.values()).plan(64).constexprs["IS_NEOX"] is False
    t8 = dict(t, out=torch.empty(64, 4, 24, dtype=torch.float8_e4m3fn))
    fp8_out = tb.bind(p, 3, True, True, *t8.values())
    assert fp8_out.out_view == "bytes" and fp8_out.plan(64).constexprs["OUT_STORE"] == "float8_e4m3fn/bits"
    assert plan.constexprs["OUT_STORE"] == "plain"


# --- S2 (issue 41): the cache's block size and the early index loads, decided when bound ----------


@pytest.mark.parametrize("op", [1, 2, 3])
def test_early_index_loads_need_the_promise_pdl_and_unit_stride_indices(monkeypatch, op):
    """``EARLY_INDEX_LOADS`` (positions, slots and cos/sin read before the grid-dependency wait)
    is on only where the caller promised it (binding.py's ``early_index_loads``), the launch
    uses programmatic dependent launch, and the index tensors are read in place: strided ones
    are copied by the host just before the launch, and that copy is the kernel before ours."""
    p = Problem(64, 4, 32, 16, torch.float32, nope_dim=8 if op == 3 else None)
    t = _tensors(op, 64)
    for pdl in (False, True):
        monkeypatch.setattr(tb, "_pdl_ok", lambda device, pdl=pdl: pdl)
        for promised in (False, True):
            launch = tb.bind(p, op, True, True, *t.values(), promised)
            assert launch.early_index_loads is promised
            c = launch.plan(64).constexprs
            assert c["USE_PDL"] is pdl and c["EARLY_INDEX_LOADS"] is (promised and pdl)
            assert c["BLOCK_SIZE"] == t["kv_cache"].shape[1] == 16
        strided = dict(t, positions=torch.arange(128)[::2])
        launch = tb.bind(p, op, True, True, *strided.values(), True)
        assert launch.copy_index and not launch.early_index_loads
        assert launch.plan(64).constexprs["EARLY_INDEX_LOADS"] is False
    assert tb.bind(p, op, True, True, *t.values()).early_index_loads is False  # not promised by default


def test_the_block_size_is_a_constexpr_of_the_bound_layout():
    """The cache's block size is a constexpr (``slot // BLOCK_SIZE`` compiles to a shift, not a
    64-bit division by a runtime value): each block size its own variant, bound with the layout."""
    t = _tensors(1, 8)
    p = Problem(8, 4, 32, 16, torch.float32)
    for block_size in (1, 16, 64, 48):
        cache = torch.empty(256 // block_size + 1, block_size, 48)
        plan = tb.bind(p, 1, True, True, *dict(t, kv_cache=cache).values()).plan(8)
        assert plan.constexprs["BLOCK_SIZE"] == block_size
        assert plan.values[tb._CONSTEXPR_NAMES[1].index("BLOCK_SIZE")] == block_size


def test_the_prefill_key_takes_no_output_scale():
    """Op 3's entry point has no output scale (the key is cast without one): a scale passed to its
    binding is refused, not dropped."""
    t = dict(_tensors(3, 8), out_scale=torch.ones(()))
    p = Problem(8, 4, 32, 16, torch.float32, nope_dim=8)
    with pytest.raises(ValueError, match="out_scale"):
        tb.bind(p, 3, True, True, *t.values())
