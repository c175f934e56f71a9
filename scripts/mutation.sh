#!/usr/bin/env bash
# Mutation testing (not part of .ci/run): plants each realistic bug listed in scripts/mutants.py
# into a scratch copy of this checkout, one at a time, runs the CPU tests meant to catch it and
# prints killed/total. Every mutant must be killed. ~8 minutes on a 2-core CPU machine.
#   scripts/mutation.sh [-k SUBSTRING] [--list] [--timeout SECONDS] [--keep] [--no-baseline] [-v]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
exec "$PY" scripts/mutation.py "$@"
