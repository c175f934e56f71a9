"""docs/performance.md cites every file under benchmarks/results/ (issue 43): a raw file that no
report names is one nobody can find or judge, and one the report names must exist.

A citation is a file name, or a family of them, alone in backticks: ``{a,b}`` alternatives
(expanded as a shell does), with or without the ``benchmarks/results/`` prefix. No ``*``
wildcards: they would cite files not yet written. A backticked command line (it has spaces)
cites nothing, so a "How to run" line's output pattern cites no run. A name that names no file
is an error.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
REPORT = REPO / "docs" / "performance.md"


def expand_braces(pattern: str) -> list[str]:
    """``a{b,c}d`` -> ``[abd, acd]``, innermost group first, as a shell expands it."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    return [e for alt in m.group(1).split(",") for e in expand_braces(pattern[: m.start()] + alt + pattern[m.end() :])]


def cited_patterns(text: str) -> list[str]:
    """Every backticked token that names something under results/ (by a results-file-like suffix)."""
    patterns = []
    for code in re.findall(r"`([^`\s]+)`", text):
        word = code.removeprefix("benchmarks/results/")
        if "/" in word or not re.search(r"\.(\{|\*|json|md|png|log|gz|tgz|txt)", word):
            continue
        patterns += expand_braces(word)
    return patterns


def test_brace_expansion_and_patterns():
    assert expand_braces("x{,_b}.{md,json.gz}") == ["x.md", "x.json.gz", "x_b.md", "x_b.json.gz"]
    assert cited_patterns("see `benchmarks/results/a_h200.{md,png}` and `b*.log`, not `docs/x.md` nor "
                          "`cp out/b.json benchmarks/results/c.json`") == ["a_h200.md", "a_h200.png", "b*.log"]


def test_every_results_file_is_cited_by_the_performance_report():
    patterns = cited_patterns(REPORT.read_text())
    files = sorted(p.name for p in RESULTS.iterdir() if p.is_file())
    uncited = [f for f in files if not any(fnmatch.fnmatchcase(f, p) for p in patterns)]
    assert not uncited, f"benchmarks/results/ files docs/performance.md does not cite: {uncited}"


def test_the_report_cites_by_name_not_by_wildcard():
    """A wildcard would cite every future file it matches: the report spells its families out ({a,b})."""
    wild = [p for p in cited_patterns(REPORT.read_text()) if "*" in p]
    assert not wild, f"docs/performance.md cites results files by wildcard: {wild}"


def test_every_file_the_report_names_exists():
    files = [p.name for p in RESULTS.iterdir() if p.is_file()]
    missing = [p for p in cited_patterns(REPORT.read_text())
               if p.startswith(("bench_", "serving_", "kernel_", "gpu_", "host_", "tune_", "ncu_", "sanitizer_", "vllm_"))
               and not any(fnmatch.fnmatchcase(f, p) for f in files)]  # fmt: skip
    assert not missing, f"docs/performance.md names files benchmarks/results/ does not have: {missing}"
