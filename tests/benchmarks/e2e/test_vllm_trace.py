"""benchmarks/e2e/vllm_trace.py on synthetic traces shaped like torch.profiler's Chrome export of a vLLM worker."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from benchmarks.e2e import vllm_trace


@pytest.fixture(scope="module")
def T():
    return vllm_trace


class Trace:
    """Builds traceEvents: step annotations, launches on the host, kernels on the GPU."""

    def __init__(self):
        self.events = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}}]
        self.corr = 0

    def step(self, ts, dur, ctx=(0, 0), gen=(0, 0)):
        name = f"execute_context_{ctx[0]}({ctx[1]})_generation_{gen[0]}({gen[1]})"
        self.events.append({"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 7})

    def launch(self, ts, kernels, api="cudaLaunchKernel", gpu_ts=None, cat="kernel"):
        """One launch call at host time ts; its kernels (name, dur) run back to back from gpu_ts."""
        self.corr += 1
        self.events.append({"ph": "X", "cat": "cuda_driver" if api.startswith("cu") and not api.startswith("cuda")
                            else "cuda_runtime", "name": api, "ts": ts, "dur": 2, "pid": 1, "tid": 7,
                            "args": {"correlation": self.corr}})  # fmt: skip
        t = ts + 5 if gpu_ts is None else gpu_ts
        for name, dur in kernels:
            self.events.append({"ph": "X", "cat": cat, "name": name, "ts": t, "dur": dur, "pid": 0, "tid": 7,
                                "args": {"correlation": self.corr, "device": 0, "stream": 7}})  # fmt: skip
            t += dur

    def cpu_op(self, ts, name, dur=1):
        self.events.append({"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 7})

    def dict(self):
        return {"schemaVersion": 1, "traceEvents": self.events}


OURS = "_mla_rope_cache_kernel"
CACHE = "void vllm::concat_and_cache_mla_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>(...)"


def build() -> Trace:
    tr = Trace()
    tr.launch(5, [("warmup_kernel", 3)])  # before the first step: belongs to none
    # step 0: prefill, two layers, eager launches and our op's CPU events
    tr.step(100, 50, ctx=(2, 16))
    for i in range(2):
        tr.cpu_op(110 + i, "mla_fusion::mla_rope_cache_write")
        tr.launch(110 + i, [(OURS, 2.0)], api="cuLaunchKernelEx")
        tr.launch(112 + i, [("gemm", 10.0)])
    tr.launch(160, [("sampler", 4.0)])  # after the annotation, before the next step: still step 0
    # step 1: decode replayed from one CUDA graph; its kernels run while step 2 is already prepared
    tr.step(200, 20, gen=(2, 2))
    tr.launch(205, [(OURS, 1.0), ("gemm", 8.0), (OURS, 1.0), ("gemm", 8.0), (CACHE, 1.5)], api="cudaGraphLaunch",
              gpu_ts=260)  # fmt: skip
    tr.launch(207, [("Memcpy DtoH", 0.5)], api="cudaMemcpyAsync", cat="gpu_memcpy", gpu_ts=281)
    # step 2: mixed; two kernels that overlap on the GPU (programmatic dependent launch)
    tr.step(240, 30, ctx=(1, 600), gen=(2, 2))
    tr.launch(245, [(OURS, 3.0)], gpu_ts=300)
    tr.launch(246, [(OURS, 3.0)], gpu_ts=302)
    # step 3: the last one: launches after its end are outside every window
    tr.step(400, 10, gen=(3, 3))
    tr.launch(405, [("gemm", 5.0)])
    tr.launch(500, [("late", 5.0)])
    return tr


def test_steps_kinds_and_windows(T):
    steps = T.parse_steps(build().dict(), ["mla_fusion::mla_rope_cache_write"])
    assert [s.kind for s in steps] == ["prefill", "decode", "mixed", "decode"]
    assert [s.closed for s in steps] == [True, True, True, False]
    assert (steps[0].ctx_reqs, steps[0].ctx_tokens, steps[1].gen_reqs, steps[2].ctx_tokens) == (2, 16, 2, 600)
    s0, s1, s2, s3 = steps
    assert s0.kernel_counts() == {OURS: 2, "gemm": 2, "sampler": 1}
    assert s0.count_matching(OURS) == 2 and s0.cpu_ops == {"mla_fusion::mla_rope_cache_write": 2}
    assert s0.cpu_op_us == {"mla_fusion::mla_rope_cache_write": 2.0}  # host time: the two events' durations
    # Graph replay: all five kernels by the launch's correlation, although they ran during step 2's window.
    assert s1.count_matching(OURS) == 2 and s1.count_matching("concat_and_cache_mla") == 1
    assert all(e.graph for e in s1.kernels) and s1.summary()["graph_launches"] == 1
    assert s2.count_matching(OURS) == 2 and not s2.kernels[0].graph
    assert s3.kernel_counts() == {"gemm": 1}  # "late" launched after the last step's end
    trace = build().dict()
    assert T.unattributed_gpu_events(trace, T.parse_steps(trace)) == 2  # warmup_kernel, late


def test_gpu_time(T):
    s1, s2 = T.parse_steps(build().dict())[1:3]
    g1 = s1.gpu_time_us()
    assert g1["sum"] == pytest.approx(19.5) and g1["memcpy"] == pytest.approx(0.5) and g1["kernels"] == 5
    assert g1["busy"] == pytest.approx(19.5 + 0.5) and g1["span"] == pytest.approx(281.5 - 260)
    g2 = s2.gpu_time_us()
    assert g2["sum"] == pytest.approx(6.0)
    assert g2["busy"] == pytest.approx(5.0)  # [300, 303] and [302, 305] overlap: the union counts once


def test_short_names_union_and_tables(T):
    assert T.short_name(CACHE) == (
        "vllm::concat_and_cache_mla_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>"
    )
    assert T.short_name("triton_poi_fused_add_mul_0") == "triton_poi_fused_add_mul_0"
    assert T.short_name("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 3>(...)") == (
        "at::native::CatArrayBatchedCopy<float, unsigned int, 3>"
    )
    assert T.union_length([(0, 2), (1, 3), (5, 6)]) == pytest.approx(4.0)
    assert T.union_length([]) == 0.0
    steps = T.parse_steps(build().dict())
    on = T.per_step_kernel_table([steps[1]])
    off = {"gemm": {"per_step": 2.0, "us_per_step": 16.0}, "rotary": {"per_step": 2.0, "us_per_step": 4.0},
           T.short_name(CACHE): {"per_step": 1.0, "us_per_step": 1.5}}  # fmt: skip
    diff = T.kernel_diff(on, off)
    assert set(diff["added"]) == {OURS} and set(diff["removed"]) == {"rotary"} and not diff["changed"]
    assert diff["added"][OURS]["on_per_step"] == 2.0 and diff["removed"]["rotary"]["off_us"] == 4.0
    assert any("rotary" in line for line in T.format_diff(diff))


def test_find_and_load(T, tmp_path):
    trace = build().dict()
    p1 = tmp_path / "census_dp0_pp0_tp0_dcp0_ep0_rank0.100.pt.trace.json.gz"
    with gzip.open(p1, "wt") as f:
        json.dump(trace, f)
    p2 = tmp_path / "other_dp0_rank0.200.pt.trace.json"
    p2.write_text(json.dumps(trace))
    os.utime(p1, (1, 1))
    assert T.find_traces(str(tmp_path), "census") == [str(p1)]
    assert len(T.find_traces(str(tmp_path))) == 2 and T.find_traces(str(tmp_path))[0] == str(p1)  # oldest first
    assert len(T.parse_steps(T.load(str(p1)))) == len(T.parse_steps(T.load(str(p2)))) == 4


def test_no_annotations_no_steps(T):
    tr = Trace()
    tr.launch(5, [("k", 1.0)])
    assert T.parse_steps(tr.dict()) == []


def test_host_breakdown(T):
    tr = Trace()
    tr.step(100, 100, ctx=(1, 1024))
    ev = tr.events.append

    def host(ts, dur, name, cat="user_annotation", tid=7):
        ev({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid})

    host(100, 20, "## Call CompiledFxGraph fabc ##")
    host(101, 5, "aten::mm", cat="cpu_op")  # inside the piece: not a child of the step
    host(125, 30, "mla_fusion_vllm::mla_attention_with_output", cat="cpu_op")
    host(125, 10, "mla_fusion::mla_prefill_rope_cache_write")  # starts with its parent
    tr.launch(130, [("flash_fwd", 9.0)])  # the launch inside the op
    host(160, 15, "## Call CompiledFxGraph fdef ##")  # another piece: same name
    tr.launch(180, [("sampler", 1.0)])  # a launch between ops: a child (dur 2)
    host(120, 70, "output thread work", cat="cpu_op", tid=9)  # other thread
    host(195, 10, "aten::copy_", cat="cpu_op")  # runs past the span's end: counts up to it
    tr.step(300, 10, gen=(1, 1))
    steps = T.parse_steps(tr.dict())
    b = T.host_breakdown(tr.dict(), steps)
    assert b[0]["span"] == 100
    assert b[0]["children"] == {
        T.COMPILED_PIECE: [2, 35.0],
        "mla_fusion_vllm::mla_attention_with_output": [1, 30.0],
        "cudaLaunchKernel": [1, 2.0],
        "aten::copy_": [1, 5.0],
    }
    assert b[0]["uncovered"] == pytest.approx(100 - 72)
    assert b[1] == {"span": 10, "children": {}, "uncovered": 10}
