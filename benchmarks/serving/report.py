"""The report: vLLM's own result files, gathered per load and side, compared, written out.

Every figure is a field of the result JSON that ``vllm bench serve --save-result`` wrote
(vllm/benchmarks/serve.py, 0.33: ``request_throughput``, ``output_throughput``,
``median_ttft_ms``, ``p99_ttft_ms``, ...); nothing is recomputed from per-request times.
Which server, side and load a file belongs to is read from the ``--metadata`` fields the
benchmark put into it. Per side the report gives the median over its servers and their
range (min, max), and every server's own value; then each side against the reference
(``off``), and each ``on@PATH`` baseline against ``on``.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

# (vLLM result field, label, better when higher)
METRICS = (
    ("request_throughput", "request throughput (req/s)", True),
    ("output_throughput", "output throughput (tok/s)", True),
    ("median_ttft_ms", "TTFT p50 (ms)", False),
    ("p99_ttft_ms", "TTFT p99 (ms)", False),
    ("median_tpot_ms", "TPOT p50 (ms)", False),
    ("p99_tpot_ms", "TPOT p99 (ms)", False),
    ("median_itl_ms", "ITL p50 (ms)", False),
    ("p99_itl_ms", "ITL p99 (ms)", False),
)
LATENCY_FIELDS = tuple(name for name, _, higher in METRICS if not higher)
FULL_DEPTH = 61


def read_results(result_dir: Path) -> list[dict]:
    """Every vLLM result JSON in ``result_dir`` that carries this benchmark's metadata, sorted by server."""
    results = []
    for path in sorted(Path(result_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and {"server", "side", "load"} <= data.keys():
            data["_file"] = path.name
            results.append(data)
    return sorted(results, key=lambda r: (int(r["server"]), r["load"]))


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def comparison_pairs(sides: list[str]) -> list[tuple[str, str]]:
    """(side, reference) pairs: every side against ``off`` (else the first side); ``on`` against each
    baseline (``on@PATH``); each switch variant (``on+NAME=VALUE``) against ``on``."""
    reference = "off" if "off" in sides else sides[0]
    pairs = [(s, reference) for s in sides if s != reference]
    for s in sides:
        base = s.split("+")[0]
        if base != s and base in sides and base != reference:
            pairs.append((s, base))  # a switch variant against its own plugin side
        elif s.startswith("on@") and base == s and "on" in sides and reference != "on":
            pairs.append(("on", s))  # this checkout against a baseline
    return pairs


# Student's t, two-sided 95%, by degrees of freedom 1-30; past 30 the value at 30 (at most 4% wide of the
# exact one, on the safe side).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def geometric_interval(ratios: list[float]) -> dict:
    """The ratios' geometric mean and its 95% interval (t over their logarithms), which says how far a
    run of rounds pins a side's factor down; None for the interval below two ratios."""
    logs = [math.log(x) for x in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return {"geomean": math.exp(mean), "low": None, "high": None}
    half = _T95[min(len(logs) - 2, len(_T95) - 1)] * statistics.stdev(logs) / math.sqrt(len(logs))
    return {"geomean": math.exp(mean), "low": math.exp(mean - half), "high": math.exp(mean + half)}


def _host_bound(server: dict) -> bool:
    """Whether this server's API server fell behind its engine over the load (host_figures)."""
    return server.get("host", {}).get("tokens_per_message", 1.0) > API_SERVER_BEHIND


def _round_ratios(ratios: list[float], higher: bool) -> dict:
    """Ratios of rounds: their spread, geometric mean with a 95% interval, and the rounds worse."""
    # A round where a side measured 0 (a failed load) has no logarithm: then no mean of the rounds at all,
    # rather than one over the rounds that happened to work.
    spread = (geometric_interval(ratios) if all(x > 0 for x in ratios)
              else {"geomean": None, "low": None, "high": None})  # fmt: skip
    return dict(_spread(ratios), **spread, worse=sum(1 for x in ratios if (x < 1 if higher else x > 1)))


def _paired(servers: list[dict], reference: list[dict], name: str, num_sides: int, higher: bool) -> dict | None:
    """A side against its reference round by round (``--interleave``: record ``index`` of round ``r`` is
    ``r * num_sides + position``): the ratio in each round both measured, its spread, its geometric
    mean with a 95% interval, and the rounds in which the side was worse.

    ``host_bound``: the rounds in which either side's API server fell behind its engine (_host_bound):
    there TTFT and ITL carry the host's lag, which moved one side's TTFT 3.3x between rounds in issue
    40's runs 9-10 while the plugin moved it by a few percent. Where some rounds were and some were
    not, ``kept_up`` gives the same figures over the rounds in which both sides kept up."""
    ref = {s["server"] // num_sides: s for s in reference}
    rounds = [(s[name] / ref[r][name], _host_bound(s) or _host_bound(ref[r])) for s in servers
              if isinstance(s.get(name), (int, float)) and (r := s["server"] // num_sides) in ref
              and isinstance(ref[r].get(name), (int, float)) and ref[r][name]]  # fmt: skip
    if not rounds:
        return None
    out = dict(_round_ratios([x for x, _ in rounds], higher), host_bound=sum(1 for _, bound in rounds if bound))
    kept_up = [x for x, bound in rounds if not bound]
    if kept_up and out["host_bound"]:
        out["kept_up"] = _round_ratios(kept_up, higher)
    return out


def summarize(results: list[dict], sides: list[str], layers: int, prefix_cache: dict | None = None,
              compiles: dict | None = None, hosts: dict | None = None, interleaved: int = 0) -> dict:  # fmt: skip
    """Per load: per side every server's figures and their spread; the comparisons; problems seen.

    ``prefix_cache``: (server, load) -> the server's prefix-cache token counters over that load.
    ``compiles``: (server, load) -> the kernels the server compiled during that load (server.kernel_compiles).
    ``hosts``: (server, load) -> the client's progress entry for that load (its CPU times and the
    server's own latencies, client.py), summarized by ``host_figures``.
    ``interleaved``: the number of sides of an ``--interleave`` run, whose records are rounds; each
    comparison then also pairs the sides round by round (``paired``, _paired).
    """
    prefix_cache, compiles, hosts = prefix_cache or {}, compiles or {}, hosts or {}
    loads: dict[str, dict] = {}
    for r in results:
        load = loads.setdefault(r["load"], {"sides": {}, "problems": []})
        server = {"server": int(r["server"]), "file": r["_file"], "completed": r.get("completed"),
                  "failed": r.get("failed"), "num_prompts": r.get("num_prompts"), "duration_s": r.get("duration")}  # fmt: skip
        server.update({name: r.get(name) for name, _, _ in METRICS})
        key = (int(r["server"]), r["load"])
        counters = prefix_cache.get(key)
        if counters and counters.get("queries"):
            server["prefix_cache_hit_fraction"] = counters["hits"] / counters["queries"]
        if key in compiles:
            server["kernel_compiles"] = compiles[key]
        if key in hosts and (host := host_figures(hosts[key], r)):
            server["host"] = host
        if r.get("failed") or r.get("completed") != r.get("num_prompts"):
            load["problems"].append(f"server {r['server']} ({r['side']}): {r.get('completed')} of "
                                    f"{r.get('num_prompts')} requests completed, {r.get('failed')} failed")  # fmt: skip
        load["sides"].setdefault(r["side"], {"servers": []})["servers"].append(server)
    for load in loads.values():
        for side in load["sides"].values():
            side["summary"] = {
                name: _spread(vals)
                for name, _, _ in METRICS
                if (vals := [s[name] for s in side["servers"] if isinstance(s.get(name), (int, float))])
            }
        load["comparisons"] = []
        for a, b in comparison_pairs([s for s in sides if s in load["sides"]]):
            row = {"side": a, "against": b, "metrics": {}}
            for name, _, higher in METRICS:
                sa, sb = load["sides"][a]["summary"].get(name), load["sides"][b]["summary"].get(name)
                if not sa or not sb:
                    continue
                m = {"ratio": sa["median"] / sb["median"] if sb["median"] else None,
                     "delta": sa["median"] - sb["median"]}  # fmt: skip
                if interleaved and (paired := _paired(load["sides"][a]["servers"], load["sides"][b]["servers"], name,
                                                      interleaved, higher)):  # fmt: skip
                    m["paired"] = paired
                if layers != FULL_DEPTH and name in LATENCY_FIELDS:
                    # A per-layer change scales with depth; start-up, sampling and the API server do not.
                    m["delta_scaled_to_61_layers"] = m["delta"] * FULL_DEPTH / layers
                row["metrics"][name] = m
            load["comparisons"].append(row)
    return loads


# Tokens per streamed message past which the API server is behind the engine (1.00 when it keeps up).
API_SERVER_BEHIND = 1.05


def host_figures(entry: dict, result: dict) -> dict | None:
    """Where one server's load spent the host's time, and the server's latencies against the client's.

    ``cores``: CPU seconds of each server process (by role) and of the client over the load's wall
    time: 1.0 is one core kept busy. The wall time, the client's CPU and the server's histograms
    cover all of ``vllm bench serve``'s run of the load: its dataset, its initial test prompt and
    warm-ups with the measured requests. An API server near 1.0 cannot keep up with the engine's
    outputs; it then streams several tokens per message, which the client's ITL counts as one
    interval: ``tokens_per_message`` (the client's mean ITL over its mean TPOT) says how many.
    ``server_ms``: vLLM's own means over the load (server.LATENCY_HISTOGRAMS), beside the client's
    ``client_ms`` means.
    """
    wall = entry.get("wall_s")
    out: dict = {}
    if wall and "server_cpu_s" in entry:
        out["cores"] = {role: cpu / wall for role, cpu in sorted(entry["server_cpu_s"].items())}
        if "client_cpu_s" in entry:
            out["cores"]["client"] = entry["client_cpu_s"] / wall
    if entry.get("server_latency_ms"):
        out["server_ms"] = entry["server_latency_ms"]
    if entry.get("engine_steps"):
        out["engine_steps"] = entry["engine_steps"]
    client = {k: result.get(f"mean_{k}_ms") for k in ("ttft", "itl", "tpot")}
    if all(isinstance(v, (int, float)) for v in client.values()):
        out["client_ms"] = client
        if client["tpot"]:
            out["tokens_per_message"] = client["itl"] / client["tpot"]
    return out or None


def _host_lines(load: dict, sides: list[str]) -> list[str]:
    """The per-server table of host_figures: engine, API server and client, and what each saw."""
    rows = [(s, v) for s in sides for v in load["sides"][s]["servers"]
            if "cores" in v.get("host", {}) or "server_ms" in v.get("host", {})]  # fmt: skip
    if not rows:
        return []

    def engine_cores(cores: dict) -> float:
        # Every process of the server but the API server: the engine core and, at TP > 1, its workers
        # (named by their vLLM process titles where setproctitle is installed, else "python3").
        return sum(c for role, c in cores.items() if role not in ("api_server", "client"))

    def fmt(x, digits: int = 1) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    lines = ["", "Host and server-side latencies per server (cores: CPU time over the load's wall time; "
             "server: vLLM's /metrics means, queue + prefill being the engine's share of TTFT; client: "
             "`vllm bench serve`'s means; tokens per message: client ITL / TPOT):", "",
             "| server | side | API server cores | engine and other server processes' cores | client cores | TTFT server / client ms | "
             "queue + prefill ms | ITL server / client ms | tokens per message |", "|" + "---|" * 9]  # fmt: skip
    for side, v in rows:
        h = v["host"]
        cores, srv, cli = h.get("cores", {}), h.get("server_ms", {}), h.get("client_ms", {})
        engine = engine_cores(cores) if cores else None
        qp = srv["queue"] + srv["prefill"] if {"queue", "prefill"} <= srv.keys() else None
        per_message = f"{h['tokens_per_message']:.2f}" if "tokens_per_message" in h else "-"
        lines.append(f"| {v['server']} | {side} | {fmt(cores.get('api_server'), 2)} | {fmt(engine, 2)} | "
                     f"{fmt(cores.get('client'), 2)} | {fmt(srv.get('ttft'))} / {fmt(cli.get('ttft'))} | {fmt(qp)} | "
                     f"{fmt(srv.get('itl'))} / {fmt(cli.get('itl'))} | "
                     f"{per_message} |")  # fmt: skip
    behind = [f"{v['server']} ({side}, {v['host']['tokens_per_message']:.2f})" for side, v in rows
              if v["host"].get("tokens_per_message", 1.0) > API_SERVER_BEHIND]  # fmt: skip
    if behind:
        lines += ["", f"**The API server fell behind the engine** on server(s) {', '.join(behind)}: more than "
                  f"{API_SERVER_BEHIND} tokens per streamed message, so TTFT and ITL include its lag and the host's "
                  "speed (issue 40's runs 1-3 and 7); compare sides only within this run."]  # fmt: skip
    steps = [(s, v) for s, v in rows if v["host"].get("engine_steps")]
    if steps:
        lines += ["", "Engine steps per server (vLLM's iteration log, `--enable-logging-iteration-details`; time: "
                  "how long the engine waited for each step's output, ms):", "",
                  "| server | side | kind | steps | prompt / decode tokens p50 | time p50 / p90 | time in all |",
                  "|" + "---|" * 7]  # fmt: skip
        for side, v in steps:
            for kind, k in sorted(v["host"]["engine_steps"].items()):
                lines.append(f"| {v['server']} | {side} | {kind} | {k['steps']} | {k['prompt_tokens_p50']:.0f} / "
                             f"{k['decode_tokens_p50']:.0f} | {k['ms_p50']:.1f} / {k['ms_p90']:.1f} | "
                             f"{k['ms_sum']:.0f} |")  # fmt: skip
    return lines


def _cell(summary: dict | None, fmt: str) -> str:
    if not summary:
        return "-"
    text = fmt.format(summary["median"])
    if summary["n"] > 1:
        text += f" [{fmt.format(summary['min'])}-{fmt.format(summary['max'])}]"
    return text


def _prompts_sent(load: dict) -> str:
    """The prompts each server was sent (vLLM's ``num_prompts``): --prompts-scale, or the plan, can make
    them fewer than the load's description says."""
    sent = sorted({srv["num_prompts"] for side in load["sides"].values() for srv in side["servers"]
                   if srv.get("num_prompts") is not None})  # fmt: skip
    return f" (sent: {', '.join(map(str, sent))} prompts per server)" if sent else ""


def _configuration_lines(cfg: dict) -> list[str]:
    """The serving configuration (configs.py) and the whole server command line: a result holds for these."""
    conf = cfg.get("configuration")
    if not conf:  # a report written before configurations were named
        return []
    lines = ["", f"**Configuration `{conf['name']}`**: {conf['description']}.", ""]
    lines += [f"- {key}: `{value}`" if key.startswith("vllm") else f"- {key}: {value}"
              for key, value in conf.items() if key not in ("name", "description") and value not in (None, [], "")]
    lines.append(f"- server command: `{cfg['server_command']}`")
    return lines


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [
        f"# Serving benchmark: {cfg['model_description']}",
        "",
        f"vLLM's `vllm bench serve` against `vllm serve` ({cfg['server_summary']}). Sides: "
        + ", ".join(f"`{s}`" for s in cfg["sides"]) + f"; {report['servers_measured']} server(s) measured. "
        "Each cell: the median over the side's servers [min-max over servers].",
    ]  # fmt: skip
    lines += _configuration_lines(cfg)
    if cfg.get("interleave"):
        lines.append(f"\n**Interleaved** (`--interleave`): one server per side, all up at once; the measured loads in "
                     f"{cfg['interleave']} rounds, one server loaded at a time, the order reversed every other round. "
                     "Each \"server\" below is a round of a side (index round x sides + position): the cells are "
                     "medians over rounds, and the sides are also paired round by round.")  # fmt: skip
    if cfg["layers"] != FULL_DEPTH:
        lines.append(f"\n**{cfg['layers']} of DeepSeek-V3's 61 layers**: the deltas scaled by 61/{cfg['layers']} "
                     "(a per-layer change; start-up, sampling and the API server do not scale) are in the JSON "
                     "(`delta_scaled_to_61_layers`) and in the last column.")  # fmt: skip
    for name, load in report["loads"].items():
        sides = [s for s in cfg["sides"] if s in load["sides"]]
        pairs = load["comparisons"]
        lines += ["", f"## {name}: {report['config']['loads'].get(name, '')}{_prompts_sent(load)}", ""]
        header = ["metric", *sides, *[f"{c['side']} / {c['against']}" for c in pairs]]
        if cfg["layers"] != FULL_DEPTH:
            header += [f"{c['side']} - {c['against']} at 61 layers" for c in pairs]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for field, label, _ in METRICS:
            fmt = "{:.2f}" if "throughput" in field and "request" in field else "{:.1f}"
            row = [label, *[_cell(load["sides"][s]["summary"].get(field), fmt) for s in sides]]
            row += [f"{c['metrics'][field]['ratio']:.3f}" if c["metrics"].get(field, {}).get("ratio") else "-"
                    for c in pairs]  # fmt: skip
            if cfg["layers"] != FULL_DEPTH:
                row += [f"{c['metrics'][field]['delta_scaled_to_61_layers']:+.2f}"
                        if "delta_scaled_to_61_layers" in c["metrics"].get(field, {}) else "-" for c in pairs]  # fmt: skip
            lines.append("| " + " | ".join(row) + " |")
        lines += _paired_lines(pairs)
        hits = []
        for s in sides:
            fractions = [v["prefix_cache_hit_fraction"] for v in load["sides"][s]["servers"]
                         if "prefix_cache_hit_fraction" in v]  # fmt: skip
            if fractions:
                hits.append(f"{s} {', '.join(f'{100 * f:.1f}%' for f in fractions)}")
        if hits:
            lines.append(f"\nPrefix-cache hits (share of prompt tokens, per server): {'; '.join(hits)}.")
        lines += _compiles_line(load, sides)
        lines += _host_lines(load, sides)
        for problem in load["problems"]:
            lines.append(f"\n**Problem:** {problem}")
    warmups = [f"server {v['index']} ({v['side']}) {e['load']}: {len(e['kernel_compiles'])}"
               for v in report.get("servers", []) for e in v.get("loads", [])
               if e.get("load") not in cfg["loads"] and "kernel_compiles" in e]  # fmt: skip
    if warmups:
        lines += ["", f"Kernels compiled during the warm-up (not measured): {'; '.join(warmups)}."]
    if report.get("skipped"):
        lines += ["", "## Not run", ""] + [f"- {s}" for s in report["skipped"]]
    if report.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e}" for e in report["errors"]]
    return "\n".join(lines) + "\n"


def _paired_lines(pairs: list[dict]) -> list[str]:
    """The round-by-round comparison of an ``--interleave`` run (summarize's ``paired``), if any."""
    pairs = [c for c in pairs if any("paired" in m for m in c["metrics"].values())]
    if not pairs:
        return []
    rounds = max(m["paired"]["n"] for c in pairs for m in c["metrics"].values() if "paired" in m)
    lines = ["", f"Paired by round (`--interleave`: every side's server up at once, the load run on each in turn, "
             f"{rounds} rounds): each side against its reference within a round, median [min-max] over the "
             "rounds, their geometric mean with its 95% confidence interval (t over the rounds' log ratios, "
             "taken as independent), and in how many rounds it was worse:", ""]  # fmt: skip
    header = ["metric", *[f"{c['side']} / {c['against']}" for c in pairs]]

    def table(pick) -> list[str]:
        rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for field, label, _ in METRICS:
            cells = []
            for c in pairs:
                p = pick(c["metrics"].get(field, {}).get("paired") or {})
                if not p:
                    cells.append("-")
                    continue
                mean = "" if p.get("geomean") is None else f", geomean {p['geomean']:.3f}"
                interval = "" if p.get("low") is None else f" ({p['low']:.3f}-{p['high']:.3f})"
                cells.append(f"{p['median']:.3f} [{p['min']:.3f}-{p['max']:.3f}]{mean}{interval}, "
                             f"worse in {p['worse']} of {p['n']}")  # fmt: skip
            rows.append("| " + " | ".join([label, *cells]) + " |")
        return rows

    lines += table(lambda p: p)
    bound = {f"{c['side']} / {c['against']}": (m["paired"]["host_bound"], m["paired"]["n"]) for c in pairs
             for m in c["metrics"].values() if m.get("paired", {}).get("host_bound")}  # fmt: skip
    if bound:
        counts = ", ".join(f"{name}: {n} of {rounds}" for name, (n, rounds) in bound.items())
        lines += ["", f"**Host-bound rounds** ({counts}): in these an API server streamed more than "
                  f"{API_SERVER_BEHIND} tokens per message (the host table below), so their TTFT and ITL ratios "
                  "carry the host's lag, which moves between rounds far more than the plugin does (issue 40's "
                  "runs 9-10: one side's TTFT 3.3x between rounds). Over the rounds in which both API servers "
                  "kept up:", ""]  # fmt: skip
        if any("kept_up" in m.get("paired", {}) for c in pairs for m in c["metrics"].values()):
            lines += table(lambda p: p.get("kept_up"))
        else:
            lines.append("none: every round was host-bound; this run cannot tell the plugin from the host.")
    return lines


def _compiles_line(load: dict, sides: list[str]) -> list[str]:
    """What vLLM's JIT monitor logged during the load, per server: a compile stalls the engine, and the
    requests in flight then carry it (their TTFT p99 above all)."""
    counted = [(s, v) for s in sides for v in load["sides"][s]["servers"] if "kernel_compiles" in v]
    if not counted:
        return []
    if not any(v["kernel_compiles"] for _, v in counted):
        return [f"\nKernels compiled during the load: none on any of the {len(counted)} server(s) (vLLM's JIT monitor)."]
    parts = []
    for side, v in counted:
        names = v["kernel_compiles"]
        kinds = ", ".join(f"{n} x{names.count(n)}" for n in dict.fromkeys(names))
        parts.append(f"server {v['server']} ({side}): {len(names)}" + (f" ({kinds})" if names else ""))
    return [f"\n**Kernels compiled during the load** (vLLM's JIT monitor; each stalls the engine while it "
            f"compiles, inside this load's latencies): {'; '.join(parts)}."]  # fmt: skip


def plot(report: dict, path: Path) -> str:
    """A PNG of every metric per load and side (bars: median over servers; dots: each server).

    Returns what was done: the path, or why there is no plot (matplotlib is not part of the
    test environment; the GPU machine's image has it).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed in this environment"
    loads = [name for name in report["loads"] if report["loads"][name]["sides"]]
    if not loads:
        return "no plot: no results"
    sides = report["config"]["sides"]
    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    width = 0.8 / len(sides)
    for ax, (field, label, _) in zip(axes.flat, METRICS):
        for k, side in enumerate(sides):
            xs, heights, dots = [], [], []
            for i, name in enumerate(loads):
                entry = report["loads"][name]["sides"].get(side)
                summary = entry and entry["summary"].get(field)
                if not summary:
                    continue
                x = i + (k - (len(sides) - 1) / 2) * width
                xs.append(x)
                heights.append(summary["median"])
                dots += [(x, s[field]) for s in entry["servers"] if isinstance(s.get(field), (int, float))]
            ax.bar(xs, heights, width, label=side)
            if dots:
                ax.plot(*zip(*dots), "k.", markersize=4)
        ax.set_xticks(range(len(loads)), loads, fontsize=8)
        ax.set_title(label, fontsize=10)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"vllm bench serve, {report['config']['model_description']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
