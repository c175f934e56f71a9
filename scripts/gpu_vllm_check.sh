#!/usr/bin/env bash
# The plugin inside real vLLM on the lent GPU machine (no vLLM, no network there), issue 13:
#   scripts/gpu_vllm_check.sh STAGE...        stages run in the order given:
#     install   vLLM 0.33.0 + torch 2.14.0 + Triton 3.8.0 (+ deps) from the carried pieces in $ACC_DIR
#               into $SITE_DIR (skipped when a previous call completed it); ~3-4 min
#     tests     GPU integration tests, tests/vllm_plugin_gpu (-m "gpu and vllm"), budget from the time left
#     e2e1      end-to-end benchmark part 1: bf16 KV cache, 2 engines per side alternating on/off
#     e2e2      part 2: fp8 KV cache, 2 per side, then more bf16 pairs while the deadline allows
#     ttft      the 1k-TTFT question: bf16, 3 engines per side alternating, host timers per region
#     insitu    issue 20's in-situ run: up to 4 engines per side, TTFT at 1k/4k/16k, a 1k prompt joining
#               4 decodes (the mixed step's host record), host regions; $INSITU_KV auto (default) or fp8,
#               $INSITU_SUFFIX appended to the tag (a second run of the same lease)
#     e2ex      a part of one's own: tag $E2E_TAG (default partx), benchmark options $E2E_ARGS (default a
#               bf16 pair); variants of the plugin come from the environment (its variables set for
#               the call), and the compile caches in $E2E_WORK from earlier parts make its engines warm
#     env       only set up the environment and print versions
# Logs and results go under $OUT (default ./gpu_out); a short summary is printed last. The whole
# call keeps inside $TOTAL_S seconds (default 585: one device command may run 600).
#
# The pieces come from scripts/pack_vllm_h200.sh on the CPU machine (.vllm-h200/parts/pNN, one per
# device call: mkdir -p /tmp/acc && cp .vllm-h200/parts/pNN /tmp/acc/); the install call must also
# carry .vllm-h200/parts.sha256 (or find it as $ACC_DIR/SHA256SUMS). docs/vllm.md, "GPU tests".
set -u -o pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/gpu_out}
ACC_DIR=${ACC_DIR:-/tmp/acc}
WHL_DIR=${WHL_DIR:-/tmp/whl}
SITE_DIR=${SITE_DIR:-/tmp/site}
EP_DIR=${EP_DIR:-/tmp/mla_fusion_ep}          # holds the plugin's dist-info (entry point) for this checkout
E2E_WORK=${E2E_WORK:-/tmp/e2e_work}           # model dir, compile caches, traces: kept between e2e parts
PACK_DIR=${PACK_DIR:-$REPO/.vllm-h200}
TOTAL_S=${TOTAL_S:-585}
mkdir -p "$OUT"
stages=${*:-env}
status=0
summary=()

left() { echo $((TOTAL_S - SECONDS)); }
note() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*"; }

# shellcheck source=scripts/vllm_h200_env.sh
source "$REPO/scripts/vllm_h200_env.sh"

stage_install() {
  if [ -f "$SITE_DIR/.mla_fusion_install_complete" ]; then
    note "install: $SITE_DIR already complete, skipped"
    return 0
  fi
  local sums=$PACK_DIR/parts.sha256
  [ -f "$sums" ] || sums=$ACC_DIR/SHA256SUMS
  if [ ! -f "$sums" ]; then
    echo "install: no checksum list ($PACK_DIR/parts.sha256 or $ACC_DIR/SHA256SUMS)"; return 1
  fi
  local n_want n_have
  n_want=$(wc -l <"$sums")
  n_have=$(ls "$ACC_DIR" 2>/dev/null | grep -c '^p[0-9][0-9]$')
  note "install: $n_have of $n_want pieces in $ACC_DIR"
  # Only the pieces are checked and joined: a glob like p* would also take parts.sha256.
  (cd "$ACC_DIR" && sha256sum -c "$sums" --quiet) || { echo "install: checksum mismatch or missing piece"; return 1; }
  rm -rf "$WHL_DIR" && mkdir -p "$WHL_DIR"
  cat "$ACC_DIR"/p[0-9][0-9] | tar -x -C "$WHL_DIR" || { echo "install: tar failed"; return 1; }
  note "install: $(ls "$WHL_DIR"/*.whl | wc -l) wheels unpacked; pip install --target $SITE_DIR"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE_DIR" "$WHL_DIR"/*.whl \
    >"$OUT/install.log" 2>&1 || { tail -n 30 "$OUT/install.log"; return 1; }
  rm -rf "$WHL_DIR"
  touch "$SITE_DIR/.mla_fusion_install_complete"
  note "install: done"
}

stage_env() {
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 || true
    python3 - <<'EOF'
import importlib.metadata as md, sys
print("python", sys.version.split()[0])
for name in ("torch", "triton", "vllm", "vllm-mla-fusion"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
import torch  # a few seconds; vLLM itself is not imported here (~20 s)
print("torch", torch.__version__, torch.__file__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
eps = {ep.name: ep.value for ep in md.entry_points(group="vllm.general_plugins")}
print("vllm.general_plugins:", eps)
EOF
  } 2>&1 | tee "$OUT/env.txt"
  grep -q "mla_fusion" "$OUT/env.txt" || { echo "env: the plugin's entry point is not visible"; return 1; }
}

stage_tests() {
  local budget=$(( $(left) - 45 ))
  [ "$budget" -gt 360 ] && budget=360
  if [ "$budget" -lt 120 ]; then echo "tests: only ${budget}s left, not starting"; return 1; fi
  note "tests: budget ${budget}s"
  MLA_FUSION_GPU_OUT=$OUT MLA_FUSION_GPU_BUDGET_S=$budget \
    timeout -k 10 $((budget + 30)) python3 -m pytest tests/vllm_plugin_gpu -m "gpu and vllm" -v -rA \
      -p no:cacheprovider --junitxml="$OUT/vllm_gpu_tests.xml" >"$OUT/vllm_gpu_tests.log" 2>&1
  local rc=$?
  # The report holds every reading; printed here: what failed or could not be read, and the counts.
  if [ -f "$OUT/vllm_gpu_report.txt" ]; then
    grep -E "^(worker|==)|\[(FAIL|n/a)\]" "$OUT/vllm_gpu_report.txt" | cut -c1-300 | tail -n 60
    echo "report: $(grep -c '\[ok\]' "$OUT/vllm_gpu_report.txt") readings ok, $(grep -c '\[FAIL\]' "$OUT/vllm_gpu_report.txt") failed"
  fi
  grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/vllm_gpu_tests.log" | cut -c1-250 | tail -n 40
  tail -n 1 "$OUT/vllm_gpu_tests.log"
  summary+=("tests: exit $rc, $(tail -n 1 "$OUT/vllm_gpu_tests.log")")
  return $rc
}

stage_e2e() {
  local tag=$1; shift
  local limit=$(( $(left) - 20 ))
  if [ "$limit" -lt 150 ]; then echo "e2e $tag: only ${limit}s left, not starting"; return 1; fi
  local extra=()
  # For a CPU dry run of this script's logic (E2E_SMOKE=1): same options, the benchmark's smoke mode.
  [ "${E2E_SMOKE:-0}" = 1 ] && extra=(--smoke --inproc)
  note "e2e $tag: limit ${limit}s"
  timeout -k 15 "$limit" python3 -m benchmarks.e2e.bench_vllm_e2e --out "$OUT" --work-dir "$E2E_WORK" --tag "$tag" \
    --deadline-s $((limit - 40)) "$@" ${extra[@]+"${extra[@]}"} >"$OUT/bench_vllm_e2e_$tag.log" 2>&1
  local rc=$?
  grep -E "^\[[0-9:]+\] " "$OUT/bench_vllm_e2e_$tag.log" | tail -n 60
  sed -n '/^==== E2E SUMMARY/,$p' "$OUT/bench_vllm_e2e_$tag.log" | head -n 80
  summary+=("e2e $tag: exit $rc")
  collect_inductor_code "$tag"
  return $rc
}

# Inductor's generated code of every compiled piece, per side: which ops each kernel fuses, when
# the per-kernel table shows a neighbouring kernel changing with the plugin ("Where the decode
# saving goes"). Each side's compile cache is its own (VLLM_CACHE_ROOT per side); the output
# modules are the files that define call(), and *.best_config the configurations Inductor's
# autotuning chose for each kernel.
collect_inductor_code() {
  local files
  files=$(cd "$E2E_WORK" 2>/dev/null && { find . -path "*inductor_cache*" -name "*.py" -size -4M -print0 \
    | xargs -0 -r grep -l "^def call(" 2>/dev/null; find . -path "*inductor_cache*" -name "*.best_config"; })
  if [ -z "$files" ]; then note "inductor code: none under $E2E_WORK"; return 0; fi
  (cd "$E2E_WORK" && echo "$files" | tar -czf "$OUT/inductor_code_$1.tgz" -T -)
  note "inductor code: $(echo "$files" | wc -l) files (output modules, chosen configurations) in inductor_code_$1.tgz"
}

setup_vllm_env
for stage in $stages; do
  case $stage in
  install) stage_install || { status=1; summary+=("install: FAILED"); break; } ;;
  env) stage_env || status=1 ;;
  tests) stage_tests || status=1 ;;
  # --host-regions: TTFT judged at equal host speed too (docs/performance-history.md, "Where the TTFT
  # goes"); its timers run only where Python runs, never inside a CUDA-graph decode step.
  e2e1) stage_e2e part1 --kv-cache-dtypes auto --runs 2 --host-regions || status=1 ;;
  e2e2) stage_e2e part2 --kv-cache-dtypes fp8 --runs "${E2E_RUNS:-2}" --extra-pairs auto --host-regions || status=1 ;;
  # The 1k TTFT question: three engines per side, host timers, prefill and one decode batch only.
  ttft) stage_e2e ttft --kv-cache-dtypes auto --runs 3 --decode-batches 1 --prefill-lens 1024 4096 --repeats 6 \
    --host-regions || status=1 ;;
  # Issue 20's in-situ run: pooled engines (4 per side as far as the call allows), prefills and a
  # prompt joining 4 decodes (a mixed step), host regions; cache dtype $INSITU_KV (auto or fp8).
  # Runs of one lease pool with benchmarks/e2e/e2e_pool.py.
  insitu) stage_e2e "insitu_${INSITU_KV:-auto}${INSITU_SUFFIX:-}" --kv-cache-dtypes "${INSITU_KV:-auto}" --runs 4 \
    --decode-batches 1 16 64 256 --prefill-lens 1024 4096 16384 --mixed-lens 1024 --repeats 6 --host-regions || status=1 ;;
  # shellcheck disable=SC2086 # E2E_ARGS is a list of options
  e2ex) stage_e2e "${E2E_TAG:-partx}" ${E2E_ARGS:---kv-cache-dtypes auto --runs 1} || status=1 ;;
  *) echo "unknown stage $stage (install env tests e2e1 e2e2 e2ex ttft insitu)"; status=2 ;;
  esac
done
echo "==== gpu_vllm_check: ${SECONDS}s, stages: $stages"
for line in ${summary[@]+"${summary[@]}"}; do echo "  $line"; done
ls -la "$OUT"
exit $status
