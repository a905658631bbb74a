"""The control core's state as plain JSON, and back: the write-ahead journal's base and the
checkpoint's ``core.json``. Restoring checks that the config would run the saved protocol
under the same rules (:func:`~staleflow_trainer.control.config.check_resumable`)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from rollout_coordinator import InstanceSnapshot, coordinator_from_dict, coordinator_to_dict
from staleflow_trainer.control import effects as fx
from staleflow_trainer.control.config import check_resumable
from staleflow_trainer.control.events import snapshot_from_dict, snapshot_to_dict
from staleflow_trainer.control.feed import PromptFeed
from staleflow_trainer.control.ledger import Ledger
from staleflow_trainer.control.report import StepReport
from staleness_protocol import StalenessProtocol, protocol_from_dict

if TYPE_CHECKING:
    from staleflow_trainer.control.core import ControlCore

STATE_FORMAT = "staleflow-core/1"


def core_to_dict(self: ControlCore) -> dict[str, Any]:
    """The core's whole state, JSON-plain."""
    return {
        "format": STATE_FORMAT,
        "now": self.now,
        "protocol": self.protocol.to_dict(),
        "coordinator": coordinator_to_dict(self.coordinator),
        "ledger": self.ledger.to_dict(),
        "feed": self.feed.to_dict(),
        "steps_done": self.steps_done,
        "published": self.published,
        "counters": dict(self.counters),
        "report": self.report.to_dict(),
        "training": None if self.training is None else _train_to_dict(self.training),
        "idle_since": self._idle_since,
        "stuck_checked_at": self._stuck_checked_at,
        "fresh": list(self._fresh),
        "replacements_due": self._replacements_due,
        "snapshots": {k: _snap(v) for k, v in self._snapshots.items()},
        "sync_fail_streak": dict(self._sync_fail_streak),
        "reward_fail_streak": self._reward_fail_streak,
        "filtered_streak": self._filtered_streak,
        "streamed": sorted(self.streamed),
        "done": self.done,
    }


def core_from_dict(core: ControlCore, state: Mapping[str, Any]) -> ControlCore:
    """Put ``state`` (:func:`core_to_dict`) into a freshly built ``core``; returns it."""
    config = core.config
    state = copy.deepcopy(dict(state))  # the restored parts must not alias the caller's
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"core state format {state.get('format')!r}, expected {STATE_FORMAT!r}")
    core.now = float(state["now"])
    core.protocol = protocol_from_dict(dict(state["protocol"]))
    check_resumable(core.protocol, config.protocol)
    core.coordinator = coordinator_from_dict(
        state["coordinator"],
        config.coordinator,
        cast(StalenessProtocol, core.protocol),
        clock=lambda: core.now,
    )
    core.ledger = Ledger.from_dict(state["ledger"])
    core.feed = PromptFeed.from_dict(state["feed"])
    core.steps_done = int(state["steps_done"])
    core.published = int(state["published"])
    core.counters.update({str(k): int(v) for k, v in state["counters"].items()})
    core.report = StepReport.from_dict(state["report"])
    tr = state["training"]
    core.training = None if tr is None else _train_from_dict(tr)
    core._idle_since = float(state["idle_since"])
    core._stuck_checked_at = float(state["stuck_checked_at"])
    core._fresh = dict.fromkeys(str(g) for g in state["fresh"])
    core._replacements_due = int(state["replacements_due"])
    core._snapshots = {str(k): snapshot_from_dict(v) for k, v in state["snapshots"].items()}
    core._sync_fail_streak = {str(k): int(v) for k, v in state["sync_fail_streak"].items()}
    core._reward_fail_streak = int(state.get("reward_fail_streak", 0))
    core._filtered_streak = int(state.get("filtered_streak", 0))
    # absent from states written before it was saved: those groups go out again
    core.streamed = {str(g) for g in state.get("streamed", ())}
    # the run may go on with more steps than the state it resumes from was written with
    core.done = bool(state["done"]) and core.steps_done >= config.steps
    return core


def _snap(s: InstanceSnapshot) -> dict[str, Any]:
    return snapshot_to_dict(s)


def _train_to_dict(t: fx.Train) -> dict[str, Any]:
    return {
        "version": t.version,
        "group_ids": list(t.group_ids),
        "trajectory_ids": [list(m) for m in t.trajectory_ids],
        "staleness": [list(s) for s in t.staleness],
        "rewards": [list(r) for r in t.rewards],
        "tokens": t.tokens,
        "response_tokens": t.response_tokens,
        "response_lengths": [list(g) for g in t.response_lengths],
    }


def _train_from_dict(d: Mapping[str, Any]) -> fx.Train:
    return fx.Train(
        version=int(d["version"]),
        group_ids=tuple(str(g) for g in d["group_ids"]),
        trajectory_ids=tuple(tuple(str(t) for t in m) for m in d["trajectory_ids"]),
        staleness=tuple(tuple(int(s) for s in st) for st in d["staleness"]),
        rewards=tuple(tuple(float(r) for r in rs) for rs in d["rewards"]),
        tokens=int(d["tokens"]),
        response_tokens=int(d["response_tokens"]),
        # absent from journals written before the field existed
        response_lengths=tuple(tuple(int(n) for n in g) for g in d.get("response_lengths", ())),
    )
