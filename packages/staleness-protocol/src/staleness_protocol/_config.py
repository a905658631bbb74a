"""ProtocolConfig: the three required knobs and one field per optional mechanism."""

from __future__ import annotations

from typing import Any, ClassVar, Self

import attrs

from ._checks import is_int as _is_int
from .errors import ConfigError


def _int_at_least(low: int) -> Any:
    def check(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not _is_int(value) or value < low:
            raise ConfigError(attribute.name, value, f"an int >= {low}")

    return check


def _check_stuck_threshold(
    inst: ProtocolConfig, attribute: attrs.Attribute[Any], value: Any
) -> None:
    if value is None:
        return
    if not _is_int(value) or value < 1:
        raise ConfigError(attribute.name, value, "None (off) or an int >= 1")
    # attrs validates in field order, so batch_size is already checked here.
    if value >= inst.batch_size:
        raise ConfigError(
            attribute.name,
            value,
            f"< batch_size ({inst.batch_size}): a buffer lacking every group is not stuck, it is empty",
        )


def _check_filtering(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(attribute.name, value, "True or False")


#: Default of every config's ``tombstone_versions``.
TOMBSTONE_VERSIONS = 4


class ConfigDict:
    """What the configs share on top of their attrs fields: ``n'`` and the dict round trip.

    Every config also has ``tombstone_versions`` (>= 1, default 4): how many consumes an
    ended trajectory or group is still recognised for after it left the live ledger (a late
    ``finish`` of an aborted trajectory answers ALREADY_ENDED, a late sibling of a closed
    group DISCARD). Older ids are forgotten, so a checkpoint does not grow with the run.
    """

    __slots__ = ()

    __attrs_attrs__: ClassVar[Any]  # set by @attrs.frozen on the subclass
    group_size: int
    group_redundancy: int
    tombstone_versions: int

    @property
    def samples_per_group(self) -> int:
        """``n'``: how many members a group may have live at once."""
        return self.group_size + self.group_redundancy

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(unknown[0], data[unknown[0]], f"one of {sorted(known)}")
        return cls(**data)


@attrs.frozen(kw_only=True)
class ProtocolConfig(ConfigDict):
    """What the protocol needs to know; every optional mechanism is off by default.

    Required:
        batch_size: ``B``, groups per training batch (>= 1).
        group_size: ``n``, trajectories per group that are trained on (>= 1).
        eta: ``η``, the staleness bound (>= 0; 0 is on-policy).

    Optional mechanisms (each off unless set):
        batch_redundancy: spare slots per buffer, ``B' = B + batch_redundancy``. More groups are
            admitted than a batch needs; once a buffer is READY its remaining reservations are
            aborted (reason ``batch_surplus``).
        group_redundancy: extra samples per group, ``n' = n + group_redundancy``. Once ``n``
            members finish, the rest are aborted (reason ``group_surplus``).
        filtering: when True every ``drop_group`` queues a replacement-prompt request. (Dropping
            works either way; without filtering no replacement is asked for.)
        stuck_threshold: enables ``resolve_stuck()``: a buffer lacking at most this many groups
            is completed from later buffers after aborting its reserved stragglers. Must be
            ``< batch_size``.

    Retirement: tombstone_versions (>= 1, default 4) — see :class:`ConfigDict`.
    """

    batch_size: int = attrs.field(validator=_int_at_least(1))
    group_size: int = attrs.field(validator=_int_at_least(1))
    eta: int = attrs.field(validator=_int_at_least(0))
    batch_redundancy: int = attrs.field(default=0, validator=_int_at_least(0))
    group_redundancy: int = attrs.field(default=0, validator=_int_at_least(0))
    filtering: bool = attrs.field(default=False, validator=_check_filtering)
    stuck_threshold: int | None = attrs.field(default=None, validator=_check_stuck_threshold)
    tombstone_versions: int = attrs.field(default=TOMBSTONE_VERSIONS, validator=_int_at_least(1))

    @property
    def slots_per_buffer(self) -> int:
        """``B'``: slots per buffer (``B`` plus spares)."""
        return self.batch_size + self.batch_redundancy
