"""The demo (``./scripts/demo.sh``): vLLM generating with the plugin and without it, then the kernel self-check.

1. writes the tiny DeepSeek-V3-architecture model (demo/tiny_model.py);
2. runs vLLM's engine on it with the plugin, then in a second process with
   ``VLLM_MLA_FUSION=0`` (demo/generate.py), on the GPU if torch sees one,
   else on the CPU with stand-ins for the vLLM kernels the wheel lacks;
3. prints what happened: the plugin's log line, whether the tokens are
   identical, the launch census per MLA layer and step, time per step;
4. runs the kernel self-check (vllm_mla_fusion/selfcheck.py).

Exits non-zero if a run fails, the tokens differ, or the self-check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import census as C
from . import cpu_stand_ins, tiny_model

REPO = Path(__file__).resolve().parents[1]
ON_GPU = torch.cuda.is_available()
# The plugin's log lines: "vllm-mla-fusion: ..." and, for the lines every rank logs,
# "vllm-mla-fusion (rank 0, local rank 0): ..." (vllm_plugin/layer.py).
PLUGIN_LINE = re.compile(r"vllm-mla-fusion(?: \([^()]*\))?: ")
UNKNOWN_ENV = "Unknown vLLM environment variable"
CPU_MLA_OVERRIDE = "forcing chunked prefill and prefix caching to be disabled"
WHEEL_KERNELS = "Failed to import from vllm._C"


def log_message(line: str) -> str:
    """A vLLM log line without its process prefix and timestamp."""
    return re.sub(r"^\(\w+ pid=\d+\) ", "", line).strip()


def plugin_lines(lines: list[str]) -> list[str]:
    """The plugin's own log lines among a run's log lines, without their process prefix."""
    return [log_message(x) for x in lines if PLUGIN_LINE.search(x)]


def run_generation(model_dir: Path, plugin: bool, log_path: Path) -> tuple[dict, list[str]]:
    """One demo/generate.py process; streams its progress; returns (result, log lines)."""
    env = {**os.environ, "VLLM_MLA_FUSION": "1" if plugin else "0"}
    env.pop("TRITON_INTERPRET", None)  # the self-check's business, not vLLM's
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "demo.generate", str(model_dir)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
    )  # fmt: skip
    lines, result = [], None
    with open(log_path, "w") as log:
        for line in proc.stdout:
            log.write(line)
            if line.startswith("RESULT "):
                result = json.loads(line.removeprefix("RESULT "))
            else:
                lines.append(line.rstrip("\n"))
                if line.startswith("PROGRESS "):
                    print(f"      {line.removeprefix('PROGRESS ').strip()}", flush=True)
    proc.wait()
    if proc.returncode != 0 or result is None:
        print("\n".join(lines[-40:]), file=sys.stderr)
        raise SystemExit(f"the generation run failed (exit {proc.returncode}); full log: {log_path}")
    print(f"      done in {time.perf_counter() - started:.0f} s (log: {log_path})", flush=True)
    return result, lines


def batch_text(batch: dict) -> str:
    parts = []
    if batch.get("decodes"):
        parts.append(f"decode {batch['decodes']}")
    if batch.get("prefills"):
        ctx = ", with context" if batch.get("prefill_with_context") else ""
        parts.append(f"prefill {batch['prefills']} ({batch['prefill_tokens']} tok{ctx})")
    return " + ".join(parts) or "(no MLA batch)"


def short_name(cat: str) -> str:
    return cat.removeprefix(C.FUSED_PREFIX).removeprefix("vLLM ")


def census_text(counts: dict[str, int]) -> str:
    """``3 = mla_rope_cache_write 1 + RoPE 1 + ...``: fused ops first."""
    cats = sorted(counts, key=lambda c: (not C.is_fused(c), c))
    return f"{sum(counts.values())} = " + " + ".join(f"{short_name(c)} {counts[c]}" for c in cats) if cats else "0"


def step_census(step: dict) -> dict[str, int] | str:
    """The census of one step, per layer when every MLA layer ran the same (else the full per-layer text)."""
    layers = step["layers"]
    distinct = {json.dumps(v, sort_keys=True) for v in layers.values()}
    if len(distinct) == 1:
        return next(iter(layers.values()))
    return "; ".join(f"{name}: {census_text(v)}" for name, v in layers.items())


def print_census(on: dict, off: dict, num_layers: int) -> bool:
    """Side-by-side census of the counted passes, consecutive identical steps grouped. False if it looks wrong."""
    steps_on, steps_off = on["counted"]["steps"], off["counted"]["steps"]
    if len(steps_on) != len(steps_off):
        print(f"  UNEXPECTED: {len(steps_on)} engine steps with the plugin, {len(steps_off)} without")
        return False
    rows = []
    for i, (a, b) in enumerate(zip(steps_on, steps_off)):
        kind = (bool(a["batch"].get("decodes")), a["batch"].get("prefills", 0) > 0)
        key = (kind, json.dumps(step_census(a)), json.dumps(step_census(b)))
        if rows and rows[-1]["key"] == key:
            rows[-1]["last"] = i
            rows[-1]["batches"].append(a["batch"])
        else:
            rows.append({"key": key, "first": i, "last": i, "batches": [a["batch"]], "on": a, "off": b})
    print(f"  {'steps':<7}{'batch (requests, prefill tokens)':<36}launches per MLA layer")
    for row in rows:
        span = str(row["first"]) if row["first"] == row["last"] else f"{row['first']}-{row['last']}"
        texts = {batch_text(b) for b in row["batches"]}
        batch = texts.pop() if len(texts) == 1 else batch_text(row["batches"][0]) + " ..."
        for tag, step in (("on ", row["on"]), ("off", row["off"])):
            c = step_census(step)
            print(f"  {span:<7}{batch:<36}{tag}: {census_text(c) if isinstance(c, dict) else c}")
            span = batch = ""
    totals = {}
    for tag, steps in (("on", steps_on), ("off", steps_off)):
        total = {}
        for step in steps:
            for counts in step["layers"].values():
                for cat, n in counts.items():
                    total[cat] = total.get(cat, 0) + n
        totals[tag] = total
    print(f"  {'all':<7}{f'{len(steps_on)} steps x {num_layers} layers':<36}on : {census_text(totals['on'])}")
    print(f"  {'':<43}off: {census_text(totals['off'])}")
    outside = [s["outside_layers"] for s in steps_on + steps_off if s["outside_layers"]]
    if outside:
        print(f"  counted outside any MLA layer (unexpected): {outside}")
    replaced_but_ran = [c for c in totals["on"] if c in C.VLLM_REPLACED]
    return not outside and not replaced_but_ran and not any(C.is_fused(c) for c in totals["off"])


def compare_outputs(on: dict, off: dict) -> tuple[bool, float, int, list[str]]:
    """(identical, max |logprob diff| where identical, tokens compared, first differences)."""
    same, max_diff, n, diffs = True, 0.0, 0, []
    for pass_name in ("counted", "timed"):
        for name, a in on[pass_name]["outputs"].items():
            b = off[pass_name]["outputs"][name]
            n += len(a["tokens"])
            if a["tokens"] != b["tokens"]:
                same = False
                i = next(i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y)
                diffs.append(
                    f"{pass_name}/{name}: token {i}: on {a['tokens'][i]} (logprob {a['logprobs'][i]:.4f}), "
                    f"off {b['tokens'][i]} (logprob {b['logprobs'][i]:.4f})"
                )
                continue
            max_diff = max([max_diff] + [abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])])
    return same, max_diff, n, diffs


def step_kind(batch: dict) -> str:
    if batch.get("prefills") and batch.get("decodes"):
        return "mixed (decode + prefill)"
    return "prefill only" if batch.get("prefills") else "decode only"


def print_timing(on: dict, off: dict) -> None:
    kinds = ("decode only", "mixed (decode + prefill)", "prefill only")
    by_kind = {tag: {k: [] for k in kinds} for tag in ("on", "off")}
    for tag, result in (("on", on), ("off", off)):
        for step in result["timed"]["steps"]:
            by_kind[tag][step_kind(step["batch"])].append(step["ms"])
    print(f"  {'engine step':<28}{'steps':>6}{'plugin on':>12}{'plugin off':>12}   (median ms)")
    for kind in kinds:
        a, b = by_kind["on"][kind], by_kind["off"][kind]
        if a and b:
            print(f"  {kind:<28}{len(a):>6}{statistics.median(a):>12.2f}{statistics.median(b):>12.2f}")
    total_on = sum(s["ms"] for s in on["timed"]["steps"])
    total_off = sum(s["ms"] for s in off["timed"]["steps"])
    print(f"  {'whole schedule (sum)':<28}{len(on['timed']['steps']):>6}{total_on:>12.1f}{total_off:>12.1f}")
    if ON_GPU:
        print("  Eager mode (no CUDA graphs, so that the census sees every launch), host overhead included;")
        print("  indicative only. Kernel timings under CUDA graphs: docs/performance.md.")
    else:
        print("  MEANINGLESS as performance figures: a CPU, plain-torch stand-in kernels, the plugin's torch")
        print("  reference backend and a 3-layer toy model. Kernel timings on an H200: docs/performance.md.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", help="write (and keep) the model here instead of a temporary directory")
    parser.add_argument("--skip-selfcheck", action="store_true", help="stop after the vLLM comparison")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="vllm-mla-fusion-demo-"))
    import vllm

    where = f"GPU ({torch.cuda.get_device_name()})" if ON_GPU else f"CPU only ({os.cpu_count()} cores)"
    print(f"vllm-mla-fusion demo: vLLM {vllm.__version__}, torch {torch.__version__}, {where}\n")
    try:
        model_dir = Path(args.model_dir) if args.model_dir else work / "model"
        t0 = time.perf_counter()
        tiny_model.write(model_dir)
        print(f"[1/4] tiny DeepSeek-V3-architecture model written to {model_dir} ({time.perf_counter() - t0:.1f} s)")
        print(f"      {tiny_model.describe()}")
        print("      seeded safetensors weights, byte-level BPE tokenizer trained here: nothing downloaded\n")
        print("[2/4] vLLM with the plugin", flush=True)
        on, log_on = run_generation(model_dir, True, work / "plugin_on.log")
        print("[3/4] vLLM without the plugin (VLLM_MLA_FUSION=0, a second process: plugins load once per process)")
        off, log_off = run_generation(model_dir, False, work / "plugin_off.log")
        ok = report(on, off, log_on, log_off)
        if args.skip_selfcheck:
            return 0 if ok else 1
        print("\n[4/4] kernel self-check: each backend against an independent float64 reference", flush=True)
        if not ON_GPU:
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton kernel is first defined
        from vllm_mla_fusion import selfcheck

        ok = selfcheck.main([]) == 0 and ok
    finally:
        shutil.rmtree(work / "model", ignore_errors=True)
    print(f"\ndemo {'finished' if ok else 'FAILED'} in {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


def report(on: dict, off: dict, log_on: list[str], log_off: list[str]) -> bool:
    ok = True
    print()
    if on["stand_ins"] or off["stand_ins"]:
        why = next((log_message(x) for x in log_on if WHEEL_KERNELS in x), "")
        print("CPU-only machine: vLLM's PyPI wheel is built for CUDA and brings no CPU kernels", end="")
        print(f" (vLLM logged: {why})." if why else ".")
        print("The demo registered plain-torch stand-ins (demo/cpu_stand_ins.py) for the vLLM ops this path calls:")
        for name in on["stand_ins"]:
            print(f"  torch.ops._C.{name:<34}{cpu_stand_ins.STAND_INS[name][3]}")
        print("None of them is RoPE, the KV-cache write or the query concat: with the plugin off, that part is")
        print("vLLM's own code, and with it on, the plugin's.")
        has = "has AMX tiles" if on["amx"]["host"] else "has none either"
        print(f"vLLM was also told the CPU has no AMX (this one {has}) and asked for CPU_MLA by name: with AMX,")
        print("vLLM's CPU platform picks AMX_MLA and packs bf16 linear weights, with kernels the wheel lacks too.\n")
    asked_off = [f for f in ("chunked_prefill", "prefix_caching") if not on[f]]
    if asked_off:
        said = next((log_message(x) for x in log_on if CPU_MLA_OVERRIDE in x), None)
        turned_off = " and ".join(f.replace("_", " ") for f in asked_off)
        print(f"vLLM turned {turned_off} OFF, although the demo asked for them:")
        if said:
            print(f"  {said}")
        print("  (vllm/platforms/cpu.py does this for MLA models on CPU_MLA.) So the long prompt is prefilled in")
        print("  one step, not in chunks, and the request that shares its beginning recomputes it. On a GPU")
        print(f"  both stay on (the demo asks for chunks of {on['requested_max_num_batched_tokens']} tokens).\n")
    for tag, lines in (("plugin on ", log_on), ("plugin off", log_off)):
        # With VLLM_MLA_FUSION=0 the plugin builds no layer, and vLLM configures its logging only
        # after loading plugins in this process, so register()'s own info line does not show.
        said = plugin_lines(lines) or ["(none: no fused layer was built)"]
        print(f"plugin log, {tag}: {said[0]}")
        for extra in said[1:]:
            print(f"{'':<23}{extra}")
    unknown = sorted({log_message(x) for x in log_on + log_off if UNKNOWN_ENV in x})
    print(f"vLLM warnings about unknown VLLM_* variables: {'; '.join(unknown) if unknown else 'none'}")
    modes_on = {layer["mode"] for layer in on["layers"]}
    print(f"MLA layers: {len(on['layers'])} ({', '.join(l['name'] for l in on['layers'])}), attention backend "
          f"{on['layers'][0]['backend']}; mode with the plugin: {', '.join(map(str, sorted(modes_on)))}; "
          f"without: vLLM's own layer")  # fmt: skip
    if None in modes_on or any(layer["mode"] is not None for layer in off["layers"]):
        print("  UNEXPECTED: a layer kept vLLM's path with the plugin on, or took the fused one with it off")
        ok = False

    print(f"\nRequests (greedy, {on['dtype']}; each arrives before the engine step shown; text from plugin on):")
    for r in on["requests"]:
        out = on["counted"]["outputs"][r["name"]]
        print(f"  {r['name']:<18}{out['prompt_tokens']:>4} prompt tokens, step {r['arrives']:>2}, "
              f"{r['max_tokens']:>2} new: {out['text']!r}"[:118])  # fmt: skip
    same, max_diff, n, diffs = compare_outputs(on, off)
    if same:
        print(f"Generated tokens: IDENTICAL with the plugin on and off ({n} tokens over both passes), "
              f"max |logprob difference| {max_diff:.1e}")  # fmt: skip
    else:
        ok = False
        print("Generated tokens: DIFFERENT with the plugin on and off. First differences:")
        for d in diffs:
            print(f"  {d}")
        if ON_GPU:
            print("  In bf16 a near tie (two logprobs within ~1e-2) can flip with one rounding of RoPE changed.")

    num_layers = len(on["layers"])
    print(f"\nLaunch census per MLA layer and engine step: RoPE, KV-cache write and query/key concat work,")
    print("counted from what ran (torch.profiler + ranges around vLLM's launch sites, demo/census.py); one")
    print(f"cell = each of the {num_layers} MLA layers (listed per layer where they differ):")
    census_ok = print_census(on, off, num_layers)
    print("  prefill key concat: vLLM's _concat_k_nope_k_pe, building the prefill attention key [k_nope | k_pe];")
    print("  decode query concat: the backend's forward_mqa receiving (ql_nope, q_pe) separately and joining them.")
    if not census_ok:
        print("  UNEXPECTED census: vLLM's RoPE, cache write or decode concat ran with the plugin on,")
        print("  or a fused op with it off")
        ok = False

    print("\nTime per engine step (second pass over the same schedule, no profiler):")
    print_timing(on, off)
    return ok


if __name__ == "__main__":
    sys.exit(main())
