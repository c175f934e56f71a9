"""The demo's pieces (demo/). vLLM picks its platform when first imported: the CPU one, as in tests/vllm_plugin."""

from __future__ import annotations

import os

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
# Model directories are local; without this, config loading probes the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
