"""The sides compared, the environment each side's server gets, and the order servers start in.

A side is written as on the command line:

- ``off``: the plugin installed but switched off (``VLLM_MLA_FUSION=0``): vLLM as shipped;
- ``on``: the plugin of this checkout (the package Python finds first, as installed);
- ``on@PATH``: the plugin of another checkout at PATH (a directory holding
  ``vllm_mla_fusion/``), put first on the server's PYTHONPATH: a baseline commit and the
  new one compared in one lease. vLLM still finds the plugin through the installed entry
  point (``vllm_mla_fusion.vllm_plugin:register``), which then imports PATH's package.
- ``on+NAME=VALUE`` (also ``on@PATH+NAME=VALUE``, repeatable): a plugin side with one of the
  plugin's switches set (docs/vllm.md), e.g. ``on+VLLM_MLA_FUSION_DECODE=0``: the
  ``rope_cache`` mode (op 1 inside the compiled graph) against the default ``decode`` mode.

Servers take turns side by side, and every round reverses the order of the one before
(on, off, off, on, on, off, ...), so that no side always starts right after the same
other side or always first on a fresh machine.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

ENV_ENABLE = "VLLM_MLA_FUSION"  # vllm_mla_fusion.vllm_plugin.settings.ENV_ENABLE (not imported: the driver imports no torch)
ENV_DECODE = "VLLM_MLA_FUSION_DECODE"  # off: every layer in rope_cache mode
ENV_GRAPH_ROPE = "VLLM_MLA_FUSION_GRAPH_ROPE"  # on: decode mode logs itself as decode-graph-rope
ENV_PREFILL_KEY = "VLLM_MLA_FUSION_PREFILL_KEY"  # on: decode mode logs itself as decode[-graph-rope]-prefill-key
# The plugin's switches other than ENV_ENABLE (settings.ENVIRONMENT_VARIABLES; a test keeps them equal).
SWITCHES = (ENV_DECODE, ENV_PREFILL_KEY, "VLLM_MLA_FUSION_PREWARM", ENV_GRAPH_ROPE,
            "VLLM_MLA_FUSION_BACKEND", "VLLM_MLA_FUSION_DEBUG", "VLLM_MLA_FUSION_PDL", "VLLM_MLA_FUSION_AITER_FP8")  # fmt: skip
PACKAGE = "vllm_mla_fusion"
OFF_VALUES = ("0", "false", "no", "off")  # settings.env_enabled's
ON_VALUES = ("1", "true", "yes", "on")  # settings.env_opted_in's


@dataclass(frozen=True)
class Side:
    """One configuration of the server; ``name`` is how the command line and the report write it."""

    name: str
    plugin: bool
    checkout: Path | None = None
    env: tuple[tuple[str, str], ...] = ()  # the plugin's switches this side sets

    @property
    def slug(self) -> str:
        """A file-name-safe, unique label: ``off``, ``on``, ``on-at-<dir>-<hash>``, then
        ``-<NAME>_<VALUE>`` per switch (NAME less the prefix ``VLLM_MLA_FUSION`` and its underscore)."""
        if self.checkout is None:
            base = self.name.partition("+")[0]
        else:
            digest = hashlib.sha1(str(self.checkout).encode()).hexdigest()[:6]
            base = f"on-at-{self.checkout.name}-{digest}"
        switches = "".join(f"-{name.removeprefix(ENV_ENABLE + '_')}_{value}" for name, value in self.env)
        return re.sub(r"[^A-Za-z0-9_.-]", "_", base + switches)

    @property
    def expected_mode(self) -> str | None:
        """The fusion mode the plugin's line must name where this side's switches decide it (None:
        the plugin chooses, e.g. rope_cache where the decode mode is not eligible)."""
        env = {k: v.strip().lower() for k, v in self.env}
        if env.get(ENV_DECODE) in OFF_VALUES:
            return "rope_cache"
        graph_rope, prefill_key = env.get(ENV_GRAPH_ROPE) in ON_VALUES, env.get(ENV_PREFILL_KEY) in ON_VALUES
        if not (graph_rope or prefill_key):
            return None
        return "decode" + ("-graph-rope" if graph_rope else "") + ("-prefill-key" if prefill_key else "")

    def accepts_mode(self, mode: str) -> bool:
        """Whether the plugin's line may name ``mode`` on this side: the expected mode, or for a
        checkout's side (``on@PATH``) that mode without ``-prefill-key``, since checkouts from before
        the line named op 3 (1d01116) say plain ``decode`` with it on."""
        want = self.expected_mode
        if want is None or mode == want:
            return True
        return self.checkout is not None and want.endswith("-prefill-key") and mode == want.removesuffix("-prefill-key")

    def server_env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with this side's switches and, for ``on@PATH``, PATH first on PYTHONPATH. The
        plugin's switches set in ``base`` (the driver's own environment) are dropped: a side is
        what its name says, whatever the shell exported."""
        env = {k: v for k, v in base.items() if k not in SWITCHES}
        env[ENV_ENABLE] = "1" if self.plugin else "0"
        env.update(self.env)
        if self.checkout is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.checkout), base.get("PYTHONPATH", "")) if p)
        return env


def parse_side(text: str) -> Side:
    """``off``, ``on``, ``on@PATH`` (PATH must hold the package and contain no ``+``), either plugin
    side followed by ``+NAME=VALUE`` switches (NAME one of ``SWITCHES``, the plugin's variables other
    than the on/off switch ``VLLM_MLA_FUSION`` itself); ValueError otherwise."""
    base, *assignments = text.split("+")
    env = []
    for a in assignments:
        name, sep, value = a.partition("=")
        if not sep or name not in SWITCHES or not value:
            raise ValueError(f"side {text!r}: a switch is +NAME=VALUE with NAME one of {SWITCHES}, not {a!r}")
        env.append((name, value))
    if len({name for name, _ in env}) != len(env):
        raise ValueError(f"side {text!r} sets a switch twice")
    if base in ("on", "off"):
        if base == "off" and env:
            raise ValueError(f"side {text!r}: the off side runs vLLM as shipped, it takes no plugin switch")
        return Side(text, plugin=base == "on", env=tuple(env))
    head, sep, path = base.partition("@")
    if head != "on" or not sep or not path:
        raise ValueError(f"a side is 'off', 'on', 'on@PATH' or a plugin side with +NAME=VALUE switches, not {text!r}")
    checkout = Path(path).expanduser().resolve()
    if not (checkout / PACKAGE / "__init__.py").is_file():
        raise ValueError(f"side {text!r}: {checkout} holds no {PACKAGE}/ package")
    suffix = "".join(f"+{name}={value}" for name, value in env)
    return Side(f"on@{checkout}{suffix}", plugin=True, checkout=checkout, env=tuple(env))


def parse_sides(texts: list[str]) -> list[Side]:
    sides = [parse_side(t) for t in texts]
    names = [s.name for s in sides]
    if len(set(names)) != len(names):
        raise ValueError(f"a side is given twice: {texts}")
    if len(sides) < 2:
        raise ValueError(f"compare at least two sides, got {texts}")
    return sides


def side_of_server(sides: list[Side], index: int) -> Side:
    """The side of the ``index``-th server (0-based, counted over every call of a resumed run)."""
    round_, position = divmod(index, len(sides))
    order = sides if round_ % 2 == 0 else sides[::-1]
    return order[position]


def server_order(sides: list[Side], servers_per_side: int, first: int = 0) -> list[tuple[int, Side]]:
    """(index, side) of the servers ``first`` .. the last one of ``servers_per_side`` rounds."""
    return [(i, side_of_server(sides, i)) for i in range(first, servers_per_side * len(sides))]


def interleaved_turns(num_sides: int, rounds: int) -> list[tuple[int, int]]:
    """(round, side position) of every measured turn of ``--interleave``: each side's server once per
    round, the order reversed every other round (A B, B A, A B, ...), so that a drift of the host's
    speed over the run falls on every side alike; within a round the sides meet the same minutes."""
    turns = []
    for r in range(rounds):
        order = range(num_sides) if r % 2 == 0 else range(num_sides - 1, -1, -1)
        turns += [(r, position) for position in order]
    return turns
