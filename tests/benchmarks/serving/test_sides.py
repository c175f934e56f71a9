"""benchmarks/serving/sides.py: off / on / on@PATH, each side's server environment, the alternating order."""

from __future__ import annotations

import pytest

from benchmarks.serving.sides import Side, parse_side, parse_sides, server_order, side_of_server


@pytest.fixture
def old_checkout(tmp_path):
    (tmp_path / "old" / "vllm_mla_fusion").mkdir(parents=True)
    (tmp_path / "old" / "vllm_mla_fusion" / "__init__.py").write_text("")
    return tmp_path / "old"


def test_on_and_off():
    assert parse_side("on") == Side("on", plugin=True)
    assert parse_side("off") == Side("off", plugin=False)


def test_on_at_a_checkout(old_checkout):
    side = parse_side(f"on@{old_checkout}")
    assert side.plugin and side.checkout == old_checkout.resolve()
    assert side.name == f"on@{old_checkout.resolve()}"
    assert side.slug.startswith("on-at-old-") and "/" not in side.slug


def test_two_checkouts_of_the_same_name_get_different_slugs(tmp_path, old_checkout):
    other = tmp_path / "elsewhere" / "old"
    (other / "vllm_mla_fusion").mkdir(parents=True)
    (other / "vllm_mla_fusion" / "__init__.py").write_text("")
    assert parse_side(f"on@{old_checkout}").slug != parse_side(f"on@{other}").slug


@pytest.mark.parametrize("text", ["On", "of", "off@/x", "on@", "@/x", "on@/nonexistent/checkout"])
def test_bad_sides_are_refused(text):
    with pytest.raises(ValueError):
        parse_side(text)


def test_a_side_twice_or_alone_is_refused():
    with pytest.raises(ValueError, match="twice"):
        parse_sides(["on", "on"])
    with pytest.raises(ValueError, match="at least two"):
        parse_sides(["on"])


def test_server_environment(old_checkout):
    base = {"PYTHONPATH": "/tmp/site:/repo", "VLLM_MLA_FUSION": "0", "OTHER": "x"}
    assert parse_side("on").server_env(base) == {**base, "VLLM_MLA_FUSION": "1"}
    assert parse_side("off").server_env({"OTHER": "x"}) == {"OTHER": "x", "VLLM_MLA_FUSION": "0"}
    old = parse_side(f"on@{old_checkout}").server_env(base)
    assert old["PYTHONPATH"] == f"{old_checkout.resolve()}:/tmp/site:/repo"  # the old package is found first
    assert old["VLLM_MLA_FUSION"] == "1"
    assert parse_side(f"on@{old_checkout}").server_env({})["PYTHONPATH"] == str(old_checkout.resolve())
    assert base["VLLM_MLA_FUSION"] == "0"  # the caller's dict is left alone


def test_rounds_alternate_their_order():
    on, off = parse_sides(["on", "off"])
    assert [s.name for _, s in server_order([on, off], 3)] == ["on", "off", "off", "on", "on", "off"]
    assert [s.name for _, s in server_order([off, on], 2)] == ["off", "on", "on", "off"]


def test_three_sides_alternate_too(old_checkout):
    sides = parse_sides(["on", "off", f"on@{old_checkout}"])
    names = [s.name.split("@")[0] + ("@" if "@" in s.name else "") for _, s in server_order(sides, 2)]
    assert names == ["on", "off", "on@", "on@", "off", "on"]


def test_a_resumed_run_continues_the_sequence():
    sides = parse_sides(["on", "off"])
    assert server_order(sides, 2, first=2) == [(2, side_of_server(sides, 2)), (3, side_of_server(sides, 3))]
    assert [s.name for _, s in server_order(sides, 2, first=1)] == ["off", "off", "on"]
    assert server_order(sides, 2, first=4) == []


def test_a_plugin_side_with_switches(old_checkout):
    side = parse_side("on+VLLM_MLA_FUSION_DECODE=0")
    assert side.plugin and side.checkout is None and side.env == (("VLLM_MLA_FUSION_DECODE", "0"),)
    assert side.name == "on+VLLM_MLA_FUSION_DECODE=0" and side.slug == "on-DECODE_0"
    assert side.expected_mode == "rope_cache" and parse_side("on").expected_mode is None
    assert parse_side("on+VLLM_MLA_FUSION_GRAPH_ROPE=1").expected_mode == "decode-graph-rope"
    assert parse_side("on+VLLM_MLA_FUSION_PREFILL_KEY=1").expected_mode == "decode-prefill-key"
    assert parse_side("on+VLLM_MLA_FUSION_PREFILL_KEY=1+VLLM_MLA_FUSION_GRAPH_ROPE=on").expected_mode == (
        "decode-graph-rope-prefill-key")  # fmt: skip
    env = side.server_env({"VLLM_MLA_FUSION_DECODE": "1", "OTHER": "x"})
    assert env == {"VLLM_MLA_FUSION": "1", "VLLM_MLA_FUSION_DECODE": "0", "OTHER": "x"}
    two = parse_side("on+VLLM_MLA_FUSION_PREFILL_KEY=0+VLLM_MLA_FUSION_PDL=0")
    assert two.slug == "on-PREFILL_KEY_0-PDL_0" and two.expected_mode is None
    at = parse_side(f"on@{old_checkout}+VLLM_MLA_FUSION_DECODE=off")
    assert at.checkout == old_checkout.resolve() and at.expected_mode == "rope_cache"
    assert at.slug.startswith("on-at-old-") and at.slug.endswith("-DECODE_off")
    assert at.server_env({})["PYTHONPATH"] == str(old_checkout.resolve())
    # Distinct sides, distinct compile caches: every slug differs.
    sides = parse_sides(["on", "off", "on+VLLM_MLA_FUSION_DECODE=0", f"on@{old_checkout}+VLLM_MLA_FUSION_DECODE=0"])
    assert len({s.slug for s in sides}) == 4


@pytest.mark.parametrize("text", ["off+VLLM_MLA_FUSION_DECODE=0", "on+DECODE=0", "on+VLLM_MLA_FUSION_DECODE",
                                  "on+VLLM_MLA_FUSION_DECODE=", "on+VLLM_MLA_FUSION_DECODE=0+VLLM_MLA_FUSION_DECODE=1",
                                  "on+VLLM_ATTENTION_BACKEND=TRITON_MLA", "on+VLLM_MLA_FUSION_GRAPH_ROEP=1",
                                  "on+VLLM_MLA_FUSION_PREFILL=KEY_0", "on+VLLM_MLA_FUSION=0"])  # fmt: skip
def test_bad_switches_are_refused(text):
    """Malformed, doubled and unknown switches (a typo would otherwise run as plain ``on``)."""
    with pytest.raises(ValueError):
        parse_side(text)


def test_the_shells_switches_do_not_reach_a_side_that_does_not_name_them():
    base = {"VLLM_MLA_FUSION_DECODE": "0", "VLLM_MLA_FUSION_GRAPH_ROPE": "1", "VLLM_MLA_FUSION_ENV": "/env", "X": "y"}
    on = parse_side("on").server_env(base)
    assert "VLLM_MLA_FUSION_DECODE" not in on and "VLLM_MLA_FUSION_GRAPH_ROPE" not in on
    assert on["VLLM_MLA_FUSION_ENV"] == "/env" and on["X"] == "y"  # locations and the rest stay
    assert parse_side("on+VLLM_MLA_FUSION_DECODE=0").server_env(base)["VLLM_MLA_FUSION_DECODE"] == "0"


def test_the_switch_list_is_the_plugins():
    from vllm_mla_fusion.vllm_plugin import settings

    from benchmarks.serving import sides

    assert set(sides.SWITCHES) == set(settings.ENVIRONMENT_VARIABLES) - {settings.ENV_ENABLE}
    assert sides.ENV_ENABLE == settings.ENV_ENABLE
