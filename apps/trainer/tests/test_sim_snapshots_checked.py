"""The simulator builds its instances' snapshots unchecked (``InstanceSnapshot.unchecked``):
its engine meets the checks by construction. Here every snapshot of a run is built checked
instead, as an engine adapter's is; the run must pass every check and compute the same run.
The workload fills instances past their KV (preemptions, a prefill head in the running list),
syncs and migrates, so every kind of running list appears."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from rollout_coordinator import InstanceSnapshot
from staleflow_trainer.config import load_config
from staleflow_trainer.sim import shell
from staleflow_trainer.sim.shell import Simulation
from staleflow_trainer.sim.spec import with_policy

PRESET = Path(__file__).resolve().parents[3] / "examples" / "sim-paper-30b-a3b-rollout-bound.yaml"
SMALL = [
    "rollout.num_instances=3",
    "sim.train_gpus=8",
    "sim.total_gpus=20",
    "protocol.batch_size=12",
    "trainer.steps=5",
    "sim.warmup_steps=1",
    "metrics.timeline=false",
]


_UNCHECKED = shell._instance_snapshot
_FIELDS = [f.name for f in attrs.fields(InstanceSnapshot)]


def _run(tmp_path: Path, name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    over = [f"run.run_dir={tmp_path / name}", *SMALL]
    sim = Simulation(with_policy(load_config(PRESET, over), "staleflow", 1))
    sim.run()
    summary = {k: v for k, v in sim.rec.summary().items() if "wall" not in k}
    return summary, sim.rec.steps


def test_every_snapshot_passes_the_checks_and_the_run_is_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[InstanceSnapshot] = []

    def checked(eng: Any, now: float) -> InstanceSnapshot:
        snap = _UNCHECKED(eng, now)
        again = InstanceSnapshot(**{f: getattr(snap, f) for f in _FIELDS})  # checked: raises
        assert again == snap
        built.append(again)
        return again

    unchecked = _run(tmp_path, "unchecked")
    monkeypatch.setattr(shell, "_instance_snapshot", checked)
    assert _run(tmp_path, "checked") == unchecked
    assert len(built) > 1000
    assert unchecked[0]["preemptions"] > 0
    assert unchecked[0]["syncs"] > 0 and unchecked[0]["migrations"] > 0
    assert any(len(s.running) > 1 for s in built)
