"""Mutation testing: plant each bug of scripts/mutants.py, one at a time, and run the tests meant to catch it.

    python scripts/mutation.py [-k SUBSTRING] [--list] [--timeout SECONDS] [--keep]

Works on a scratch copy of the checkout (tracked and untracked, non-ignored files), so the
checkout itself is never modified, even when interrupted. The copy is imported first
(``PYTHONPATH``, and pytest runs from its root), not the editable install.

1. Baseline: the union of all selected tests must pass on the unmutated copy.
2. Each mutant: its ``original`` must occur exactly once in its file (otherwise the entry is
   reported as an ERROR: the code moved and the entry must be updated, never skipped), and a
   mutated Python file must still compile (an ERROR otherwise: every test would "kill" it); the
   file is rewritten, the mutant's tests run (``-x``, CPU, Triton's interpreter) under a
   per-mutant timeout, and the file restored. A failing run (test failure, error, crash,
   timeout) kills the mutant; a passing run means it SURVIVED: a bug the suite misses.
3. Summary: killed/total; exit status 0 only if every mutant was killed and none errored.

Too slow for .ci/run: 51 mutants at 4-40 s each (the plugin ones import vLLM), plus a
baseline of 6 pytest runs, took ~650 s (~11 minutes; 48 of them 628 s) on a 2-core CPU machine; the time of each
run is printed at the end.
harness-amx-not-hidden runs the AMX-simulated vLLM tests (tests/vllm_plugin/test_amx.py): ~3-4
minutes more, in the baseline and again as a mutant (``-k`` leaves it out or runs it alone).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from mutants import MUTANTS, Mutant  # noqa: E402

NO_TESTS_COLLECTED = 5  # pytest's exit status when a selection matches nothing


def scratch_copy() -> Path:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")  # fmt: skip
    dst = Path(tempfile.mkdtemp(prefix="mla-mutation-"))
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    return dst


def test_env(root: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MLA_FUSION")}
    env.update(
        PYTHONPATH=str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
        # A mutant and its original can have the same size and mtime second: never reuse bytecode.
        PYTHONDONTWRITEBYTECODE="1",
        TRITON_INTERPRET="1",
        VLLM_TARGET_DEVICE="cpu",
        HYPOTHESIS_PROFILE="ci",
    )
    return env


def run_pytest(root: Path, args: list[str], timeout: float) -> tuple[int | str, float, str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args]
    start = time.monotonic()
    try:
        r = subprocess.run(cmd, cwd=root, env=test_env(root), capture_output=True, text=True, timeout=timeout)
        return r.returncode, time.monotonic() - start, (r.stdout + r.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, ""


def baseline_runs(mutants: list[Mutant]) -> list[list[str]]:
    """The mutants' selections merged per set of paths (``-k a`` and ``-k b`` become ``-k '(a) or (b)'``),
    so that the baseline costs a few pytest start-ups instead of one per selection."""
    groups: dict[tuple[str, ...], set[str] | None] = {}
    for m in mutants:
        args = shlex.split(m.tests)
        k = None
        if "-k" in args:
            i = args.index("-k")
            k, args = args[i + 1], args[:i] + args[i + 2 :]
        key = tuple(args)
        if k is None or groups.get(key, set()) is None:
            groups[key] = None  # the whole paths
        else:
            groups.setdefault(key, set()).add(k)
    return [[*paths] + ([] if ks is None else ["-k", " or ".join(f"({k})" for k in sorted(ks))])
            for paths, ks in groups.items()]  # fmt: skip


def check_import_location(root: Path) -> None:
    out = subprocess.run([sys.executable, "-c", "import vllm_mla_fusion; print(vllm_mla_fusion.__file__)"], cwd=root,
                         env=test_env(root), capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    if not Path(out).resolve().is_relative_to(root.resolve()):
        raise SystemExit(f"the scratch copy's package is not the one imported ({out}); mutants would not be seen")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default="", help="run only mutants whose id or file contains this substring")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per mutant run (default 300)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copy")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run (when iterating)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the end of each mutant's test output")
    opts = ap.parse_args()
    mutants: list[Mutant] = [m for m in MUTANTS if opts.k in m.id or opts.k in m.file]
    ids = [m.id for m in MUTANTS]
    dupes = {i for i in ids if ids.count(i) > 1}
    if dupes:
        raise SystemExit(f"duplicate mutant ids: {sorted(dupes)}")
    if opts.list:
        for m in mutants:
            print(f"{m.id:40s} {m.file:45s} {m.why}")
        return 0
    if not mutants:
        raise SystemExit(f"no mutant id or file contains {opts.k!r}")

    t0 = time.monotonic()
    root = scratch_copy()
    print(f"scratch copy: {root}", flush=True)
    try:
        check_import_location(root)
        if not opts.no_baseline:
            # A mutant is only "killed" if its tests pass without it: every selection, unmutated.
            runs = baseline_runs(mutants)
            print(f"baseline: {len(runs)} runs covering every mutant's tests on the unmutated code", flush=True)
            for args in runs:
                rc, secs, out = run_pytest(root, args, 4 * opts.timeout)
                if rc != 0:
                    print(out)
                    raise SystemExit(f"baseline failed (rc={rc}) for: {shlex.join(args)}")
        killed, survived, errors = [], [], []
        for m in mutants:
            path = root / m.file
            text = path.read_text()
            count = text.count(m.original)
            if count != 1:
                errors.append(m)
                print(f"ERROR    {m.id}: the original snippet occurs {count} times in {m.file} (expected once)",
                      flush=True)  # fmt: skip
                continue
            mutated = text.replace(m.original, m.replacement)
            if path.suffix == ".py":
                # A mutant that does not compile is "killed" by every test, whatever it checks.
                try:
                    compile(mutated, m.file, "exec")
                except SyntaxError as e:
                    errors.append(m)
                    print(f"ERROR    {m.id}: the mutated {m.file} does not compile ({e.msg}, line {e.lineno}): "
                          "a mutant plants a bug, not a syntax error", flush=True)  # fmt: skip
                    continue
            path.write_text(mutated)
            try:
                rc, secs, out = run_pytest(root, shlex.split(m.tests), opts.timeout)
            finally:
                path.write_text(text)
            if rc == NO_TESTS_COLLECTED:
                errors.append(m)
                print(f"ERROR    {m.id}: its test selection collected nothing: {m.tests}", flush=True)
            elif rc == 0:
                survived.append(m)
                print(f"SURVIVED {m.id} ({secs:.0f} s): {m.why}; tests: {m.tests}", flush=True)
            else:
                killed.append(m)
                how = "timeout" if rc == "timeout" else f"rc={rc}"
                print(f"killed   {m.id} ({secs:.0f} s, {how})", flush=True)
                if opts.verbose:
                    print("    " + "\n    ".join(line for line in out.splitlines()[-12:] if line.strip()), flush=True)
        total = len(mutants)
        print(f"\n{len(killed)}/{total} mutants killed, {len(survived)} survived, {len(errors)} errors "
              f"({time.monotonic() - t0:.0f} s)")  # fmt: skip
        for m in survived:
            print(f"  survived: {m.id} ({m.file}): {m.why}")
        for m in errors:
            print(f"  error:    {m.id} ({m.file})")
        return 0 if not survived and not errors else 1
    finally:
        if opts.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
