"""The ``protocol`` section of the app's config, and the checks that tie it to the policy.

Which staleness protocol a run gets follows from ``protocol.eta`` and the policy
(:func:`fifo_protocol`): per-version buffers, or one FIFO (``eta: unbounded``, or a policy that
models a FIFO system). A setting that applies to only one of them is refused on the other
(:func:`check_protocol`), and the settings whose default depends on it are null until then
(:func:`stuck_threshold`, :attr:`ProtocolConfig.inflight_batches`). ``control.config.core_config`` builds
the protocol itself, in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import attrs

from staleflow_trainer.config_coordinator import (
    FIFO_POLICIES,
    FIXED_ETA,
    UNBOUNDED_POLICIES,
    WINDOW_POLICIES,
    verl_window,
)
from staleflow_trainer.config_schema import config_error as _err
from staleflow_trainer.config_schema import field as _f
from staleflow_trainer.config_schema import section as _section
from staleflow_trainer.errors import ConfigError
from staleness_protocol.errors import ConfigError as PackageConfigError
from trajectory_server import MAX_GROUP_SIZE

if TYPE_CHECKING:
    from staleflow_trainer.config import AppConfig

#: (B + B') groups of (n + n') trajectories ahead of training, and the control core holds a record
#: of each: absurd values (η = 10^12, B = 10^8) would admit without end and grow memory by the
#: second. The bounds sit far beyond any useful run: the published staleness results converge
#: like synchronous training up to η ≈ 3 and degrade from about 10 (use ``unbounded`` for no
#: staleness control at all), the largest published RL recipes train on a few thousand prompts
#: per step, and 2^20 admitted trajectories (≈ 1 GiB of bookkeeping) is 14x a run of B = 512
#: prompts x n = 16 at η = 8.
MAX_ETA = 64
#: ``protocol.stuck_threshold`` where it is null and the protocol has per-version buffers (at most
#: ``batch_size - 1``)
DEFAULT_STUCK_THRESHOLD = 4
#: ``protocol.stuck_after_s`` where null and stuck resolution is on
DEFAULT_STUCK_AFTER_S = 5.0
MAX_BATCH_SIZE = 16384
MAX_ADMITTED_TRAJECTORIES = 2**20
#: ``protocol.unbounded_inflight_batches`` where it is null (with ``eta: unbounded``)
DEFAULT_INFLIGHT_BATCHES = 2


@_section("protocol")
@attrs.frozen(kw_only=True)
class ProtocolConfig:
    __section__: ClassVar[str]
    batch_size: int = _f(
        8, ge=1, le=MAX_BATCH_SIZE, doc="B: groups per training batch (see MAX_BATCH_SIZE)"
    )
    group_size: int = _f(
        8, ge=1, le=MAX_GROUP_SIZE, doc="n: responses per prompt (the trajectory server's limit)"
    )
    eta: int | Literal["unbounded"] = _f(
        1, ge=0, le=MAX_ETA, doc="staleness bound; 'unbounded' = no control (see MAX_ETA)"
    )
    batch_redundancy: int = _f(0, ge=0, le=MAX_BATCH_SIZE, doc="B' - B spare slots per buffer")
    group_redundancy: int = _f(0, ge=0, doc="n' - n extra responses per group")
    stuck_threshold: int | None = _f(
        None,
        ge=0,
        doc="abort stragglers of a buffer lacking <= this many groups, < batch_size (0: off; "
        f"null: {DEFAULT_STUCK_THRESHOLD} over per-version buffers, batch_size - 1 where that "
        "is smaller, off over a FIFO)",
    )
    stuck_after_s: float | None = _f(
        None,
        ge=0.0,
        doc="resolve a stuck buffer only after the trainer waited this long for it (null: "
        f"{DEFAULT_STUCK_AFTER_S:g} s where stuck resolution is on)",
    )
    unbounded_inflight_batches: int | None = _f(
        None,
        ge=1,
        le=MAX_ETA + 1,
        doc="eta 'unbounded' only: groups admitted and not yet complete <= this x batch_size "
        f"(null: {DEFAULT_INFLIGHT_BATCHES})",
    )

    @property
    def inflight_batches(self) -> int:
        """With eta 'unbounded': admission's limit in batches (``unbounded_inflight_batches``,
        :data:`DEFAULT_INFLIGHT_BATCHES` where null)."""
        given = self.unbounded_inflight_batches
        return DEFAULT_INFLIGHT_BATCHES if given is None else given

    def __attrs_post_init__(self) -> None:
        members = self.group_size + self.group_redundancy
        if members > MAX_GROUP_SIZE:
            raise ConfigError(
                f"protocol.group_redundancy: group_size {self.group_size} + group_redundancy "
                f"{self.group_redundancy} = {members} members exceed the trajectory server's "
                f"{MAX_GROUP_SIZE} per group",
                key="protocol.group_redundancy",
                allowed=f"<= {MAX_GROUP_SIZE - self.group_size}",
            )
        buffers = self.inflight_batches if self.eta == "unbounded" else self.eta + 1
        groups = self.batch_size + self.batch_redundancy
        if buffers * groups * members > MAX_ADMITTED_TRAJECTORIES:
            raise ConfigError(
                f"protocol.batch_size: up to {buffers} x {groups} groups x {members} members = "
                f"{buffers * groups * members:,} trajectories would be admitted ahead of "
                f"training (buffers x (batch_size + batch_redundancy) x (group_size + "
                f"group_redundancy)); at most {MAX_ADMITTED_TRAJECTORIES:,}",
                key="protocol.batch_size",
                allowed=f"batch_size + batch_redundancy <= "
                f"{MAX_ADMITTED_TRAJECTORIES // (buffers * members)} with these eta and group sizes",
            )


def is_fifo(policy: str, eta: int | str) -> bool:
    """Whether ``policy`` at ``eta`` runs over one FIFO (eta 'unbounded', or a policy of
    :data:`FIFO_POLICIES`) rather than per-version buffers."""
    return eta == "unbounded" or policy in FIFO_POLICIES


def fifo_protocol(cfg: AppConfig) -> bool:
    """Whether the run's staleness protocol is one FIFO (:func:`is_fifo`)."""
    return is_fifo(cfg.coordinator.policy, cfg.protocol.eta)


def stuck_threshold(cfg: AppConfig) -> int:
    """``protocol.stuck_threshold`` as the run applies it (0: off): null is
    :data:`DEFAULT_STUCK_THRESHOLD` over per-version buffers (``batch_size - 1`` where that is
    smaller) and off over a FIFO."""
    given = cfg.protocol.stuck_threshold
    if given is not None:
        return given
    if fifo_protocol(cfg):
        return 0
    # a buffer lacking all of its batch_size groups is empty, not stuck
    return min(DEFAULT_STUCK_THRESHOLD, cfg.protocol.batch_size - 1)


def stuck_after_s(cfg: AppConfig) -> float:
    """``protocol.stuck_after_s`` as the run applies it: null is :data:`DEFAULT_STUCK_AFTER_S`
    (a run without stuck resolution never waits on it)."""
    given = cfg.protocol.stuck_after_s
    return DEFAULT_STUCK_AFTER_S if given is None else float(given)


def _check_window(cfg: AppConfig) -> None:
    """verl-async: its window ``s`` (``coordinator.verl_staleness_threshold``, η if null)
    bounds what it admits ahead of training, as η + 1 buffers do for the others; filtered
    groups free room only at the next weight sync, so dynamic sampling could starve it."""
    given = cfg.coordinator.verl_staleness_threshold
    key = "coordinator.verl_staleness_threshold" if given is not None else "protocol.eta"
    s = verl_window(cfg.protocol.eta, given)
    if s > MAX_ETA:
        raise _err(key, f"{s:g}: verl-async's window is (1 + this) x batch_size groups",
                   f"<= {MAX_ETA}")  # fmt: skip
    p = cfg.protocol
    members = p.group_size + p.group_redundancy
    admitted = (int(s) + 2) * p.batch_size * members
    if admitted > MAX_ADMITTED_TRAJECTORIES:
        raise _err(key, f"{s:g}: up to {admitted:,} trajectories would be admitted ahead of "
                   f"training ((floor(s) + 2) x batch_size x members); at most "
                   f"{MAX_ADMITTED_TRAJECTORIES:,}",
                   f"<= {MAX_ADMITTED_TRAJECTORIES // (p.batch_size * members) - 2} "
                   "with these batch and group sizes")  # fmt: skip
    if cfg.trainer.dynamic_sampling:
        raise _err("trainer.dynamic_sampling", "true: verl-async's window frees the room of "
                   "filtered groups only at the next weight sync, so a window whose groups "
                   "are filtered never fills a batch", "false with policy verl-async")  # fmt: skip


def check_protocol(cfg: AppConfig) -> None:
    """The protocol's settings against the policy: eta 'unbounded' only with a policy that
    syncs greedily, the η of a policy that models a fixed staleness, no setting of per-version
    buffers over a FIFO or of the FIFO over buffers, and the package's own checks (a stuck
    threshold below the batch size, ...: :func:`_check_by_package`). Raises ConfigError
    naming the key."""
    if cfg.protocol.eta == "unbounded" and cfg.coordinator.policy not in UNBOUNDED_POLICIES:
        raise _err(
            "coordinator.policy",
            f"{cfg.coordinator.policy!r} cannot run protocol.eta 'unbounded' (no staleness "
            "control syncs greedily like the systems it models; the baselines model a fixed "
            "eta or budget it)",
            f"one of {list(UNBOUNDED_POLICIES)} (or an integer protocol.eta)",
        )
    policy = cfg.coordinator.policy
    if policy in FIXED_ETA and cfg.protocol.eta != FIXED_ETA[policy]:
        raise _err(
            "protocol.eta",
            f"{cfg.protocol.eta!r}: policy {policy!r} models a system whose staleness is fixed "
            f"at {FIXED_ETA[policy]}",
            f"{FIXED_ETA[policy]} with policy {policy!r}",
        )
    if cfg.protocol.eta == "unbounded" and cfg.protocol.batch_redundancy:
        raise _err(
            "protocol.batch_redundancy",
            f"{cfg.protocol.batch_redundancy}: spare buffer slots mean nothing with eta "
            "'unbounded' (a FIFO, no buffers; protocol.unbounded_inflight_batches sets admission)",
            "0 with eta 'unbounded'",
        )
    if cfg.coordinator.policy in FIFO_POLICIES and cfg.protocol.batch_redundancy:
        raise _err(
            "protocol.batch_redundancy",
            f"{cfg.protocol.batch_redundancy}: policy {cfg.coordinator.policy!r} runs over one "
            "FIFO, without per-version buffers to hold spare slots",
            f"0 with policy one of {list(FIFO_POLICIES)}",
        )
    if fifo_protocol(cfg) and cfg.protocol.stuck_threshold:
        raise _err(
            "protocol.stuck_threshold",
            f"{cfg.protocol.stuck_threshold}: policy {cfg.coordinator.policy!r} with eta "
            f"{cfg.protocol.eta!r} runs over one FIFO, without per-version buffers that could "
            "wait for stragglers",
            f"0 or null with policy one of {list(FIFO_POLICIES)} or eta 'unbounded'",
        )
    if cfg.protocol.stuck_after_s is not None and not stuck_threshold(cfg):
        raise _err(
            "protocol.stuck_after_s",
            f"{cfg.protocol.stuck_after_s:g}: the wait before a stuck buffer is resolved, and "
            f"this run resolves none (protocol.stuck_threshold {cfg.protocol.stuck_threshold!r}"
            f" with policy {cfg.coordinator.policy!r}, eta {cfg.protocol.eta!r})",
            "null with stuck resolution off (or set protocol.stuck_threshold > 0 over "
            "per-version buffers)",
        )
    if cfg.coordinator.policy in WINDOW_POLICIES and cfg.protocol.eta != "unbounded":
        _check_window(cfg)
    if cfg.protocol.eta != "unbounded" and cfg.protocol.unbounded_inflight_batches is not None:
        raise _err(
            "protocol.unbounded_inflight_batches",
            f"{cfg.protocol.unbounded_inflight_batches}: it sizes admission with eta "
            f"'unbounded' only; eta {cfg.protocol.eta} admits by its buffers",
            "null with an integer eta",
        )
    _check_by_package(cfg)


def _check_by_package(cfg: AppConfig) -> None:
    """The staleness-protocol package's own checks of the protocol this config builds
    (``control.config.protocol_spec``, the one place it is built): a value it refuses (a
    ``stuck_threshold`` of at least ``batch_size``, ...) is refused here, at load, naming the
    app's key, instead of when a run starts."""
    from staleflow_trainer.control.config import config_key, protocol_spec

    try:
        protocol_spec(cfg)
    except PackageConfigError as e:
        key = config_key(e.field) if e.field else "protocol"
        raise _err(key, f"{e.value!r} is refused by the staleness protocol", e.allowed) from None
