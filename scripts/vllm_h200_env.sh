# Sourced by scripts/gpu_vllm_check.sh and scripts/gpu_serving.sh: the environment that runs the carried
# vLLM 0.33 stack from $SITE_DIR with this checkout's plugin (../shared/notes/vllm-on-h200.md).
# Needs REPO, SITE_DIR and EP_DIR set.
setup_vllm_env() {
  export PYTHONPATH=$SITE_DIR:$EP_DIR:$REPO PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
  # vLLM's V2 model runner imports flashinfer for its sampler unless told not to; it is not carried.
  export VLLM_USE_FLASHINFER_SAMPLER=0
  unset TRITON_INTERPRET VLLM_TARGET_DEVICE VLLM_MLA_FUSION VLLM_MLA_FUSION_DECODE VLLM_MLA_FUSION_BACKEND VLLM_PLUGINS
  # The checkout is on PYTHONPATH, not pip-installed: its entry point needs a dist-info there.
  local version dist
  version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO/pyproject.toml" | head -1)
  dist=$EP_DIR/vllm_mla_fusion-${version}.dist-info
  rm -rf "$EP_DIR" && mkdir -p "$dist"
  printf 'Metadata-Version: 2.1\nName: vllm-mla-fusion\nVersion: %s\n' "$version" >"$dist/METADATA"
  printf '[vllm.general_plugins]\nmla_fusion = vllm_mla_fusion.vllm_plugin:register\n' >"$dist/entry_points.txt"
  printf 'vllm_mla_fusion\n' >"$dist/top_level.txt"
}
