"""The demo's report finds the plugin's log lines, whatever form the plugin logs them in."""

from __future__ import annotations

import ast
from pathlib import Path

from demo import main as demo_main

PLUGIN_SOURCES = sorted((Path(__file__).resolve().parents[2] / "vllm_mla_fusion" / "vllm_plugin").glob("*.py"))
LOG_METHODS = {"debug", "info", "warning", "error", "info_once", "warning_once", "debug_once"}


def _logged_formats() -> list[str]:
    """Every format string the plugin passes to a logger and that names the plugin."""
    found = []
    for path in PLUGIN_SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LOG_METHODS and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                    and node.args[0].value.startswith("vllm-mla-fusion")):  # fmt: skip
                found.append(node.args[0].value)
    return found


def test_every_plugin_log_line_is_reported():
    formats = _logged_formats()
    # The fused-path line and the setup-failure line are among them (the ones the demo must show).
    assert any("MLA layers use the fused" in f for f in formats)
    assert any("setting up the fused MLA path failed" in f for f in formats)
    for fmt in formats:
        message = fmt.replace("%s", "rank 0, local rank 0" if fmt.startswith("vllm-mla-fusion (%s)") else "x")
        line = f"(EngineCore pid=123) INFO 12-01 13:26:45 [layer.py:110] {message}"
        assert demo_main.plugin_lines([line]) == [f"INFO 12-01 13:26:45 [layer.py:110] {message}"], fmt


def test_other_lines_are_not_the_plugins():
    lines = [
        "(MainProcess pid=1) INFO 12-01 13:26:44 [cpu.py:186] Using CPU_MLA backend.",
        "(MainProcess pid=1) INFO [startup.py:96] non-default args: {'model': '/tmp/vllm-mla-fusion-demo-x/model'}",
        "(MainProcess pid=1) INFO 12-01 13:26:45 [layer.py:110] vllm-mla-fusion (rank 0, local rank 0): MLA layers "
        "use the fused RoPE + KV-cache write (backend torch, mode decode)",
    ]
    assert demo_main.plugin_lines(lines) == [
        "INFO 12-01 13:26:45 [layer.py:110] vllm-mla-fusion (rank 0, local rank 0): MLA layers use the fused RoPE "
        "+ KV-cache write (backend torch, mode decode)"
    ]
