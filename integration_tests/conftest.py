"""Shared set-up for the composed-system tests: one Ray session per module, tiny configs.

``STALEFLOW_REQUIRE_BACKEND`` (set by ``nox -s "integration(backend=...)"``) names the engine
the session is about; a test for that backend whose engine is missing fails loudly (never skips).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from tiny_setup import EXAMPLES, require_engine, tiny_config


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    """A local Ray for the whole module (Deployments reuse it; starting Ray costs ~20 s)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from staleflow_trainer.config import load_config
    from staleflow_trainer.runtime.prepare import init_ray

    started = init_ray(load_config(EXAMPLES / "tiny.yaml", ["ray.object_store_mb=256"]))
    yield
    if started:
        ray.shutdown()


def probe_prompt(model_path: Path, text: str = "3+4=") -> Sequence[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(model_path))(text)["input_ids"])


def train_and_resume(
    run_dir: Path, backend: str, *, steps: int = 3, overrides: tuple[str, ...] = ()
) -> dict[str, object]:
    """The README run, shortened: train ``steps`` steps on Ray (checkpoint at the end), probe an
    instance before and after it syncs to the final version, then resume from the checkpoint
    for one more step. ``overrides`` (``key=value``) apply to both runs. Returns everything the
    tests assert on."""
    import json

    import ray

    from staleflow_trainer.actors.reconcile import STATE_FILE, latest_checkpoint
    from staleflow_trainer.report.metrics import read_jsonl
    from staleflow_trainer.runtime.wiring import Deployment

    out: dict[str, object] = {"eta": 1, "batch": 8, "group": 8, "steps": steps}
    cfg = tiny_config(
        run_dir, f"trainer.steps={steps}", "run.checkpoint_every=2", "run.resume=never",
        *overrides, backend=backend,
    )  # fmt: skip
    dep = Deployment(cfg).start()
    out["startup"] = list(dep.startup.lines)
    try:
        iid = sorted(dep.rollouts)[0]
        prompt = probe_prompt(dep.model_path)
        out["probe_before"] = ray.get(dep.rollouts[iid].probe.remote(prompt, 2))
        out["summary"] = dep.run()
        out["ledger"] = dep.ledger()
        out["protocol_end"] = dep.protocol_state()
        version = int(out["summary"]["version"])  # type: ignore[index]
        out["synced"] = ray.get(dep.rollouts[iid].sync.remote(version))
        after = ray.get(dep.rollouts[iid].probe.remote(prompt, 2))
        out["probe_after"] = after
        out["trainer_logprobs"] = ray.get(dep.trainer.logprobs.remote(prompt, after["token_ids"]))
    finally:
        dep.close()
    out["metrics"] = read_jsonl(run_dir / "metrics.jsonl")
    out["timeline"] = read_jsonl(run_dir / "timeline.jsonl")
    ckpt = latest_checkpoint(run_dir)
    out["checkpoint"] = ckpt
    out["checkpoint_protocol"] = json.loads((ckpt / STATE_FILE).read_text())["protocol"]

    cfg2 = tiny_config(
        run_dir, f"trainer.steps={steps + 1}", "run.checkpoint_every=2", "run.resume=must",
        *overrides, backend=backend,
    )  # fmt: skip
    dep2 = Deployment(cfg2).start()
    try:
        out["resumed_from"] = dep2.resume_dir
        out["protocol_resumed"] = ray.get(dep2.coordinator.restored.remote())["protocol"]
        out["summary_resumed"] = dep2.run()
        out["ledger_resumed"] = dep2.ledger()
    finally:
        dep2.close()
    out["metrics_resumed"] = read_jsonl(run_dir / "metrics.jsonl")
    return out


@pytest.fixture(scope="session")
def train_scenario() -> Callable[..., dict[str, Any]]:
    """:func:`train_and_resume`, for test modules (conftest helpers are not importable)."""
    return train_and_resume


@pytest.fixture(scope="session")
def engine_required() -> Callable[[str], None]:
    return require_engine
