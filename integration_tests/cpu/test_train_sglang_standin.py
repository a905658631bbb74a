"""`staleflow train` with the SGLang backend, against the in-repo SGLang **stand-in** server.

SGLang cannot run on CPU-only machines (it needs a CUDA build). The stand-in
(``engine_adapters.testing.sglang_standin``) implements the documented semantics of SGLang
0.5.x's HTTP API (/generate with input_ids + logprobs, /abort_request, /pause_generation,
/continue_generation, /update_weights_from_disk with weight_version, /get_server_info,
/metrics) over the sim engine, so its tokens are synthetic: this checks the wiring and the
adapter's control surface, not learning. ``integration_tests/gpu/gpu_sglang_conformance.py``
runs the adapter against a real SGLang server on machines that have one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fault_checks import assert_ledger_balances, assert_routes_stopped, lost_record
from tiny_setup import tiny_config

from staleflow_trainer.report.metrics import REQUIRED_KEYS, read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.sglang, pytest.mark.timeout(900)]

STEPS = 3


def _servers(count: int) -> list[Any]:
    """``count`` stand-in servers (not started) for the tiny model's tokenizer."""
    from engine_adapters.sim import SimConfig
    from engine_adapters.testing.sglang_standin import SglangStandIn
    from staleflow_trainer.tiny_model import make_char_tokenizer

    tok = make_char_tokenizer()
    cfg = SimConfig(
        cost="qwen-7b-h20",
        max_running=64,
        kv_capacity_tokens=65536,
        max_model_len=32,
        vocab_size=len(tok),
        num_special_tokens=max(tok.all_special_ids) + 1,
        eos_token_id=int(tok.eos_token_id),
    )
    return [SglangStandIn(cfg, speed=50.0) for _ in range(count)]


@pytest.fixture(scope="module")
def standins() -> Iterator[list[str]]:
    servers = _servers(2)
    try:
        yield [s.start() for s in servers]
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def run(
    ray_session: None, standins: list[str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    from staleflow_trainer.runtime.wiring import Deployment

    run_dir = tmp_path_factory.mktemp("train_sglang")
    cfg = tiny_config(
        run_dir,
        "rollout.backend=sglang",
        f"rollout.sglang_url={','.join(standins)}",
        f"trainer.steps={STEPS}",
        "run.checkpoint_every=0",
        "run.resume=never",
    )
    dep = Deployment(cfg).start()
    try:
        summary = dep.run()
        ledger = dep.ledger()
    finally:
        dep.close()
    return {
        "summary": summary,
        "ledger": ledger,
        "metrics": read_jsonl(run_dir / "metrics.jsonl"),
        "eta": cfg.protocol.eta,
        "per_step": cfg.protocol.batch_size * cfg.protocol.group_size,
    }


def test_steps_complete_through_the_sglang_adapter(run: dict[str, Any]) -> None:
    assert run["summary"]["steps_done"] == STEPS
    rows = run["metrics"]
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert set(REQUIRED_KEYS) <= set(r)
        assert sum(r["staleness_hist"].values()) == run["per_step"]
        assert 0 <= r["max_staleness"] <= run["eta"]


def test_instances_synced_new_versions_over_http(run: dict[str, Any]) -> None:
    # every sync is a pull from the param server + /update_weights_from_disk on a stand-in
    assert sum(r["syncs"] for r in run["metrics"]) > 0


def test_no_trajectory_lost(run: dict[str, Any]) -> None:
    ledger = run["ledger"]
    assert not ledger["problems"], ledger["problems"]
    assert ledger["consumed"] == STEPS * run["per_step"]


# --------------------------------------------- a server that stops answering, one that fails

GONE_STEPS = 10
ERROR_LIMIT = 2
GENERATE_ERROR_LIMIT = 4


@pytest.fixture(scope="module")
def gone(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run on three attached servers (``rollout.sglang_url``: not launched by the adapter, so
    it cannot watch their processes). Once they started, one server stops: its instance's calls
    fail with connection errors. Another answers everything but fails every generation (HTTP 500):
    its instance looks idle, so work keeps coming to it and coming back with no progress. Both
    must leave the run, and the run complete on the third."""
    import ray

    from staleflow_trainer.runtime.wiring import Deployment

    servers = _servers(3)
    urls = [s.start() for s in servers]
    run_dir = tmp_path_factory.mktemp("train_sglang_gone")
    cfg = tiny_config(
        run_dir,
        "rollout.backend=sglang",
        f"rollout.sglang_url={','.join(urls)}",
        "rollout.num_instances=3",
        "rollout.cpus_per_instance=0.5",
        f"trainer.steps={GONE_STEPS}",
        f"coordinator.instance_error_limit={ERROR_LIMIT}",
        f"coordinator.generate_error_limit={GENERATE_ERROR_LIMIT}",
        "run.checkpoint_every=0",
        "run.resume=never",
    )
    out: dict[str, Any] = {"per_step": cfg.protocol.batch_size * cfg.protocol.group_size}
    dep = Deployment(cfg).start()

    def alive(iid: str) -> bool:
        try:  # a killed or ended actor: a call fails
            ray.get(dep.rollouts[iid].stats.remote(), timeout=30)
            return True
        except ray.exceptions.RayActorError:
            return False

    # the instances follow the URLs' order; both faults before the first cycle, so each
    # instance holds work when its server fails
    *_, out["failing"], out["victim"] = sorted(dep.rollouts)
    servers[-1].stop()
    servers[-2].fail_generations("stand-in: CUDA error")

    try:
        out["summary"] = dep.run()
        out["lost"] = lost_record(dep, out["victim"], "the silent server's instance lost", 5)
        out["lost_failing"] = lost_record(
            dep, out["failing"], "the failing server's instance lost", 5
        )
        out["victim_alive"] = alive(out["victim"])
        out["failing_alive"] = alive(out["failing"])
        out["ledger"] = dep.ledger()
        out["instances"] = ray.get(dep.coordinator.instances.remote())
        out["histories"] = ray.get(dep.coordinator.histories.remote())
    finally:
        dep.close()
        for s in servers:
            s.stop()
    return out


def test_a_silent_server_leaves_the_run_which_completes(gone: dict[str, Any]) -> None:
    assert gone["summary"]["steps_done"] == GONE_STEPS
    assert gone["summary"]["counters"]["instances_lost"] == 2
    assert gone["victim"] not in gone["instances"] and len(gone["instances"]) == 1
    rec = gone["lost"]
    assert f"{ERROR_LIMIT} polls in a row on {gone['victim']!r} failed" in rec["error"], rec
    assert gone["victim_alive"] is False


def test_a_server_that_fails_every_generation_leaves_the_run(gone: dict[str, Any]) -> None:
    """Its instance ended its own process after the failures in a row (its polls answered:
    the control side found its actor dead, it did not kill it)."""
    assert gone["failing"] not in gone["instances"]
    assert gone["failing_alive"] is False
    assert "ActorDiedError" in gone["lost_failing"]["error"], gone["lost_failing"]


def test_what_the_lost_instances_held_ran_elsewhere(gone: dict[str, Any]) -> None:
    assert_routes_stopped(gone["histories"], gone["lost"])
    assert_routes_stopped(gone["histories"], gone["lost_failing"])
    assert_ledger_balances(gone["ledger"], gone["per_step"])
    assert gone["ledger"]["steps_done"] == GONE_STEPS
