#!/usr/bin/env bash
# One lease of the GPU machine, planned as a few long calls (device time is the scarce thing).
# Each call is one of:
#   scripts/gpu_session.sh first    vLLM's install in the background while the kernel's GPU tests run
#                                   on the image's torch 2.11 / Triton 3.6; then the GPU integration
#                                   tests inside vLLM (torch 2.14 / Triton 3.8)
#   scripts/gpu_session.sh host     the same install while the kernel's GPU tests run; then the
#                                   host cost per call on torch 2.14 / Triton 3.8 (no vLLM tests)
#   scripts/gpu_session.sh install  only the install while the kernel's GPU tests run (e2e calls follow)
#   scripts/gpu_session.sh hostpath host time per call, this checkout against .baseline/ (an older
#                                   commit's package), then the GPU tests inside vLLM
#   scripts/gpu_session.sh e2e      the end-to-end benchmark, bf16 KV cache (gpu_vllm_check.sh e2e1)
#   scripts/gpu_session.sh e2e-fp8  the same with the fp8 KV cache (gpu_vllm_check.sh e2e2)
#   scripts/gpu_session.sh e2e-x    a part of one's own ($E2E_TAG, $E2E_ARGS: gpu_vllm_check.sh e2ex)
#   scripts/gpu_session.sh e2e-ttft three engines per side with host timers (gpu_vllm_check.sh ttft)
#   scripts/gpu_session.sh e2e-insitu  issue 20's pooled in-situ run, mixed steps included ($INSITU_KV:
#                                   gpu_vllm_check.sh insitu)
#   scripts/gpu_session.sh k3       issue 41's table in one call: the install beside the kernel's GPU tests,
#                                   then on torch 2.14 / Triton 3.8 with vLLM's Kimi-K3 ops as peers: op 2
#                                   (bf16, fp8) and op 3, T 1-16384, H 16 and 128, each as the public ops and
#                                   as the plugin's layers launch ours
#   scripts/gpu_session.sh kernels  compute-sanitizer memcheck of the new cases; the kernel benchmark's
#                                   epilogue section and the op 1 / op 2 shapes of issue 10 with vLLM's
#                                   kernels (K3 included) as peers; the host-cost probe; the launch
#                                   tuner on issue 10's shapes; on torch 2.14 / Triton 3.8
# The carried vLLM pieces must be in /tmp/acc before "first" (scripts/pack_vllm_h200.sh --list).
# Everything lands under $OUT; each call stays inside ${TOTAL_S:-585} seconds.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
TOTAL_S=${TOTAL_S:-585}
SITE_DIR=${SITE_DIR:-/tmp/site}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
left() { echo $((TOTAL_S - SECONDS)); }
status=0

# vLLM's install in the background while the kernel's GPU tests run on the image's own
# torch 2.11 / Triton 3.6 (no PYTHONPATH to the carried stack); the install keeps the CPUs busy.
install_during_kernel_tests() {
  TOTAL_S=$(left) scripts/gpu_vllm_check.sh install >"$OUT/install_stage.log" 2>&1 &
  local install_pid=$!
  timeout "${KERNEL_TESTS_S:-$1}" scripts/gpu_check.sh tests || status=1
  wait "$install_pid" || { echo "install failed:"; tail -n 20 "$OUT/install_stage.log"; exit 1; }
  tail -n 3 "$OUT/install_stage.log"
}

case ${1:-} in
first)
  install_during_kernel_tests 210
  TOTAL_S=$(left) scripts/gpu_vllm_check.sh env tests || status=1
  ;;
host)
  # A lease where only the host path changed: then the host cost per call on the carried
  # torch 2.14 / Triton 3.8 (the e2e calls follow).
  install_during_kernel_tests 240
  PYTHONPATH=$SITE_DIR timeout 60 scripts/gpu_check.sh hostcost || status=1
  ;;
install)
  install_during_kernel_tests 240
  ;;
hostpath)
  # The host path on torch 2.14 / Triton 3.8: host time per call of this checkout and of an older
  # commit's package carried in .baseline/ (git archive of vllm_mla_fusion/, benchmarks/__init__.py
  # and benchmarks/kernels/; for a commit before benchmarks/ became a package, of vllm_mla_fusion/
  # and benchmarks/host_overhead.py), alternating twice so that host-speed drift shows; then the
  # GPU tests inside vLLM. Each side runs from its own root, so that it imports its own package.
  out_abs=$(cd "$OUT" && pwd)
  for round in 1 2; do
    for side in new old; do
      root=.
      [ "$side" = old ] && root=.baseline
      if [ -f "$root/benchmarks/kernels/host_overhead.py" ]; then
        cmd=(python3 -m benchmarks.kernels.host_overhead)
      elif [ -f "$root/benchmarks/host_overhead.py" ]; then
        cmd=(python3 benchmarks/host_overhead.py)  # the layout before benchmarks/ became a package
      else
        continue
      fi
      (cd "$root" && PYTHONPATH=$SITE_DIR timeout 90 "${cmd[@]}" --out "$out_abs/host_${side}_$round") \
        >"$OUT/host_${side}_$round.log" 2>&1 || status=1
      tail -n 22 "$OUT/host_${side}_$round.log"
    done
  done
  TOTAL_S=$(left) scripts/gpu_vllm_check.sh env tests || status=1
  ;;
e2e | e2e-fp8 | e2e-x | e2e-ttft | e2e-insitu)
  # Each is one stage of gpu_vllm_check.sh, given the time this call has left.
  declare -A stage=([e2e]=e2e1 [e2e-fp8]=e2e2 [e2e-x]=e2ex [e2e-ttft]=ttft [e2e-insitu]=insitu)
  TOTAL_S=$(left) scripts/gpu_vllm_check.sh "${stage[$1]}" || status=1
  ;;
k3)
  install_during_kernel_tests 200
  # Op 2 against K3's decode ops first (a budget cut drops what runs last), then op 3 against K3's
  # epilogue; each section as the public ops launch ours, then as the plugin's layers do
  # (--plugin-launches: the early-index-loads promise, what a vLLM user runs); vLLM importable
  # for the peers. Each run takes ~20-30 s on an H100.
  k3_bench() {  # NAME SECONDS, then the benchmark's options
    local name=$1 budget=$2
    shift 2
    [ "$budget" -ge 20 ] || { echo "== $name: skipped, ${budget} s left"; status=1; return; }
    mkdir -p "$OUT/$name"
    PYTHONPATH=$SITE_DIR:$PWD timeout $((budget + 20)) python3 -m benchmarks.kernels.bench_mla_rope_cache \
      --out "$OUT/$name" --no-plot --quick --tokens 1 16 64 256 1024 4096 16384 --time-budget-s "$budget" "$@" \
      >"$OUT/$name.log" 2>&1 || status=1
    tail -n 45 "$OUT/$name.log"
  }
  k3_bench k3_decode $(( $(left) / 4 - 10 )) --sections sweep --ops decode --impls triton vllm_k3
  k3_bench k3_decode_plugin $(( $(left) / 3 - 10 )) --sections sweep --ops decode --impls triton vllm_k3 --plugin-launches
  k3_bench k3_epilogue $(( $(left) / 2 - 10 )) --sections epilogue
  k3_bench k3_epilogue_plugin $(( $(left) - 45 )) --sections epilogue --plugin-launches
  ;;
kernels)
  export PYTHONPATH=$SITE_DIR
  SANITIZE_SELECTION=${SANITIZE_SELECTION:-"sanitize_core or out_of_range_slots"} \
    timeout 110 scripts/gpu_check.sh memcheck || status=1
  BENCH_BUDGET_S=${BENCH_BUDGET_S:-220} timeout 300 scripts/gpu_check.sh epilogue || status=1
  timeout 40 scripts/gpu_check.sh hostcost || status=1
  timeout $(( $(left) - 25 )) scripts/gpu_check.sh tune || status=1
  ;;
*)
  echo "usage: scripts/gpu_session.sh first|host|install|hostpath|e2e|e2e-fp8|e2e-x|e2e-ttft|e2e-insitu|k3|kernels"
  exit 2 ;;
esac
echo "==== gpu_session $1: ${SECONDS}s, status $status"
# At most 8 files come back from a call: everything goes into one archive (results, logs,
# plots, the stages' own archives such as inductor_code_TAG.tgz); only an earlier call's
# session_*.tgz stays out.
(cd "$OUT" && find . -type f ! -name "session_*.tgz" | sed 's|^\./||' | sort >files.txt \
  && tar -czf "session_$1.tgz" -T files.txt && find . -mindepth 1 ! -name "session_$1.tgz" -delete)
ls -la "$OUT"
exit $status
