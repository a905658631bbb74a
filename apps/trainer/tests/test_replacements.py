"""The driver's replacement of lost instances, stage by stage, with fake actors (no Ray): the
real path runs in ``integration_tests/cpu/test_replace_lost_sim.py``."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from staleflow_trainer.errors import ComponentLost
from staleflow_trainer.runtime import replacements
from staleflow_trainer.runtime.replacements import Replacer


class Ref:
    """A call's answer: ``done`` once answered; ``value`` or ``error``."""

    def __init__(self, value: Any = None, error: Exception | None = None, done: bool = True):
        self.value, self.error, self.done = value, error, done


class Method:
    """``.remote(...)`` records the call and answers the next of ``answers`` (the last one
    again once they run out)."""

    def __init__(self, *answers: Ref) -> None:
        self.answers, self.calls = list(answers), []  # type: list[Ref], list[Any]

    def remote(self, *args: Any, **kw: Any) -> Ref:
        self.calls.append((args, kw))
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


class Rollout:
    def __init__(self, start: Ref, sync: Ref) -> None:
        self.start, self.sync = Method(start), Method(sync)


def _coordinator(*answers: Ref) -> Any:
    return SimpleNamespace(add_instance=Method(*(answers or (Ref(None),))))


def _dep(*rollouts: Rollout, coordinator: Any = None) -> Any:
    made = iter(rollouts)
    dep = SimpleNamespace(
        rollouts={"r-0": object(), "r-1": object()},
        coordinator=coordinator or _coordinator(),
        cfg=SimpleNamespace(rollout=SimpleNamespace(cpus_per_instance=1.0, gpus_per_instance=0)),
        bundles_asked=[],
        next=2,
    )

    def new_rollout(bundle_of: str | None = None) -> tuple[str, Any]:
        dep.bundles_asked.append(bundle_of)
        iid = f"r-{dep.next}"
        dep.next += 1
        return iid, next(made)

    dep.new_rollout = new_rollout
    return dep


def _ok() -> Rollout:
    return Rollout(Ref({"kv_capacity_tokens": 5000}), Ref({"version": 7}))


@pytest.fixture
def killed(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    out: list[Any] = []
    monkeypatch.setattr(replacements, "kill_actor", out.append)
    monkeypatch.setattr(replacements, "_answered", lambda ref: ref.done)

    def answer(ref: Ref) -> Any:
        if ref.error is not None:
            raise ref.error
        return ref.value

    monkeypatch.setattr(replacements, "_answer", answer)
    monkeypatch.setattr(Replacer, "_lacking", lambda self: "; free now: {}")
    return out


def test_a_replacement_goes_through_start_sync_and_join_without_waiting(killed: list[Any]) -> None:
    new = Rollout(Ref({"kv_capacity_tokens": 5000}), Ref({"version": 7}, done=False))
    dep = _dep(new)
    lost = dep.rollouts["r-0"]
    rep = Replacer(dep, limit=2, timeout_s=60)
    rep.update(["r-0", "r-1"])  # nothing lost
    assert rep.started == 0 and killed == []
    rep.update(["r-1"])  # the control actor left r-0 out: lost
    assert killed == [lost] and "r-0" not in dep.rollouts  # the lost actor is gone
    assert dep.bundles_asked == ["r-0"]  # in its place
    assert rep.pending == 1 and dep.coordinator.add_instance.calls == []  # sync not answered
    rep.update(["r-1"])  # the same loss again: no second replacement
    assert rep.started == 1 and rep.pending == 1
    new.sync.answers[0].done = True
    rep.update(["r-1"])
    assert dep.coordinator.add_instance.calls == [
        (("r-2", new), {"kv_capacity_tokens": 5000, "version": 7})
    ]
    assert dep.rollouts["r-2"] is new and rep.replaced == {"r-0": "r-2"} and rep.pending == 0
    assert rep.members == {"r-1", "r-2"}


def test_losses_beyond_the_limit_are_not_replaced(killed: list[Any]) -> None:
    dep = _dep(_ok())
    rep = Replacer(dep, limit=1, timeout_s=60)
    rep.update([])
    assert rep.replaced == {"r-0": "r-2"} and rep.not_replaced == ["r-1"]
    assert len(killed) == 2  # both lost actors, replaced or not


def test_a_replacement_lost_after_it_joined_is_replaced_in_turn(killed: list[Any]) -> None:
    second = _ok()
    dep = _dep(_ok(), second)
    rep = Replacer(dep, limit=2, timeout_s=60)
    rep.update(["r-1"])
    assert rep.replaced == {"r-0": "r-2"}
    joined = dep.rollouts["r-2"]
    rep.update(["r-1"])  # r-2 joined, then left the run before this answer
    assert killed[-1] is joined and rep.replaced == {"r-0": "r-2", "r-2": "r-3"}
    assert dep.bundles_asked == ["r-0", "r-2"] and dep.rollouts["r-3"] is second


def test_a_replacement_that_fails_to_start_is_killed_and_the_run_goes_on(
    killed: list[Any],
) -> None:
    new = Rollout(Ref(error=RuntimeError("engine failed")), Ref({"version": 0}))
    dep = _dep(new)
    rep = Replacer(dep, limit=3, timeout_s=60)
    rep.update(["r-1"])
    assert rep.not_replaced == ["r-0"] and rep.pending == 0
    assert killed[-1] is new and "r-2" not in dep.rollouts
    assert dep.coordinator.add_instance.calls == []
    assert rep.started == 1  # it counts against the limit


def test_a_malformed_answer_fails_the_replacement_not_the_run(killed: list[Any]) -> None:
    new = Rollout(Ref({"kv_capacity_tokens": None}), Ref({"version": 0}))
    rep = Replacer(_dep(new), limit=1, timeout_s=60)
    rep.update(["r-1"])
    assert rep.not_replaced == ["r-0"] and killed[-1] is new


def test_a_replacement_that_never_answers_is_given_up_at_the_deadline(killed: list[Any]) -> None:
    new = Rollout(Ref(done=False), Ref({"version": 0}))
    rep = Replacer(_dep(new), limit=1, timeout_s=0.0)
    rep.update(["r-1"])
    assert rep.not_replaced == ["r-0"] and killed[-1] is new and rep.pending == 0


def test_a_join_goes_to_the_control_actor_that_replaced_the_one_it_was_sent_to(
    killed: list[Any],
) -> None:
    old = _coordinator(Ref(done=False))
    dep = _dep(_ok(), coordinator=old)
    rep = Replacer(dep, limit=1, timeout_s=60)
    rep.update(["r-1"])
    assert len(old.add_instance.calls) == 1 and rep.pending == 1
    dep.coordinator = _coordinator()  # the control actor crashed and was replaced
    rep.update(["r-1"])
    assert len(dep.coordinator.add_instance.calls) == 1 and rep.replaced == {"r-0": "r-2"}


def test_a_join_refused_for_a_version_not_yet_recorded_is_sent_again(
    killed: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replacements, "JOIN_RETRY_S", 0.05)
    refused = Ref(error=ValueError("version must be in [0, 6], got 7"))
    dep = _dep(_ok(), coordinator=_coordinator(refused, Ref(None)))
    rep = Replacer(dep, limit=1, timeout_s=60)
    rep.update(["r-1"])
    assert rep.pending == 1 and rep.not_replaced == []
    rep.update(["r-1"])  # not yet: it waits JOIN_RETRY_S
    assert len(dep.coordinator.add_instance.calls) == 1 and rep.pending == 1
    time.sleep(0.06)
    rep.update(["r-1"])
    assert len(dep.coordinator.add_instance.calls) == 2 and rep.replaced == {"r-0": "r-2"}


def test_close_kills_the_replacements_still_starting(killed: list[Any]) -> None:
    new = Rollout(Ref(done=False), Ref({"version": 0}))
    rep = Replacer(_dep(new), limit=1, timeout_s=60)
    rep.update(["r-1"])
    rep.close()
    assert killed[-1] is new and rep.pending == 0


def test_with_no_replacements_a_loss_is_logged_and_nothing_else_happens(
    killed: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    lost = {"instance_id": "r-0", "error": "ActorDiedError('the actor died')",
            "requeued": ["g1/0"], "queued": ["g1/0", "g1/1"], "finished": ["g0/3"],
            "dropped": []}  # fmt: skip
    dep = _dep()
    dep.coordinator.lost_instances = SimpleNamespace(remote=lambda: Ref([lost]))
    monkeypatch.setattr(replacements, "_answer_within", lambda ref, timeout_s: ref.value)
    rep = Replacer(dep, limit=0, timeout_s=60)
    with capture_logs() as logs:
        rep.update(["r-1"])
    assert [(e["event"], e["instance"], e["error"]) for e in logs] == [
        ("instance_lost", "r-0", "ActorDiedError('the actor died')")
    ]
    assert (logs[0]["requeued"], logs[0]["finished"], logs[0]["dropped"]) == (2, 1, 0)
    assert killed == [] and "r-0" in dep.rollouts and rep.started == 0  # left as it was


def test_no_instance_left_and_none_starting_stops_the_run(
    killed: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every instance lost and the replace_lost limit spent: nothing can generate, so the run
    stops with ComponentLost naming each loss, instead of waiting for work forever."""
    errors = {"r-0": "EngineDead('its EngineCore stopped')", "r-1": "ActorDiedError()"}
    dep = _dep()
    dep.coordinator.lost_instances = SimpleNamespace(
        remote=lambda: Ref([{"instance_id": i, "error": e} for i, e in errors.items()])
    )
    monkeypatch.setattr(replacements, "_answer_within", lambda ref, timeout_s: ref.value)
    rep = Replacer(dep, limit=0, timeout_s=60)
    rep.update(["r-1"])  # one left: the run goes on
    assert rep.stranded() is None
    with pytest.raises(ComponentLost) as info:
        rep.update([])
    msg = str(info.value)
    assert info.value.component == "rollout"
    assert "r-0: EngineDead" in msg and "r-1: ActorDiedError" in msg
    assert "0 of rollout.replace_lost=0 replacements started" in msg and "run.resume=auto" in msg


def test_a_replacement_under_way_keeps_the_run_going(killed: list[Any]) -> None:
    new = Rollout(Ref({"kv_capacity_tokens": 5000}, done=False), Ref({"version": 7}))
    rep = Replacer(_dep(new), limit=1, timeout_s=60)
    rep.update(["r-1"])  # r-0 lost: its replacement starts
    rep.update([])  # r-1 lost beyond the limit, but r-2 is starting
    assert rep.pending == 1 and rep.stranded() is None
