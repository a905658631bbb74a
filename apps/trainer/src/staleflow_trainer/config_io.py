"""Loading the app's config: one YAML mapping plus ``key=value`` overrides (values parsed as
YAML scalars), unknown keys rejected, cross-field checks run; dumping it back (a round trip).
The sections themselves are in :mod:`staleflow_trainer.config`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import yaml

from staleflow_trainer import config as _config  # a module: config re-exports this one's names
from staleflow_trainer.config_schema import build as _build
from staleflow_trainer.errors import ConfigError

if TYPE_CHECKING:
    from staleflow_trainer.config import AppConfig

# ---------------------------------------------------------------------------------------------
# loading, overrides, dumping

_ALIASES = {"run_dir": "run.run_dir"}


def parse_override(item: str) -> tuple[str, Any]:
    """``"trainer.lr=3e-4"`` → ``("trainer.lr", 0.0003)`` (value parsed as a YAML scalar)."""
    if "=" not in item:
        raise ConfigError(
            f"override {item!r} is not of the form key=value", key=item, allowed="key=value"
        )
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has an empty key", key=item, allowed="key=value")
    key = _ALIASES.get(key, key)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(
            f"override {item!r}: value is not a YAML scalar ({e})", key=key, allowed="a scalar"
        ) from None
    if isinstance(value, float) is False and isinstance(raw, str) and _looks_like_float(raw):
        value = float(raw)  # YAML 1.1 reads "1e-3" as a string; users mean a number
    return key, value


def _looks_like_float(raw: str) -> bool:
    try:
        float(raw)
    except ValueError:
        return False
    return not raw.strip().lstrip("+-").isdigit()


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply dotted ``key=value`` overrides to a nested dict in place (schema-checked later)."""
    for item in overrides:
        key, value = parse_override(item)
        parts = key.split(".")
        node: Any = data
        cls: Any = _config.AppConfig
        for depth, part in enumerate(parts):
            here = ".".join(parts[: depth + 1])
            names = {a.name: a for a in attrs.fields(cls)}
            if part not in names:
                allowed = ", ".join(sorted(names))
                raise ConfigError(
                    f"unknown config key {here!r}; allowed keys here: {allowed}",
                    key=here,
                    allowed=allowed,
                )
            ftype = names[part].type
            if depth == len(parts) - 1:
                if attrs.has(ftype) and not isinstance(value, Mapping):
                    raise ConfigError(
                        f"{here} is a section; set one of its keys ({here}.KEY=VALUE)",
                        key=here,
                        allowed=", ".join(a.name for a in attrs.fields(ftype)),
                    )
                node[part] = value
            else:
                if not attrs.has(ftype):
                    raise ConfigError(
                        f"unknown config key {key!r}: {here} is not a section",
                        key=key,
                        allowed=here,
                    )
                child = node.get(part)
                if child is None:
                    child = node[part] = {}
                elif not isinstance(child, dict):
                    raise ConfigError(
                        f"{here} must be a mapping, got {child!r}", key=here, allowed="a mapping"
                    )
                node, cls = child, ftype
    return data


def from_dict(data: Mapping[str, Any]) -> AppConfig:
    """Build and validate an :class:`AppConfig` from a nested mapping."""
    data = dict(data)
    for alias, target in _ALIASES.items():
        if alias in data:
            section, key = target.split(".")
            sec = dict(data.get(section) or {})
            sec[key] = data.pop(alias)
            data[section] = sec
    config: AppConfig = _build(_config.AppConfig, data, "")
    return config


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> AppConfig:
    """Read ``path`` (YAML; None = all defaults), apply overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist", key="<file>", allowed="")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: invalid YAML: {e}", key="<file>", allowed="YAML") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{p}: top level must be a mapping, got {type(loaded).__name__}",
                key="<root>",
                allowed="a mapping of sections",
            )
        data = loaded
    data = _normalize_aliases(data)
    apply_overrides(data, overrides)
    return from_dict(data)


def _normalize_aliases(data: dict[str, Any]) -> dict[str, Any]:
    data = dict(data)
    for alias, target in _ALIASES.items():
        if alias in data:
            section, key = target.split(".")
            sec = dict(data.get(section) or {})
            sec[key] = data.pop(alias)
            data[section] = sec
    return data


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict (tuples → lists) suitable for YAML/JSON."""

    def conv(_inst: Any, _a: Any, v: Any) -> Any:
        return list(v) if isinstance(v, tuple) else v

    return attrs.asdict(cfg, value_serializer=conv)


def dump_config(cfg: AppConfig, path: str | Path) -> Path:
    """Write the resolved config as YAML (atomically); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    tmp.replace(p)
    return p
