"""benchmarks/e2e/host_profile_report.py on fabricated collapsed stacks: parsing, per-step
normalisation, attribution to regions and functions, and the on - off difference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.e2e import host_profile_report

SITE = "/usr/lib/python3/site-packages/"
MLA = SITE + "vllm/model_executor/layers/attention/mla_attention.py"
RUNNER = SITE + "vllm/v1/worker/gpu/model_runner.py"
PLUGIN = "/work/checkout/vllm_mla_fusion/"


@pytest.fixture(scope="module")
def R():
    return host_profile_report


def frame(function: str, path: str, line: int = 1) -> str:
    return f"{function} ({path}:{line})"


def line(thread: str, frames: list[str], count: int) -> str:
    return ";".join([thread, *frames]) + f" {count}\n"


MAIN = "thread (4242): MainThread"
EXEC = frame("GPUModelRunner.execute_model", RUNNER, 100)
IMPL = frame("MLAAttention.forward_impl", MLA, 900)
FUSED = frame("FusedMLAAttention.forward_fused", PLUGIN + "vllm_plugin/attention.py", 158)
CHECK = frame("check_prefill_rope_cache_write", PLUGIN + "validation.py", 223)
CONCAT = frame("MLACommonBaseImpl._concat_k_nope_k_pe", MLA, 2931)


def test_frames_and_threads_parse(R):
    text = [
        line(MAIN, [EXEC, frame("weird name (with parens)", "/a b/c d.py", 7)], 3),
        # A busier thread than the main one (an idle waiter, sampled with --idle).
        line("thread (77): pin memory", [frame("Thread.run", "/usr/lib/python3.12/threading.py", 971)], 8),
        line(MAIN, [EXEC, frame("weird name (with parens)", "/a b/c d.py", 7)], 2),  # same stack: adds up
        "\n",
        frame("<module>", "x.py", 1) + " 4\n",  # no thread frame (py-spy without --threads)
    ]
    threads = R.parse_collapsed(text)
    assert set(threads) == {"MainThread", "pin memory", ""}
    (stack, n), = threads["MainThread"].items()
    assert n == 5
    assert stack[0] == R.Frame("GPUModelRunner.execute_model", RUNNER, 100)
    assert stack[1] == R.Frame("weird name (with parens)", "/a b/c d.py", 7)
    assert sum(threads[""].values()) == 4
    assert R.main_thread(threads) is threads["MainThread"]
    # Without a MainThread: the busiest thread.
    del threads["MainThread"]
    assert R.main_thread(threads) is threads["pin memory"]
    with pytest.raises(ValueError):
        R.parse_collapsed(["no-count-here\n"])


def test_a_frame_name_broken_over_lines_is_one_sample(R):
    """py-spy --nonblocking can read source text with newlines as a frame's name (the H200 profile
    of 2026-12-02 had two such samples): the pieces make one sample, not an error or three."""
    text = [
        f"{MAIN};        state: _CacheKeyState,\n",
        " (        result: list[object],\n",
        ":32539);" + frame("OpOverloadPacket.__call__", "/tmp/site/torch/_ops.py", 1338) + " 1\n",
        line(MAIN, [EXEC], 2),
    ]
    threads = R.parse_collapsed(text)
    assert sum(threads["MainThread"].values()) == 3
    assert any(f.function == "OpOverloadPacket.__call__" for stack in threads["MainThread"] for f in stack)


def test_cpu_sets_are_written_as_ranges(R):
    assert R._cpu_ranges([5, 0, 1, 2, 8, 9]) == "0-2,5,8-9"


def test_short_paths(R):
    assert R.short_path(MLA) == "vllm/model_executor/layers/attention/mla_attention.py"
    assert R.short_path(PLUGIN + "ops.py") == "vllm_mla_fusion/ops.py"
    assert R.short_path("/tmp/torchinductor_root/ab/cabc.py") == "/tmp/torchinductor_root/ab/cabc.py"


def test_regions_count_each_sample_once_and_self_time_takes_the_leaf(R):
    stacks = R.main_thread(R.parse_collapsed([
        # forward_fused -> forward_impl -> forward_fused again (a recursion): once per region.
        line(MAIN, [EXEC, FUSED, IMPL, FUSED, CHECK], 4),
        line(MAIN, [EXEC, IMPL, CONCAT], 6),
        line(MAIN, [EXEC], 10),
    ]))  # fmt: skip
    regions = R.region_samples(stacks)
    assert regions["execute_model (model runner)"] == 20
    assert regions["plugin: forward_fused"] == 4
    assert regions["plugin: validation.check_*"] == 4
    assert regions["MLAAttention.forward_impl"] == 10
    assert regions["_concat_k_nope_k_pe (vLLM's key concat)"] == 6
    assert regions["plugin: all code"] == 4
    assert regions["forward_mha (prefill attention)"] == 0
    own = R.self_samples(stacks)
    assert own["check_prefill_rope_cache_write (vllm_mla_fusion/validation.py)"] == 4
    assert own["GPUModelRunner.execute_model (vllm/v1/worker/gpu/model_runner.py)"] == 10
    assert sum(own.values()) == 20


def test_pattern_matches_qualified_names_and_their_last_part(R):
    p = R.Pattern("vllm_mla_fusion/backends/triton.py", frozenset({"_launch", "_DirectLauncher.__call__"}))
    triton = PLUGIN + "backends/triton.py"
    assert p.matches(R.Frame("_launch", triton))
    assert p.matches(R.Frame("_DirectLauncher.__call__", triton))
    assert not p.matches(R.Frame("_launch_config", triton))
    assert not p.matches(R.Frame("_launch", PLUGIN + "backends/aiter.py"))
    assert not p.matches(R.Frame("Other.__call__", triton))


def _window(R, side, stacks_lines, units, window_ms, execs=()):
    return R.Window(side=side, mode="compiled", workload="prefill_1024", units=units, unit="prefill step",
                    window_ms=window_ms, stacks=R.main_thread(R.parse_collapsed(stacks_lines)),
                    execute_model_ms=list(execs))  # fmt: skip


def test_per_step_normalisation_uses_each_windows_own_scale(R):
    # Window 1: 100 samples over 200 ms (2 ms a sample), 2 steps; window 2: 50 samples over
    # 50 ms (1 ms a sample), 3 steps. forward_fused: 40 samples in the first, 10 in the second.
    w1 = _window(R, "on", [line(MAIN, [EXEC, FUSED], 40), line(MAIN, [EXEC], 60)], 2, 200.0, [90.0, 95.0])
    w2 = _window(R, "on", [line(MAIN, [EXEC, FUSED], 10), line(MAIN, [EXEC], 40)], 3, 50.0, [15.0, 15.0, 15.0])
    assert w1.ms_per_sample == pytest.approx(2.0) and w2.ms_per_sample == pytest.approx(1.0)
    side = R.summarize_side([w1, w2])
    assert side.units == 5
    # (40 * 2 + 10 * 1) / 5 steps = 18 ms per step
    assert side.regions_ms["plugin: forward_fused"] == pytest.approx(18.0)
    assert side.regions_ms["execute_model (model runner)"] == pytest.approx((200.0 + 50.0) / 5)
    assert side.sampled_ms == pytest.approx(50.0)
    assert side.timed_execute_model_ms == pytest.approx(230.0 / 5)
    assert side.window_execute_model_ms == pytest.approx([92.5, 15.0])


def test_difference_is_on_minus_off_largest_first(R):
    rows = R.difference({"a": 1.0, "b": 5.0, "gone": 2.0}, {"a": 4.0, "b": 5.5, "new": 0.7})
    assert [r[0] for r in rows] == ["a", "new", "b", "gone"]
    assert rows[0] == ("a", 1.0, 4.0, 3.0)
    assert rows[-1] == ("gone", 2.0, 0.0, -2.0)


def _write_side(folder: Path, side: str, windows: list[tuple[list[str], int, float, list[float]]],
                threads: dict | None = None, gil_lines: list[str] | None = None, facts: dict | None = None) -> None:
    recs = []
    for i, (lines, units, window_ms, execs) in enumerate(windows):
        name = f"host_profile_compiled_{side}_prefill_1024_r{i}.collapsed"
        (folder / name).write_text("".join(lines))
        recs.append({"workload": "prefill_1024", "unit": "prefill step", "units": units, "window_ms": window_ms,
                     "collapsed": name, "host": {"execute_model_ms": execs, "gc_ms": [0.5]}})  # fmt: skip
        if threads is not None:
            recs[-1]["threads"] = threads
        if gil_lines is not None:
            (folder / f"gil_{side}_{i}.collapsed").write_text("".join(gil_lines))
            recs[-1]["gil_collapsed"] = f"gil_{side}_{i}.collapsed"
    data = {"side": side, "mode": "compiled", "windows": recs, "sampler": {"kind": "py-spy", "rate_hz": 1000}}
    if facts is not None:
        data["facts"] = facts
    (folder / f"host_profile_compiled_{side}.json").write_text(json.dumps(data))


def test_report_from_files_attributes_the_extra_time(R, tmp_path):
    # off: 10 steps of 40 ms, vLLM's concat 2 ms a step; on: 10 steps of 60 ms, 15 of them in
    # forward_fused (5 in validation), no concat. 1 ms a sample on both sides.
    _write_side(tmp_path, "off", [([line(MAIN, [EXEC, IMPL, CONCAT], 20), line(MAIN, [EXEC, IMPL], 380)], 10, 400.0,
                                   [40.0] * 10)])  # fmt: skip
    _write_side(tmp_path, "on", [([line(MAIN, [EXEC, FUSED, CHECK], 50), line(MAIN, [EXEC, FUSED], 100),
                                   line(MAIN, [EXEC, IMPL], 450)], 10, 600.0, [60.0] * 10)])  # fmt: skip
    on = R.summarize_side(R.load_side(tmp_path / "host_profile_compiled_on.json"))
    off = R.summarize_side(R.load_side(tmp_path / "host_profile_compiled_off.json"))
    rows = {r[0]: r for r in R.difference(off.regions_ms, on.regions_ms)}
    assert rows["execute_model (model runner)"][1:] == pytest.approx((40.0, 60.0, 20.0))
    assert rows["plugin: forward_fused"][3] == pytest.approx(15.0)
    assert rows["plugin: validation.check_*"][3] == pytest.approx(5.0)
    assert rows["_concat_k_nope_k_pe (vLLM's key concat)"][3] == pytest.approx(-2.0)
    assert off.gc_ms == pytest.approx(0.05)
    md = R.build_report(tmp_path)
    assert "### prefill_1024: per prefill step (10 prefill steps off, 10 on)" in md
    assert "| execute_model host span, timed (ms) | 40.00 | 60.00 | +20.00 |" in md
    regions = md.split("Inclusive regions")[1].split("Self time")[0]
    # The largest extra first; the concat the plugin removed at the end.
    assert regions.index("`execute_model (model runner)`") < regions.index("`plugin: forward_fused`") \
        < regions.index("`plugin: validation.check_*`") < regions.index("`_concat_k_nope_k_pe")  # fmt: skip
    assert "| `check_prefill_rope_cache_write (vllm_mla_fusion/validation.py)` | 0.000 | 5.000 | +5.000 |" in md


OP = frame("mla_attention_with_output", PLUGIN + "vllm_plugin/custom_ops.py", 133)
KEY = frame("FusedMLAAttention.assemble_prefill_key", PLUGIN + "vllm_plugin/attention.py", 316)
MHA = frame("MLACommonBaseImpl.forward_mha", MLA, 2950)
EMPTY = frame("empty", SITE + "torch/_refs/__init__.py", 10)  # a torch frame: counts for its caller
CACHE_OP = frame("unified_mla_kv_cache_update", MLA, 1400)


def test_per_layer_measure_counts_the_plugins_own_code_and_the_vllm_work_it_replaces(R, tmp_path):
    # on, per step (10 steps, 1 ms a sample): the op's own lines 3 ms, the key assembly inside
    # forward_mha 2 ms (1 of it in a torch frame below it), vLLM's attention inside the op 5 ms:
    # the plugin's own 5 ms. off: the cache write op 1.5 ms and the key concat 2.5 ms: 4 ms.
    _write_side(tmp_path, "on", [([line(MAIN, [EXEC, OP, FUSED], 30), line(MAIN, [EXEC, OP, FUSED, IMPL, MHA], 50),
                                   line(MAIN, [EXEC, OP, FUSED, IMPL, MHA, KEY], 10),
                                   line(MAIN, [EXEC, OP, FUSED, IMPL, MHA, KEY, EMPTY], 10),
                                   line(MAIN, [EXEC, FUSED], 7)], 10, 107.0, [10.7] * 10)],
                facts={"layers": [{"prefix": "model.layers.0.self_attn.mla_attn"}, {"same_as_first_for": 4}]})  # fmt: skip
    _write_side(tmp_path, "off", [([line(MAIN, [EXEC, CACHE_OP], 15), line(MAIN, [EXEC, IMPL, MHA, CONCAT], 25),
                                    line(MAIN, [EXEC, IMPL, MHA], 60)], 10, 100.0, [10.0] * 10)])  # fmt: skip
    on = R.summarize_side(R.load_side(tmp_path / "host_profile_compiled_on.json"))
    off = R.summarize_side(R.load_side(tmp_path / "host_profile_compiled_off.json"))
    assert on.per_layer_ms[R.PLUGIN_OWN] == pytest.approx(5.0)  # forward_fused outside the op: not counted
    assert off.per_layer_ms[R.VLLM_REPLACED] == pytest.approx(4.0)
    assert off.per_layer_ms[R.PLUGIN_OWN] == 0 and on.per_layer_ms[R.VLLM_REPLACED] == 0
    md = R.build_report(tmp_path)
    assert "Per layer (5 MLA layers)" in md
    assert "| on: plugin's own code in its attention op | 5.00 | 1000.0 |" in md
    assert "| on - off | +1.00 | +200.0 |" in md
    assert "window by window: on: 1000, off: 800" in md


def test_the_owner_of_a_sample_is_its_innermost_plugin_or_vllm_frame(R):
    def stack(*frames):
        return tuple(R.parse_frame(f) for f in frames)

    assert R.owner(stack(EXEC, OP, FUSED, IMPL, MHA, KEY, EMPTY)) == "plugin"
    assert R.owner(stack(EXEC, OP, FUSED, IMPL, MHA, EMPTY)) == "vllm"
    assert R.owner(stack(EMPTY)) is None
    assert R.layer_count({"facts": {"layers": [{"prefix": "a"}, {"prefix": "b"}]}}) == 2
    assert R.layer_count({}) is None


def test_report_names_a_missing_side(R, tmp_path):
    _write_side(tmp_path, "on", [([line(MAIN, [EXEC], 10)], 1, 10.0, [10.0])])
    assert "## compiled: one side missing (['on'])" in R.build_report(tmp_path)


def test_a_failed_window_is_left_out(R, tmp_path):
    _write_side(tmp_path, "on", [([line(MAIN, [EXEC], 10)], 1, 10.0, [10.0]), ([line(MAIN, [EXEC], 99)], 1, 99.0, [99.0])])
    data = json.loads((tmp_path / "host_profile_compiled_on.json").read_text())
    data["windows"][1]["error"] = "RuntimeError: the engine died"
    (tmp_path / "host_profile_compiled_on.json").write_text(json.dumps(data))
    windows = R.load_side(tmp_path / "host_profile_compiled_on.json")
    assert [w.window_ms for w in windows] == [10.0]


def test_threads_and_gil_per_step(R, tmp_path):
    # Two windows of 4 and 6 steps, 2 ms a sample (200 ms, 100 samples each): a helper thread
    # holding the GIL for 5 and 15 samples; CPU time from /proc per window.
    threads = {"MainThread": {"cpu_ms": 150.0, "involuntary": 4}, "pt_autotune": {"cpu_ms": 25.0, "involuntary": 0}}
    gil = [line(MAIN, [EXEC], 40), line("thread (9): helper", [frame("Helper.run", "/x/helper.py")], 5)]
    _write_side(tmp_path, "on", [([line(MAIN, [EXEC], 100)], 4, 200.0, [40.0] * 4),
                                 ([line(MAIN, [EXEC], 100)], 6, 200.0, [30.0] * 6)], threads, gil)  # fmt: skip
    side = R.summarize_side(R.load_side(tmp_path / "host_profile_compiled_on.json"))
    assert side.thread_cpu_ms == pytest.approx({"MainThread": 30.0, "pt_autotune": 5.0})
    assert side.thread_involuntary == pytest.approx({"MainThread": 0.8, "pt_autotune": 0.0})
    assert side.gil_ms == pytest.approx({"MainThread": 2 * 40 * 2 / 10, "helper": 2 * 5 * 2 / 10})
    _write_side(tmp_path, "off", [([line(MAIN, [EXEC], 100)], 4, 200.0, [40.0] * 4)], threads)
    md = R.build_report(tmp_path)
    assert "| helper | - | - | - | 2.00 | - | - |" in md
    assert "| MainThread | 37.50 | 30.00 | - | 16.00 | 1.0 | 0.8 |" in md
