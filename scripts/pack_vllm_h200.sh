#!/usr/bin/env bash
# Packs vLLM 0.33.0 + torch 2.14.0 + Triton 3.8.0 (+ deps) for the lent GPU machine, which reaches no
# package index: the shared pack script (../shared/tools/pack-vllm-for-h200.sh, 22 pieces of 60 MiB, re-split here into 46 MiB ones,
# ~1.3 GiB) writes into .vllm-h200/ in this checkout (git-ignored). Run on the CPU machine:
#   scripts/pack_vllm_h200.sh            pack (skipped when .vllm-h200/parts.sha256 already checks out)
#   scripts/pack_vllm_h200.sh --list     print the device calls that carry the pieces, and the install call
# docs/vllm.md ("GPU tests") has the whole sequence.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.vllm-h200
PACK=${PACK_SCRIPT:-$(cd .. && pwd)/shared/tools/pack-vllm-for-h200.sh}

list() {
  local n=0
  compgen -G "$DEST/parts/p[0-9][0-9]" >/dev/null || { echo "no pieces in $DEST/parts: run without --list first"; return 1; }
  for p in "$DEST"/parts/p[0-9][0-9]; do
    echo "carry [\"$p\"]   command: mkdir -p /tmp/acc && cp $p /tmp/acc/"
    n=$((n + 1))
  done
  echo "then, in the next call: carry [\"$DEST/parts.sha256\"]   command: scripts/gpu_vllm_check.sh install env tests"
  echo "($n pieces, $(du -sh "$DEST/parts" | cut -f1))"
}

if [ "${1:-}" = "--list" ]; then
  list
  exit 0
fi
if [ -f "$DEST/parts.sha256" ] && (cd "$DEST/parts" && sha256sum -c ../parts.sha256 --quiet 2>/dev/null); then
  echo "$DEST: pieces present and checked; nothing to do"
else
  [ -x "$PACK" ] || [ -f "$PACK" ] || { echo "pack script not found: $PACK (set PACK_SCRIPT)"; exit 1; }
  git check-ignore -q "$DEST/" || { echo "$DEST is not git-ignored; refusing to fill it"; exit 1; }
  bash "$PACK" "$DEST"
fi
# One device call carries at most 64 MiB, the checkout's tracked files included (~14 MiB and
# growing): re-split the shared tool's 60 MiB pieces into PIECE_MIB ones (same bytes, in order).
PIECE_MIB=${PIECE_MIB:-46}
first=$(ls "$DEST"/parts/p[0-9][0-9] | head -1)
if [ "$(stat -c %s "$first")" -gt $((PIECE_MIB * 1048576)) ]; then
  tmp=$DEST/parts.resplit
  rm -rf "$tmp" && mkdir -p "$tmp"
  cat "$DEST"/parts/p[0-9][0-9] | split -b "${PIECE_MIB}M" -d -a 2 - "$tmp/p"
  rm -rf "$DEST/parts" && mv "$tmp" "$DEST/parts"
  (cd "$DEST/parts" && sha256sum p[0-9][0-9]) >"$DEST/parts.sha256"
  echo "$DEST: re-split into $(ls "$DEST"/parts | wc -l) pieces of ${PIECE_MIB} MiB"
fi
list
