#!/usr/bin/env bash
# DeepSeek-V3 as deployed (issue 24): the whole model at tensor-parallel size 8 on the 8-GPU machine
# (kind nvidia-h200-x8), `vllm serve --load-format dummy`, plugin on and off (VLLM_MLA_FUSION=0), in one
# lease (benchmarks/serving/README.md, "DeepSeek-V3 at TP8"). Each device call is one of:
#   scripts/gpu_tp8.sh plan     on this machine: the lease's calls (carry list, command, estimate), in order
#   scripts/gpu_tp8.sh install  vLLM 0.33 from the carried pieces in /tmp/acc into $SITE_DIR (one install for
#                               all eight GPUs: ranks are processes of one host), then the versions and GPUs
#   scripts/gpu_tp8.sh serve    one server per call, resumed: the 1st call `on`, the 2nd `off` (their order
#                               in benchmarks/serving/sides.py), each `python -m benchmarks.serving --model full
#                               --tensor-parallel-size 8 --probe`: every rank's plugin line, the probe
#                               (redrawn weights, greedy tokens and logprobs, rank 0's decode-step GPU
#                               time), then the loads that fit; the 2nd call's report compares the sides
# Settings (environment): TP8_ARGS more options of the benchmark (e.g. "--layers 20" when 61 layers do not
# start within a call; "--dry-run"), TOTAL_S (serve: default 450, so that both serve calls and the
# install fit a 30-minute lease), SERVING_SIDES, SERVING_FRESH, SERVING_WORK as scripts/gpu_serving.sh.
set -u -o pipefail
cd "$(dirname "$0")/.."
PACK_DIR=${PACK_DIR:-.vllm-h200}  # as carried: paths relative to the checkout
WHL_DIR=${WHL_DIR:-.whl}
GPUS=8
# The benchmark's options for this issue; loads beyond the probe: what is left of the call after a cold start.
TP8_SERVING_ARGS="--model full --tensor-parallel-size $GPUS --probe --servers-per-side 1 --loads warmup rate4 saturate"
SERVE_TOTAL_S=450
# Estimates (seconds of device time) for the plan; guesses until the first lease measures them.
PIECE_CALL_S=15
INSTALL_CALL_S=300

need_gpus() {
  local n
  n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  if [ "$n" -ne "$GPUS" ]; then
    echo "this machine has $n GPUs, not $GPUS: run on the kind nvidia-h200-x8"; exit 2
  fi
}

plan() {
  local pieces
  pieces=$(compgen -G "$PACK_DIR/parts/p[0-9][0-9]" | sort)
  [ -n "$pieces" ] || { echo "no pieces in $PACK_DIR/parts: run scripts/pack_vllm_h200.sh first"; return 1; }
  [ -f "$PACK_DIR/parts.sha256" ] || { echo "no $PACK_DIR/parts.sha256: run scripts/pack_vllm_h200.sh"; return 1; }
  [ -n "$(compgen -G "$WHL_DIR/*.whl")" ] || { echo "no wheels in $WHL_DIR: run scripts/pack_serving_wheels.sh first"; return 1; }
  local n total=0 call=0
  n=$(echo "$pieces" | wc -l)
  echo "0. status: kind nvidia-h200-x8 lent, budget_left_s >= 1800, no machine held"
  for p in $pieces; do
    call=$((call + 1))
    echo "$call. kind nvidia-h200-x8, timeout_s 120, carry [\"$p\"], command: mkdir -p /tmp/acc && cp $p /tmp/acc/   (~${PIECE_CALL_S} s)"
  done
  total=$((n * PIECE_CALL_S))
  call=$((call + 1))
  echo "$call. timeout_s 600, carry [\"$PACK_DIR/parts.sha256\"], command: scripts/gpu_tp8.sh install   (~${INSTALL_CALL_S} s)"
  total=$((total + INSTALL_CALL_S))
  for side in on off; do
    call=$((call + 1))
    echo "$call. timeout_s 600, carry [\"$WHL_DIR\"], command: scripts/gpu_tp8.sh serve   (server '$side', <= ${SERVE_TOTAL_S} s)"
    total=$((total + SERVE_TOTAL_S))
  done
  echo "then give_back; the report is in the last call's serving_call_*.tgz"
  echo "$call calls, ~$((total / 60)) min of device time at most (the machine's start comes on top)"
}

case ${1:-} in
plan)
  plan
  ;;
install)
  need_gpus
  scripts/gpu_vllm_check.sh install env
  status=$?
  nvidia-smi topo -m 2>&1 | head -n 12  # NVLink between the eight: what the all-reduces run over
  exit $status
  ;;
serve)
  need_gpus
  # gpu_serving.sh installs the carried wheels once, sets up the environment, keeps the deadline and
  # leaves one archive; the run in $SERVING_WORK continues from the call before (same configuration).
  SERVING_ARGS="$TP8_SERVING_ARGS ${TP8_ARGS:-}" TOTAL_S=${TOTAL_S:-$SERVE_TOTAL_S} exec scripts/gpu_serving.sh
  ;;
*)
  echo "usage: scripts/gpu_tp8.sh plan|install|serve"
  exit 2
  ;;
esac
