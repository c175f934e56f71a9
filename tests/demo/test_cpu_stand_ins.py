"""The CPU stand-ins register only what is missing, after vLLM has had the chance to load its own kernels."""

from __future__ import annotations

import itertools

import pytest
import torch

from demo import cpu_stand_ins

_namespaces = itertools.count()


@pytest.fixture
def namespace() -> str:
    """A fresh op namespace per test, standing in for ``_C``."""
    return f"mla_fusion_test_stand_ins_{next(_namespaces)}"


def test_registers_each_missing_op_and_keeps_the_present_ones(namespace):
    lib = torch.library.Library(namespace, "FRAGMENT")
    lib.define("greedy_argmax(Tensor logits) -> Tensor")
    lib.impl("greedy_argmax", lambda logits: torch.full((logits.shape[0],), 7), "CPU")  # "vLLM's own kernel"

    installed = cpu_stand_ins.install(namespace=namespace, before_checking=lambda: None)

    assert installed == [name for name in cpu_stand_ins.STAND_INS if name != "greedy_argmax"]
    ops = getattr(torch.ops, namespace)
    assert ops.greedy_argmax(torch.zeros(3, 5)).tolist() == [7, 7, 7]  # untouched
    assert all(hasattr(ops, name) for name in cpu_stand_ins.STAND_INS)
    assert cpu_stand_ins.install(namespace=namespace, before_checking=lambda: None) == []  # idempotent


def test_checks_only_after_vllm_loaded_its_kernels(namespace):
    """The check runs after ``before_checking`` (by default: vLLM's own kernel import), so a kernel it loads wins."""
    libs = []

    def load_kernels():
        lib = torch.library.Library(namespace, "FRAGMENT")
        lib.define("init_cpu_memory_env(int[] nodes) -> ()")
        lib.impl("init_cpu_memory_env", lambda nodes: None, "CompositeExplicitAutograd")
        libs.append(lib)

    installed = cpu_stand_ins.install(["init_cpu_memory_env", "greedy_argmax"], namespace, before_checking=load_kernels)

    assert libs and installed == ["greedy_argmax"]
    assert cpu_stand_ins.install.__defaults__[-1] is cpu_stand_ins.load_vllm_kernels


def test_stand_ins_compute_what_vllm_expects(namespace):
    cpu_stand_ins.install(namespace=namespace, before_checking=lambda: None)
    ops = getattr(torch.ops, namespace)

    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 2.0]])
    assert ops.greedy_argmax(logits).tolist() == [1, 0]

    # two requests: 2 tokens at positions 15, 16 (crossing a block) and 1 token at position 0; 2 slots padding
    block_size, slot_mapping = 16, torch.zeros(5, dtype=torch.int64)
    block_table = torch.tensor([[4, 9], [2, 0]], dtype=torch.int32)
    query_start_loc, positions = torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([15, 16, 0, 0, 0])
    ops.compute_slot_mapping_kernel_impl(query_start_loc, positions, block_table, slot_mapping, block_size)
    assert slot_mapping.tolist() == [4 * 16 + 15, 9 * 16 + 0, 2 * 16 + 0, -1, -1]

    # decode attention of one request over its 3 cache rows: softmax(q k^T * scale) v, v = the latent part
    g = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(4, block_size, 6, generator=g)  # latent 4 + rope 2
    query = torch.randn(1, 2, 6, generator=g)
    out = torch.empty(1, 2, 4)
    ops.mla_decode_kvcache(out, query, kv_cache, 0.5, torch.tensor([[3]], dtype=torch.int32), torch.tensor([3]))
    rows = kv_cache[3, :3]
    want = torch.softmax(query[0] @ rows.T * 0.5, dim=-1) @ rows[:, :4]
    torch.testing.assert_close(out[0], want)


def test_hide_amx_reports_no_amx_and_remembers_the_hosts_answer(monkeypatch):
    """What vLLM reads says no AMX; what torch said before stays available (host_has_amx)."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)  # a host with AMX
    monkeypatch.setattr(cpu_stand_ins, "_HOST_AMX", None)  # not hidden yet in this "process"
    cpu_stand_ins.hide_amx()
    cpu_stand_ins.hide_amx()  # idempotent: the host's answer is not overwritten by our own
    assert torch.cpu._is_amx_tile_supported() is False
    assert cpu_stand_ins.host_has_amx() is True
