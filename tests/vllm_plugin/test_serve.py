"""`vllm serve` end to end (the example in docs/vllm.md): OpenAI-API completions, plugin on and off, same tokens.

The tiny model (demo/tiny_model.py) served by ``python -m demo.serve``, which
is ``vllm serve`` plus, on this CPU-only machine, the stand-ins for the vLLM
kernels the wheel lacks, in every server process (API server, engine core,
worker). Concurrent requests of different lengths, greedy, float32.

Marked ``slow``: about 2-2.5 minutes on a 2-core machine (each server takes
about a minute to start: three processes import vLLM). The whole suite with
it takes ~8 minutes there, well inside CI's 90-minute limit, so CI runs it:
scripts/test.sh selects no markers; deselect locally with ``-m "not slow"``.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from demo import tiny_model

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
FUSED_LINE = (
    "vllm-mla-fusion (rank 0, local rank 0): MLA layers use the fused RoPE + KV-cache write (backend torch, mode decode)"
)
UNKNOWN = "Unknown vLLM environment variable"
LINES = tiny_model.CORPUS.splitlines()
# (prompt, max_tokens): a few tokens, a paragraph, the whole text (~440 tokens)
REQUESTS = [("The fused kernel", 12), (" ".join(LINES[:4]), 8), (tiny_model.CORPUS, 6), ("A padded token", 10)]
START_TIMEOUT_S = 420


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(Exception):
    """The port free_port() found was bound by another process before the server bound it."""


class Server:
    """``python -m demo.serve`` in its own process group, its log in a file."""

    def __init__(self, model: Path, plugin: bool, log_path: Path):
        self.port = free_port()
        self.log_path = log_path
        env = {
            **os.environ,
            "VLLM_MLA_FUSION": "1" if plugin else "0",
            "VLLM_TARGET_DEVICE": "cpu",
            "CUDA_VISIBLE_DEVICES": "",
            "HF_HUB_OFFLINE": "1",
        }
        env.pop("VLLM_PLUGINS", None)  # every installed plugin, as a user's server loads them
        args = [
            str(model), "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "tiny",
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "8",
            "--kv-cache-memory-bytes", str(64 << 20), "--attention-backend", "CPU_MLA", "--seed", "0",
        ]  # fmt: skip
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "demo.serve", *args],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if "Address already in use" in self.log():
                    raise PortTaken(self.port)
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        pytest.fail(f"the server was not healthy after {START_TIMEOUT_S} s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # vLLM shuts its engine core and worker down
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group this test started
                self.proc.wait()
        self._log.close()


def complete_all(port: int) -> list[dict]:
    """All requests at once, as concurrent clients send them."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")

    def one(request):
        prompt, max_tokens = request
        r = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0, logprobs=1,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        choice = r.choices[0]
        return {"tokens": choice.token_ids, "logprobs": choice.logprobs.token_logprobs, "text": choice.text}

    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
        return list(pool.map(one, REQUESTS))


def serve_and_complete(model: Path, plugin: bool, log_path: Path) -> tuple[list[dict], str]:
    # A port is free when free_port() looks and bound a moment later; anything else on the
    # machine (a gloo or ZMQ socket of another test run) can take it in between: try another.
    for _ in range(3):
        server = Server(model, plugin, log_path)
        try:
            server.wait_healthy()
            return complete_all(server.port), server.log()
        except PortTaken:
            continue
        finally:
            server.stop()
    pytest.fail("three free ports in a row were taken before the server could bind them")


def test_vllm_serve_same_completions_with_plugin_on_and_off(tmp_path):
    model = tiny_model.write(tmp_path / "model")
    on, log_on = serve_and_complete(model, True, tmp_path / "serve_on.log")
    off, log_off = serve_and_complete(model, False, tmp_path / "serve_off.log")

    assert FUSED_LINE in log_on  # logged by the worker process that built the model
    assert "vllm-mla-fusion: MLA layers use" not in log_off
    assert UNKNOWN not in log_on and UNKNOWN not in log_off
    for (prompt, max_tokens), got, want in zip(REQUESTS, on, off, strict=True):
        assert len(got["tokens"]) == max_tokens, prompt[:30]
        assert got["tokens"] == want["tokens"], prompt[:30]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4), prompt[:30]
