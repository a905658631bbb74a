"""The shape of the tree holds: no Python module over 600 lines, the Ray control shell over
the control core at most 500 (its logic lives in the core, not in the shell), no shipped
wait that can swallow a cancellation, and the app's modules stay in the folders of their
jobs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MAX_LINES = 600
SHELL = "apps/trainer/src/staleflow_trainer/actors/control.py"
MAX_SHELL_LINES = 500
APP = ROOT / "apps/trainer/src/staleflow_trainer"
# what a run reports and how runs compare; the driver side of the Ray deployment
GROUPED = {
    "report": ("compare", "compare_plots", "metrics", "plan", "plots", "progress", "trackers"),
    "runtime": ("deployment", "prepare", "replacements", "startup", "wiring"),
}


def _python_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [p for p in out.splitlines() if (ROOT / p).is_file()]


def _lines(rel: str) -> int:
    return len((ROOT / rel).read_text().splitlines())


def test_no_module_over_600_lines() -> None:
    files = _python_files()
    assert len(files) > 100  # the listing works
    over = {p: n for p in files if (n := _lines(p)) > MAX_LINES}
    assert over == {}, f"split these modules (limit {MAX_LINES} lines): {over}"


def test_the_ray_control_shell_stays_thin() -> None:
    assert _lines(SHELL) <= MAX_SHELL_LINES


def test_grouped_modules_stay_in_their_folders() -> None:
    """``report/`` and ``runtime/`` hold their modules, and none of them is back at the
    package's top level (``staleflow_trainer/plan.py``, a ``plan/`` package or a shim)."""
    missing = [
        f"{d}/{m}.py"
        for d, ms in GROUPED.items()
        for m in ms
        if not (APP / d / f"{m}.py").is_file()
    ]
    back = sorted(
        p.name
        for ms in GROUPED.values()
        for m in ms
        for p in (APP / f"{m}.py", APP / m)
        if p.exists()
    )
    assert missing == [], f"moved away from their folder: {missing}"
    assert back == [], f"back at staleflow_trainer's top level: {back}"


def test_no_asyncio_wait_for_in_shipped_code() -> None:
    """Shipped code bounds a wait with ``asyncio.timeout``: on Python 3.11, ``asyncio.wait_for``
    can swallow a cancellation that lands as the awaited call completes, and a task cancelled
    that way runs on (a close that waits for it never returns)."""
    shipped = [p for p in _python_files() if p.startswith(("packages/", "apps/")) and "/src/" in p]
    assert len(shipped) > 50  # the listing works
    calls = [p for p in shipped if _uses_wait_for(ast.parse((ROOT / p).read_text()))]
    assert calls == [], f"use asyncio.timeout instead of asyncio.wait_for in {calls}"


def _uses_wait_for(tree: ast.AST) -> bool:
    """``asyncio.wait_for`` used (called or not), or ``wait_for`` imported from asyncio."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "asyncio":
            found = any(a.name == "wait_for" for a in node.names)
        elif isinstance(node, ast.Attribute) and node.attr == "wait_for":
            found = isinstance(node.value, ast.Name) and node.value.id == "asyncio"
        else:
            found = False
        if found:
            return True
    return False


def test_the_wait_for_check_finds_each_form() -> None:
    found = [_uses_wait_for(ast.parse(src)) for src in (
        "import asyncio\nasync def f(c):\n    await asyncio.wait_for (c, 1)",
        "from asyncio import sleep, wait_for",
        "import asyncio\nw = asyncio.wait_for",
        "# asyncio.wait_for(x) in a comment\nself.wait_for(1)",
    )]  # fmt: skip
    assert found == [True, True, True, False]


def test_every_app_module_imports_first() -> None:
    """Each module of the app imports in a fresh state (no other app module loaded before it):
    an import cycle inside the package fails here, not in the user's first script."""
    script = """
import importlib, pkgutil, sys
import staleflow_trainer
names = [m.name for m in pkgutil.walk_packages(staleflow_trainer.__path__, "staleflow_trainer.")]
failed = {}
for name in names:
    for loaded in [k for k in sys.modules if k.startswith("staleflow_trainer.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as e:
        failed[name] = f"{type(e).__name__}: {e}"
print(len(names))
print(failed)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert int(out[0]) > 40  # the walk found the package's modules
    assert out[1] == "{}", f"modules that fail to import first: {out[1]}"
