"""The sides compared, the environment each side's server gets, and the order servers start in.

A side is written as on the command line:

- ``off``: the plugin installed but switched off (``VLLM_MLA_FUSION=0``): vLLM as shipped;
- ``on``: the plugin of this checkout (the package Python finds first, as installed);
- ``on@PATH``: the plugin of another checkout at PATH (a directory holding
  ``vllm_mla_fusion/``), put first on the server's PYTHONPATH: a baseline commit and the
  new one compared in one lease. vLLM still finds the plugin through the installed entry
  point (``vllm_mla_fusion.vllm_plugin:register``), which then imports PATH's package.

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

ENV_ENABLE = "VLLM_MLA_FUSION"  # vllm_mla_fusion.vllm_plugin.ENV_ENABLE (not imported: the driver stays vLLM-free)
PACKAGE = "vllm_mla_fusion"


@dataclass(frozen=True)
class Side:
    """One configuration of the server; ``name`` is how the command line and the report write it."""

    name: str
    plugin: bool
    checkout: Path | None = None

    @property
    def slug(self) -> str:
        """A file-name-safe, unique label: ``off``, ``on``, ``on-at-<dir>-<hash>``."""
        if self.checkout is None:
            return self.name
        digest = hashlib.sha1(str(self.checkout).encode()).hexdigest()[:6]
        return f"on-at-{re.sub(r'[^A-Za-z0-9_.-]', '_', self.checkout.name)}-{digest}"

    def server_env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with this side's switch and, for ``on@PATH``, PATH first on PYTHONPATH."""
        env = dict(base)
        env[ENV_ENABLE] = "1" if self.plugin else "0"
        if self.checkout is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.checkout), base.get("PYTHONPATH", "")) if p)
        return env


def parse_side(text: str) -> Side:
    """``off``, ``on`` or ``on@PATH`` (PATH must hold the package); ValueError otherwise."""
    if text in ("on", "off"):
        return Side(text, plugin=text == "on")
    head, sep, path = text.partition("@")
    if head != "on" or not sep or not path:
        raise ValueError(f"a side is 'off', 'on' or 'on@PATH', not {text!r}")
    checkout = Path(path).expanduser().resolve()
    if not (checkout / PACKAGE / "__init__.py").is_file():
        raise ValueError(f"side {text!r}: {checkout} holds no {PACKAGE}/ package")
    return Side(f"on@{checkout}", plugin=True, checkout=checkout)


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
