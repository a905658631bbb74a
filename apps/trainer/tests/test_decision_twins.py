"""coarse-async over StaleFlow's buffers makes all-vanilla's every decision (its in-flight
budget never binds: the proof is in ``coarse_async_baseline``'s docstring), and a comparison
runs the pair once.

The first test checks the claim where it is tight: in real simulated all-vanilla runs the
budget coarse-async would apply is computed at every cycle beside what the router admitted,
and it must never fall below it (and must meet it, so the tight case is exercised); the
coarse-async runs of the same configs must then produce the same runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from rollout_coordinator.policies._base import GateState
from rollout_coordinator.policies.admission import admit_by_inflight_budget
from staleflow_trainer.config import load_config
from staleflow_trainer.report.compare import decision_twins, plan_runs, run_comparison
from staleflow_trainer.sim.shell import Simulation
from staleflow_trainer.sim.spec import with_policy

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
SHORT = [
    "trainer.steps=8",
    "sim.warmup_steps=1",
    "metrics.log_every=0",
    "protocol.stuck_threshold=0",
]
#: what differs between two runs of the same decisions: their names and how long they took
_OWN = {"policy", "wall_s"}


def _run(cfg: Any, run_dir: Path, slack: list[int] | None = None) -> dict[str, Any]:
    sim = Simulation(cfg.evolve(f"run.run_dir={run_dir}"))
    if slack is not None:
        coordinator = sim.core.coordinator
        route = coordinator.policy.routing

        def routing(view: Any, port: Any, quota: int | None) -> Any:
            result = route(view, port, quota)
            budget, _ = admit_by_inflight_budget(view, GateState())
            slack.append(budget - result.new_admitted)
            return result

        coordinator.policy = attrs.evolve(coordinator.policy, routing=routing)
    sim.run()
    return dict(sim.rec.summary())


@pytest.mark.parametrize(("eta", "surplus"), [(1, 0), (2, 0), (3, 0), (2, 1)])
def test_coarse_async_budget_never_binds_over_the_buffers(
    tmp_path: Path, eta: int, surplus: int
) -> None:
    """``surplus``: group redundancy (``n' > n``; the first ``n`` to finish are kept)."""
    base = load_config(EXAMPLES / "sim-tiny.yaml", [*SHORT, f"protocol.group_redundancy={surplus}"])
    vanilla = with_policy(base, "all-vanilla", eta)
    coarse = with_policy(base, "coarse-async", eta)
    assert coarse.evolve("coordinator.policy=all-vanilla") == vanilla
    slack: list[int] = []
    a = _run(vanilla, tmp_path / "vanilla", slack)
    assert min(slack) >= 0, "coarse-async's budget would have refused what all-vanilla admitted"
    assert min(slack) == 0, "the budget was never tight: the check proves nothing here"
    b = _run(coarse, tmp_path / "coarse")
    assert a["steps"] == 8 and a["tokens_per_s"] > 0
    assert {k: v for k, v in a.items() if k not in _OWN} == {
        k: v for k, v in b.items() if k not in _OWN
    }


def test_a_comparison_runs_the_twins_once(tmp_path: Path) -> None:
    base = load_config(EXAMPLES / "sim-tiny.yaml", SHORT)
    report = run_comparison(
        base,
        tmp_path,
        policies=["all-vanilla", "coarse-async"],
        etas=(2,),
        seeds=(0,),
        workers=1,
        plots=False,
    )
    rows = {r["policy"]: r for r in report["results"]}
    assert rows["coarse-async"]["same_as"] == "all-vanilla"
    assert rows["coarse-async"]["run"] == rows["all-vanilla"]["run"] == "all-vanilla-eta2-seed0"
    assert rows["coarse-async"]["wall_s"] == 0.0
    assert rows["coarse-async"]["tokens_per_s"] == rows["all-vanilla"]["tokens_per_s"]
    assert "same_as" not in rows["all-vanilla"]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["all-vanilla-eta2-seed0"]
    table = (tmp_path / "results" / "compare.md").read_text()
    assert "coarse-async: all-vanilla's runs, reported for it" in table


def test_settings_a_baseline_runs_without_keep_both_runs() -> None:
    """Batch redundancy (a baseline runs without it) makes the configs differ: both run."""
    plain = load_config(EXAMPLES / "sim-tiny.yaml", SHORT)
    runs = plan_runs(plain, ["all-vanilla", "coarse-async", "staleflow"], (1, 3))
    names = [(c.coordinator.policy, c.protocol.eta) for c in runs]
    twins = {names[i]: names[j] for i, j in decision_twins(runs).items()}
    assert twins == {
        ("coarse-async", 1): ("all-vanilla", 1),
        ("coarse-async", 3): ("all-vanilla", 3),
    }
    redundant = plain.evolve("protocol.batch_redundancy=1")
    assert decision_twins(plan_runs(redundant, ["all-vanilla", "coarse-async"], (1, 3))) == {}
    # without its twin planned, coarse-async runs itself
    assert decision_twins(plan_runs(plain, ["coarse-async"], (1, 3))) == {}
