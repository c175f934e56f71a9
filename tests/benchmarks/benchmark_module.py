"""Import a script of benchmarks/ by its path: benchmarks/ is not an installed package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str):
    """``benchmarks/<name>.py`` as module ``name`` (registered in sys.modules, so that its
    dataclasses and pickling resolve it); benchmarks/ goes on sys.path for its own imports."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
