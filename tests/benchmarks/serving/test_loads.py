"""benchmarks/serving/loads.py: the loads, and their `vllm bench serve` command lines as vLLM's parser reads them."""

from __future__ import annotations

import math

import pytest

from benchmarks.serving.loads import DEFAULT_LOADS, PRESETS, Load, parse_load, parse_loads, scaled_prompts


def test_the_issues_loads_are_the_presets():
    assert (PRESETS["rate4"].input_len, PRESETS["rate4"].output_len, PRESETS["rate4"].request_rate) == (1024, 128, 4)
    assert (PRESETS["rate16"].input_len, PRESETS["rate16"].output_len, PRESETS["rate16"].request_rate) == (1024, 128, 16)
    sat = PRESETS["saturate"]
    assert (sat.input_len, sat.output_len, math.isinf(sat.request_rate)) == (512, 256, True)
    assert 64 <= sat.max_concurrency <= 128
    assert (PRESETS["prefill"].input_len, PRESETS["prefill"].output_len) == (4096, 32)
    assert DEFAULT_LOADS[0] == "warmup" and not PRESETS["warmup"].measured


def test_a_load_written_out():
    load = parse_load("name=short,in=64,out=8,rate=inf,concurrency=4,prompts=6")
    assert load == Load("short", 64, 8, math.inf, prompts=6, max_concurrency=4)
    assert parse_load("name=w,in=8,out=2,rate=2,prompts=3,warmup=1").measured is False
    assert parse_load("rate16") is PRESETS["rate16"]
    assert parse_load("name=v,in=64,out=8,rate=4,prompts=6,range=0.5").range_ratio == 0.5
    assert parse_load("name=v,in=64,out=8,rate=4,prompts=6").range_ratio == 0.0


def test_the_warm_up_takes_every_step_size_class_of_the_loads():
    """Its prompts vary from about a tenth of to nearly twice 2048 tokens, with up to 16 in flight: its steps
    take sizes from a few hundred tokens to a full 8192-token chunk, which the measured loads' eager steps
    (a 512- or 1k-token prompt plus decodes, a 4k prompt) fall within; the measured loads stay fixed."""
    w = PRESETS["warmup"]
    assert not w.measured and w.max_concurrency >= 8 and w.prompts >= 3 * w.max_concurrency
    low, high = w.input_len * (1 - w.range_ratio), w.input_len * (1 + w.range_ratio)
    assert low <= PRESETS["saturate"].input_len and high >= PRESETS["prefill"].input_len * 0.9
    assert high + w.output_len * (1 + w.range_ratio) <= 8192  # within the default --max-model-len
    assert all(PRESETS[name].range_ratio == 0 for name in DEFAULT_LOADS if PRESETS[name].measured)
    assert "--random-range-ratio" not in _args(PRESETS["rate4"])
    args = _args(w)
    assert args[args.index("--random-range-ratio") + 1] == "0.9"


def test_a_second_warm_up_takes_the_saturating_loads_mix_before_it():
    """Stop 32's H200 run: fused-MoE compiles inside ``saturate`` (64 decodes plus short prompts) that the long
    prompts at 16 in flight never caused; the decode warm-up runs that mix at the same concurrency, before every
    measured load, with lengths around saturate's."""
    d, sat = PRESETS["warmup_decode"], PRESETS["saturate"]
    assert not d.measured and d.max_concurrency == sat.max_concurrency and d.prompts >= 2 * d.max_concurrency
    assert d.input_len * (1 - d.range_ratio) <= sat.input_len <= d.input_len * (1 + d.range_ratio)
    measured = [name for name in DEFAULT_LOADS if PRESETS[name].measured]
    assert DEFAULT_LOADS.index("warmup_decode") < DEFAULT_LOADS.index(measured[0])


@pytest.mark.parametrize("text", ["nosuch", "name=x,in=64,out=8,rate=4", "name=x,in=64,out=8,rate=4,prompts=0",
                                  "name=x,in=64,out=8,rate=0,prompts=4", "name=a/b,in=1,out=1,rate=1,prompts=1",
                                  "name=x,in=64,out=8,rate=4,prompts=4,colour=red", "name=x,in64",
                                  "name=x,in=64,out=8,rate=4,prompts=4,range=1", "name=x,in=64,out=8,rate=4,prompts=4,range=-0.1",
                                  "name=x,in=64,out=8,rate=4,prompts=4,skip=5", "name=x,in=64,out=8,rate=4,prompts=4,profile=-1",
                                  "name=x,in=64,out=8,rate=4,prompts=4,profile=9,skip=-1"])  # fmt: skip
def test_bad_loads_are_refused(text):
    with pytest.raises(ValueError):
        parse_load(text)


def test_a_profiled_load_is_never_reported():
    """Its latencies are the profiler's as much as the server's: a profiled load is not measured, whatever the
    spec says; ``profile16`` is rate16's mix, recorded after its ramp-up, and not among the defaults."""
    load = parse_load("name=p,in=64,out=8,rate=4,prompts=6,profile=20,skip=3")
    assert (load.profile_steps, load.profile_skip, load.measured) == (20, 3, False)
    assert parse_load("name=p,in=64,out=8,rate=4,prompts=6,profile=20,warmup=0").measured is False
    assert parse_load("name=p,in=64,out=8,rate=4,prompts=6").profile_steps == 0
    p16, r16 = PRESETS["profile16"], PRESETS["rate16"]
    assert (p16.input_len, p16.output_len, p16.request_rate) == (r16.input_len, r16.output_len, r16.request_rate)
    assert not p16.measured and p16.profile_steps > 0 and p16.profile_skip > 0 and "profile16" not in DEFAULT_LOADS
    assert "profiled: engine steps 50-200" in p16.describe()
    assert [ld.name for ld in parse_loads(["warmup", "profile16"])] == ["warmup", "profile16"]  # nothing else needed


def test_load_lists():
    with pytest.raises(ValueError, match="twice"):
        parse_loads(["rate4", "rate4"])
    with pytest.raises(ValueError, match="nothing would be measured"):
        parse_loads(["warmup"])


def test_scaling_keeps_a_wave():
    assert scaled_prompts(PRESETS["rate16"], 0.5) == 100
    assert scaled_prompts(PRESETS["saturate"], 0.01) == 64  # one wave of its concurrency at least
    assert scaled_prompts(PRESETS["rate4"], 0.001) == 4


def _args(load, **kw):
    return load.bench_args(served_model="m", tokenizer="/model", port=8123, seed=7, prompts=kw.pop("prompts", 50),
                           result_dir="/r", result_filename="01-off-rate4.json",
                           metadata={"server": 1, "side": "on@/x=y", "load": load.name}, **kw)  # fmt: skip


@pytest.mark.vllm
def test_vllm_bench_serve_reads_the_arguments_as_meant():
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    a = parser.parse_args(_args(PRESETS["saturate"], extra=("--ready-check-timeout-sec", "5")))
    assert (a.backend, a.host, a.port, a.model, a.tokenizer) == ("openai", "127.0.0.1", 8123, "m", "/model")
    assert (a.dataset_name, a.random_input_len, a.random_output_len, a.num_prompts) == ("random", 512, 256, 50)
    assert math.isinf(a.request_rate) and a.max_concurrency == 64 and a.seed == 7
    assert a.ignore_eos and a.temperature == 0 and a.save_result and a.disable_tqdm
    assert (a.result_dir, a.result_filename) == ("/r", "01-off-rate4.json")
    assert a.percentile_metrics == "ttft,tpot,itl,e2el" and a.metric_percentiles == "50,99"
    assert a.metadata == ["server=1", "side=on@/x=y", "load=saturate"]  # vLLM splits at the first '='
    assert a.ready_check_timeout_sec == 5
    paced = parser.parse_args(_args(PRESETS["rate4"]))
    assert paced.request_rate == 4.0 and paced.max_concurrency is None
    assert float(paced.random_range_ratio) == 0.0
    assert float(parser.parse_args(_args(PRESETS["warmup"])).random_range_ratio) == 0.9


def test_a_chat_like_load_whose_mixed_steps_replay_piecewise_graphs():
    """short32's steps (a prompt or two plus the running decodes) stay within the 512 tokens vLLM
    captures on an H200, so they exercise piecewise CUDA graphs, which the 1k-prompt loads never do."""
    short = PRESETS["short32"]
    assert short.input_len * 2 <= 512 < PRESETS["rate4"].input_len
    assert short.measured and "short32" not in DEFAULT_LOADS  # the issue's loads stay the default
