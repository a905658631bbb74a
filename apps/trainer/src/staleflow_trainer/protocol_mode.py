"""Which staleness protocol a run's control loop owns.

* ``protocol.eta`` an int ≥ 0 → :class:`staleness_protocol.StalenessProtocol` (Reserve /
  Occupy / Consume, the bound η guaranteed per trajectory);
* ``protocol.eta: unbounded`` → :class:`staleness_protocol.UnboundedFifo`: no staleness
  control, as in systems without a guarantee (verl fully-async with no staleness threshold,
  AReaL with ``max_staleness`` unset). New groups are admitted while fewer than
  ``protocol.unbounded_inflight_batches × batch_size`` groups are admitted and not yet complete
  (enough to keep every instance busy; finished groups waiting for the trainer are not
  counted, so their queue is unbounded), the trainer takes the first ``B`` complete groups
  FIFO, and staleness ``b − V_traj`` is measured per consumed sample, never enforced. The
  config only allows it with a greedy-global-sync policy (``config.UNBOUNDED_POLICIES``):
  every instance pulls each version as soon as it is published, interrupted work is kept
  (partial rollout) and resumes at the new version with its V_traj.

* ``coordinator.policy: coarse-async-drop`` (an integer η) → :class:`staleness_protocol.GcFifo`:
  the strict-async baseline's data path — one FIFO, the first ``B`` complete groups trained,
  groups that age past η dropped (in flight or waiting); admission by the policy's
  ``(η + v + 1)·B`` budget.

All expose the same methods; the loop and the coordinator call nothing else.
"""

from __future__ import annotations

from typing import Any

from staleflow_trainer.config import GC_FIFO_POLICIES, AppConfig
from staleflow_trainer.errors import CheckpointError, ConfigError
from staleness_protocol import (
    GcFifo,
    GcFifoConfig,
    ProtocolConfig,
    StalenessProtocol,
    UnboundedConfig,
    UnboundedFifo,
    protocol_from_dict,
)

LoopProtocol = StalenessProtocol | UnboundedFifo


def is_unbounded(cfg: AppConfig) -> bool:
    return cfg.protocol.eta == "unbounded"


def mode(cfg: AppConfig) -> str:
    """``"buffers"``, ``"unbounded"`` or ``"gc-fifo"``: which protocol the config asks for."""
    if is_unbounded(cfg):
        return "unbounded"
    return "gc-fifo" if cfg.coordinator.policy in GC_FIFO_POLICIES else "buffers"


def _mode_of(proto: LoopProtocol) -> str:
    if isinstance(proto, GcFifo):
        return "gc-fifo"
    return "unbounded" if isinstance(proto, UnboundedFifo) else "buffers"


def protocol_config(cfg: AppConfig) -> ProtocolConfig:
    """The bounded protocol's config; ``eta: unbounded`` has none (see :func:`build_protocol`)."""
    p = cfg.protocol
    if p.eta == "unbounded":
        raise ConfigError(
            "protocol.eta: 'unbounded' runs without the bounded protocol; use build_protocol",
            key="protocol.eta",
            allowed="an integer >= 0",
        )
    return ProtocolConfig(
        batch_size=p.batch_size,
        group_size=p.group_size,
        eta=int(p.eta),
        batch_redundancy=p.batch_redundancy,
        group_redundancy=p.group_redundancy,
        filtering=cfg.trainer.dynamic_sampling,
        stuck_threshold=p.stuck_threshold or None,
    )


def unbounded_config(cfg: AppConfig) -> UnboundedConfig:
    p = cfg.protocol
    return UnboundedConfig(
        batch_size=p.batch_size,
        group_size=p.group_size,
        max_inflight_groups=p.unbounded_inflight_batches * p.batch_size,
        group_redundancy=p.group_redundancy,
        filtering=cfg.trainer.dynamic_sampling,
    )


def gc_fifo_config(batch_size: int, group_size: int, eta: int, filtering: bool) -> GcFifoConfig:
    """``GcFifo``'s config for the ``coarse-async-drop`` baseline (the app and the simulator).
    Its own cap is (η + 1)·B groups in flight, so the policy's ``(η + v + 1)·B`` budget gate,
    which also counts finished groups, always binds first."""
    return GcFifoConfig(
        batch_size=batch_size,
        group_size=group_size,
        eta=eta,
        max_inflight_groups=(eta + 1) * batch_size,
        filtering=filtering,
    )


def build_protocol(cfg: AppConfig) -> LoopProtocol:
    """A fresh protocol for a new run."""
    m = mode(cfg)
    if m == "unbounded":
        return UnboundedFifo(unbounded_config(cfg))
    if m == "gc-fifo":
        p = cfg.protocol
        return GcFifo(
            gc_fifo_config(p.batch_size, p.group_size, int(p.eta), cfg.trainer.dynamic_sampling)
        )
    return StalenessProtocol(protocol_config(cfg))


def restore_protocol(data: dict[str, Any], cfg: AppConfig) -> LoopProtocol:
    """The protocol a checkpoint (or a handover) holds; refused when its mode differs from the
    config's (a bounded run cannot resume as unbounded, nor the reverse)."""
    proto = protocol_from_dict(data)
    saved, wanted = _mode_of(proto), mode(cfg)
    if saved != wanted:
        raise CheckpointError(
            f"the checkpoint's protocol state is {saved} (eta={proto.config.eta!r}), the config "
            f"asks for {wanted} (protocol.eta={cfg.protocol.eta!r}, coordinator.policy="
            f"{cfg.coordinator.policy!r}): resume with the config it was written with"
        )
    return proto
