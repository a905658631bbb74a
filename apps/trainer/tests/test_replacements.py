"""The driver's replacement of lost instances, stage by stage, with fake actors (no Ray): the
real path runs in ``integration_tests/cpu/test_replace_lost_sim.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from staleflow_trainer import replacements
from staleflow_trainer.replacements import Replacer


class Ref:
    """A call's answer: ``done`` once answered; ``value`` or ``error``."""

    def __init__(self, value: Any = None, error: Exception | None = None, done: bool = True):
        self.value, self.error, self.done = value, error, done


class Method:
    def __init__(self, answer: Ref, calls: list[Any]) -> None:
        self.answer, self.calls = answer, calls

    def remote(self, *args: Any, **kw: Any) -> Ref:
        self.calls.append((args, kw))
        return self.answer


class Rollout:
    def __init__(self, start: Ref, sync: Ref) -> None:
        self.calls: list[Any] = []
        self.start = Method(start, self.calls)
        self.sync = Method(sync, self.calls)


def _dep(*rollouts: Rollout, join: Ref | None = None) -> Any:
    made = iter(rollouts)
    joined: list[Any] = []
    dep = SimpleNamespace(
        rollouts={"r-0": object(), "r-1": object()},
        coordinator=SimpleNamespace(add_instance=Method(join or Ref(None), joined)),
        cfg=SimpleNamespace(rollout=SimpleNamespace(cpus_per_instance=1.0, gpus_per_instance=0)),
        joined=joined,
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
    sync = Ref({"version": 7}, done=False)
    new = Rollout(Ref({"kv_capacity_tokens": 5000}), sync)
    dep = _dep(new)
    lost = dep.rollouts["r-0"]
    rep = Replacer(dep, limit=2, timeout_s=60)
    rep.update(["r-0"])
    assert killed == [lost] and "r-0" not in dep.rollouts  # the lost actor is gone
    assert dep.bundles_asked == ["r-0"]  # on the lost one's bundle
    assert rep.pending == 1 and dep.joined == []  # the sync has not answered: no waiting
    rep.update(["r-0"])  # seen before: no second replacement
    assert rep.started == 1 and rep.pending == 1
    sync.done = True
    rep.update([])
    assert dep.joined == [(("r-2", new), {"kv_capacity_tokens": 5000, "version": 7})]
    assert dep.rollouts["r-2"] is new and rep.replaced == {"r-0": "r-2"} and rep.pending == 0


def test_losses_beyond_the_limit_are_not_replaced(killed: list[Any]) -> None:
    dep = _dep(Rollout(Ref({"kv_capacity_tokens": 1}), Ref({"version": 0})))
    rep = Replacer(dep, limit=1, timeout_s=60)
    rep.update(["r-0", "r-1"])
    assert rep.replaced == {"r-0": "r-2"} and rep.not_replaced == ["r-1"]
    assert len(killed) == 2  # both lost actors, replaced or not


def test_a_replacement_that_fails_to_start_is_killed_and_the_run_goes_on(
    killed: list[Any],
) -> None:
    new = Rollout(Ref(error=RuntimeError("engine failed")), Ref({"version": 0}))
    dep = _dep(new)
    rep = Replacer(dep, limit=3, timeout_s=60)
    rep.update(["r-0"])
    assert rep.not_replaced == ["r-0"] and rep.pending == 0
    assert killed[-1] is new and "r-2" not in dep.rollouts and dep.joined == []
    assert rep.started == 1  # it counts against the limit


def test_a_replacement_that_never_answers_is_given_up_at_the_deadline(killed: list[Any]) -> None:
    new = Rollout(Ref(done=False), Ref({"version": 0}))
    dep = _dep(new)
    rep = Replacer(dep, limit=1, timeout_s=0.0)
    rep.update(["r-0"])
    assert rep.not_replaced == ["r-0"] and killed[-1] is new and rep.pending == 0


def test_close_kills_the_replacements_still_starting(killed: list[Any]) -> None:
    new = Rollout(Ref(done=False), Ref({"version": 0}))
    rep = Replacer(_dep(new), limit=1, timeout_s=60)
    rep.update(["r-0"])
    rep.close()
    assert killed[-1] is new and rep.pending == 0
