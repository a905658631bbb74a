"""`staleflow train` with ``trainer.stream_batch``: the real trainer actor starts on the groups
settled in its next batch before the batch is complete (2 real vLLM-CPU instances, the
trajectory server, NIXL, Ray).

The first batch is the one the trainer always waits for (nothing is trained before it), and its
groups settle one after another: they are streamed in. Asserted: the run completes with the
metrics contract, a step streamed groups in before its batch was complete and never more than
its batch, staleness stays within η, and each step trained exactly its consumed batch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from staleflow_trainer.report.metrics import REQUIRED_KEYS

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.nixl, pytest.mark.timeout(600)]

STEPS = 3


@pytest.fixture(scope="module")
def run(
    ray_session: None,
    tmp_path_factory: pytest.TempPathFactory,
    engine_required: Callable[[str], None],
) -> dict[str, Any]:
    import ray
    from tiny_setup import tiny_config

    from staleflow_trainer.report.metrics import read_jsonl
    from staleflow_trainer.runtime.wiring import Deployment

    engine_required("vllm")
    run_dir: Path = tmp_path_factory.mktemp("stream_batch")
    cfg = tiny_config(
        run_dir,
        f"trainer.steps={STEPS}",
        "run.resume=never",
        "trainer.stream_batch=true",
        # responses of up to 16 tokens end at different times, so groups settle one by one
        "rollout.sampling.max_new_tokens=16",
    )
    dep = Deployment(cfg).start()
    try:
        summary = dep.run()
        trained = ray.get(dep.trainer.trained.remote())
    finally:
        dep.close()
    return {
        "cfg": cfg,
        "summary": summary,
        "trained": trained,
        "metrics": read_jsonl(run_dir / "metrics.jsonl"),
    }


def test_the_run_completes_with_the_metrics_contract(run: dict[str, Any]) -> None:
    assert run["summary"]["steps_done"] == STEPS
    rows = run["metrics"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert set(REQUIRED_KEYS) <= set(r)
        assert r["max_staleness"] <= run["cfg"].protocol.eta


def test_groups_were_streamed_in_before_their_batch_was_complete(run: dict[str, Any]) -> None:
    cfg = run["cfg"]
    batch = cfg.protocol.batch_size * cfg.protocol.group_size
    streamed = [r["trainer"]["streamed_samples"] for r in run["metrics"]]
    assert streamed[0] > 0, streamed  # the first batch: the trainer waited for all of it
    assert all(0 <= s < batch and s % cfg.protocol.group_size == 0 for s in streamed), streamed
    assert run["metrics"][0]["trainer"]["stream_busy_s"] > 0


def test_each_step_trained_exactly_its_consumed_batch(run: dict[str, Any]) -> None:
    """The trainer's token count (streamed parts and the rest) is the consumed batch's: a group
    streamed in but not consumed would add tokens, one lost between the two would remove them."""
    cfg = run["cfg"]
    assert [v for v, _ in run["trained"]] == list(range(STEPS))
    for r in run["metrics"]:
        lengths = r["response_lengths"]
        assert len(lengths) == cfg.protocol.batch_size
        assert r["trainer"]["tokens"] == sum(sum(g) for g in lengths) == r["response_tokens"]
