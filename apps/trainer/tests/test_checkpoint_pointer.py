"""Without a ``checkpoints/latest`` pointer the newest verifiable step directory is resumed;
step directories none of which verifies are refused, never silently dropped."""

from __future__ import annotations

from pathlib import Path

import pytest

from staleflow_trainer.actors.reconcile import STATE_FILE, latest_checkpoint
from staleflow_trainer.atomic_files import atomic_write_bytes
from staleflow_trainer.errors import CheckpointError


def _step(root: Path, k: int, *, good: bool = True) -> Path:
    d = root / "checkpoints" / f"step_{k:06d}"
    d.mkdir(parents=True)
    atomic_write_bytes(d / STATE_FILE, b'{"steps_done": %d}' % k)
    if not good:
        raw = bytearray((d / STATE_FILE).read_bytes())
        raw[2] ^= 0xFF
        (d / STATE_FILE).write_bytes(bytes(raw))
    return d


def test_the_pointer_names_the_checkpoint(tmp_path: Path) -> None:
    _step(tmp_path, 2)
    d4 = _step(tmp_path, 4)
    atomic_write_bytes(tmp_path / "checkpoints" / "latest", d4.name.encode())
    assert latest_checkpoint(tmp_path) == d4


@pytest.mark.fault
def test_without_a_pointer_the_newest_verifiable_step_is_used(tmp_path: Path) -> None:
    d2 = _step(tmp_path, 2)
    _step(tmp_path, 4, good=False)  # damaged: skipped
    assert latest_checkpoint(tmp_path) == d2
    assert d2.is_dir()


@pytest.mark.fault
def test_step_directories_none_of_which_verifies_are_refused(tmp_path: Path) -> None:
    _step(tmp_path, 2, good=False)
    with pytest.raises(CheckpointError, match="none of them verifies"):
        latest_checkpoint(tmp_path)


def test_no_checkpoint_at_all_is_none(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None


@pytest.mark.fault
def test_a_pointer_renamed_without_its_digest_falls_back_to_the_step_directories(
    tmp_path: Path,
) -> None:
    """A crash between the pointer's rename and its ``.sha256``'s rename leaves the new name
    with the old digest: the newest complete step directory is used, nothing is refused."""
    d2 = _step(tmp_path, 2)
    d4 = _step(tmp_path, 4)
    pointer = tmp_path / "checkpoints" / "latest"
    atomic_write_bytes(pointer, d2.name.encode())
    pointer.write_bytes(d4.name.encode())  # the pointer renamed; its digest still the old one
    assert latest_checkpoint(tmp_path) == d4
    (tmp_path / "checkpoints" / "latest.sha256").unlink()  # or the digest not written at all
    assert latest_checkpoint(tmp_path) == d4
