#!/usr/bin/env bash
# The serving benchmark on the H200 (issue 21): `vllm bench serve` against `vllm serve`, plugin on and off,
# in one device call (benchmarks/serving/README.md).
#   scripts/gpu_serving.sh        one call: continues the run kept in $SERVING_WORK (same machine, same
#                                 configuration), else starts one; as many servers as fit $TOTAL_S
# Runs after `scripts/gpu_session.sh install` (vLLM 0.33 in $SITE_DIR) on the same machine. Carry `.whl`
# (scripts/pack_serving_wheels.sh: uvicorn & co. for the API server, py-spy); this script installs them
# into $SITE_DIR once. Settings (environment):
#   SERVING_ARGS   more options of python -m benchmarks.serving (default: the dense stand-in, its loads)
#                  e.g. "--model fp8-moe --layers 20", "--servers-per-side 3", "--prompts-scale 0.5",
#                  "--interleave 4" (every side's server up at once, the loads in turns: one call)
#   SERVING_SIDES  default "on off"; a baseline checkout: "on off on@.baseline" with .baseline carried, made by
#                  mkdir -p .baseline && git archive BASE vllm_mla_fusion | tar -x -C .baseline &&
#                  git rev-parse BASE >.baseline/COMMIT
#   SERVING_FRESH=1  start a new run instead of continuing (the compile caches stay)
#   SERVING_WORK   models, compile caches, runs (default /tmp/serving_work: kept while the machine is; each
#                  configuration is a run of its own there, so a dense and an fp8-moe run both continue)
#   TOTAL_S        seconds for the whole call (default 585: a device call runs at most 600)
# Everything lands in one archive under $OUT (at most 8 files come back from a call).
set -u -o pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/gpu_out}
TOTAL_S=${TOTAL_S:-585}
SITE_DIR=${SITE_DIR:-/tmp/site}
EP_DIR=${EP_DIR:-/tmp/mla_fusion_ep}
WHL_DIR=${WHL_DIR:-$REPO/.whl}
SERVING_WORK=${SERVING_WORK:-/tmp/serving_work}
mkdir -p "$OUT/serving"
note() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*"; }
left() { echo $((TOTAL_S - SECONDS)); }
status=0

if [ ! -f "$SITE_DIR/.mla_fusion_install_complete" ]; then
  echo "no vLLM in $SITE_DIR: run scripts/gpu_session.sh install first (same machine)"; exit 1
fi

# The API server's wheels, once per machine: the marker holds the list installed.
wheels=$(cd "$WHL_DIR" 2>/dev/null && ls ./*.whl 2>/dev/null | sort)
if [ -z "$wheels" ]; then
  echo "no wheels in $WHL_DIR: carry .whl (scripts/pack_serving_wheels.sh)"; exit 1
fi
if [ "$(cat "$SITE_DIR/.serving_wheels" 2>/dev/null)" != "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE_DIR" "$WHL_DIR"/*.whl \
    >"$OUT/serving/wheels_install.log" 2>&1 || { tail -n 20 "$OUT/serving/wheels_install.log"; exit 1; }
  echo "$wheels" >"$SITE_DIR/.serving_wheels"
  note "installed $(echo "$wheels" | wc -l) wheels into $SITE_DIR"
else
  note "serving wheels already in $SITE_DIR"
fi

# shellcheck source=scripts/vllm_h200_env.sh
source "$REPO/scripts/vllm_h200_env.sh"
setup_vllm_env
# pip --target installs no scripts: py-spy (pyspy loads) is unpacked from its wheel.
python3 -m benchmarks.serving.host_samples unpack "$WHL_DIR" "$SITE_DIR/bin" >/dev/null \
  || note "py-spy not unpacked: pyspy loads will sample nothing"
export PATH=$SITE_DIR/bin:$PATH

resume=(--resume)
# --interleave runs every side's server within one call: nothing to continue.
[ "${SERVING_FRESH:-0}" = 1 ] || [[ " ${SERVING_ARGS:-} " == *" --interleave"[=\ ]* ]] && resume=()
# The benchmark keeps its own deadline (plans servers and loads inside it, writes a partial report when
# late); the timeout is the backstop, and the archive below needs the last seconds.
budget=$(( $(left) - 20 ))
note "serving benchmark: budget ${budget}s, sides ${SERVING_SIDES:-on off}, args: ${SERVING_ARGS:-(defaults)}"
# shellcheck disable=SC2086 # SERVING_SIDES and SERVING_ARGS are lists of words
timeout -k 10 $((budget + 10)) python3 -m benchmarks.serving --out "$OUT/serving" --work-dir "$SERVING_WORK" \
  --budget-s "$budget" "${resume[@]}" --sides ${SERVING_SIDES:-on off} ${SERVING_ARGS:-} \
  >"$OUT/serving/serving.log" 2>&1 || status=$?
grep -E "^\[[0-9:]+\] " "$OUT/serving/serving.log" | tail -n 40
sed -n '/^# Serving benchmark/,$p' "$OUT/serving/serving.log" | head -n 120
[ "$status" = 0 ] || tail -n 30 "$OUT/serving/serving.log"
note "serving benchmark: exit $status"

(cd "$OUT" && find . -type f ! -name "serving_call_*.tgz" | sed 's|^\./||' | sort >files.txt \
  && tar -czf "serving_call_$(date +%H%M%S).tgz" -T files.txt && find . -mindepth 1 ! -name "serving_call_*.tgz" -delete)
ls -la "$OUT"
exit $status
