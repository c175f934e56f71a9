#!/usr/bin/env bash
# The main job: a self-check of every backend this machine runs (torch everywhere; Triton on a
# GPU, or in Triton's interpreter on a CPU-only machine) at DeepSeek-V3 shapes, against the
# reference, with a small timing table.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  export TRITON_INTERPRET=1
fi
exec "$PY" -m vllm_mla_fusion.selfcheck "$@"
