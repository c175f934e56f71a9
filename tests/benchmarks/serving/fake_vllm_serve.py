"""A stand-in for `vllm serve` in the driver's tests: answers /health and /metrics, logs like the plugin.

``python fake_vllm_serve.py MODEL --served-model-name N --host H --port P [vLLM options]``. What it logs
is set by FAKE_SERVE_LINE: ``plugin`` (the plugin's line unless VLLM_MLA_FUSION=0, as the real
plugin), ``always`` (even when switched off: a broken switch), ``never`` (a plugin that did not load).
FAKE_SERVE_DELAY_S delays /health.
"""

import http.server
import os
import sys
import time

LINE = ("(Worker pid=1) INFO [layer.py:110] vllm-mla-fusion (rank 0, local rank 0): MLA layers use the fused "
        "RoPE + KV-cache write (backend triton, mode decode)")
port = int(sys.argv[sys.argv.index("--port") + 1])
mode = os.environ.get("FAKE_SERVE_LINE", "plugin")
if mode == "always" or (mode == "plugin" and os.environ.get("VLLM_MLA_FUSION") != "0"):
    print(LINE, flush=True)
print(f"INFO Using FLASH_ATTN_MLA backend. args={sys.argv[1:]}", flush=True)
ready_at = time.monotonic() + float(os.environ.get("FAKE_SERVE_DELAY_S", "0"))


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health" and time.monotonic() >= ready_at:
            body = b""
        elif self.path == "/metrics":
            body = b'vllm:prefix_cache_queries_total{engine="0"} 10.0\nvllm:prefix_cache_hits_total{engine="0"} 4.0\n'
        else:
            self.send_response(503)
            self.end_headers()
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
