"""The repository stands on its own: no file points at documents that live outside it.

Code, comments, docstrings and docs explain themselves or point at ``docs/design.md``; a
reference to a design, style, environment or peer-notes file kept next to the checkout (or to
a sibling folder of shared notes) is a dead link for every user of the repository.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# Built from pieces so that this file does not match its own patterns.
_UPPER = "DESIGN"
PATTERNS = (
    re.compile(_UPPER + r"\.md"),
    re.compile(r"\b" + _UPPER + r" §"),
    re.compile("NOTES" + "-ENV"),
    re.compile("PEERS" + r"\.md"),
    re.compile("STYLE" + r"\.md"),
    re.compile(r"\.\./" + "shared" + r"\b"),
)

# Files allowed to hold such a reference (none; an entry must be removed once its file is
# fixed: test_known_offenders_still_offend fails until it is).
KNOWN_OFFENDERS: frozenset[str] = frozenset()

# Used only when the checkout has no git metadata (an exported tree).
_SKIP_DIRS = frozenset(
    {
        ".git",
        ".venv",
        ".nox",
        "__pycache__",
        ".hypothesis",
        ".pytest_cache",
        ".mypy_cache",
        ".ruff_cache",
        "runs",
        "bench-results",
        "dist",
    }
)


def _repo_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        files = []
        for dirpath, dirnames, filenames in os.walk(ROOT):
            dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
            files += [str((Path(dirpath) / f).relative_to(ROOT)) for f in filenames if f != ".git"]
        return sorted(files)
    return sorted({p for p in out.decode().split("\0") if p and not p.startswith(".venv/")})


def _offending_lines(rel: str) -> list[str]:
    path = ROOT / rel
    if not path.is_file():
        return []
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return []  # binary files (plots) cannot hold a readable reference
    return [
        f"{rel}:{n}: {line.strip()}"
        for n, line in enumerate(text.splitlines(), start=1)
        if any(p.search(line) for p in PATTERNS)
    ]


def test_the_file_list_covers_the_repository() -> None:
    files = set(_repo_files())
    assert {"README.md", "docs/design.md", "pyproject.toml"} <= files
    assert not any(f.startswith(".venv/") for f in files)


def test_no_file_references_documents_outside_the_repository() -> None:
    hits = [
        hit for rel in _repo_files() if rel not in KNOWN_OFFENDERS for hit in _offending_lines(rel)
    ]
    assert not hits, (
        "these lines point at files outside the repository; explain in place or refer to "
        "docs/design.md instead:\n" + "\n".join(hits)
    )


def test_known_offenders_still_offend() -> None:
    fixed = sorted(rel for rel in KNOWN_OFFENDERS if not _offending_lines(rel))
    assert not fixed, f"no longer reference outside files; remove from KNOWN_OFFENDERS: {fixed}"


def test_patterns_catch_what_they_are_meant_to() -> None:
    samples = [
        "see " + _UPPER + ".md §3",
        "(" + _UPPER + " §4)",
        "NOTES" + "-ENV §1",
        "../../" + "shared/" + "NOTES" + "-ENV.md",
        "PEERS" + ".md",
        "STYLE" + ".md",
    ]
    for sample in samples:
        assert any(p.search(sample) for p in PATTERNS), sample
    assert not any(p.search("see docs/design.md, Stuck buffers") for p in PATTERNS)
