"""`staleflow train`, shortened: the whole system on Ray (real TS, NIXL param server, trainer),
once per rollout backend — 2 sim engine instances, and 2 real vLLM-CPU instances — and once
more on sim engines with the ``coarse-async-drop`` baseline (its FIFO protocol, GcFifo).

One run per backend (Ray started once): 3 training steps of the README config, then a resume
from its checkpoint for a 4th step. Asserted: steps completed and the metrics contract;
consumed staleness <= eta; no trajectory lost (every admitted one consumed, in flight or dropped
with a reason, and the two services agree); weights really changed on an instance after a sync
(served version advanced, log-probs shifted — for vLLM they also equal the trainer's own; sim
weights are bytes only, so only the synthetic log-probs move with the version); resume restores
the protocol state exactly and continues.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from staleflow_trainer.report.metrics import REQUIRED_KEYS

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

BACKENDS = [
    pytest.param(("sim", ()), marks=[pytest.mark.sim], id="sim"),
    pytest.param(("vllm", ()), marks=[pytest.mark.vllm, pytest.mark.nixl], id="vllm"),
    # the strict-async FIFO baseline's data path (staleness_protocol.GcFifo) through the app
    pytest.param(
        ("sim", ("coordinator.policy=coarse-async-drop", "protocol.stuck_threshold=0")),
        marks=[pytest.mark.sim],
        id="sim-coarse-async-drop",
    ),
]


@pytest.fixture(scope="module", params=BACKENDS)
def run(
    request: pytest.FixtureRequest,
    ray_session: None,
    tmp_path_factory: pytest.TempPathFactory,
    train_scenario: Callable[..., dict[str, Any]],
    engine_required: Callable[[str], None],
) -> dict[str, Any]:
    backend, overrides = request.param
    engine_required(backend)
    result = train_scenario(
        tmp_path_factory.mktemp(f"train_{backend}"), backend, steps=3, overrides=overrides
    )
    result["backend"] = backend
    result["policy"] = "coarse-async-drop" if overrides else "staleflow"
    return result


def test_steps_completed_with_the_metrics_contract(run: dict[str, Any]) -> None:
    assert run["summary"]["steps_done"] == 3
    assert run["summary"]["version"] == 3
    rows = run["metrics"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["version"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert set(REQUIRED_KEYS) <= set(r)
        # a trained batch has a rate even when it was complete before the previous step ended
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["gen_tokens_per_s"] > 0, r
        assert sum(r["staleness_hist"].values()) == run["batch"] * run["group"]
    assert sum(r["tokens"] for r in rows) > 0
    assert run["timeline"] and {t["state"] for t in run["timeline"]} <= {"busy", "syncing", "idle"}


def test_startup_names_every_phase_with_elapsed_seconds(run: dict[str, Any]) -> None:
    """A watcher sees each start-up phase begin and end, and each engine as it is ready."""
    lines = run["startup"]
    assert lines and all(ln.startswith("start-up ") and " s  " in ln for ln in lines), lines
    for phase in ("model", "ray", "servers", "trainer", "control"):
        assert any(f"  {phase}: ready (" in ln for ln in lines), (phase, lines)
    ready = [ln for ln in lines if "  engines: " in ln and " ready (" in ln]
    assert len(ready) == 2, lines  # both instances, each as it became ready


def test_consumed_staleness_never_exceeds_eta(run: dict[str, Any]) -> None:
    for r in run["metrics_resumed"]:
        assert 0 <= r["max_staleness"] <= run["eta"]
        assert all(0 <= int(s) <= run["eta"] for s in r["staleness_hist"])
    hist = run["summary_resumed"]["staleness_histogram"]
    assert sum(hist.values()) == 4 * run["batch"] * run["group"]
    assert max(int(s) for s in hist) <= run["eta"]


def test_no_trajectory_lost(run: dict[str, Any]) -> None:
    for key, steps in (("ledger", 3), ("ledger_resumed", 4)):
        ledger = run[key]
        assert ledger["problems"] == []
        assert ledger["consumed"] == steps * run["batch"] * run["group"]
        assert (
            ledger["consumed"] + ledger["in_flight"] + ledger["waiting_consume"]
            + ledger["dropped"] == ledger["trajectories"]
        )  # fmt: skip
        assert all(reason for reason in ledger["dropped_reasons"])


def test_instances_served_new_weights_after_sync(run: dict[str, Any]) -> None:
    # during the run: instances synced and served newer versions
    assert run["summary"]["counters"]["syncs"] >= 1
    assert max(t["version"] for t in run["timeline"]) >= 1
    # after an explicit sync to the final version: the served weights are the trainer's
    before, after = run["probe_before"], run["probe_after"]
    assert before["version"] == 0
    assert run["synced"]["version"] == after["version"] == 3
    shift = max(abs(a - b) for a, b in zip(after["logprobs"], before["logprobs"], strict=True))
    assert after["token_ids"] != before["token_ids"] or shift > 1e-4
    if run["backend"] == "vllm":  # real weights: the engine serves exactly what was trained
        for served, trained in zip(after["logprobs"], run["trainer_logprobs"], strict=True):
            assert served == pytest.approx(trained, abs=2e-3)


def test_resume_restores_the_protocol_exactly(run: dict[str, Any]) -> None:
    assert Path(run["resumed_from"]) == run["checkpoint"]
    assert run["checkpoint"].name == "step_000003"
    assert run["protocol_resumed"] == run["checkpoint_protocol"] == run["protocol_end"]
    assert run["summary_resumed"]["steps_done"] == 4
    assert [r["step"] for r in run["metrics_resumed"]] == [1, 2, 3, 4]


def test_the_protocol_is_the_one_the_policy_keeps_eta_with(run: dict[str, Any]) -> None:
    from staleness_protocol import FORMAT, GC_FIFO_FORMAT

    want = GC_FIFO_FORMAT if run["policy"] == "coarse-async-drop" else FORMAT
    assert run["checkpoint_protocol"]["format"] == want
    assert run["protocol_end"]["format"] == want
