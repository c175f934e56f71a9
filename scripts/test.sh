#!/usr/bin/env bash
# The test suite, as CI runs it: CPU tests (the Triton kernel in Triton's interpreter), the
# vLLM 0.33.0 plugin tests (VLLM_TARGET_DEVICE=cpu), the demo's pieces and, on a machine with a
# GPU, the gpu tests. No marker is deselected: the slow tests (the `vllm serve` end-to-end test,
# a few minutes) run too, in CI as well. Extra arguments go to pytest (e.g. scripts/test.sh -k
# decode, or -m "not slow" for a quicker local run).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
export VLLM_TARGET_DEVICE=${VLLM_TARGET_DEVICE:-cpu} HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
set +e
"$PY" -m pytest tests -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating that as a failure" >&2
  exit 1
fi
exit "$rc"
