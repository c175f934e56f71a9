"""Shared by the serving benchmark's tests: vLLM 0.33 result files as `vllm bench serve --save-result` writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def vllm_result(server: int, side: str, load: str, *, ttft_ms: float = 100.0, tpot_ms: float = 20.0,
                itl_ms: float = 19.0, req_s: float = 4.0, tok_s: float = 500.0, completed: int = 100,
                failed: int = 0, num_prompts: int = 100) -> dict:  # fmt: skip
    """Every scalar field of a vLLM 0.33.0 result JSON (vllm/benchmarks/serve.py, openai backend, random
    dataset, --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99, --metadata server= side=
    load= model= layers=), as read from a real file of the CPU smoke run; the figures are the arguments."""
    return {
        "date": "20261202-054430", "endpoint_type": "openai", "backend": "openai", "label": None,
        "model_id": "dsv3-stand-in", "tokenizer_id": "/work/model", "num_prompts": num_prompts,
        "server": str(server), "side": side, "load": load, "model": "dense", "layers": "61",
        "request_rate": 4.0, "burstiness": 1.0, "max_concurrency": None, "duration": completed / req_s,
        "completed": completed, "failed": failed, "total_input_tokens": 1024 * completed,
        "total_output_tokens": 128 * completed, "request_throughput": req_s, "request_goodput": None,
        "output_throughput": tok_s, "total_token_throughput": tok_s * 9, "max_output_tokens_per_s": tok_s * 2,
        "max_concurrent_requests": 12, "rtfx": 0.0,
        "mean_ttft_ms": ttft_ms * 1.1, "median_ttft_ms": ttft_ms, "std_ttft_ms": 5.0, "p50_ttft_ms": ttft_ms,
        "p99_ttft_ms": ttft_ms * 3, "mean_tpot_ms": tpot_ms, "median_tpot_ms": tpot_ms, "std_tpot_ms": 1.0,
        "p50_tpot_ms": tpot_ms, "p99_tpot_ms": tpot_ms * 2, "mean_itl_ms": itl_ms, "median_itl_ms": itl_ms,
        "std_itl_ms": 2.0, "p50_itl_ms": itl_ms, "p99_itl_ms": itl_ms * 4, "mean_e2el_ms": 3000.0,
        "median_e2el_ms": 3000.0, "std_e2el_ms": 100.0, "p50_e2el_ms": 3000.0, "p99_e2el_ms": 3500.0,
    }  # fmt: skip


@pytest.fixture
def write_results(tmp_path):
    """Write result dicts as vLLM names them (<server>-<side slug>-<load>.json); returns the folder."""

    def write(results: list[dict]) -> Path:
        folder = tmp_path / "results"
        folder.mkdir(exist_ok=True)
        for r in results:
            slug = r["side"].replace("@", "-at-").replace("/", "_")
            (folder / f"{int(r['server']):02d}-{slug}-{r['load']}.json").write_text(json.dumps(r))
        return folder

    return write
