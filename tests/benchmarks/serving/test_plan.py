"""benchmarks/serving/plan.py: start-up and load estimates, and what fits a time budget."""

from __future__ import annotations

import math

import pytest

from benchmarks.serving import plan as P
from benchmarks.serving.loads import PRESETS, Load
from benchmarks.serving.sides import parse_sides, server_order

SPEED = P.Speed(30.0, 1.0, 10.0, 0.5, tpot_s=0.05, decode_step_s=0.01, prefill_tokens_per_s=10_000)
LOADS = [PRESETS["rate4"], PRESETS["saturate"]]


def _estimator(measured=None, layers=10):
    return P.Estimator(SPEED, layers, measured or P.Measured())


def test_guessed_start_up_cold_and_warm():
    e = _estimator()
    assert e.start_s("on", warm=False) == 30.0 + 10
    assert e.start_s("on", warm=True) == 10.0 + 5


def test_measured_start_up_replaces_the_guess():
    m = P.Measured()
    m.add_start("on", warm=False, seconds=100.0)
    m.add_start("on", warm=True, seconds=20.0)
    e = _estimator(m)
    assert e.start_s("off", warm=False) == pytest.approx(110.0)  # another side's cold start, with 10% margin
    assert e.start_s("on", warm=True) == 20.0
    assert e.start_s("off", warm=True) == 15.0  # no warm start of off measured yet: the guess


def test_load_estimates():
    e = _estimator()
    rate = Load("r", 1000, 100, 4.0, prompts=40)
    assert e.load_s(rate, 40) == pytest.approx(40 / 4 + 0.1 + 100 * 0.05 + P.LOAD_OVERHEAD_S)
    waves = Load("c", 1000, 100, math.inf, prompts=64, max_concurrency=16)
    assert e.load_s(waves, 64) == pytest.approx(4 * (16 * 0.1 + 100 * 0.01) + P.LOAD_OVERHEAD_S)
    m = P.Measured()
    m.add_load(rate, 40, 7.0)
    assert _estimator(m).load_s(rate, 40) == 7.0 + P.LOAD_OVERHEAD_S
    assert _estimator(m).load_s(rate, 20) == e.load_s(rate, 20)  # measured at another prompt count
    # A profiled load: the trace export and the driver's reading of it on top; measured, only the reading.
    profiled = Load("p", 1000, 100, 4.0, prompts=40, measured=False, profile_steps=10)
    assert e.load_s(profiled, 40) == pytest.approx(e.load_s(rate, 40) + P.PROFILED_LOAD_S)
    m.add_load(profiled, 40, 9.0)
    assert _estimator(m).load_s(profiled, 40) == 9.0 + P.LOAD_OVERHEAD_S + P.PROFILED_LOAD_S / 2


def test_measured_round_trips_through_json():
    m = P.Measured()
    m.add_start("on", warm=True, seconds=20.0)
    m.add_load(PRESETS["rate4"], 100, 30.0)
    assert P.Measured.from_json(m.to_json()) == m
    assert P.Measured.from_json(None) == P.Measured()


def _queue(n=2):
    return server_order(parse_sides(["on", "off"]), n)


def test_servers_are_taken_in_order_while_they_fit():
    e = _estimator()
    cold = e.server_s("on", False, LOADS, 1.0)
    warm = e.server_s("on", True, LOADS, 1.0)
    p = P.plan(_queue(), cold * 2 + warm + 1, e, LOADS, set())
    assert [(i, s.name) for i, s in p.servers] == [(0, "on"), (1, "off"), (2, "off")]
    assert p.estimates_s == pytest.approx([cold, cold, warm])  # the second server of a side starts warm
    assert p.scale == 1.0 and "1 more server" in p.reason


def test_warm_caches_from_an_earlier_call_count():
    e = _estimator()
    p = P.plan(_queue(), 10_000, e, LOADS, {"on", "off"})
    assert p.estimates_s == pytest.approx([e.server_s("on", True, LOADS, 1.0)] * 4)
    assert p.reason == ""


def test_prompts_shrink_before_nothing_runs():
    e = _estimator()
    budget = e.server_s("on", False, LOADS, 0.5) + 1
    assert budget < e.server_s("on", False, LOADS, 1.0)
    p = P.plan(_queue(), budget, e, LOADS, set())
    assert p.scale == 0.5 and len(p.servers) == 1


def test_nothing_fits_says_why():
    p = P.plan(_queue(), 5.0, _estimator(), LOADS, set())
    assert p.servers == [] and p.reason.startswith("no server fits: the next (on) needs")
    assert P.plan([], 5.0, _estimator(), LOADS, set()).reason == ""
    doc = P.plan(_queue(), 5.0, _estimator(), LOADS, set()).to_json()
    assert doc["servers"] == [] and doc["budget_s"] == 5.0


def test_the_h200_defaults_fit_one_call():
    """Dense, 61 layers, sides on/off, default loads: a cold pair fits the GPU script's ~545 s."""
    from benchmarks.serving.loads import DEFAULT_LOADS, parse_loads

    e = P.Estimator(P.SPEEDS["dense"], 61, P.Measured())
    loads = parse_loads(list(DEFAULT_LOADS))
    p = P.plan(_queue(), 585 - 20 - 20, e, loads, set())
    assert [s.name for _, s in p.servers] == ["on", "off"] and p.scale == 1.0
    warm = P.plan(server_order(parse_sides(["on", "off"]), 2, first=2), 530, e, loads, {"on", "off"})
    assert [s.name for _, s in warm.servers] == ["off", "on"]
