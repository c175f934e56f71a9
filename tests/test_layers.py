"""The package's imports run one way: each module imports only from the layers below it.

LAYERS is the order vllm_mla_fusion/__init__.py's docstring and the README's layout section
write down. Every import statement counts, at module level or inside a function: an import
deferred into a function hides a cycle from Python at import time, not from this test.
Importing a submodule also runs its parent packages' ``__init__``; that is Python's, not an
edge of the graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_mla_fusion"

# Bottom first; a module's name is its path in the package without ".py".
LAYERS = (
    ("opcodes", "environment", "fp8"),  # import nothing of the package
    ("validation",),
    ("backends/__init__", "backends/reference", "backends/triton"),
    ("backends/aiter",),  # hands the ops AITER does not compute to the Triton kernel
    ("dispatch",),
    ("binding",),
    ("ops",),
    ("__init__",),
    ("selfcheck",),
    # The vLLM plugin: nothing below imports it.
    ("vllm_plugin/settings",),
    ("vllm_plugin/compat", "vllm_plugin/eligibility", "vllm_plugin/prewarm"),
    ("vllm_plugin/custom_ops",),  # compiles ahead in the profile run (prewarm)
    ("vllm_plugin/attention",),
    ("vllm_plugin/layer",),
    ("vllm_plugin/__init__",),
)


def _module_name(dotted: str) -> str | None:
    """``"backends.aiter"`` -> ``"backends/aiter"``; a package -> its ``__init__``; None if not a module."""
    path = dotted.replace(".", "/")
    if (PACKAGE / f"{path}.py").is_file():
        return path
    if (PACKAGE / path / "__init__.py").is_file():
        return f"{path}/__init__".lstrip("/")
    return None


def _imports(name: str) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its source."""
    tree = ast.parse((PACKAGE / f"{name}.py").read_text(), filename=f"{name}.py")
    package = name.split("/")[:-1]  # for __init__, the package it initialises
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            dotted = [a.name for a in node.names]
            candidates = [d.split(".", 1)[1] if "." in d else "" for d in dotted if d.split(".")[0] == PACKAGE.name]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == PACKAGE.name:
                base = node.module.partition(".")[2]
            else:
                continue
            # `from base import x`: the submodule x if there is one, else a name of base.
            candidates = [f"{base}.{a.name}".lstrip(".") if _module_name(f"{base}.{a.name}".lstrip(".")) else base
                          for a in node.names]  # fmt: skip
        else:
            continue
        for dotted in candidates:
            target = _module_name(dotted)
            assert target is not None, f"{name}.py imports {dotted!r}, which is not a module of the package"
            targets.add(target)
    return targets


def _graph() -> dict[str, set[str]]:
    names = sorted(str(p.relative_to(PACKAGE).with_suffix("")) for p in PACKAGE.rglob("*.py"))
    return {name: _imports(name) for name in names}


def test_the_import_graph_is_read_whole():
    """The parser sees top-level, relative, package and function-level imports (else the checks below prove nothing)."""
    graph = _graph()
    assert {"binding", "validation", "opcodes"} <= graph["ops"]
    assert "backends/triton" in graph["dispatch"]  # imported inside load()
    assert "__init__" in graph["selfcheck"]  # `from . import available_backends, ...`
    assert "vllm_plugin/layer" in graph["vllm_plugin/__init__"]  # imported inside register()


def test_every_module_has_one_layer():
    placed = [name for layer in LAYERS for name in layer]
    assert len(placed) == len(set(placed)), "a module is in two layers"
    assert sorted(placed) == sorted(_graph()), "a module is missing from LAYERS (or LAYERS names one that is gone)"


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    state: dict[str, str] = {}  # "open" while on the search path, "done" after

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(target):] + [target]))
            if target not in state:
                visit(target, path + [target])
        state[name] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_each_module_imports_only_from_the_layers_below_it():
    layer_of = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    upward = [f"{name} (layer {layer_of[name]}) imports {target} (layer {layer_of[target]})"
              for name, targets in _graph().items() for target in sorted(targets)
              if layer_of[target] >= layer_of[name]]  # fmt: skip
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)
