#!/usr/bin/env bash
# Unpack AMD AITER's Triton MLA op (fused_qk_rope_cat_and_cache_mla) for the
# GPU cross-check test and the benchmark. Nothing of AITER is committed: the
# files land in <repo>/third_party_aiter/ (git-ignored) or in the folder given
# as the first argument, and the project finds them only through
# VLLM_MLA_FUSION_AITER_TRITON_PATH or that default folder
# (benchmarks/kernels/aiter_triton_peer.py).
#
# Source: the amd-aiter wheel on PyPI. It is old (0.1.7, Nov 2025: the Triton
# op returns (q_out, decode_q_pe_out, k_pe_out, kv_cache), no upcast_operand),
# but it is the only published build and its aiter/ops/triton/ is plain Python.
# Only the op's import closure is kept (8 files, ~110 kB) plus AITER's MIT
# license, with empty aiter/__init__.py and aiter/ops/__init__.py so that
# importing it needs neither ROCm nor AITER's C++ build.
#
# Usage: scripts/fetch_aiter_triton.sh [DEST]      (PYTHON=... picks the pip to use)
set -euo pipefail

VERSION=0.1.7.post2.dev18
# sha256 of amd_aiter-0.1.7.post2.dev18-py3-none-any.whl as published on PyPI.
SHA256=fe139d74438217c35e87e3b961166bac8db2d381eadccb371da2e63615f05a31
# The import closure of aiter.ops.triton.fused_kv_cache in that wheel
# (aiter/ops/triton/_triton_kernels is a namespace package there).
FILES=(
  aiter/ops/triton/__init__.py
  aiter/ops/triton/fused_kv_cache.py
  aiter/ops/triton/quant.py
  aiter/ops/triton/rope.py
  aiter/ops/triton/utils/__init__.py
  aiter/ops/triton/utils/logger.py
  aiter/ops/triton/_triton_kernels/fused_kv_cache.py
  aiter/ops/triton/_triton_kernels/quant.py
  aiter/ops/triton/_triton_kernels/rope.py
)

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=${1:-$repo/third_party_aiter}
python=${PYTHON:-}
if [[ -z $python ]]; then
  for candidate in "$repo/.venv/bin/python" python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -m pip --version >/dev/null 2>&1; then
      python=$candidate
      break
    fi
  done
fi
[[ -n $python ]] || { echo "fetch_aiter_triton: no python with pip found; set PYTHON=..." >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$python" -m pip download "amd-aiter==$VERSION" --no-deps --only-binary=:all: -d "$tmp" --quiet
whl=$(ls "$tmp"/amd_aiter-"$VERSION"-*.whl)
echo "$SHA256  $whl" | sha256sum --check --quiet -

stage=$tmp/stage
"$python" - "$whl" "$stage" "${FILES[@]}" <<'PY'
import sys
import zipfile
from pathlib import Path

whl, stage, *files = sys.argv[1:]
stage = Path(stage)
with zipfile.ZipFile(whl) as z:
    names = set(z.namelist())
    missing = [f for f in files if f not in names]
    if missing:
        sys.exit(f"fetch_aiter_triton: the wheel lacks {missing}")
    for f in files:
        z.extract(f, stage)
    license_name = next(n for n in names if n.endswith(".dist-info/LICENSE"))
    (stage / "LICENSE.aiter").write_bytes(z.read(license_name))
# Empty package markers: the real ones import AITER's C++ ops and need ROCm.
(stage / "aiter" / "__init__.py").write_text("")
(stage / "aiter" / "ops" / "__init__.py").write_text("")
PY
printf 'amd-aiter==%s\nsha256=%s\n' "$VERSION" "$SHA256" >"$stage/AITER_VERSION"

rm -rf "$dest"
mkdir -p "$(dirname "$dest")"
mv "$stage" "$dest"
echo "AITER $VERSION Triton op unpacked into $dest ($(du -sh "$dest" | cut -f1))"
