"""Shared helpers for the staleness-protocol tests."""

from __future__ import annotations

import json
from typing import Any

from staleness_protocol import ProtocolConfig, StalenessProtocol


def make(batch_size: int = 2, group_size: int = 1, eta: int = 1, **kw: Any) -> StalenessProtocol:
    return StalenessProtocol(
        ProtocolConfig(batch_size=batch_size, group_size=group_size, eta=eta, **kw)
    )


def states(p: StalenessProtocol) -> dict[Any, str]:
    """Live trajectories -> state (consumed ones are retired, ended ones are tombstones)."""
    return {t[0]: t[3] for t in p.to_dict()["trajectories"]}


def step(p: StalenessProtocol) -> None:
    """Consume the READY buffer and publish the version its training step produces."""
    batch = p.consume()
    p.publish(batch.version + 1)


def roundtrip(p: StalenessProtocol) -> StalenessProtocol:
    d = p.to_dict()
    q = StalenessProtocol.from_dict(json.loads(json.dumps(d)))
    assert q.to_dict() == d
    return q
