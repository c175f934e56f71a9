"""benchmarks/e2e/host_profile.py: its samplers on a known workload, the process facts it compares,
and (slow) one CPU run end to end, both sides, through the report."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def HP():
    from benchmarks.e2e import host_profile  # sets vLLM's environment defaults when imported

    return host_profile


def spin_for(seconds: float) -> int:
    """Python work the samplers must find, by name."""
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        n += 1
    return n


def _sample(HP, sampler, tmp_path: Path) -> tuple[dict, dict]:
    path, gil = tmp_path / "main.collapsed", tmp_path / "gil.collapsed"
    with sampler.window(path, gil) as info:
        spin_for(0.4)
    return info, HP.report.parse_collapsed(path.open())


def _spin_share(stacks) -> float:
    total = sum(stacks.values())
    spinning = sum(n for stack, n in stacks.items() if any(f.function == "spin_for" for f in stack))
    return spinning / total


def test_signal_sampler_finds_the_busy_function(HP, tmp_path):
    info, threads = _sample(HP, HP.SignalSampler(500), tmp_path)
    stacks = HP.report.main_thread(threads)
    assert info["window_ms"] > 350
    # Timer expirations while the process waits for a core arrive as one signal: on a busy
    # machine fewer than 200 samples, but still nearly all of them in the spin.
    assert sum(stacks.values()) > 20
    assert _spin_share(stacks) > 0.8
    frame = next(f for stack in stacks for f in stack if f.function == "spin_for")
    assert frame.file.endswith("test_host_profile.py")


@pytest.mark.skipif(HP_MISSING := shutil.which("py-spy") is None and not (Path(sys.executable).parent / "py-spy").exists(),
                    reason="py-spy is not installed (a measuring tool, not a dependency)")  # fmt: skip
def test_py_spy_sampler_reads_this_process(HP, tmp_path):
    sampler = HP.make_sampler("py-spy", 500)
    info, threads = _sample(HP, sampler, tmp_path)
    assert info["errors"] == 0 and info["samples_reported"] > 50, info
    stacks = threads["MainThread"]
    # The window opens when py-spy reports it is sampling: most of it is the spin.
    assert _spin_share(stacks) > 0.5
    assert "gil_sampler" in info and (tmp_path / "gil.collapsed").exists()


def test_thread_times_see_this_threads_cpu(HP):
    before, cpu0 = HP.thread_times(), time.thread_time()
    while time.thread_time() - cpu0 < 0.2:  # CPU time, not wall: the machine may be shared
        pass
    spent_ms = 1e3 * (time.thread_time() - cpu0)
    delta = HP.thread_times_delta(before, HP.thread_times())
    assert delta["MainThread"]["cpu_ms"] == pytest.approx(spent_ms, rel=0.1, abs=5.0)


def test_process_facts_compare_across_processes(HP):
    facts = HP.process_facts()
    assert facts["gc_threshold"] == tuple(__import__("gc").get_threshold())
    assert "MainThread" in facts["threads"]
    # Object addresses and set orders differ from process to process, never a real difference.
    assert HP._plain({"b", "a"}) == HP._plain({"a", "b"}) == "{'a', 'b'}"
    assert HP._plain(spin_for).startswith("<function spin_for") and " at 0x" not in HP._plain(spin_for)
    a = {"x": 1, "nested": {"y": [1, 2], "z": "same"}}
    b = {"x": 1, "nested": {"y": [1, 3], "z": "same"}, "new": True}
    assert HP.facts_difference(a, b) == {"nested.y": [[1, 2], [1, 3]], "new": [None, True]}


@pytest.mark.vllm
@pytest.mark.slow
def test_cpu_run_both_sides_through_the_report(HP, tmp_path):
    """Both side processes start, warm up, measure when told, and the report compares them (~2
    minutes on a 2-core machine; the in-process sampler, as where py-spy is absent). Where the
    machine has two physical cores or more, each side runs pinned to its own (--pin-cpus)."""
    pin = len(HP.physical_cores()) >= 2
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MLA_FUSION")}
    env.update(VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.e2e.host_profile", "--cpu", "--sampler", "signal", "--out",
         str(out), "--work-dir", str(tmp_path / "work"), "--layers", "2", "--prefill-lens", "32",
         "--prefill-requests", "2", "--mixed-decoders", "2", "--mixed-prefill", "32", "--mixed-rounds", "1",
         "--rounds", "2", "--rate", "200", "--deadline-s", "500", *(["--pin-cpus"] if pin else [])],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads((out / "host_profile_run.json").read_text())
    assert [b["name"] for b in run["blocks"]] == ["eager_off", "eager_on", "eager_on", "eager_off"]
    for side in ("off", "on"):
        data = json.loads((out / f"host_profile_eager_{side}.json").read_text())
        assert "error" not in data, data.get("traceback")
        assert data["sampler"]["kind"] == "signal"
        windows = {(w["workload"], w["tag"]) for w in data["windows"]}
        assert windows == {(w, r) for w in ("prefill_32", "mixed_2dec_32") for r in ("r0", "r1")}
        prefill = [w for w in data["windows"] if w["workload"] == "prefill_32"]
        assert all(w["host"]["execute_model_tokens"].count(32) == 2 for w in prefill), prefill
        assert data["process_before"]["gc_threshold"]
        if pin:  # the side and every thread it started ran on its own CPUs only
            assert data["process_before"]["cpu_set"] == run["cpu_sets"][f"eager_{side}"]
    if pin:
        assert not set(run["cpu_sets"]["eager_off"]) & set(run["cpu_sets"]["eager_on"])
    md = (out / "host_profile.md").read_text()
    assert "### prefill_32: per prefill step (4 prefill steps off, 4 on)" in md
    assert "### mixed_2dec_32: per round (2 rounds off, 2 on)" in md
    assert "| `plugin: forward_fused` | 0.000 |" in md
    assert "## Process-wide state, on vs off" in md


def test_pinned_sides_get_disjoint_whole_physical_cores(HP):
    # 8 CPUs as 4 physical cores with SMT siblings (0,4) (1,5) (2,6) (3,7), as sysfs lists them.
    cores = [[0, 4], [1, 5], [2, 6], [3, 7]]
    sets = HP.cpu_sets(["compiled_off", "compiled_on"], cores)
    assert sets == {"compiled_off": [0, 1, 4, 5], "compiled_on": [2, 3, 6, 7]}
    four = HP.cpu_sets(["a", "b", "c", "d"], cores)
    assert sorted(c for cpus in four.values() for c in cpus) == list(range(8))
    assert all(len(cpus) == 2 and cpus[1] - cpus[0] == 4 for cpus in four.values())
    with pytest.raises(ValueError, match="physical cores"):
        HP.cpu_sets(["a", "b", "c"], cores[:2])


def test_physical_cores_group_this_machines_smt_siblings(HP):
    cores = HP.physical_cores()
    flat = [c for core in cores for c in core]
    assert sorted(flat) == sorted(os.sched_getaffinity(0)) and len(flat) == len(set(flat))
    assert HP._cpu_list("0-2,5,7-8\n") == {0, 1, 2, 5, 7, 8}
    assert HP.physical_cores({min(flat)}) == [[min(flat)]]
