#!/usr/bin/env bash
# The main job (demo/main.py): vLLM 0.33 serving a tiny DeepSeek-V3-architecture model, written
# here with real (seeded) weights and a locally built tokenizer, with the plugin and without it
# (VLLM_MLA_FUSION=0); it prints the plugin's log line, whether the tokens are identical, the
# launch census per MLA layer and step, and the time per step; then the kernel self-check
# against an independent float64 reference. On the GPU when torch sees one, else on the CPU
# with stand-ins for the vLLM kernels the PyPI wheel lacks there. Options: demo/main.py --help.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
exec "$PY" -m demo.main "$@"
