"""A stand-in for `vllm serve` in the driver's tests: answers /health and /metrics, logs like the plugin.

``python fake_vllm_serve.py MODEL --served-model-name N --host H --port P [vLLM options]``. What it logs
is set by FAKE_SERVE_LINE: ``plugin`` (the plugin's line unless VLLM_MLA_FUSION=0, as the real
plugin), ``always`` (even when switched off: a broken switch), ``never`` (a plugin that did not load);
one line per rank of ``--tensor-parallel-size``. FAKE_SERVE_DELAY_S delays /health.

The probe's routes (benchmarks/serving/probe.py) as vLLM's dev mode and profiler answer them:
``/collective_rpc`` (one result per rank), ``/v1/completions`` (greedy tokens and logprobs, a function
of the prompt; FAKE_SERVE_SKEW=1 shifts the plugin side's last logprob, a plugin that changes rounding),
``/start_profile`` and ``/stop_profile`` (a small trace per rank into --profiler-config's directory; the
start's body beside it as ``<prefix>.start.json``, for the tests of step_profile.py's sessions).
"""

import gzip
import http.server
import json
import os
import sys
import time
from pathlib import Path

LINE = ("(Worker_TP{r} pid=1) INFO [layer.py:110] vllm-mla-fusion (rank {r}, local rank {r}): MLA layers use the fused "
        "RoPE + KV-cache write (backend triton, mode decode)")
port = int(sys.argv[sys.argv.index("--port") + 1])
ranks = int(sys.argv[sys.argv.index("--tensor-parallel-size") + 1]) if "--tensor-parallel-size" in sys.argv else 1
plugin_on = os.environ.get("VLLM_MLA_FUSION") != "0"
mode = os.environ.get("FAKE_SERVE_LINE", "plugin")
if mode == "always" or (mode == "plugin" and plugin_on):
    for r in range(ranks):
        print(LINE.format(r=r), flush=True)
profile = {"prefix": None}


def completion(body: dict) -> dict:
    prompt, n = body["prompt"], body["max_tokens"]
    tokens = [(sum(prompt) * 31 + 7 * k) % 500 + 2 for k in range(n)]
    logprobs = [-0.25 - 0.01 * k for k in range(n)]
    if plugin_on and os.environ.get("FAKE_SERVE_SKEW") == "1":
        logprobs[-1] -= 1e-3
    return {"choices": [{"logprobs": {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": logprobs}}]}


def write_traces() -> None:
    """Per rank: one prefill step, three decode steps of the whole batch (1000 + 100 * rank us of kernels)."""
    directory = Path(json.loads(sys.argv[sys.argv.index("--profiler-config") + 1])["torch_profiler_dir"])
    directory.mkdir(parents=True, exist_ok=True)
    for r in range(ranks):
        events = []
        for i, name in enumerate(["execute_context_2(128)_generation_0(0)"] + ["execute_context_0(0)_generation_2(2)"] * 3):
            ts = 10_000 * i
            events += [{"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": 50, "pid": 1, "tid": 7},
                       {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts + 5, "dur": 2, "pid": 1,
                        "tid": 7, "args": {"correlation": i + 1}},
                       {"ph": "X", "cat": "kernel", "name": "gemm", "ts": ts + 100, "dur": 1000 + 100 * r + i, "pid": 0,
                        "tid": 7, "args": {"correlation": i + 1}}]
        name = f"{profile['prefix']}_dp0_pp0_tp{r}_dcp0_ep0_rank{r}.1.pt.trace.json.gz"
        with gzip.open(directory / name, "wt") as f:
            json.dump({"traceEvents": events}, f)
print(f"INFO Using FLASH_ATTN_MLA backend. args={sys.argv[1:]}", flush=True)
ready_at = time.monotonic() + float(os.environ.get("FAKE_SERVE_DELAY_S", "0"))


class Handler(http.server.BaseHTTPRequestHandler):
    def answer(self, status: int, body: bytes = b"") -> None:
        self.send_response(status)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health" and time.monotonic() >= ready_at:
            self.answer(200)
        elif self.path == "/metrics":
            self.answer(200, b'vllm:prefix_cache_queries_total{engine="0"} 10.0\nvllm:prefix_cache_hits_total{engine="0"} 4.0\n')
        else:
            self.answer(503)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/collective_rpc" and body.get("method") == "redraw_weights":
            answer = {"results": [{"tp_rank": r, "mla_layers": 3, "fp8_weights": 10} for r in range(ranks)]}
        elif self.path == "/v1/completions":
            answer = completion(body)
        elif self.path == "/start_profile":
            profile["prefix"], answer = body.get("profile_prefix"), None
            directory = Path(json.loads(sys.argv[sys.argv.index("--profiler-config") + 1])["torch_profiler_dir"])
            directory.mkdir(parents=True, exist_ok=True)
            (directory / f"{profile['prefix']}.start.json").write_text(json.dumps(body))
        elif self.path == "/stop_profile":
            write_traces()
            answer = None
        else:
            return self.answer(404)
        self.answer(200, json.dumps(answer).encode() if answer is not None else b"")

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
