"""The convergence study, shortened for CI: learning happens at η = 0 and at η = 3.

Two deployments of ``examples/convergence.yaml`` (2 real vLLM-CPU instances, NIXL param
server, StaleFlow coordinator; Ray started once for the module), ``STEPS`` steps each at a
fixed seed — the study's own run length: a step takes ~0.3 s, the deployment's start-up
(~1-3 min) dominates, and shorter runs only learn the answer format (reward ~0.2), not the
answers. The system is asynchronous, so these runs are not reproducible; the recipe they train
with is checked deterministically in ``test_convergence_recipe.py``. Asserted per setting: the reward of the consumed batches rises from its first to its
last ``window(STEPS)`` steps (as the study's reward_start / reward_end) by at least
``MARGIN``; the trained policy, evaluated on every prompt with the HF sampler, beats the initial
one by ``POLICY_MARGIN``; consumed staleness stays within η, and at η = 3 most samples really
are stale (so the second run is not a synchronous run in disguise).

A third, short deployment runs the study's "unbounded" setting (``protocol.eta=unbounded``: no
staleness control, FIFO consumption, greedy global sync) for ``UNBOUNDED_STEPS`` steps and checks
the mode itself, not learning: every step consumed a full batch with its staleness measured,
each instance synced (weights pulled after publishes), data generated after a sync was
consumed, and nothing was lost.

The margins come from the full study (docs/convergence.md, results/convergence/summary.json):
see the constants' comments.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import convergence_study as study
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 60
SEED = 0
# consumed-batch reward, mean of the last 6 steps minus mean of the first 6. Full study at lr 3e-3
# (2 seeds): eta=0 +0.74 / +0.76, eta=3 +0.75 / +0.65 (eta=3 without TIS +0.37 / +0.37); the
# deterministic recipe check (test_convergence_recipe.py, 5 seeds) at eta=3: +0.43 at the least.
# At the old lr 1e-2 a CI run got +0.11 (stuck at the answer format; see docs/convergence.md,
# "The learning rate"). The margin is ~40 % of the smallest real learning run.
MARGIN = 0.25
# expected reward of the final policy minus that of the initial one. Full study: eta=0
# +0.79 / +0.86, eta=3 +0.84 / +0.78 (without TIS +0.40 / +0.44); recipe check, eta=3: +0.51 at
# the least. The margins are about learning, not about separating the settings.
POLICY_MARGIN = 0.25
# Without a bound, the instances generate ahead into the FIFO at version 0 while the trainer runs
# its first step (1-token responses: 4 to 8 batches of it were measured before the first sync
# landed); consumption reaches data generated after a sync only once that is drained, so the run
# is several times longer than the most ever measured (8 batches, in a CI run)
UNBOUNDED_STEPS = 40


def _train(run_dir: Path, name: str, steps: int = STEPS) -> dict[str, Any]:
    import ray

    from staleflow_trainer.config import load_config
    from staleflow_trainer.report.metrics import read_jsonl
    from staleflow_trainer.runtime.wiring import Deployment

    setting = study.BY_NAME[name]
    cfg = load_config(
        study.CONFIG,
        [*study.overrides(setting, SEED, steps, run_dir), "coordinator.snapshot_interval_s=0.1"],
    )
    dep = Deployment(cfg).start()
    try:
        summary = dep.run()
        ledger = dep.ledger()
        instances = ray.get([h.stats.remote() for h in dep.rollouts.values()])
    finally:
        dep.close()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    run = {
        "summary": summary,
        "ledger": ledger,
        "instances": instances,  # each rollout actor's own counts (syncs it loaded)
        "rows": rows,
        "policy_start": study.policy_reward(run_dir, final=False),
        "policy_end": study.policy_reward(run_dir, final=True),
    }
    stats = study.run_stats(rows)
    print(  # shown with -s or beside a failure: what this run measured
        f"[convergence] {name}: reward {stats['reward_start']:.3f} -> {stats['reward_end']:.3f}, "
        f"policy {run['policy_start']} -> {run['policy_end']}, "
        f"mean staleness {stats['mean_staleness']:.2f}"
    )
    return run


@pytest.fixture(scope="module")
def runs(
    ray_session: None, tmp_path_factory: pytest.TempPathFactory, engine_required: Any
) -> Iterator[dict[int, dict[str, Any]]]:
    engine_required("vllm")
    root = tmp_path_factory.mktemp("convergence")
    yield {eta: _train(root / f"eta{eta}", f"eta{eta}") for eta in (0, 3)}


@pytest.fixture(scope="module")
def unbounded_run(
    ray_session: None, tmp_path_factory: pytest.TempPathFactory, engine_required: Any
) -> dict[str, Any]:
    engine_required("vllm")
    root = tmp_path_factory.mktemp("convergence")
    return _train(root / "unbounded", "unbounded", steps=UNBOUNDED_STEPS)


@pytest.mark.parametrize("eta", [0, 3])
def test_reward_of_consumed_batches_rises(runs: dict[int, dict[str, Any]], eta: int) -> None:
    rows = runs[eta]["rows"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    rewards = [r["reward_mean"] for r in rows]
    w = study.window(STEPS)
    start = sum(rewards[:w]) / w
    end = sum(rewards[-w:]) / w
    assert end - start >= MARGIN, f"eta={eta}: reward {start:.3f} -> {end:.3f}: {rewards}"


@pytest.mark.parametrize("eta", [0, 3])
def test_trained_policy_beats_the_initial_one(runs: dict[int, dict[str, Any]], eta: int) -> None:
    start, end = runs[eta]["policy_start"], runs[eta]["policy_end"]
    assert end - start >= POLICY_MARGIN, f"eta={eta}: policy reward {start:.3f} -> {end:.3f}"


@pytest.mark.parametrize("eta", [0, 3])
def test_staleness_within_bound_and_nothing_lost(runs: dict[int, dict[str, Any]], eta: int) -> None:
    rows = runs[eta]["rows"]
    assert max(r["max_staleness"] for r in rows) <= eta
    for r in rows:
        assert sum(r["staleness_hist"].values()) == 8 * 16
        assert all(0 <= int(s) <= eta for s in r["staleness_hist"])
    assert not runs[eta]["ledger"].get("problems")
    if eta > 0:  # the bounded run really trained on stale data
        assert sum(r["mean_staleness"] for r in rows) / len(rows) > 1.0


def test_unbounded_consumes_fifo_with_staleness_measured_and_weights_synced(
    unbounded_run: dict[str, Any],
) -> None:
    rows, summary = unbounded_run["rows"], unbounded_run["summary"]
    assert [r["step"] for r in rows] == list(range(1, UNBOUNDED_STEPS + 1))
    for r in rows:  # every consumed sample's staleness b - V_traj is recorded
        assert sum(r["staleness_hist"].values()) == 8 * 16
        assert r["max_staleness"] == max(int(s) for s in r["staleness_hist"])
    # greedy global sync: every instance pulled (the latest version at the time: versions
    # published during a pull are skipped, and with a full FIFO a step is shorter than a pull,
    # so not every version is loaded), and no instance pulled more often than versions appeared
    loaded = {i["instance_id"]: i["syncs"] for i in unbounded_run["instances"]}
    assert len(loaded) == 2 and all(n >= 1 for n in loaded.values()), loaded
    assert 2 <= summary["counters"]["syncs"] <= 2 * UNBOUNDED_STEPS, summary["counters"]
    # data generated after a sync (V_traj = version consumed - staleness > 0) was trained on;
    # the old "eta = steps" stand-in never synced, so it trained only on version-0 data
    v_traj = {r["version"] - 1 - int(s) for r in rows for s in r["staleness_hist"]}
    assert max(v_traj) > 0, rows
    assert min(v_traj) >= 0
    assert not unbounded_run["ledger"].get("problems")
