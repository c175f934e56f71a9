#!/usr/bin/env bash
# The wheels `vllm serve` (the OpenAI API server) and the lead's profiling need on the GPU machine beyond
# the carried vLLM stack (../shared/tools/pack-vllm-for-h200.sh) and the machine's image: cp312 manylinux
# wheels into .whl/ (git-ignored), ~4 MiB. Carried as `.whl` in the run call; scripts/gpu_serving.sh
# installs them into /tmp/site.
#   scripts/pack_serving_wheels.sh [DEST]     DEST defaults to .whl
# Then every wheel's Requires-Dist (outside extras) is checked against this set, the vLLM pack and the
# image (PROVIDED below); the script fails on anything missing.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
mkdir -p "$DEST"
# Versions as in the CPU test environment's vLLM 0.33.0 install (requirements-test.txt resolved).
SERVE_WHEELS=(
  uvicorn==0.54.0                              # the API server's ASGI server
  orjson==3.13.0                               # its JSON responses
  watchfiles==1.3.0                            # uvicorn's reload support, imported by vLLM's launcher
  prometheus-fastapi-instrumentator==8.1.0     # /metrics
  model-hosting-container-standards==0.1.16    # vLLM's SageMaker routes, imported by the API server
  jmespath==1.1.0                              # model-hosting-container-standards
  supervisor==4.3.0                            # model-hosting-container-standards
)
PROFILING_WHEELS=(py-spy==0.4.3)               # sampling profiler for the lead (a manylinux binary)
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d "$DEST" "${SERVE_WHEELS[@]}" "${PROFILING_WHEELS[@]}"

# Requirements met elsewhere: the GPU image (/work/.library/device/KINDS.md's package list) has click,
# h11, anyio, prometheus-client, httpx, setuptools, typing-extensions; the vLLM pack carries starlette,
# fastapi and pydantic.
PROVIDED="click h11 anyio prometheus-client httpx setuptools typing-extensions starlette fastapi pydantic"
python3 - "$DEST" "$PROVIDED" <<'EOF'
import re, sys, zipfile
from pathlib import Path

dest, provided = Path(sys.argv[1]), set(sys.argv[2].split())
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
wheels = sorted(dest.glob("*.whl"))
have = {norm(w.name.split("-")[0]) for w in wheels} | {norm(p) for p in provided}
missing = []
for w in wheels:
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        reqs = [l.split(":", 1)[1].strip() for l in z.read(meta).decode().splitlines() if l.startswith("Requires-Dist:")]
    needed = [r for r in reqs if "extra ==" not in r and "python_version < '3.1" not in r]
    names = [norm(re.split(r"[ ;<>=!~(\[]", r, maxsplit=1)[0]) for r in needed]
    print(f"{w.name}: {', '.join(names) or 'no requirements'}")
    missing += [f"{w.name} needs {n}" for n in names if n not in have]
if missing:
    sys.exit("missing on the GPU machine:\n  " + "\n  ".join(missing))
print(f"{len(wheels)} wheels, every requirement met")
EOF
du -sh "$DEST"
