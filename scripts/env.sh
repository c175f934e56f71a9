# Sourced by scripts/test.sh and scripts/demo.sh: create (or reuse) the Python environment.
#
# The environment lives outside the checkout, keyed by the Python version and the pinned
# requirements, so CI and fresh clones reuse it when nothing changed (a first install of
# vLLM 0.33.0 and torch 2.14.0 takes ~10 minutes and ~9.4 GB). Override the location with
# VLLM_MLA_FUSION_ENV. The checkout itself is (re)installed editable each time: a few seconds,
# and it registers the vllm.general_plugins entry point of *this* checkout.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-python3}
key=$("$py" -c 'import sys; print("py%d%d" % sys.version_info[:2])')-$(cat "$repo/requirements-test.txt" | sha256sum | cut -c1-12)
env_dir=${VLLM_MLA_FUSION_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-mla-fusion/env-$key}
if [ ! -f "$env_dir/.complete" ]; then
  echo "[env] creating $env_dir (first run: ~10 minutes)" >&2
  rm -rf "$env_dir"
  mkdir -p "$(dirname "$env_dir")"
  "$py" -m venv "$env_dir"
  "$env_dir/bin/python" -m pip install -q --upgrade pip >&2
  "$env_dir/bin/python" -m pip install -q -r "$repo/requirements-test.txt" >&2
  touch "$env_dir/.complete"
else
  echo "[env] reusing $env_dir" >&2
fi
log=$(mktemp)
if ! "$env_dir/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$repo" >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
rm -f "$log"
PY="$env_dir/bin/python"
export PY
