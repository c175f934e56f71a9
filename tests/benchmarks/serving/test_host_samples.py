"""benchmarks/serving/host_samples.py: py-spy's collapsed stacks read into shares, the sides compared, the
sampler attached to a server's engine core and stopped (a stand-in py-spy), and the load that asks for it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.serving import host_samples as hs
from benchmarks.serving import run
from benchmarks.serving.loads import DEFAULT_LOADS, PRESETS, parse_load

# Three stacks, 10 samples: step() in 8 of them, the plugin's op in 3, vLLM's scheduler in 2.
COLLAPSED = """\
<module> (serve.py:1);run_engine (core.py:40);step (core.py:88);forward (mla.py:10);forward_fused (attention.py:271) 3
<module> (serve.py:1);run_engine (core.py:40);step (core.py:88);schedule (scheduler.py:200) 2
<module> (serve.py:1);run_engine (core.py:41);step (core.py:90) 3
<module> (serve.py:1);run_engine (core.py:44);busy_loop (core.py:60) 2
not a stack line
"""


def test_stacks_read_into_inclusive_and_self_shares(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text(COLLAPSED)
    stacks = hs.read_stacks(COLLAPSED)
    assert sum(stacks.values()) == 10 and len(stacks) == 4  # the malformed line is skipped
    s = hs.summarize(str(path))
    assert s["samples"] == 10
    # One function is one row whatever its line: step() at core.py:88 and :90.
    assert s["inclusive"]["step (core.py)"] == pytest.approx(0.8)
    assert s["inclusive"]["run_engine (core.py)"] == pytest.approx(1.0)
    assert s["inclusive"]["forward_fused (attention.py)"] == pytest.approx(0.3)
    assert s["self"] == pytest.approx({"forward_fused (attention.py)": 0.3, "step (core.py)": 0.3,
                                       "schedule (scheduler.py)": 0.2, "busy_loop (core.py)": 0.2})  # fmt: skip
    empty = tmp_path / "e.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="no samples"):
        hs.summarize(str(empty))


def test_sides_pooled_by_samples_per_role_and_their_differences():
    def server(side, samples, shares, role="EngineCore_DP0"):
        return {"side": side, "loads": [{"load": "pyspy16",
                                         "pyspy_summary": {role: {"samples": samples, "inclusive": shares}}}]}  # fmt: skip

    servers = [server("on", 100, {"step (core.py)": 0.9, "forward_fused (attention.py)": 0.3}),
               server("off", 300, {"step (core.py)": 0.6, "concat (mla.py)": 0.1}),
               server("on", 300, {"step (core.py)": 0.5, "forward_fused (attention.py)": 0.1}),
               server("on", 50, {"execute_model (gpu_worker.py)": 1.0}, role="Worker_TP0-77"),
               {"side": "off", "loads": [{"load": "pyspy16", "pyspy_summary": {"error": "py-spy is not on PATH"}}]},
               {"side": "off", "loads": [{"load": "pyspy16", "pyspy_summary": {"Worker_TP0": {"error": "no samples"}}}]}]
    c = hs.compare_sides(servers)
    assert set(c) == {"EngineCore_DP0", "Worker_TP0"}  # a worker's pid suffix pools with its role
    core = c["EngineCore_DP0"]
    assert core["samples"] == {"on": 400, "off": 300}
    assert core["inclusive"]["on"]["step (core.py)"] == pytest.approx((90 + 150) / 400)
    delta = core["differences"]["on - off"]
    assert delta["step (core.py)"] == pytest.approx(0.6 - 0.6)
    assert delta["forward_fused (attention.py)"] == pytest.approx(0.15) and delta["concat (mla.py)"] == pytest.approx(-0.1)
    assert c["Worker_TP0"]["samples"] == {"on": 50} and c["Worker_TP0"]["differences"] == {}
    text = hs.markdown(c)
    assert "### EngineCore_DP0" in text and "**on** (400 samples)" in text and "+15.0  forward_fused (attention.py)" in text


# A stand-in py-spy: records its arguments, writes its output file when interrupted, as py-spy does.
FAKE_PY_SPY = """#!{python}
import os, signal, sys, time
args = sys.argv[1:]
out = args[args.index("--output") + 1]
def done(*_):
    open(out, "w").write("main (x.py:1);step (core.py:2) 5\\n")
    sys.exit(0)
signal.signal(signal.SIGINT, done)  # before the argv file, which the test waits for before stopping
open({argv_dir!r} + f"/argv-{{os.getpid()}}.txt", "w").write(" ".join(args))
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def fake_py_spy(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "py-spy"
    argv_file = tmp_path / "argv" / "argv.txt"  # each call writes argv-<pid>.txt beside it
    argv_file.parent.mkdir()
    exe.write_text(FAKE_PY_SPY.format(python=sys.executable, argv_dir=str(argv_file.parent)))
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return argv_file


def _wait_for_children(server, ready) -> list:
    """The server's processes once ``ready(children)`` holds (they exec into their final command lines)."""
    psutil = pytest.importorskip("psutil")
    for _ in range(400):  # 20 s: a busy CI machine starts processes slowly
        try:
            children = psutil.Process(server.pid).children(recursive=True)
            if ready(children):
                return children
        except psutil.Error:
            pass
        time.sleep(0.05)
    os.killpg(server.pid, signal.SIGKILL)
    pytest.fail("the stand-in engine processes never started")


def _server_with_engine_processes():
    """A process standing for `vllm serve`, with children titled as vLLM titles its engine core and worker."""
    server = subprocess.Popen(["bash", "-c", "(exec -a VLLM::EngineCore_DP0 sleep 60) & (exec -a VLLM::Worker_TP0 sleep 60) & wait"],
                              start_new_session=True)  # fmt: skip
    want = {"VLLM::EngineCore_DP0", "VLLM::Worker_TP0"}
    children = _wait_for_children(server, lambda cs: want <= {(c.cmdline() or [""])[0] for c in cs})
    titles = {(c.cmdline() or [""])[0]: c.pid for c in children}
    return server, {"APIServer": server.pid, "EngineCore_DP0": titles["VLLM::EngineCore_DP0"],
                    "Worker_TP0": titles["VLLM::Worker_TP0"]}  # fmt: skip


def test_untitled_engine_processes_found_by_multiprocessing_spawn():
    """Without setproctitle (the lent GPU machine has none) vLLM's processes keep python's command
    line: multiprocessing's spawned children, the server's own the engine core, the one below it a
    worker; the resource tracker is no engine."""
    pytest.importorskip("psutil")
    py = sys.executable
    worker = "import time; time.sleep(60)  # spawn_main(tracker_fd=5, pipe_handle=7) worker"
    engine = (f"import subprocess, time; subprocess.Popen([{py!r}, '-c', {worker!r}]); "
              "time.sleep(60)  # spawn_main(tracker_fd=5, pipe_handle=9) engine")  # fmt: skip
    tracker = "import time; time.sleep(60)  # from multiprocessing.resource_tracker import main; main(4)"
    server = subprocess.Popen([py, "-c", f"import subprocess, time; subprocess.Popen([{py!r}, '-c', {engine!r}]); "
                               f"subprocess.Popen([{py!r}, '-c', {tracker!r}]); time.sleep(60)"],
                              start_new_session=True)  # fmt: skip
    try:
        # Each child exec'd into its own code: a child forked but not yet exec'd still shows the
        # server's command line, which quotes the others' code ("spawn_main" included).
        children = _wait_for_children(server, lambda cs: len(cs) == 3
                                      and sorted((c.cmdline() or [""])[-1] for c in cs) == sorted([worker, engine, tracker]))
        engine_pid = next(c.pid for c in children if c.ppid() == server.pid and "engine" in " ".join(c.cmdline()))
        worker_pid = next(c.pid for c in children if c.ppid() == engine_pid)
        assert hs.sampled_processes(server.pid) == {"APIServer": server.pid, "EngineCore": engine_pid,
                                                    "Worker": worker_pid}  # fmt: skip
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_the_samplers_attach_to_each_engine_process_and_write_on_stop(tmp_path, fake_py_spy):
    server, pids = _server_with_engine_processes()
    try:
        assert hs.sampled_processes(server.pid) == pids
        prefix = tmp_path / "results" / "pyspy-00-on-pyspy16"
        procs, record = hs.start(server.pid, str(prefix))
        outputs = {role: f"{prefix}-{role}.txt" for role in pids}
        assert record == {"outputs": outputs, "pids": pids, "rate_hz": hs.RATE_HZ} and len(procs) == 3
        for _ in range(400):  # 20 s: a busy CI machine starts processes slowly
            if len(list(fake_py_spy.parent.glob("argv-*.txt"))) == 3:
                break
            time.sleep(0.05)
        calls = sorted(p.read_text().split() for p in fake_py_spy.parent.glob("argv-*.txt"))
        assert [c[:3] for c in calls] == sorted(["record", "--pid", str(pid)] for pid in pids.values())
        assert all("--nonblocking" in c and "raw" in c for c in calls)
        record = hs.stop(procs, record)
        assert record["exits"] == [0, 0, 0] and "errors" not in record
        summary = hs.summarize_record(record)
        assert {role: s["inclusive"]["step (core.py)"] for role, s in summary.items()} == {role: 1.0 for role in pids}
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_the_sampler_reports_why_nothing_was_sampled(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no py-spy there
    procs, record = hs.start(os.getpid(), str(tmp_path / "x"))
    assert procs == [] and record == {"error": "py-spy is not on PATH"}
    assert hs.stop(procs, record) == record and hs.summarize_record(record) == {"error": "py-spy is not on PATH"}
    assert hs.sampled_processes(os.getpid())["APIServer"] == os.getpid()  # the server itself, engine processes or not
    missing = {"outputs": {"EngineCore_DP0": str(tmp_path / "none.txt")}, "pids": {"EngineCore_DP0": 1}}
    assert "EngineCore_DP0" in hs.stop([], missing)["errors"]


def test_a_sampled_load_is_never_reported_and_its_spec_names_its_file(tmp_path):
    load = parse_load("name=s,in=64,out=8,rate=4,prompts=6,pyspy=1")
    assert load.pyspy and not load.measured
    assert not parse_load("name=s,in=64,out=8,rate=4,prompts=6").pyspy
    p16, r16 = PRESETS["pyspy16"], PRESETS["rate16"]
    assert (p16.input_len, p16.output_len, p16.request_rate) == (r16.input_len, r16.output_len, r16.request_rate)
    assert p16.pyspy and not p16.measured and "pyspy16" not in DEFAULT_LOADS and "py-spy" in p16.describe()
    a = run.parse_args(["--out", str(tmp_path), "--config", "seqs128", "--layers", "4", "--loads", "warm1k", "pyspy16"])
    loads = run.Benchmark(a).client_spec(3, a.side_list[0], 8000, 1.0)["loads"]
    assert "pyspy" not in loads[0]
    assert loads[1]["pyspy"]["prefix"].endswith("pyspy-03-on-pyspy16")


def test_the_driver_reads_each_sampled_load(tmp_path):
    a = run.parse_args(["--out", str(tmp_path), "--config", "seqs128", "--layers", "4", "--loads", "warm1k", "pyspy16"])
    bench = run.Benchmark(a)
    out = tmp_path / "s.txt"
    out.write_text(COLLAPSED)
    (tmp_path / "empty.txt").write_text("")
    loads = [{"load": "warm1k"},
             {"load": "pyspy16", "pyspy": {"outputs": {"EngineCore_DP0": str(out), "Worker_TP0": str(tmp_path / "empty.txt")}}},
             {"load": "x", "pyspy": {"error": "py-spy is not on PATH"}}]  # fmt: skip
    bench.read_host_samples(0, a.side_list[0], loads)
    assert "pyspy_summary" not in loads[0]
    assert loads[1]["pyspy_summary"]["EngineCore_DP0"]["samples"] == 10
    assert loads[1]["pyspy_summary"]["Worker_TP0"]["error"].startswith("ValueError: no samples")
    assert loads[2]["pyspy_summary"] == {"error": "py-spy is not on PATH"}


def test_py_spy_unpacked_from_its_wheels_data_scripts(tmp_path):
    import zipfile

    wheel_dir = tmp_path / "whl"
    wheel_dir.mkdir()
    with zipfile.ZipFile(wheel_dir / "py_spy-0.4.3-py2.py3-none-manylinux1_x86_64.whl", "w") as z:
        z.writestr("py_spy-0.4.3.dist-info/sboms/py-spy.cyclonedx.json", "{}")  # a py-spy that is not the binary
        z.writestr("py_spy-0.4.3.data/scripts/py-spy", b"\x7fELF binary")
    exe = hs.unpack_py_spy(wheel_dir, tmp_path / "bin")
    assert exe == tmp_path / "bin" / "py-spy" and exe.read_bytes() == b"\x7fELF binary"
    assert os.access(exe, os.X_OK)


def test_py_spy_unpack_names_what_is_missing(tmp_path):
    import zipfile

    with pytest.raises(FileNotFoundError, match="no py_spy-"):
        hs.unpack_py_spy(tmp_path, tmp_path / "bin")
    with zipfile.ZipFile(tmp_path / "py_spy-0.4.3-py3-none-any.whl", "w") as z:
        z.writestr("py_spy-0.4.3.dist-info/METADATA", "Name: py-spy\n")
    with pytest.raises(FileNotFoundError, match="has no"):
        hs.unpack_py_spy(tmp_path, tmp_path / "bin")
    assert not (tmp_path / "bin" / "py-spy").exists()


def test_py_spy_unpack_command_fails_with_a_message_not_a_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serving.host_samples", "unpack", str(tmp_path),
                           str(tmp_path / "bin")], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))  # fmt: skip
    assert proc.returncode == 1
    assert "py-spy not unpacked: no py_spy-" in proc.stderr and "Traceback" not in proc.stderr
