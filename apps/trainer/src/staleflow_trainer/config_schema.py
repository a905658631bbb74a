"""The schema machinery of the app's config: typed, range-checked fields and section builders.

Every config section is a frozen attrs class whose fields are made with :func:`field` (a default,
an optional range, a doc line) and decorated with :func:`section` (its dotted name). The same
check runs when a section is built from YAML (:func:`build`) and when code constructs it
directly; every failure is a :class:`~staleflow_trainer.errors.ConfigError` naming the full
dotted key and what would be accepted.

Every number must be finite: ``inf`` and ``nan`` (``.inf``/``.nan`` in YAML) are refused for
every float field, here, once (no field accepts them: a period, a timeout, a learning rate or a
ratio of infinity is a typo, not a setting). A string field made with ``nonempty=True`` refuses
an empty or blank value (e.g. ``run.run_dir=`` would otherwise mean the current directory).
"""

from __future__ import annotations

import math
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import attrs

from staleflow_trainer.errors import ConfigError

_META = "staleflow"


def config_error(key: str, msg: str, allowed: str) -> ConfigError:
    """A :class:`ConfigError` for ``key`` whose message starts with the key."""
    return ConfigError(f"{key}: {msg}", key=key, allowed=allowed)


#: Keys that no longer exist, and what to set instead.
REMOVED = {
    "sim.rollout_gpus": "the simulator runs rollout.num_instances instances of "
    "sim.gpus_per_instance GPUs each, as a deployment does: set rollout.num_instances",
}


def unknown_key(key: str, allowed: Iterable[str]) -> ConfigError:
    """The error for a key the schema does not have (a removed key says what replaced it)."""
    names = ", ".join(sorted(allowed))
    if key in REMOVED:
        return ConfigError(
            f"config key {key!r} was removed: {REMOVED[key]}", key=key, allowed=names
        )
    return ConfigError(
        f"unknown config key {key!r}; allowed keys here: {names}", key=key, allowed=names
    )


def field(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    nonempty: bool = False,
    doc: str = "",
) -> Any:
    meta = {"ge": ge, "gt": gt, "le": le, "lt": lt, "nonempty": nonempty, "doc": doc}
    if isinstance(default, (list, dict)):
        raise TypeError("use tuples / sections, not mutable defaults")
    return attrs.field(default=default, validator=validate_field, metadata={_META: meta})


def describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a list of {describe(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    if attrs.has(tp):
        return f"a mapping with keys {', '.join(a.name for a in attrs.fields(tp))}"
    return {int: "an integer", float: "a finite number", str: "a string", bool: "true/false"}.get(
        tp, str(tp)
    )


#: what a coercion step answers when ``value`` does not fit the type
_MISS: Any = object()


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` as type ``tp`` (int → float allowed) or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        out = _literal(value, typing.get_args(tp))
    elif origin in (typing.Union, types.UnionType):
        out = _union(value, typing.get_args(tp), key)
    elif origin is tuple:
        inner = typing.get_args(tp)[0]
        out = (
            tuple(coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value))
            if isinstance(value, (list, tuple))
            else _MISS
        )
    elif attrs.has(tp):
        out = _section(value, tp, key)
    else:
        out = _scalar(value, tp, key)
    if out is _MISS:
        raise ConfigError(
            f"{key}: expected {describe(tp)}, got {value!r} ({type(value).__name__})",
            key=key,
            allowed=describe(tp),
        )
    return out


def _literal(value: Any, choices: tuple[Any, ...]) -> Any:
    if value in choices and not isinstance(value, bool):
        return value
    if value is False and "off" in choices:
        return "off"  # YAML 1.1 reads an unquoted off (and no, false) as false
    return _MISS


def _union(value: Any, args: tuple[Any, ...], key: str) -> Any:
    for arg in args:
        try:
            return coerce(value, arg, key)
        except ConfigError:
            continue
    return _MISS


def _section(value: Any, tp: type, key: str) -> Any:
    if isinstance(value, tp):
        return value
    if value is None:  # an empty YAML section ("trainer:") means all defaults
        return build(tp, {}, key)
    if isinstance(value, Mapping):
        return build(tp, value, key)
    return _MISS


def _scalar(value: Any, tp: Any, key: str) -> Any:
    if tp is type(None):
        return None if value is None else _MISS
    if tp not in (bool, int, float, str):
        raise TypeError(f"unsupported config type {tp!r} at {key}")
    if isinstance(value, bool) != (tp is bool):  # a bool is no number, a number no bool
        return _MISS
    if tp is float and isinstance(value, int):
        try:
            value = float(value)
        except OverflowError:  # an int beyond float range
            return _MISS
    if not isinstance(value, tp) or (tp is float and not math.isfinite(value)):
        return _MISS
    return value


def check_known(
    value: str, known: Iterable[str], key: str, what: str, *, json_ok: bool = False
) -> None:
    """``value`` must be one of ``known`` (or, with ``json_ok``, a path ending in .json): else a
    :class:`ConfigError` naming ``key``, the ``what`` it should be, and the allowed values."""
    names = list(known)
    if value in names or (json_ok and value.endswith(".json")):
        return
    raise ConfigError(
        f"{key} {value!r} is not a known {what}",
        key=key,
        allowed=f"one of {names}" + (" or a path ending in .json" if json_ok else ""),
    )


def check_range(value: Any, meta: Mapping[str, Any], key: str) -> None:
    if isinstance(value, str) and meta.get("nonempty") and not value.strip():
        raise ConfigError(
            f"{key} must not be empty, got {value!r}", key=key, allowed="a non-empty string"
        )
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    bounds = []
    if meta.get("ge") is not None:
        bounds.append((value >= meta["ge"], f">= {meta['ge']}"))
    if meta.get("gt") is not None:
        bounds.append((value > meta["gt"], f"> {meta['gt']}"))
    if meta.get("le") is not None:
        bounds.append((value <= meta["le"], f"<= {meta['le']}"))
    if meta.get("lt") is not None:
        bounds.append((value < meta["lt"], f"< {meta['lt']}"))
    if not all(ok for ok, _ in bounds):
        allowed = " and ".join(b for _, b in bounds)
        raise ConfigError(f"{key} must be {allowed}, got {value!r}", key=key, allowed=allowed)


def validate_field(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    section = getattr(type(inst), "__section__", type(inst).__name__)
    key = f"{section}.{attribute.name}" if section else attribute.name
    tp = attribute.type
    coerced = coerce(value, tp, key)
    if type(coerced) is not type(value) and not (
        isinstance(value, int) and isinstance(coerced, float)
    ):
        # direct construction with e.g. a list where a tuple is declared
        raise ConfigError(
            f"{key}: expected {describe(tp)}, got {value!r}", key=key, allowed=describe(tp)
        )
    check_range(value, attribute.metadata.get(_META, {}), key)


def build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{prefix or 'config'} must be a mapping, got {data!r}",
            key=prefix or "<root>",
            allowed=describe(cls),
        )
    names = {a.name: a for a in attrs.fields(cls)}
    kwargs: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            raise unknown_key(key, names)
        a = names[k]
        value = coerce(v, a.type, key)
        check_range(value, a.metadata.get(_META, {}), key)
        kwargs[k] = value
    try:
        return cls(**kwargs)
    except ConfigError as e:
        # re-key errors raised by __attrs_post_init__ / validators with the full prefix
        if prefix and not e.key.startswith(prefix):
            tail = e.key.split(".", 1)[-1]
            raise ConfigError(
                str(e).replace(e.key, f"{prefix}.{tail}"),
                key=f"{prefix}.{tail}",
                allowed=e.allowed,
            ) from None
        raise


def section(name: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        setattr(cls, "__section__", name)  # noqa: B010  (ClassVar declared per section)
        attrs.resolve_types(cls, globalns=vars(sys.modules[cls.__module__]))
        return cls

    return wrap


# ---------------------------------------------------------------------------------------------
