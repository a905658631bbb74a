"""The Ray control shell's write-ahead journal reproduces the core exactly after every batch of
events, however the events are batched and wherever a checkpoint falls inside a batch (a
checkpoint moves the journal's base; the batch's later events must stay covered).

The events are those of a simulated run (the same core); the shell's I/O is a recorder (no Ray,
no servers): what is checked is the journal, not the effects. The Ray fault tests cover the
same path with real actors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from staleflow_trainer.actors.control import ControlActor
from staleflow_trainer.config import load_config, to_dict
from staleflow_trainer.control import ControlCore, core_config
from staleflow_trainer.control.events import Event, Trained, event_from_dict
from staleflow_trainer.data import PromptLengths
from staleflow_trainer.sim.shell import Simulation

SIM_TINY = Path(__file__).resolve().parents[3] / "examples" / "sim-tiny.yaml"


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _Trainer:
    def __init__(self) -> None:
        async def save(path: str) -> None:
            (Path(path) / "trainer.pt").write_bytes(b"weights")

        self.save_checkpoint = _Remote(save)


class _Store:
    def __init__(self, path: Path) -> None:
        self.path = path

    async def save_checkpoint(self) -> str:
        self.path.write_bytes(b"store")
        return str(self.path)


def _events(cfg: Any) -> list[Event]:
    seen: list[Event] = []
    Simulation(cfg, on_event=seen.append).run()
    return seen


@pytest.mark.parametrize("batch", [1, 3, 7])
async def test_journal_replay_equals_the_live_core_after_every_batch(
    tmp_path: Path, batch: int
) -> None:
    overrides = ["trainer.steps=6", "metrics.timeline=false", "run.checkpoint_every=1"]
    cfg = load_config(SIM_TINY, [f"run.run_dir={tmp_path}", *overrides])
    events = _events(cfg)
    assert sum(isinstance(e, Trained) for e in events) == 6

    actor = ControlActor(
        cfg=to_dict(cfg), prompts=PromptLengths(()), ts_address=("127.0.0.1", 1), ts_token="t",
        rollouts={}, trainer=_Trainer(), rewards=[],
    )  # fmt: skip
    sim = Simulation(cfg)  # the same prompt lengths as the recorded run
    ccfg = core_config(cfg, rows=None)

    def prompt_len(row: int) -> int:
        return sim.stream.group(row).prompt_len

    actor.core = ControlCore(ccfg, prompt_len=prompt_len)
    actor._wal.reset(actor.core.to_dict())

    async def carry(effect: Any) -> None:
        return None

    actor.io.carry = carry  # type: ignore[method-assign]
    actor.io.spawn = lambda coro: coro.close()  # type: ignore[method-assign]
    actor.io.ts = _Store(tmp_path / "store.bin")

    checkpoints_inside = 0
    for i in range(0, len(events), batch):
        chunk = events[i : i + batch]
        await actor._feed_batch(chunk)
        inside = any(isinstance(e, Trained) for e in chunk[:-1])
        checkpoints_inside += inside
        if not (inside or i + batch >= len(events) or (i // batch) % 25 == 0):
            continue  # replaying is O(journal): check where a checkpoint fell, and a sample
        base, records = actor._wal.load()
        replayed = ControlCore.restore(base, ccfg, prompt_len=prompt_len)
        for rec in records:
            for d in rec["events"]:
                replayed.handle(event_from_dict(d))
        assert replayed.to_dict() == actor.core.to_dict(), f"after batch ending at event {i}"
    assert actor.core.steps_done == 6
    assert len(list((tmp_path / "checkpoints").glob("step_*"))) >= 1
    if batch > 1:  # a checkpoint fell inside a batch, with events after it
        assert checkpoints_inside > 0
