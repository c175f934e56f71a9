"""A stand-in for benchmarks/serving/client.py in the driver's tests: the same go-file protocol and
progress lines, no vLLM. ``python fake_client.py SPEC.json``.

Each load waits for the spec's go file, then for its own (``--interleave``), appends ``position
record load`` to FAKE_CLIENT_TURNS (the order the driver let the loads run in), and, for a
measured load, writes a vLLM result file whose figures are a function of the side and the round:
TTFT ``100 * (1 + round)`` ms, times FAKE_CLIENT_ON_FACTOR on a plugin side (a host whose speed
drifts round by round, and a plugin that costs a fixed factor).
"""

import json
import os
import sys
import time
from pathlib import Path

spec = json.loads(Path(sys.argv[1]).read_text())
progress, stop = Path(spec["progress"]), Path(spec["stop_file"])
turns = Path(os.environ["FAKE_CLIENT_TURNS"])
factor = float(os.environ.get("FAKE_CLIENT_ON_FACTOR", "1.1"))
sides = int(os.environ.get("FAKE_CLIENT_SIDES", "2"))


def wait(go: Path) -> bool:
    while not go.exists():
        if stop.exists() or time.time() > spec["deadline"]:
            return False
        time.sleep(0.02)
    return True


def record(entry: dict) -> None:
    with progress.open("a") as f:
        f.write(json.dumps(entry) + "\n")


if not wait(Path(spec["go_file"])):
    sys.exit(1)
for load in spec["loads"]:
    if not wait(Path(load["go_file"])):
        sys.exit(1)
    args = load["args"]
    meta = dict(a.split("=", 1) for a in args[args.index("--metadata") + 1 :])
    with turns.open("a") as f:
        f.write(f"{spec['port']} {load['server']} {load['name']}\n")
    result_dir = Path(args[args.index("--result-dir") + 1])
    if "warmup" not in str(result_dir):
        ttft = 100.0 * (1 + int(meta["server"]) // sides) * (factor if meta["side"] != "off" else 1.0)
        result = {"server": meta["server"], "side": meta["side"], "load": meta["load"], "completed": load["prompts"],
                  "failed": 0, "num_prompts": load["prompts"], "duration": 1.0, "request_throughput": 2.0,
                  "output_throughput": 100.0, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft,
                  "median_tpot_ms": 10.0, "p99_tpot_ms": 20.0, "median_itl_ms": 9.0, "p99_itl_ms": 30.0}
        result_dir.mkdir(parents=True, exist_ok=True)
        (result_dir / args[args.index("--result-filename") + 1]).write_text(json.dumps(result))
    record({"event": "load", "load": load["name"], "prompts": load["prompts"], "server": load["server"],
            "wall_s": 0.01})
