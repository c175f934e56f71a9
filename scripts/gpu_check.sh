#!/usr/bin/env bash
# Everything this project checks on a GPU, in one call (device time is scarce):
#   scripts/gpu_check.sh [tests] [sanitizer] [memcheck] [bench] [quickbench] [epilogue] [hostcost] [ncu] [tune] [ab]
#   (default: tests sanitizer bench)
# Logs and results go under $OUT (default ./gpu_out). Needs torch + triton + pytest; no vLLM.
# AITER's Triton op joins the cross-check test and the benchmark when third_party_aiter/ is
# present (scripts/fetch_aiter_triton.sh unpacks it; carry it to the GPU machine).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
stages=${*:-tests sanitizer bench}
status=0

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env_kernels.txt"

for stage in $stages; do
  case $stage in
  tests)
    echo "== gpu tests"
    python3 -m pytest tests -m "gpu" -q -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 25 || status=1
    ;;
  sanitizer)
    # Core cases under NVIDIA's memory checker (out-of-bounds and misaligned accesses) and race
    # checker (Triton stages layout conversions through shared memory). Everything, Triton's
    # compilations included, runs under the checker, so the selection stays small.
    echo "== compute-sanitizer"
    sel='sanitize_core or 2_to_the_31 or cuda_graph or out_of_range_slots'
    for tool in memcheck racecheck; do
      timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 --target-processes all \
        python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -k "$sel" 2>&1 | tee "$OUT/sanitizer_$tool.log" | tail -n 6 || status=1
    done
    ;;
  memcheck)
    # compute-sanitizer memcheck of a chosen selection of test_gpu.py (SANITIZE_SELECTION).
    echo "== compute-sanitizer memcheck: ${SANITIZE_SELECTION:-sanitize_core}"
    compute-sanitizer --tool memcheck --error-exitcode 9 --target-processes all \
      python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -k "${SANITIZE_SELECTION:-sanitize_core}" 2>&1 \
      | tee "$OUT/sanitizer_memcheck.log" | tail -n 6 || status=1
    ;;
  bench | quickbench)
    echo "== benchmark"
    mkdir -p "$OUT/bench"
    extra=""; [ "$stage" = quickbench ] && extra="--quick"
    python3 -m benchmarks.kernels.bench_mla_rope_cache --out "$OUT/bench" $extra 2>&1 | tee "$OUT/bench.log" | tail -n 80 || status=1
    ;;
  epilogue)
    # Issue 10's sections only (the epilogue, the decode-layer figures and the op 1/op 2 shapes
    # its targets name), with vLLM's kernels as peers when vLLM is importable.
    echo "== benchmark: epilogue"
    mkdir -p "$OUT/epilogue"
    python3 -m benchmarks.kernels.bench_mla_rope_cache --out "$OUT/epilogue" --sections epilogue sweep --quick \
      --tokens 1 16 64 256 1024 4096 16384 --time-budget-s "${BENCH_BUDGET_S:-240}" 2>&1 \
      | tee "$OUT/epilogue.log" | tail -n 60 || status=1
    ;;
  hostcost)
    echo "== host time per call"
    python3 -m benchmarks.kernels.host_overhead --out "$OUT" 2>&1 | tee "$OUT/host_overhead.log" || status=1
    ;;
  ncu)
    # Hardware counters of the kernel at the shapes whose efficiency targets are missed
    # (docs/performance.md, "What bounds it"); clocks left alone, as the device notes ask.
    echo "== ncu: benchmarks/kernels/ncu_shapes.py"
    python3 -m benchmarks.kernels.ncu_shapes >/dev/null 2>&1  # compile outside the profiler first
    timeout 240 ncu --clock-control none --target-processes all -k regex:_mla_rope_cache_kernel \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
      --section LaunchStats --section SchedulerStats python3 -m benchmarks.kernels.ncu_shapes >"$OUT/ncu_shapes.txt" 2>&1 || status=1
    grep -E "launch [0-9]+:|_mla_rope_cache_kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Eligible Warps|No Eligible" \
      "$OUT/ncu_shapes.txt" | head -n 120
    ;;
  tune)
    echo "== launch tuner (issue 10 shapes)"
    python3 -m benchmarks.kernels.tune_launch --focus --grid --out "$OUT" 2>&1 | tee "$OUT/tune.log" | grep -v "^   config" || status=1
    ;;
  ab)
    # Before against after: the package in .baseline/ (carried; made by `mkdir -p .baseline && git archive
    # BASE vllm_mla_fusion | tar -x -C .baseline && git rev-parse BASE >.baseline/COMMIT`) against this
    # checkout's, with this checkout's benchmark, in one process each, alternating twice so that drift
    # shows; each log starts with the package it imported. AB_ARGS: the benchmark's options.
    echo "== benchmark: .baseline ($(cat .baseline/COMMIT 2>/dev/null || echo '?')) against this checkout"
    [ -d .baseline/vllm_mla_fusion ] || { echo "no .baseline/vllm_mla_fusion: carry it"; status=1; continue; }
    mkdir -p "$OUT/ab"
    for run in 1 2; do
      for side in base new; do
        path=$PWD; [ $side = base ] && path=$PWD/.baseline:$PWD
        PYTHONPATH=$path python3 -P -c "import vllm_mla_fusion as m; print('package:', m.__file__)" \
          >"$OUT/ab/${side}_$run.log" 2>&1
        # shellcheck disable=SC2086 # AB_ARGS is a list of options
        PYTHONPATH=$path python3 -P -m benchmarks.kernels.bench_mla_rope_cache --out "$OUT/ab/${side}_$run" --no-plot \
          ${AB_ARGS:---sections sweep epilogue --quick --impls triton --tokens 1 16 64 256 1024 4096 16384} \
          >>"$OUT/ab/${side}_$run.log" 2>&1 || status=1
        echo "$side $run: $(grep -c ' ours ' "$OUT/ab/${side}_$run.log") rows, $(grep -v '^Legend' "$OUT/ab/${side}_$run.log" | grep -c '!\|ERR') failed"
      done
    done
    ;;
  *) echo "unknown stage $stage"; status=2 ;;
  esac
done
exit $status
