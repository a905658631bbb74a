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
from tiny_setup import tiny_config

from staleflow_trainer.metrics import REQUIRED_KEYS, read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.sglang, pytest.mark.timeout(900)]

STEPS = 3


@pytest.fixture(scope="module")
def standins() -> Iterator[list[str]]:
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
    servers = [SglangStandIn(cfg, speed=50.0) for _ in range(2)]
    try:
        yield [s.start() for s in servers]
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def run(
    ray_session: None, standins: list[str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    from staleflow_trainer.wiring import Deployment

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
