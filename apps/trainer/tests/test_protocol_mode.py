"""protocol_mode: the run's protocol from its config — bounded, or the unbounded FIFO — and a
checkpoint that names the other mode is refused."""

from __future__ import annotations

import json

import pytest

from staleflow_trainer.config import load_config
from staleflow_trainer.errors import CheckpointError, ConfigError
from staleflow_trainer.protocol_mode import (
    build_protocol,
    protocol_config,
    restore_protocol,
    unbounded_config,
)
from staleness_protocol import StalenessProtocol, UnboundedFifo

UNBOUNDED = ["protocol.eta=unbounded", "coordinator.policy=all-vanilla"]


def test_int_eta_builds_the_bounded_protocol() -> None:
    cfg = load_config(
        None, ["protocol.eta=3", "protocol.batch_size=4", "protocol.stuck_threshold=0"]
    )
    p = build_protocol(cfg)
    assert isinstance(p, StalenessProtocol)
    assert p.config.eta == 3 and p.config.batch_size == 4


def test_unbounded_builds_the_fifo_with_the_inflight_cap() -> None:
    cfg = load_config(
        None, [*UNBOUNDED, "protocol.batch_size=4", "protocol.unbounded_inflight_batches=3"]
    )
    p = build_protocol(cfg)
    assert isinstance(p, UnboundedFifo)
    assert p.config.max_inflight_groups == 12 and p.config.eta is None
    assert unbounded_config(cfg).batch_size == 4
    with pytest.raises(ConfigError) as e:
        protocol_config(cfg)
    assert e.value.key == "protocol.eta"


def test_restore_round_trips_and_refuses_a_mode_change() -> None:
    bounded = load_config(
        None,
        [
            "protocol.eta=2",
            "protocol.batch_size=1",
            "protocol.group_size=1",
            "protocol.stuck_threshold=0",
        ],
    )
    unbounded = load_config(None, [*UNBOUNDED, "protocol.batch_size=1", "protocol.group_size=1"])
    for cfg in (bounded, unbounded):
        p = build_protocol(cfg)
        p.reserve("g", "g/0", 0)
        p.finish("g/0")
        data = json.loads(json.dumps(p.to_dict()))
        q = restore_protocol(data, cfg)
        assert type(q) is type(p) and q.to_dict() == p.to_dict()
    with pytest.raises(CheckpointError, match="unbounded"):
        restore_protocol(build_protocol(unbounded).to_dict(), bounded)
    with pytest.raises(CheckpointError, match="eta=2"):
        restore_protocol(build_protocol(bounded).to_dict(), unbounded)
