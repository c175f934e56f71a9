"""Issue 13's targets judged over several end-to-end runs at once.

One run of ``bench_vllm_e2e.py`` has 1-3 engines per side, and the lent machines' host
speed differs from one engine process to the next by up to ~2x (docs/performance-history.md,
"Where the TTFT goes"), so a host-bound figure such as the 1k TTFT cannot be judged from
one run. This script reads the JSON of several runs and reports, per KV-cache dtype:

- per decode batch: each run's GPU-time saving per step over the predicted one, and their
  median and minimum;
- per prefill length: every engine's median TTFT and median ``execute_model`` host time per
  prefill step, pooled by side over all runs, with the Mann-Whitney U test (engines as the
  samples): the exact two-sided p of "on and off come from the same distribution", and the
  exact one-sided p of the alternative "the plugin's engines take longer" (issue 20's test of
  "not worse": a small one-sided p says worse);
- where the runs have host-region timers, every engine's median speed of vLLM's own
  ``forward_mha`` code (the part of the host work that is the same on both sides), pooled
  by side and tested the same way: whether plugin-on processes run vLLM's Python slower;
  and, where they have it, the engine's host-speed probe (fixed work that neither side's
  code runs: a slower process shows there, a costlier plugin does not).

    python -m benchmarks.e2e.e2e_pool benchmarks/results/bench_vllm_e2e_h200*.json* --out /tmp/pool.md
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from scipy.stats import mannwhitneyu

from .bench_vllm_e2e import _host_split, med


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def mann_whitney(xs: list[float], ys: list[float]) -> dict | None:
    """U = #(x > y) + #(x == y) / 2 over all pairs, and the exact two-sided p of a U at least as far
    from m*n/2 (``scipy.stats.mannwhitneyu``, ``method="exact"``: the no-ties null distribution).
    Ties are rare in wall times; where one leaves U half-integral, scipy takes the tail from the
    whole number next towards the centre (a larger p than counting the half: tests/benchmarks/e2e/
    test_e2e_pool.py)."""
    if not xs or not ys:
        return None
    res = mannwhitneyu(xs, ys, alternative="two-sided", method="exact")
    # One-sided: the alternative that xs (the plugin's engines) are stochastically larger.
    greater = mannwhitneyu(xs, ys, alternative="greater", method="exact")
    return {"u": float(res.statistic), "pairs": len(xs) * len(ys), "p_two_sided": float(res.pvalue),
            "p_x_greater": float(greater.pvalue)}  # fmt: skip


def _ttft_ms(side: str, p: dict) -> float | None:
    return med([t * 1e3 for t in p.get("ttft_s", [])])


def _execute_model_ms(side: str, p: dict) -> float | None:
    """The engine's median ``execute_model`` host time of the prefill step (its TTFT requests)."""
    return med([ex[0] for h in p.get("host", []) if (ex := h.get("execute_model_ms"))])


def _common_ms(side: str, p: dict) -> float | None:
    """The engine's median host time of vLLM's own forward_mha code per prefill step."""
    return med([x["common"] for h in p.get("host", []) if (x := _host_split(side, h))])


def _attention_per_common(side: str, p: dict) -> float | None:
    """The engine's median, over its requests, of the attention region's host time (on: the
    plugin's forward_fused less vLLM's forward_mha code; off: vLLM's forward_impl less the same,
    plus its cache write) over vLLM's own forward_mha code in the same step: issue 20's per-layer
    comparison with the host's speed divided out (the same code runs as forward_mha's on both
    sides), one number per engine."""
    return med([x["attention"] / x["common"] for h in p.get("host", []) if (x := _host_split(side, h)) and x["common"] > 0])


def _engine_figures(e: dict):
    """(key, value) of each figure pooled per engine: per prefill length (and per ``("mixed", L)``, the
    mixed step of a prompt joining running decodes), its median TTFT, execute_model host time, host
    time in vLLM's own forward_mha code and attention region over it; and ("all", ...) the host-speed probe's medians,
    where the run has them (since the fourth lease). Values may be None (not measured)."""
    for length, p in e.get("prefill", {}).items():
        yield (int(length), "ttft_ms"), _ttft_ms(e["side"], p)
        yield (int(length), "execute_model_host_ms"), _execute_model_ms(e["side"], p)
        yield (int(length), "forward_mha_host_ms"), _common_ms(e["side"], p)
        yield (int(length), "attention_per_forward_mha"), _attention_per_common(e["side"], p)
    # A prompt joining running decodes: its TTFT, and the mixed step's host figures.
    for length, m in e.get("mixed", {}).items():
        key = ("mixed", int(length))
        yield (key, "ttft_ms"), _ttft_ms(e["side"], m)
        yield (key, "execute_model_host_ms"), _execute_model_ms(e["side"], m)
        yield (key, "attention_per_forward_mha"), _attention_per_common(e["side"], m)
    if e.get("host_probe"):
        for metric in ("python_us_per_1k", "torch_slice_us"):
            yield ("all", f"probe_{metric}"), med([x[metric] for x in e["host_probe"]])


def _pool_engines(reports: dict[str, dict], kv: str) -> dict:
    """{key: slot} for every ``_engine_figures`` key: the engines' values by side over all runs
    (``on``, ``off``) and per run (``runs``), their medians and the Mann-Whitney test. Engines
    of another cache dtype, and engines that failed, are left out."""
    slots: dict = {}
    for name, r in reports.items():
        for e in r.get("engines", []):
            if e.get("kv_cache_dtype") != kv or "error" in e:
                continue
            for key, v in _engine_figures(e):
                if v is None:
                    continue
                slot = slots.setdefault(key, {"on": [], "off": [], "runs": {}})
                slot[e["side"]].append(v)
                slot["runs"].setdefault(name, {"on": [], "off": []})[e["side"]].append(v)
    for slot in slots.values():
        slot["median"] = {"on": med(slot["on"]), "off": med(slot["off"])}
        slot["mann_whitney"] = mann_whitney(slot["on"], slot["off"])
    return slots


def pool(reports: dict[str, dict]) -> dict:
    """``reports``: run name -> bench_vllm_e2e JSON. The pooled figures per KV-cache dtype."""
    out: dict = {}
    kvs = sorted({kv for r in reports.values() for kv in r.get("summary", {})})
    for kv in kvs:
        decode: dict = {}
        for name, r in reports.items():
            for b, d in r.get("summary", {}).get(kv, {}).get("decode", {}).items():
                decode.setdefault(int(b), {})[name] = {
                    "saved_us": d.get("saving_busy_us"), "predicted_us": d.get("predicted_saving_us"),
                    "ratio": d.get("measured_over_predicted"), "tpot_delta_ms": d.get("tpot_delta_ms"),
                    "tpot_noise_ms": d.get("tpot_noise_ms") if d.get("engines_on", 0) > 1 else None,
                }  # fmt: skip
        for b, runs in decode.items():
            ratios = [x["ratio"] for x in runs.values() if x["ratio"] is not None]
            saved = [x["saved_us"] for x in runs.values() if x["saved_us"] is not None]
            runs_summary = {"ratio_median": med(ratios), "ratio_min": min(ratios) if ratios else None,
                            "saved_min_us": min(saved) if saved else None, "runs_measured": len(saved),
                            "runs_lower": sum(s > 0 for s in saved)}  # fmt: skip
            decode[b] = {"runs": runs, **runs_summary}
        slots = _pool_engines(reports, kv)
        prefill: dict = {}
        mixed: dict = {}
        for (group, metric), slot in slots.items():  # group: a prefill length, ("mixed", L) or "all"
            if isinstance(group, int):
                prefill.setdefault(group, {})[metric] = slot
            elif isinstance(group, tuple):
                mixed.setdefault(group[1], {})[metric] = slot
        probe = {metric: slot for (group, metric), slot in slots.items() if group == "all"}
        out[kv] = {"decode": dict(sorted(decode.items())), "prefill": dict(sorted(prefill.items())),
                   "mixed": dict(sorted(mixed.items())), "engine": probe}  # fmt: skip
    return out


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(pooled: dict, names: list[str]) -> str:
    lines = ["# End-to-end runs pooled (benchmarks/e2e/e2e_pool.py)", "", "Runs: " + ", ".join(f"`{n}`" for n in names), ""]
    for kv, k in pooled.items():
        lines += [f"## KV cache {kv}", "", "GPU busy time saved per decode step over the prediction, per run:", "",
                  "| B | " + " | ".join(names) + " | median | min | runs with a lower GPU time |",
                  "|---|" + "---|" * (len(names) + 3)]  # fmt: skip
        for b, d in k["decode"].items():
            cells = [_f(d["runs"][n]["ratio"]) if n in d["runs"] else "" for n in names]
            lines.append(f"| {b} | " + " | ".join(cells)
                         + f" | {_f(d['ratio_median'])} | {_f(d['ratio_min'])} | {d['runs_lower']} of {d['runs_measured']} |")  # fmt: skip
        lines += ["", "Per-engine medians pooled over the runs (each engine one sample; exact Mann-Whitney, on "
                  "against off: p two-sided, and p one-sided for the alternative \"on is larger\", i.e. slower "
                  "for a time):", "",
                  "| prefill L | figure | engines on | off | median on | off | U (of pairs) | p | p (on larger) |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        rows = [*k["prefill"].items(), *((f"mixed {n}", m) for n, m in k.get("mixed", {}).items()),
                ("all", k.get("engine", {}))]  # fmt: skip
        for length, metrics in rows:
            for metric, s in metrics.items():
                mw = s["mann_whitney"]
                fmt = "{:.3f}" if "_per_" in metric else "{:.1f}"  # a ratio, or ms / us
                lines.append(f"| {length} | {metric} | {len(s['on'])} | {len(s['off'])} | {_f(s['median']['on'], fmt)} | "
                             f"{_f(s['median']['off'], fmt)} | "
                             + (f"{mw['u']:g} ({mw['pairs']}) | {mw['p_two_sided']:.3f} | {mw['p_x_greater']:.3f} |"
                                if mw else "- | - | - |"))  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="bench_vllm_e2e JSON files (.json or .json.gz)")
    ap.add_argument("--out", type=Path, help="markdown file to write (also printed)")
    ap.add_argument("--json", type=Path, help="the pooled figures as JSON")
    a = ap.parse_args()
    reports = {}
    for path in a.results:
        name = path.name.removeprefix("bench_vllm_e2e_").split(".json")[0]
        r = load(path)
        if r.get("config", {}).get("mode") == "smoke":
            print(f"skipping {path}: a CPU smoke run", file=sys.stderr)
            continue
        reports[name] = r
    if not reports:
        print("no full runs given", file=sys.stderr)
        return 2
    pooled = pool(reports)
    text = markdown(pooled, list(reports))
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    if a.json:
        a.json.write_text(json.dumps(pooled, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
