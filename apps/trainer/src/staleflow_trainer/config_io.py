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
from staleflow_trainer.config_schema import unknown_key
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
    if isinstance(value, str) and _looks_like_float(raw):
        value = float(raw)  # YAML 1.1 reads "1e-3" as a string; users mean a number
    # (only a string: "1_000" is the YAML int 1000 and stays one)
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
                raise unknown_key(here, names)
            ftype = names[part].type
            if depth == len(parts) - 1:
                if attrs.has(ftype):  # "trainer={}" would reset the whole section: refused
                    raise ConfigError(
                        f"{here} is a section, not a value ({item!r}); set one of its keys "
                        f"({here}.KEY=VALUE)",
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
    config: AppConfig = _build(_config.AppConfig, _normalize_aliases(dict(data)), "")
    return config


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> AppConfig:
    """Read ``path`` (YAML; None = all defaults), apply overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist", key="<file>", allowed="")
        try:
            loaded = load_yaml(p.read_text(), p)
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


def load_yaml(text: str, path: Path) -> Any:
    """``yaml.safe_load`` that refuses a key given twice in one mapping (plain YAML keeps the
    last one silently): ConfigError naming the dotted key and both lines."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node, "", path)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_duplicate_keys(node: yaml.Node, prefix: str, path: Path) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            name = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            key = f"{prefix}.{name}" if prefix else str(name)
            line = key_node.start_mark.line + 1
            if name is not None and name in seen:
                raise ConfigError(
                    f"{path}:{line}: duplicate key {key!r} (first given on line "
                    f"{seen[name]}); YAML would silently keep the last one",
                    key=key,
                    allowed="each key once per section",
                )
            if name is not None:
                seen[name] = line
            _refuse_duplicate_keys(value_node, key, path)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, f"{prefix}[{i}]", path)


def _normalize_aliases(data: dict[str, Any]) -> dict[str, Any]:
    data = dict(data)
    for alias, target in _ALIASES.items():
        if alias in data:
            section, key = target.split(".")
            sec = dict(data.get(section) or {})
            if key in sec:
                raise ConfigError(
                    f"{alias} and {target} are the same setting; give it once",
                    key=target,
                    allowed=f"{alias} or {target}",
                )
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
