"""scripts/gpu_tp8.sh on this machine: its stages, the lease plan it prints, and the serve call it makes.

The 8-GPU machine is faked: nvidia-smi prints N GPUs, the site directory is marked installed, the serving
wheels marked installed already, and the benchmark runs in --dry-run mode (it plans and prints, starts nothing).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "gpu_tp8.sh"


@pytest.fixture
def machine(tmp_path):
    """A fake machine with ``gpus(n)`` to set how many GPUs nvidia-smi lists."""
    site, whl, bin_, pack = tmp_path / "site", tmp_path / "whl", tmp_path / "bin", tmp_path / "pack"
    for d in (site, whl, bin_, pack / "parts"):
        d.mkdir(parents=True)
    (site / ".mla_fusion_install_complete").touch()
    (whl / "uvicorn-0.54.0-py3-none-any.whl").write_text("")
    (site / ".serving_wheels").write_text("./uvicorn-0.54.0-py3-none-any.whl\n")
    for i in range(24):
        (pack / "parts" / f"p{i:02d}").write_text("")
    (pack / "parts.sha256").write_text("")
    (bin_ / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_ / "python3").chmod(0o755)

    def gpus(n: int) -> None:
        listing = "".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i})\\n" for i in range(n))
        (bin_ / "nvidia-smi").write_text(f'#!/bin/sh\n[ "$1" = -L ] && printf "{listing}"\nexit 0\n')
        (bin_ / "nvidia-smi").chmod(0o755)

    gpus(8)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SITE_DIR": str(site), "WHL_DIR": str(whl),
           "PACK_DIR": str(pack), "EP_DIR": str(tmp_path / "ep"), "OUT": str(tmp_path / "out"),
           "SERVING_WORK": str(tmp_path / "work"), "TP8_ARGS": "--dry-run"}  # fmt: skip
    return tmp_path, env, gpus


def run_script(env, *args, timeout=300):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)  # fmt: skip


def test_the_plan_lists_every_call_in_order_with_its_carry(machine):
    tmp_path, env, _ = machine
    proc = run_script(env, "plan")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [ln for ln in proc.stdout.splitlines() if re.match(r"^\d+\. ", ln)]
    assert calls[0].startswith("0. status")
    pieces = calls[1:25]
    assert [re.search(r'carry \["([^"]+)"\]', c).group(1) for c in pieces] == [
        f"{tmp_path}/pack/parts/p{i:02d}" for i in range(24)]  # fmt: skip
    assert all("nvidia-h200-x8" in c and "cp " in c and "/tmp/acc/" in c for c in pieces)
    assert "parts.sha256" in calls[25] and calls[25].endswith("scripts/gpu_tp8.sh install   (~300 s)")
    assert [c.split("(server ")[1][:5] for c in calls[26:]] == ["'on',", "'off'"]
    assert all(f'carry ["{tmp_path}/whl"]' in c and "gpu_tp8.sh serve" in c for c in calls[26:])
    # 24 x 15 s + 300 s + 2 x 450 s: inside a lease's 30 minutes with room for the machine's start.
    assert "27 calls, ~26 min of device time" in proc.stdout


def test_the_plan_needs_the_pieces_and_the_wheels(machine):
    tmp_path, env, _ = machine
    for p in (tmp_path / "whl").iterdir():
        p.unlink()
    proc = run_script(env, "plan")
    assert proc.returncode == 1 and "scripts/pack_serving_wheels.sh" in proc.stdout
    for p in (tmp_path / "pack" / "parts").iterdir():
        p.unlink()
    proc = run_script(env, "plan")
    assert proc.returncode == 1 and "scripts/pack_vllm_h200.sh" in proc.stdout


@pytest.mark.parametrize("args", [[], ["serve-all"]])
def test_an_unknown_stage_shows_the_usage(machine, args):
    _, env, _ = machine
    proc = run_script(env, *args)
    assert proc.returncode == 2 and "usage: scripts/gpu_tp8.sh plan|install|serve" in proc.stdout


@pytest.mark.parametrize("stage", ["install", "serve"])
def test_a_machine_without_eight_gpus_is_refused_before_anything_runs(machine, stage):
    tmp_path, env, gpus = machine
    gpus(1)
    proc = run_script(env, stage)
    assert proc.returncode == 2 and "has 1 GPUs, not 8: run on the kind nvidia-h200-x8" in proc.stdout
    assert not (tmp_path / "out").exists()


def test_serve_runs_the_benchmark_at_tp8_with_the_probe_in_one_archive(machine):
    tmp_path, env, _ = machine
    proc = run_script(env, "serve")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (archive,) = (tmp_path / "out").iterdir()
    with tarfile.open(archive) as tar:
        log = tar.extractfile("serving/serving.log").read().decode()
    command = next(ln for ln in log.splitlines() if "python -m benchmarks.serving " in ln)
    for option in ("--model full", "--tensor-parallel-size 8", "--probe", "--servers-per-side 1", "--resume",
                   "--loads warmup rate4 saturate", "--dry-run"):  # fmt: skip
        assert option in command, option
    assert 420 <= int(re.search(r"--budget-s (\d+)", command).group(1)) <= 430  # TOTAL_S 450 less the archive's 20 s
    assert "server 0 (on)" in log and "--worker-extension-cls benchmarks.serving.probe.RedrawWeights" in log
    # TOTAL_S overrides the call's length; the benchmark gets it less the archive's reserve.
    proc = run_script({**env, "TOTAL_S": "300"}, "serve")
    assert proc.returncode == 0
    newest = max((tmp_path / "out").iterdir(), key=lambda p: p.stat().st_mtime)
    with tarfile.open(newest) as tar:
        assert re.search(r"--budget-s 2[78]\d ", tar.extractfile("serving/serving.log").read().decode())


def test_install_runs_the_shared_install_stage(machine):
    _, env, _ = machine
    proc = run_script(env, "install")
    assert "install: /" in proc.stdout and "already complete, skipped" in proc.stdout  # gpu_vllm_check.sh's stage
