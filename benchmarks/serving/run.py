"""The driver: plan, then per server: start it, confirm its side, run the client, stop it; report.

``python -m benchmarks.serving --help`` for the options; README.md beside this file for
what is measured and how to run it on the GPU machine.

The driver never imports vLLM or initialises CUDA: servers and the client are processes
of their own. Everything it needs again lives in ``--work-dir``: per model, its directory
and one compile cache per side (``VLLM_CACHE_ROOT``: an artifact compiled with one side's
code must never serve another, and a side's second server starts warm); per run
(``runs/<tag>-<hash of the configuration>``), vLLM's result files, the logs, and
``state.json`` (servers done, times measured). With ``--resume`` a later call continues
the run of the same configuration where the last one stopped, in the same alternating
order, and reports every server of the run.

With ``--interleave ROUNDS`` the servers take turns instead: one per side, all up at once on
the shared GPU, the measured loads run ROUNDS times on each in turn (sides.interleaved_turns);
each round of a side is a record of its own, and the report pairs the sides round by round.
Servers started one after another meet different minutes of the host's speed, and in issue
40's configuration that difference was as large as the one being measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .. import provenance
from . import configs, host_samples, models, probe, report, step_profile
from .loads import parse_loads, scaled_prompts
from .plan import MIN_SCALE, PROBE_S, SPEEDS, TEARDOWN_S, Estimator, Measured, plan
from .server import (PortTaken, Server, ServerFailed, ServerSpec, confirm_side, engine_steps, kernel_compiles,
                     notable_lines)
from .sides import Side, interleaved_turns, parse_sides, server_order

REPO = Path(__file__).resolve().parents[2]
REPORT_RESERVE_S = 20.0  # after the last server: the report, the plot, the copies
SERVED_MODEL = "dsv3-stand-in"
# vLLM's defaults otherwise (chunked prefill, prefix caching, async scheduling, torch.compile
# and CUDA graphs, its attention backend); the access log would add a line per request. The JIT
# monitor's verbose mode logs every kernel compiled while serving, not only each kernel's first
# (the report counts them per load: a compile stalls the engine inside a measured load).
GPU_SERVER_ARGS = ["--load-format", "dummy", "--seed", "0", "--disable-uvicorn-access-log", "--jit-monitor-verbose"]
# vLLM's CPU platform, as tests/vllm_plugin/test_serve.py runs it (the CUDA wheel's missing
# kernels replaced by demo/cpu_stand_ins.py through demo.serve).
CPU_SERVER_ARGS = [*GPU_SERVER_ARGS, "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "8",
                   "--kv-cache-memory-bytes", str(64 << 20), "--attention-backend", "CPU_MLA"]  # fmt: skip


# --interleave: the share of the GPU's memory all the servers may take together.
GPU_MEMORY_SHARED = 0.88

# Load fields added after runs were kept: run_key leaves them out where unset, so those runs resume.
LATER_LOAD_FIELDS = ("range_ratio", "profile_steps", "profile_skip", "pyspy")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class SideMismatch(RuntimeError):
    """A server is not the side it was started as: stop, the comparison would be false."""


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="dense", choices=[*models.MODELS, "tiny"],
                    help="stand-in (models.py); tiny: the demo's 3-layer model, for the CPU smoke run")  # fmt: skip
    ap.add_argument("--layers", type=int, default=models.FULL_DEPTH,
                    help="decoder layers of the stand-in (deltas are also reported scaled to 61)")
    ap.add_argument("--sides", nargs="+", default=["on", "off"],
                    help="off, on, on@PATH (another checkout's plugin), on+NAME=VALUE (a plugin switch set, e.g. "
                    "on+VLLM_MLA_FUSION_DECODE=0); the first round starts in this order")
    ap.add_argument("--servers-per-side", type=int, default=2, help="servers per side over the whole (resumed) run")
    ap.add_argument("--config", default=configs.DEFAULT_CONFIGURATION, choices=list(configs.CONFIGURATIONS),
                    help="the serving configuration (configs.py): server options, tokenizer, client backend, "
                    "default loads")
    ap.add_argument("--loads", nargs="+", default=None,
                    help="preset names (loads.PRESETS) or name=N,in=N,out=N,rate=R[,concurrency=C],prompts=N "
                    "(default: the configuration's)")
    ap.add_argument("--prompts-scale", type=float, default=1.0, help="every load's prompts x this (the plan may lower it)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="wall seconds for this call, report included")
    ap.add_argument("--out", type=Path, required=True, help="report: serving_<tag>.json/.md/.png and raw/")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="models, compile caches, runs (results, logs, state) (default OUT/work)")
    ap.add_argument("--tag", default=None, help="report file names (default: the model)")
    ap.add_argument("--resume", action="store_true", help="continue the run in --work-dir (same configuration)")
    ap.add_argument("--cpu", action="store_true", help="vLLM's CPU platform with demo.serve's stand-ins (smoke test)")
    ap.add_argument("--server-launcher", default=None,
                    help="the command before the model path that starts a server (shell words; default: `vllm serve` "
                    "as python -m vllm.entrypoints.cli.main serve, or demo.serve with --cpu); e.g. under py-spy")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="GPUs per server (vllm serve --tensor-parallel-size); 8 for --model full")
    ap.add_argument("--probe", action="store_true",
                    help="before the loads: redraw the dummy weights on every rank, greedy tokens and logprobs "
                    "(compared on vs off), GPU time per decode step from rank 0's profile (probe.py)")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the configuration's")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="more `vllm serve` options (shell words), after the configuration's")
    ap.add_argument("--bench-arg", action="append", default=[], help="more `vllm bench serve` options (shell words)")
    ap.add_argument("--seed", type=int, default=0, help="the random dataset's seed of the first load (+1 per load)")
    ap.add_argument("--start-timeout-s", type=float, default=None,
                    help="seconds a server may take to become healthy (default per model: models.START_TIMEOUT_S)")
    ap.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                    help="one server per side, all up at once (sharing the GPU's memory); the warm-ups once per "
                    "server, then the measured loads ROUNDS times on each in turn, the order reversed every other "
                    "round, so that the host's speed changes fall on every side alike; the report pairs the "
                    "sides round by round (fewer rounds where the budget is short)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the command lines; start nothing")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.configuration = configs.CONFIGURATIONS[args.config]
    if args.loads is None:
        args.loads = list(args.configuration.loads)
    if args.max_model_len is None:
        args.max_model_len = args.configuration.max_model_len
    try:
        args.side_list = parse_sides(args.sides)
        args.load_list = parse_loads(args.loads)
    except ValueError as e:
        ap.error(str(e))
    if args.model == "tiny":
        args.layers = 3
    if args.servers_per_side < 1 or args.layers < 1 or not 0 < args.prompts_scale <= 10:
        ap.error("--servers-per-side and --layers must be >= 1, --prompts-scale in (0, 10]")
    if args.tensor_parallel_size < 1:
        ap.error("--tensor-parallel-size must be >= 1")
    if args.interleave:
        if args.resume or args.tensor_parallel_size > 1 or args.probe:
            ap.error("--interleave runs every side's server on one GPU within one call: no --resume, "
                     "--tensor-parallel-size or --probe")
        if not any(ld.measured for ld in args.load_list):
            ap.error("--interleave needs a measured load")
        args.servers_per_side = 1
    if args.interleave < 0:
        ap.error("--interleave must be >= 0")
    share = GPU_MEMORY_SHARED / len(args.side_list) if args.interleave else models.GPU_MEMORY_UTILIZATION
    if args.model != "tiny" and not args.cpu:
        try:  # the whole model on one GPU (or its share of it) would fail minutes into its start; say so now
            models.check_fits(models.stand_in_config(args.model, args.layers), args.tensor_parallel_size, share=share)
        except ValueError as e:
            ap.error(f"--model {args.model}: {e}")
    args.work_dir = args.work_dir or args.out / "work"
    if not args.tag:
        full = args.model == "tiny" or args.layers == models.FULL_DEPTH
        args.tag = args.model if full else f"{args.model}{args.layers}"
        if args.config != configs.DEFAULT_CONFIGURATION:
            args.tag += f"-{args.config}"
    return args


def model_config(args) -> dict:
    if args.model == "tiny":
        from demo import tiny_model

        return dict(tiny_model.CONFIG, transformers_version="4.33.1")
    return models.stand_in_config(args.model, args.layers)


def run_key(args, config: dict) -> str:
    """What must match for --resume to add servers to the same comparison (more servers per side may be asked)."""
    # A load's later fields only where set: the loads that do not use them keep the keys they had before.
    loads = [{k: v for k, v in vars(ld).items() if k not in LATER_LOAD_FIELDS or v} for ld in args.load_list]
    same = {"config": config, "sides": [s.name for s in args.side_list], "loads": loads,
            "cpu": args.cpu, "server_args": args.server_arg,
            "bench_args": args.bench_arg, "max_model_len": args.max_model_len, "seed": args.seed}  # fmt: skip
    # Only where set: the runs kept from before these options keep their keys.
    if args.tensor_parallel_size > 1:
        same["tensor_parallel_size"] = args.tensor_parallel_size
    if args.probe:
        same["probe"] = True
    if args.interleave:
        same["interleave"] = args.interleave
    if args.config != configs.DEFAULT_CONFIGURATION:
        # Everything the configuration fixes (its max_model_len and loads are in `same` as used).
        same["configuration"] = {k: v for k, v in dataclasses.asdict(args.configuration).items()
                                 if k not in ("description", "max_model_len", "loads")}  # fmt: skip
    return hashlib.sha256(json.dumps(same, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Benchmark:
    def __init__(self, args):
        self.args = args
        self.t0 = time.monotonic()
        self.deadline = time.time() + args.budget_s - REPORT_RESERVE_S  # wall clock: shared with the client
        self.config = model_config(args)
        self.key = run_key(args, self.config)
        # Shared by every run of a model on this machine: its directory and each side's compile cache.
        # A run's own (results, logs, state) is named by its configuration: runs never mix or clobber.
        self.model_tag = "tiny" if args.model == "tiny" else f"{args.model}{args.layers}"
        if args.tensor_parallel_size > 1:  # compiled graphs differ by rank shape: a cache of their own
            self.model_tag += f"-tp{args.tensor_parallel_size}"
        self.work = args.work_dir / "runs" / f"{args.tag}-{self.key[:8]}"
        # The model directory holds the tokenizer, whose size is the configuration's; compile caches
        # (by model_tag) are shared: vLLM keys its artifacts by the whole engine configuration.
        vocab = args.configuration.tokenizer_vocab
        self.model_dir = args.work_dir / (f"model-{self.model_tag}" + (f"-tok{vocab}" if vocab else ""))
        self.results_dir, self.logs_dir = self.work / "results", self.work / "logs"
        self.state = self._load_state()
        self.measured = Measured.from_json(self.state.get("measured"))
        speed = SPEEDS["tiny-cpu"] if args.cpu else SPEEDS[args.model]
        self.estimator = Estimator(speed, args.layers, self.measured, PROBE_S if args.probe else 0.0)
        self.skipped: list[str] = []
        self.errors: list[str] = []
        self.profiled = any(ld.profile_steps for ld in args.load_list)
        self.rounds = args.interleave  # --interleave: the rounds that fit (run_interleaved)

    # -- state ----------------------------------------------------------------------

    def _load_state(self) -> dict:
        path = self.work / "state.json"
        if self.args.resume and path.is_file():
            state = json.loads(path.read_text())
            if state.get("key") == self.key:
                return state
            log("resume: the run directory holds another configuration's run; starting a new one")
        # A new run: earlier results and logs would be mixed into this report; compile caches stay.
        for d in (self.results_dir, self.logs_dir):
            shutil.rmtree(d, ignore_errors=True)
        return {"key": self.key, "servers": [], "measured": {}}

    def _save_state(self) -> None:
        self.state["measured"] = self.measured.to_json()
        tmp = self.work / "state.json.tmp"
        tmp.write_text(json.dumps(self.state, indent=1, default=str))
        tmp.replace(self.work / "state.json")

    def left_s(self) -> float:
        return self.deadline - time.time()

    # -- set-up ---------------------------------------------------------------------

    def cache_dir(self, side: Side) -> Path:
        return self.args.work_dir / "compile-cache" / self.model_tag / side.slug

    def warm_slugs(self) -> set[str]:
        return {s.slug for s in self.args.side_list if self.cache_dir(s).is_dir() and any(self.cache_dir(s).iterdir())}

    def server_spec(self) -> ServerSpec:
        a = self.args
        # -P: the working directory is not put first on sys.path, so a server finds vllm_mla_fusion where
        # its side's PYTHONPATH says (on@PATH first), never a copy that happens to sit in the cwd.
        if a.cpu:
            # The configuration's options first: the CPU platform's limits (CPU_SERVER_ARGS) win.
            launcher, options = [sys.executable, "-P", "-m", "demo.serve"], [*a.configuration.server_args,
                                                                            *CPU_SERVER_ARGS]  # fmt: skip
            options += ["--max-model-len", str(min(a.max_model_len, self.config["max_position_embeddings"]))]
        else:
            launcher = [sys.executable, "-P", "-m", "vllm.entrypoints.cli.main", "serve"]  # `vllm serve`
            options = [*GPU_SERVER_ARGS, *a.configuration.server_args, "--max-model-len", str(a.max_model_len)]
        if a.tensor_parallel_size > 1:
            options += ["--tensor-parallel-size", str(a.tensor_parallel_size)]
        if a.probe:
            options += ["--worker-extension-cls", probe.WORKER_EXTENSION]
        if a.interleave and not a.cpu:  # every side's server on the one GPU at once
            options += ["--gpu-memory-utilization", f"{GPU_MEMORY_SHARED / len(a.side_list):.2f}"]
        if a.probe or self.profiled:  # the /start_profile and /stop_profile routes
            options += ["--profiler-config", json.dumps(server_profiler_config(self.trace_dir()))]
        options += [w for arg in a.server_arg for w in shlex.split(arg)]
        if a.server_launcher:
            launcher = shlex.split(a.server_launcher)
        return ServerSpec(launcher, str(self.model_dir), SERVED_MODEL, options, str(self.work))

    def base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", PYTHONUNBUFFERED="1")
        env.update(models.SERVER_ENV.get(self.args.model, {}))
        # Last on the path: this checkout's demo/ and benchmarks/ (demo.serve, the client) for processes
        # that do not run from it; anything earlier (the carried vLLM, a baseline checkout) comes first.
        paths = env.get("PYTHONPATH", "").split(os.pathsep)
        env["PYTHONPATH"] = os.pathsep.join([p for p in paths if p] + ([str(REPO)] if str(REPO) not in paths else []))
        if self.args.cpu:
            # vLLM's model runner launches a few Triton kernels of its own: on a CPU, in Triton's interpreter.
            env.update(VLLM_TARGET_DEVICE="cpu", CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
        return env

    def start_timeout_s(self) -> float:
        if self.args.start_timeout_s is not None:
            return self.args.start_timeout_s
        return models.START_TIMEOUT_S.get(self.args.model, models.START_TIMEOUT_S["dense"])

    def side_env(self, side: Side) -> dict[str, str]:
        env = side.server_env(self.base_env())
        env["VLLM_CACHE_ROOT"] = str(self.cache_dir(side))
        if self.args.probe:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # the /collective_rpc route the probe redraws the weights through
        return env

    def trace_dir(self) -> Path:
        return self.work / "traces"

    def plugin_origin(self, side: Side) -> dict:
        """Which vllm_mla_fusion a server of ``side`` imports (found, not imported), and that checkout's commit."""
        probe = "import importlib.util as u; s = u.find_spec('vllm_mla_fusion'); print(s.origin if s else '')"
        out = subprocess.run([sys.executable, "-P", "-c", probe], env=self.side_env(side), cwd=self.server_spec().cwd,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        origin = out.stdout.strip() or None
        # The digest names the commit even where the machine's git metadata lags its tree.
        facts = {"package": origin, "package_sha256": provenance.package_sha256(Path(origin).parent) if origin else None}
        if side.checkout is not None:
            if not origin or not Path(origin).resolve().is_relative_to(side.checkout):
                raise SideMismatch(f"side {side.name}: a server would import vllm_mla_fusion from {origin}, "
                                   f"not from {side.checkout}")  # fmt: skip
            commit_file = side.checkout / "COMMIT"
            facts["commit"] = commit_file.read_text().strip() if commit_file.is_file() else _git_head(side.checkout)
        return facts

    # -- the run --------------------------------------------------------------------

    def run(self) -> int:
        a = self.args
        log(f"python -m benchmarks.serving {shlex.join(a.argv)}")
        self.work.mkdir(parents=True, exist_ok=True)
        a.out.mkdir(parents=True, exist_ok=True)
        for d in (self.results_dir, self.logs_dir):
            d.mkdir(parents=True, exist_ok=True)
        config_file = self.model_dir / "config.json"
        if not config_file.is_file() or json.loads(config_file.read_text()) != self.config:
            models.write_model_dir(self.model_dir, self.config, a.configuration.tokenizer_vocab)
        log(f"model: {self._model_description()}")
        if a.interleave:
            return self.run_interleaved()
        done = len(self.state["servers"])
        queue = server_order(a.side_list, a.servers_per_side, first=done)
        the_plan = plan(queue, self.left_s(), self.estimator, a.load_list, self.warm_slugs(), a.prompts_scale)
        self.state["plan"] = the_plan.to_json()
        log(f"plan: {json.dumps(the_plan.to_json())}")
        if a.dry_run:
            self._print_commands(the_plan)
            return 0
        status = 0
        if not the_plan.servers and queue:
            self.errors.append(the_plan.reason)
            status = 4
        try:
            status = self.run_plan(the_plan) or status
        finally:  # also when the driver is ended (SIGTERM): what was measured is reported
            self.skipped += [f"server {i} ({s.name}): not in this call's plan ({the_plan.reason})"
                             for i, s in queue if (i, s) not in the_plan.servers]  # fmt: skip
            self._save_state()
            summary = self.write_report()
        if summary["problems"]:
            status = status or 1  # requests failed or went missing: the figures describe something else
        return status

    def run_plan(self, the_plan) -> int:
        """The planned servers in order, each only if it still fits; 3 on a side mismatch, 1 on an error."""
        status = 0
        warm = self.warm_slugs()
        for position, (index, side) in enumerate(the_plan.servers):
            # Estimates measured since the plan may say it no longer fits: fewer prompts first, then skip.
            scale = the_plan.scale
            while (need := self.estimator.server_s(side.slug, side.slug in warm, self.args.load_list, scale)) > \
                    self.left_s() and scale > MIN_SCALE:
                scale = max(MIN_SCALE, scale / 2)
            if need > self.left_s():
                self.skipped.append(f"server {index} ({side.name}): ~{need:.0f} s needed, {self.left_s():.0f} s left")
                log(f"deadline: not starting server {index} ({side.name})")
                continue
            if scale != the_plan.scale:
                log(f"server {index} ({side.name}): prompts x {scale:g} to fit the time left")
            try:
                record = self.run_server(index, side, side.slug in warm, scale)
            except SideMismatch as e:
                self.errors.append(str(e))
                log(f"FAILED: {e}")
                self.skipped += [f"server {i} ({s.name}): not started after the side mismatch"
                                 for i, s in the_plan.servers[position + 1 :]]  # fmt: skip
                return 3
            warm.add(side.slug)
            if "error" in record:
                self.errors.append(f"server {index} ({side.name}): {record['error']}")
                status = 1
        return status

    def run_server(self, index: int, side: Side, warm: bool, scale: float) -> dict:
        """One server from start to teardown; its record (also kept in the state). Whatever happens,
        the server's and the client's process groups are gone when this returns or raises."""
        record = {"index": index, "side": side.name, "slug": side.slug, "warm_cache": warm, "prompts_scale": scale,
                  "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
        self.state["servers"].append(record)
        record["plugin_origin"] = self.plugin_origin(side) if side.plugin else None
        self.cache_dir(side).mkdir(parents=True, exist_ok=True)
        server = client = None
        try:
            server, client = self._start(index, side, warm, scale, record)
            record["plugin"] = confirm_side(side, server.log(), self.args.tensor_parallel_size)
            if self.args.probe:
                record["probe"] = self.run_probe(index, side, server.port)
            (self.work / f"go-{index:02d}").touch()
            try:
                client.wait(timeout=max(self.deadline - time.time(), 1.0))
            except subprocess.TimeoutExpired:
                record["late"] = "the client ran past the deadline and was stopped"
            record["client_exit"] = client.poll()
            record["loads"] = self.read_progress(index, side)
            attribute_server_log(record["loads"], server.log_path)
            self.read_profiles(index, side, record["loads"])
            self.read_host_samples(index, side, record["loads"])
            for entry in record["loads"]:
                if "error" in entry:
                    record.setdefault("error", f"load {entry['load']}: {entry['error']}")
                if "skipped" in entry:
                    self.skipped.append(f"server {index} ({side.name}) load {entry['load']}: {entry['skipped']}")
        except ServerFailed as e:
            record["error"] = str(e)[:4000]
            if "plugin" not in record and "start_s" in record:  # healthy, but not the side it should be
                raise SideMismatch(str(e)) from e
        finally:
            if client is not None:
                self._stop_client(client, index)
            if server is not None:
                record["log_lines"] = notable_lines(server.log())
                record["teardown_s"] = server.stop()
            self._save_state()
        log(f"server {index} ({side.name}): done, {len(record.get('loads', []))} load(s), "
            f"teardown {record.get('teardown_s', 0):.1f} s")  # fmt: skip
        return record

    def _start(self, index: int, side: Side, warm: bool, scale: float, record: dict) -> tuple[Server, subprocess.Popen]:
        """The server and its client (which imports vLLM while the server starts), once /health answers."""
        log_path = self.server_log_path(index, side)
        for _attempt in range(3):
            server = Server(self.server_spec(), side, self.side_env(side), log_path)
            client = self.start_client(index, side, server.port, scale, server.proc.pid)
            log(f"server {index} ({side.name}): starting on port {server.port}, {'warm' if warm else 'cold'} compile cache")
            try:
                record["start_s"] = server.wait_healthy(min(self.start_timeout_s(), max(self.left_s(), 1.0)))
            except ServerFailed as e:
                self._stop_client(client, index)
                record["log_lines"] = notable_lines(server.log())
                server.stop()
                if isinstance(e, PortTaken):
                    continue
                raise
            except BaseException:
                # SIGTERM (the call's timeout) during a start of minutes: neither process may outlive the
                # driver; a TP8 server left behind would hold eight GPUs' memory in the next call.
                self._stop_client(client, index)
                server.stop()
                raise
            record["port"] = server.port
            self.measured.add_start(side.slug, warm, record["start_s"])
            log(f"server {index} ({side.name}): healthy after {record['start_s']:.1f} s")
            return server, client
        raise ServerFailed("three ports in a row were taken before the server bound them")

    def run_probe(self, index: int, side: Side, port: int) -> dict:
        """probe.run on the healthy server (its results also in results/probe-NN-<side>.json); the loads follow."""
        shape = probe.CPU_SHAPE if self.args.cpu else probe.GPU_SHAPE
        log(f"server {index} ({side.name}): probe (redraw, greedy, decode profile)")
        try:
            result = probe.run(port, SERVED_MODEL, self.config["vocab_size"], shape, self.trace_dir(),
                               f"decode-{index:02d}-{side.slug}")  # fmt: skip
        except (OSError, RuntimeError, ValueError, KeyError) as e:  # the loads still measure; the report says why
            result = {"error": f"{type(e).__name__}: {e}"}
        (self.results_dir / f"probe-{index:02d}-{side.slug}.json").write_text(json.dumps(result, indent=1))
        log(f"server {index} ({side.name}): probe {result.get('error') or 'done'}; "
            f"decode step {result.get('decode_profile', {}).get('gpu_us_median')} us GPU")  # fmt: skip
        return result

    def read_profiles(self, index: int, side: Side, loads: list[dict]) -> None:
        """Each profiled load's ``profile``: rank 0's trace read (step_profile.summarize), also kept as
        results/step-profile-NN-<side>-<load>.json."""
        for entry in loads:
            prefix = entry.get("profile_prefix")
            if not prefix or "error" in entry:
                continue
            path = probe.rank0_trace(self.trace_dir(), prefix, wait_s=min(60.0, max(self.left_s(), 1.0)))
            if path is None:
                entry["profile"] = {"error": f"no rank-0 trace {prefix}*_rank0.* in {self.trace_dir()}"}
                continue
            t = time.monotonic()
            try:
                summary = step_profile.summarize(str(path))
            except (OSError, ValueError, KeyError) as e:  # the loads' figures stand without it
                entry["profile"] = {"error": f"{type(e).__name__}: {e}"}
                continue
            summary["read_s"] = round(time.monotonic() - t, 1)
            (self.results_dir / f"step-profile-{index:02d}-{side.slug}-{entry['load']}.json").write_text(
                json.dumps(summary, indent=1))
            entry["profile"] = summary
            kinds = ", ".join(f"{n} {k['steps']}" for n, k in summary["kinds"].items())
            log(f"server {index} ({side.name}): {entry['load']} profiled, {summary['steps']} steps ({kinds}), "
                f"read in {summary['read_s']} s")  # fmt: skip

    def read_host_samples(self, index: int, side: Side, loads: list[dict]) -> None:
        """Each sampled load's ``pyspy_summary`` per process role (host_samples.summarize_record)."""
        for entry in loads:
            if entry.get("pyspy"):
                entry["pyspy_summary"] = summary = host_samples.summarize_record(entry["pyspy"])
                counts = ", ".join(f"{role} {s['samples']}" for role, s in summary.items() if isinstance(s, dict) and "samples" in s)
                log(f"server {index} ({side.name}): {entry['load']} sampled by py-spy: {counts or summary}")

    def client_spec(self, index: int, side: Side, port: int, scale: float, server_pid: int | None = None) -> dict:
        if self.args.interleave:
            loads = self._interleaved_loads(index, side, port, scale)
        else:
            loads = [self._load_spec(index, side, k, load, port, scale) for k, load in enumerate(self.args.load_list)]
        return {
            "port": port,
            "server_pid": server_pid,
            "loads": loads,
            "deadline": self.deadline - TEARDOWN_S,
            "go_file": str(self.work / f"go-{index:02d}"),
            "stop_file": str(self.work / f"stop-{index:02d}"),
            "progress": str(self.logs_dir / f"progress-{index:02d}.jsonl"),
            "server_log": str(self.server_log_path(index, side)),
        }

    def _interleaved_loads(self, position: int, side: Side, port: int, scale: float) -> list[dict]:
        """The loads of the server at ``position`` under --interleave: its warm-ups, then each round's
        measured loads, named for the round's record (index ``round * sides + position``). Each waits
        for its turn (``go_file``, written by _take_turn); within a round every side gets the same
        requests, each round new ones."""
        a = self.args
        before, measured, after = self._interleaved_phases()
        loads = [dict(self._load_spec(position, side, k, a.load_list[k], port, scale), server=position) for k in before]
        for r in range(self.rounds):
            index = r * len(a.side_list) + position
            # Each round its own prompts (the same on every side): a prefix cache never serves a later round.
            loads += [dict(self._load_spec(index, side, k, a.load_list[k], port, scale, r * len(a.load_list)),
                           server=index) for k in measured]  # fmt: skip
        loads += [dict(self._load_spec(position, side, k, a.load_list[k], port, scale), server=position) for k in after]
        for j, ld in enumerate(loads):
            ld["go_file"] = str(self.work / f"go-{position:02d}-{j:03d}")
        return loads

    def _interleaved_phases(self) -> tuple[list[int], list[int], list[int]]:
        """Positions in --loads of the loads run once per server before the rounds (the unmeasured
        ones ahead of the first measured load: warm-ups), in every round (the measured ones), and
        once after them (unmeasured ones after a measured load: a profiled or sampled load)."""
        loads = self.args.load_list
        first = next(k for k, ld in enumerate(loads) if ld.measured)
        measured = [k for k, ld in enumerate(loads) if ld.measured]
        return ([k for k in range(first) if not loads[k].measured], measured,
                [k for k in range(first, len(loads)) if not loads[k].measured])

    def _fit_rounds(self) -> int:
        """The rounds of --interleave that fit the time left (at most those asked for)."""
        a = self.args
        warm = self.warm_slugs()
        before, measured, after = self._interleaved_phases()

        def loads_s(positions):
            return sum(self.estimator.load_s(a.load_list[k], scaled_prompts(a.load_list[k], a.prompts_scale))
                       for k in positions)  # fmt: skip

        n = len(a.side_list)
        fixed = sum(self.estimator.start_s(s.slug, s.slug in warm) + TEARDOWN_S for s in a.side_list)
        fixed += n * (loads_s(before) + loads_s(after))
        return max(0, min(a.interleave, int((self.left_s() - fixed) // (n * loads_s(measured)))))

    def run_interleaved(self) -> int:
        """--interleave: one server per side, all started and confirmed first, then every load in turns
        (_take_turn): each server's warm-ups, the rounds (sides.interleaved_turns), the loads after
        them; every server stopped, whatever happens; each round of a side a record of its own."""
        a = self.args
        sides, n = a.side_list, len(a.side_list)
        self.rounds = self._fit_rounds()
        before, measured, after = self._interleaved_phases()
        turns = [(p, j) for p in range(n) for j in range(len(before))]
        turns += [(p, len(before) + r * len(measured) + m) for r, p in interleaved_turns(n, self.rounds)
                  for m in range(len(measured))]  # fmt: skip
        turns += [(p, len(before) + self.rounds * len(measured) + m) for p in range(n) for m in range(len(after))]
        self.state["plan"] = {"interleave": self.rounds, "asked": a.interleave, "servers": [s.name for s in sides],
                              "turns": list(turns)}  # fmt: skip
        log(f"plan: {json.dumps(self.state['plan'])}")
        if self.rounds < a.interleave:
            self.skipped.append(f"--interleave {a.interleave}: {self.rounds} round(s) fit the time left")
        if a.dry_run:
            spec = self.server_spec()
            for p, side in enumerate(sides):
                env = {k: v for k, v in self.side_env(side).items() if k.startswith("VLLM_") or k == "PYTHONPATH"}
                print(f"server {p} ({side.name}): {' '.join(f'{k}={v}' for k, v in sorted(env.items()))} "
                      f"{shlex.join([*spec.launcher, spec.model_dir, *spec.args])}")  # fmt: skip
            for p, j in turns:
                load = self.client_spec(p, sides[p], 8000, a.prompts_scale)["loads"][j]
                print(f"turn: server {p} ({sides[p].name}) {load['name']} as record {load['server']}")
            return 0
        if not self.rounds:
            self.errors.append(f"--interleave: not one round fits the {self.left_s():.0f} s left")
            self._save_state()
            self.write_report()
            return 4
        for stale in self.work.glob("go-*"):  # an earlier run's turns, in this run's directory
            stale.unlink()
        status, running = 0, []
        warm = self.warm_slugs()
        try:
            for p, side in enumerate(sides):
                record = {"index": p, "side": side.name, "slug": side.slug, "warm_cache": side.slug in warm,
                          "prompts_scale": a.prompts_scale, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "plugin_origin": self.plugin_origin(side) if side.plugin else None}  # fmt: skip
                self.cache_dir(side).mkdir(parents=True, exist_ok=True)
                server, client = self._start(p, side, side.slug in warm, a.prompts_scale, record)
                running.append((server, client, record))
                record["plugin"] = confirm_side(side, server.log(), a.tensor_parallel_size)
                (self.work / f"go-{p:02d}").touch()
            for p, j in turns:
                self._take_turn(p, j, running[p][1])
        except (ServerFailed, SideMismatch) as e:
            self.errors.append(f"--interleave: {e}"[:4000])
            status = 3
        finally:  # also when the driver is ended (SIGTERM): no server outlives it, what was measured is reported
            for p, (server, client, record) in enumerate(running):
                try:
                    self._stop_client(client, p)
                except Exception as e:  # noqa: BLE001 - every server is still stopped
                    self.errors.append(f"server {p} ({sides[p].name}): its client did not stop: {type(e).__name__}: {e}")
                record["log_lines"] = notable_lines(server.log())
                record["teardown_s"] = server.stop()
            for p, (_, _, record) in enumerate(running):
                try:
                    self.state["servers"] += self._round_records(p, sides[p], record)
                except Exception as e:  # noqa: BLE001 - the other servers' records and the report still come
                    self.errors.append(f"server {p} ({sides[p].name}): its records: {type(e).__name__}: {e}")
                    self.state["servers"].append(record)
            self._save_state()
            summary = self.write_report()
        if summary["problems"] or self.errors:
            status = status or 1
        return status

    def _take_turn(self, position: int, j: int, client: subprocess.Popen) -> None:
        """Let the client of server ``position`` run its ``j``-th load; return once it recorded it (or
        exited, or the deadline passed)."""
        (self.work / f"go-{position:02d}-{j:03d}").touch()
        progress = self.logs_dir / f"progress-{position:02d}.jsonl"
        while client.poll() is None and time.time() < self.deadline:
            if progress.is_file() and progress.read_text().count('"event": "load"') > j:
                return
            time.sleep(0.1)

    def _round_records(self, position: int, side: Side, record: dict) -> list[dict]:
        """The server at ``position``'s loads split into its rounds' records (by the ``server`` index its
        client recorded with each load); the first round's record is the server's own."""
        loads = self.read_progress(position, side)
        attribute_server_log(loads, self.server_log_path(position, side))
        records = []
        for r in range(max(self.rounds, 1)):
            index = r * len(self.args.side_list) + position
            rec = record if r == 0 else {k: record[k] for k in ("side", "slug", "prompts_scale", "started_utc",
                                                                "plugin_origin", "plugin", "port") if k in record}  # fmt: skip
            rec.update(index=index, interleaved={"server": position, "round": r},
                       loads=[e for e in loads if e.get("server", position) == index])  # fmt: skip
            self.read_profiles(index, side, rec["loads"])
            self.read_host_samples(index, side, rec["loads"])
            for entry in rec["loads"]:
                if "error" in entry:
                    rec.setdefault("error", f"load {entry['load']}: {entry['error']}")
                    self.errors.append(f"record {index} ({side.name}) load {entry['load']}: {entry['error']}")
                if "skipped" in entry:
                    self.skipped.append(f"record {index} ({side.name}) load {entry['load']}: {entry['skipped']}")
            records.append(rec)
        return records

    def _load_spec(self, index: int, side: Side, k: int, load, port: int, scale: float, seed_offset: int = 0) -> dict:
        """One load of one server's client: ``vllm bench serve``'s arguments (result file named for
        ``index``, the load's seed the ``k``-th, plus ``seed_offset``), its estimate, and what to
        profile or sample."""
        a = self.args
        prompts = scaled_prompts(load, scale)
        name = f"{index:02d}-{side.slug}-{load.name}"
        metadata = {"server": index, "side": side.name, "load": load.name, "model": a.model, "layers": a.layers}
        args = load.bench_args(
            served_model=SERVED_MODEL, tokenizer=str(self.model_dir), port=port, seed=a.seed + k + seed_offset,
            prompts=prompts, result_dir=str(self.results_dir if load.measured else self.work / "warmup"),
            result_filename=f"{name}.json", metadata=metadata,
            extra=tuple(w for arg in a.bench_arg for w in shlex.split(arg)),
            backend=a.configuration.client_backend,
        )  # fmt: skip
        spec = {"name": load.name, "prompts": prompts, "args": args, "estimate_s": self.estimator.load_s(load, prompts)}
        if load.profile_steps:
            spec["profile"] = {"prefix": step_profile.prefix(index, side.slug, load.name),
                               "skip": load.profile_skip, "steps": load.profile_steps}  # fmt: skip
        if load.pyspy:
            spec["pyspy"] = {"prefix": str(self.results_dir / f"pyspy-{name}")}
        return spec

    def server_log_path(self, index: int, side: Side) -> Path:
        return self.logs_dir / f"server-{index:02d}-{side.slug}.log"

    def start_client(self, index: int, side: Side, port: int, scale: float, server_pid: int | None = None
                     ) -> subprocess.Popen:  # fmt: skip
        spec = self.client_spec(index, side, port, scale, server_pid)
        for name in ("go_file", "stop_file", "progress"):
            Path(spec[name]).unlink(missing_ok=True)
        spec_path = self.logs_dir / f"client-{index:02d}.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        # The client runs in the driver's environment (no side switch: it never loads the plugin).
        with open(self.logs_dir / f"client-{index:02d}.log", "w") as out:
            return subprocess.Popen([sys.executable, "-m", "benchmarks.serving.client", str(spec_path)], cwd=REPO,
                                    env=self.base_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def _stop_client(self, client: subprocess.Popen, index: int) -> None:
        (self.work / f"stop-{index:02d}").touch()
        if client.poll() is None:
            os.killpg(client.pid, signal.SIGTERM)  # the group start_client made
            try:
                client.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(client.pid, signal.SIGKILL)
                client.wait()

    def read_progress(self, index: int, side: Side) -> list[dict]:
        path = self.logs_dir / f"progress-{index:02d}.jsonl"
        if not path.is_file():
            return []
        entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        loads = [e for e in entries if e.get("event") == "load"]
        by_name = {ld.name: ld for ld in self.args.load_list}
        for entry in loads:
            result = self.results_dir / f"{entry.get('server', index):02d}-{side.slug}-{entry['load']}.json"
            if "wall_s" in entry and "error" not in entry and entry["load"] in by_name:
                duration = _json_field(result, "duration") if by_name[entry["load"]].measured else None
                self.measured.add_load(by_name[entry["load"]], entry["prompts"], duration or entry["wall_s"])
        return loads

    # -- output ---------------------------------------------------------------------

    def _model_description(self) -> str:
        if self.args.model == "tiny":
            return "the demo's tiny DeepSeek-V3-architecture model (3 layers), vLLM's CPU platform"
        return f"{models.MODELS[self.args.model]}; {models.describe(self.config, self.args.tensor_parallel_size)}"

    def _print_commands(self, the_plan) -> None:
        spec = self.server_spec()
        for index, side in the_plan.servers:
            env = {k: v for k, v in self.side_env(side).items() if k.startswith("VLLM_") or k == "PYTHONPATH"}
            print(f"server {index} ({side.name}): {' '.join(f'{k}={v}' for k, v in sorted(env.items()))} "
                  f"{shlex.join([*spec.launcher, spec.model_dir, '--served-model-name', spec.served_model, *spec.args])}")  # fmt: skip
            for load in self.client_spec(index, side, 8000, the_plan.scale)["loads"]:
                print(f"  vllm bench serve {shlex.join(load['args'])}   (~{load['estimate_s']:.0f} s)")

    def probe_summary(self) -> dict:
        """The first probed server of each side, compared (probe.compare_sides), and every server's probe error."""
        firsts: dict[str, dict] = {}
        errors = []
        for s in self.state["servers"]:
            p = s.get("probe")
            if p and "error" in p:
                errors.append(f"server {s['index']} ({s['side']}): {p['error']}")
            elif p and s["side"] not in firsts:
                firsts[s["side"]] = p
        try:
            out = probe.compare_sides(firsts)
        except ValueError as e:
            out = {"error": str(e)}
        out["errors"] = errors
        out["servers"] = {side: p.get("redraw") for side, p in firsts.items()}
        return out

    def write_report(self) -> dict:
        a = self.args
        servers = self.state["servers"]
        prefix_cache, compiles, hosts = {}, {}, {}
        for s in servers:
            for entry in s.get("loads", []):
                hosts[(s["index"], entry["load"])] = entry
                if "prefix_cache" in entry:
                    prefix_cache[(s["index"], entry["load"])] = entry["prefix_cache"]
                if "kernel_compiles" in entry:
                    compiles[(s["index"], entry["load"])] = entry["kernel_compiles"]
        sides = [s.name for s in a.side_list]
        out = {
            "config": {
                "model": a.model, "layers": a.layers, "model_description": self._model_description(),
                "model_config": self.config, "sides": sides, "servers_per_side": a.servers_per_side,
                "interleave": self.rounds if a.interleave else None,
                "loads": {ld.name: ld.describe() for ld in a.load_list if ld.measured},
                "server_command": shlex.join([*self.server_spec().launcher, "MODEL", *self.server_spec().args]),
                "server_summary": "CPU platform, demo.serve" if a.cpu else "dummy weights",
                "configuration": {"name": a.config, "description": a.configuration.description,
                                  **a.configuration.settings(a.max_model_len, a.loads),
                                  "more server options": a.server_arg},
                "bench_args": a.bench_arg, "seed": a.seed, "budget_s": a.budget_s,
            },
            "environment": _environment(),
            "plan": self.state.get("plan"),
            "servers": servers,
            "servers_measured": sum(1 for s in servers if s.get("loads")),
            "servers_per_side_measured": {n: sum(1 for s in servers if s["side"] == n and s.get("loads")) for n in sides},
            "loads": report.summarize(report.read_results(self.results_dir), sides, a.layers, prefix_cache, compiles,
                                      hosts, interleaved=len(sides) if a.interleave else 0),
            "probe": self.probe_summary() if a.probe else None,
            "step_profile": step_profile.compare_sides(servers) if self.profiled else None,
            "host_samples": host_samples.compare_sides(servers) if any(ld.pyspy for ld in a.load_list) else None,
            "problems": [],
            "measured_times": self.measured.to_json(),
            "skipped": self.skipped,
            "errors": self.errors,
            "elapsed_s": time.monotonic() - self.t0,
        }
        out["problems"] = [f"{name}: {p}" for name, load in out["loads"].items() for p in load["problems"]]
        out["problems"] += probe.problems(out["probe"]) if out["probe"] else []
        base = a.out / f"serving_{a.tag}"
        out["plot"] = "not asked for (--no-plot)" if a.no_plot else report.plot(out, base.with_suffix(".png"))
        log(out["plot"])
        base.with_suffix(".json").write_text(json.dumps(out, indent=1, default=str))
        markdown = report.markdown(out) + (probe.markdown(out["probe"]) if out["probe"] else "")
        markdown += step_profile.markdown(out["step_profile"]) if out["step_profile"] else ""
        markdown += host_samples.markdown(out["host_samples"]) if out["host_samples"] else ""
        base.with_suffix(".md").write_text(markdown)
        # The raw material beside the report: vLLM's own result files, server and client logs.
        raw = a.out / f"serving_{a.tag}_raw"
        shutil.rmtree(raw, ignore_errors=True)
        shutil.copytree(self.results_dir, raw / "results")
        shutil.copytree(self.logs_dir, raw / "logs")
        print(markdown, flush=True)
        return out


def attribute_server_log(loads: list[dict], server_log: Path) -> None:
    """What the server logged during each load, between the client's two readings of the log's size
    (``server_log_bytes``): ``kernel_compiles`` and, where vLLM logged its iterations
    (``--enable-logging-iteration-details``), ``engine_steps``. Loads without both readings get
    neither (not an empty list)."""
    try:
        text = server_log.read_bytes()
    except OSError:
        return
    for entry in loads:
        span = entry.get("server_log_bytes")
        if span:
            stretch = text[span[0] : span[1]].decode(errors="replace")
            entry["kernel_compiles"] = kernel_compiles(stretch)
            if steps := engine_steps(stretch):
                entry["engine_steps"] = steps


def server_profiler_config(directory: Path) -> dict:
    """benchmarks/e2e/vllm_engine.py's torch-profiler settings, for the server's /start_profile; the
    workers only: the API server's own profiler would record the whole session, the client's requests
    included, in the process that serves them (vLLM: needed with per-session step bounds)."""
    from benchmarks.e2e import vllm_engine  # imports no vLLM

    return {**vllm_engine.profiler_config(str(directory)), "ignore_frontend": True}


def _json_field(path: Path, name: str):
    try:
        return json.loads(path.read_text()).get(name)
    except (OSError, ValueError):
        return None


def _git_head(path: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _environment() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    env = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": sys.version.split()[0],
           "argv": sys.argv, **provenance.source_facts(REPO)}  # fmt: skip
    for name in ("vllm", "torch", "triton", "transformers"):
        try:
            env[name] = version(name)
        except PackageNotFoundError:
            env[name] = None
    try:
        env["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=20).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        env["gpu"] = None
    env["variables"] = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "HF_")) and "TOKEN" not in k}
    return env


def main(argv=None) -> int:
    # The GPU script's timeout ends the driver with SIGTERM: unwind, so that every server and
    # client is stopped (their process groups are their own) and the state is saved.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return Benchmark(parse_args(argv)).run()
