"""The bound on coordinator replacements: a config field, and a clear error once spent."""

from __future__ import annotations

from pathlib import Path

import pytest

from staleflow_trainer.config import load_config
from staleflow_trainer.errors import ComponentLost, ConfigError

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml"


def test_coordinator_restarts_is_validated() -> None:
    assert load_config(EXAMPLE, []).run.coordinator_restarts == 3
    with pytest.raises(ConfigError) as e:
        load_config(EXAMPLE, ["run.coordinator_restarts=-1"])
    assert e.value.key == "run.coordinator_restarts"


def test_replacements_beyond_the_bound_stop_the_run(tmp_path: Path) -> None:
    from staleflow_trainer.runtime.wiring import Deployment

    cfg = load_config(EXAMPLE, [f"run_dir={tmp_path}", "run.coordinator_restarts=1"])
    dep = Deployment(cfg)
    dep.coordinator_crashes.append({"recovered": True})  # one replacement already spent
    with pytest.raises(ComponentLost, match=r"run.coordinator_restarts=1 is exhausted") as e:
        dep.replace_crashed_coordinator(RuntimeError("actor died"))
    assert e.value.component == "coordinator" and "actor died" in str(e.value)
