"""scripts/gpu_serving.sh on this machine: its checks, the driver call it makes, and the one archive it leaves.

The GPU machine's parts are faked: a site directory marked installed, wheels marked installed already
(cp312 wheels do not install into this Python), and the benchmark in --dry-run mode (it plans and prints,
starts nothing).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "gpu_serving.sh"


@pytest.fixture
def machine(tmp_path):
    site, whl, bin_ = tmp_path / "site", tmp_path / "whl", tmp_path / "bin"
    for d in (site, whl, bin_):
        d.mkdir()
    (site / ".mla_fusion_install_complete").touch()
    (whl / "uvicorn-0.54.0-py3-none-any.whl").write_text("")
    (site / ".serving_wheels").write_text("./uvicorn-0.54.0-py3-none-any.whl\n")
    # The script's python3: this environment's (a wrapper: through a symlink Python would miss its venv).
    (bin_ / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_ / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SITE_DIR": str(site), "WHL_DIR": str(whl),
           "EP_DIR": str(tmp_path / "ep"), "OUT": str(tmp_path / "out"), "SERVING_WORK": str(tmp_path / "work"),
           "SERVING_ARGS": "--dry-run --layers 4", "TOTAL_S": "200"}  # fmt: skip
    return tmp_path, env


def test_one_call_leaves_one_archive_with_the_plan(machine):
    tmp_path, env = machine
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "serving wheels already in" in proc.stdout
    (archive,) = (tmp_path / "out").iterdir()
    assert archive.name.startswith("serving_call_") and archive.name.endswith(".tgz")
    with tarfile.open(archive) as tar:
        log = tar.extractfile("serving/serving.log").read().decode()
    assert '"budget_s"' in log and "server 0 (on)" in log and "--resume" in log  # budget passed, run continued
    # The entry point the servers find the plugin through, made for this checkout.
    assert (tmp_path / "ep" / "vllm_mla_fusion-0.1.0.dist-info" / "entry_points.txt").is_file()


def test_without_vllm_installed_it_says_what_to_run_first(machine):
    tmp_path, env = machine
    (tmp_path / "site" / ".mla_fusion_install_complete").unlink()
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "run scripts/gpu_session.sh install first" in proc.stdout


def test_without_the_wheels_it_says_what_to_carry(machine):
    tmp_path, env = machine
    (tmp_path / "whl" / "uvicorn-0.54.0-py3-none-any.whl").unlink()
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "carry .whl" in proc.stdout


def test_py_spy_is_unpacked_from_its_wheel_onto_the_path(machine):
    # pip --target (the wheels' install) leaves py-spy's binary out: the script unpacks it itself.
    import zipfile

    tmp_path, env = machine
    wheel = tmp_path / "whl" / "py_spy-0.4.3-py2.py3-none-manylinux1_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("py_spy-0.4.3.data/scripts/py-spy", "#!/bin/sh\necho fake py-spy\n")
        z.writestr("py_spy-0.4.3.dist-info/METADATA", "Name: py-spy\n")
    marker = tmp_path / "site" / ".serving_wheels"
    marker.write_text("./py_spy-0.4.3-py2.py3-none-manylinux1_x86_64.whl\n./uvicorn-0.54.0-py3-none-any.whl\n")
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    exe = tmp_path / "site" / "bin" / "py-spy"
    assert os.access(exe, os.X_OK)
    assert subprocess.run([str(exe)], capture_output=True, text=True).stdout == "fake py-spy\n"
    assert "py-spy not unpacked" not in proc.stdout


def test_without_a_py_spy_wheel_it_says_pyspy_loads_sample_nothing(machine):
    tmp_path, env = machine
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "py-spy not unpacked: pyspy loads will sample nothing" in proc.stdout
