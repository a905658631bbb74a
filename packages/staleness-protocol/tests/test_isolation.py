"""The protocol is sans-IO and light: importing it loads no heavy or I/O framework."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import staleness_protocol

HEAVY = ("torch", "numpy", "ray", "vllm", "sglang", "nixl", "asyncio", "logging", "structlog")
# attrs itself imports threading; what matters is that the protocol never uses it.
SANS_IO_FORBIDDEN = {
    "time",
    "datetime",
    "threading",
    "asyncio",
    "logging",
    "socket",
    "os",
    "random",
    "structlog",
}


def test_import_loads_nothing_heavy() -> None:
    code = (
        "import sys, json; before = set(sys.modules);"
        "import staleness_protocol, staleness_protocol.testing;"
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    assert "staleness_protocol" in loaded  # the probe works
    bad = [m for m in loaded if m.split(".")[0] in HEAVY]
    assert bad == []


def test_library_modules_import_no_clock_threads_or_io() -> None:
    src = Path(staleness_protocol.__file__).parent
    checked = 0
    for path in sorted(src.glob("*.py")):
        if path.name == "example.py":  # a runnable demo, not the library
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in SANS_IO_FORBIDDEN, f"{path.name} imports {name}"
        checked += 1
    assert checked >= 8
