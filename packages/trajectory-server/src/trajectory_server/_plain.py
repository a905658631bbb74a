"""Records ⇄ plain dicts, strictly checked on the way in.

One codec serves the wire (msgpack: arrays as ``bytes``) and ``to_dict`` / checkpoints (JSON:
arrays as base64 strings). Decoding checks every field's presence and type, rejects unknown
keys, and names the offending field by its path (``route.trajectory_ids[3]``).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Any, NoReturn

from engine_adapters import SamplingParams
from trajectory_server._packed import FloatArray, IntArray
from trajectory_server._records import (
    FINISH_REASONS,
    FINISH_REASONS_TEXT,
    Completion,
    FinishedTrajectory,
    LedgerEvent,
    Location,
    QueueEntry,
    Segment,
    StoreStats,
    Trajectory,
    is_int,
    sampling_params,
)
from trajectory_server.errors import MalformedMessage, TrajectoryServerError

ErrorFactory = Callable[..., TrajectoryServerError]


class Reader:
    """Typed access to one dict; every failure names ``path.field``."""

    def __init__(self, obj: Any, path: str, error: ErrorFactory = MalformedMessage) -> None:
        self.path = path
        self.error = error
        if not isinstance(obj, dict):
            self.fail(path, f"must be a map, got {type(obj).__name__}")
        for key in obj:
            if not isinstance(key, str):
                self.fail(path, f"keys must be strings, got {key!r:.40}")
        self.obj: dict[str, Any] = obj
        self.seen: set[str] = set()

    def fail(self, field: str, why: str) -> NoReturn:
        raise self.error(f"{field}: {why}", field=field)

    def _get(self, name: str, default: Any = ..., *, optional: bool = False) -> Any:
        self.seen.add(name)
        if name not in self.obj:
            if default is not ...:
                return default
            self.fail(f"{self.path}.{name}", "is required")
        value = self.obj[name]
        return value

    def text(self, name: str, default: Any = ...) -> Any:
        value = self._get(name, default)
        if value is None and default is None:
            return None
        if not isinstance(value, str):
            self.fail(f"{self.path}.{name}", f"must be a string, got {type(value).__name__}")
        return value

    def integer(self, name: str, default: Any = ...) -> Any:
        value = self._get(name, default)
        if value is None and default is None:
            return None
        if not is_int(value):
            self.fail(f"{self.path}.{name}", f"must be an int, got {type(value).__name__}")
        return value

    def number(self, name: str, default: Any = ...) -> float:
        value = self._get(name, default)
        if not (is_int(value) or isinstance(value, float)):
            self.fail(f"{self.path}.{name}", f"must be a number, got {type(value).__name__}")
        return float(value)

    def flag(self, name: str, default: Any = ...) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            self.fail(f"{self.path}.{name}", f"must be a bool, got {type(value).__name__}")
        return value

    def items(self, name: str, default: Any = ...) -> list[Any]:
        value = self._get(name, default)
        if not isinstance(value, list | tuple):
            self.fail(f"{self.path}.{name}", f"must be a list, got {type(value).__name__}")
        return list(value)

    def texts(self, name: str) -> list[str]:
        items = self.items(name)
        for i, v in enumerate(items):
            if not isinstance(v, str):
                self.fail(f"{self.path}.{name}[{i}]", f"must be a string, got {type(v).__name__}")
        return items

    def integers(self, name: str, default: Any = ...) -> list[int]:
        items = self.items(name, default)
        for i, v in enumerate(items):
            if not is_int(v):
                self.fail(f"{self.path}.{name}[{i}]", f"must be an int, got {type(v).__name__}")
        return items

    def mapping(self, name: str, default: Any = ...) -> dict[str, Any]:
        value = self._get(name, default)
        if not isinstance(value, dict):
            self.fail(f"{self.path}.{name}", f"must be a map, got {type(value).__name__}")
        return value

    def blob(self, name: str) -> bytes:
        """Packed array bytes: ``bytes`` (msgpack) or a base64 string (JSON)."""
        value = self._get(name)
        if isinstance(value, bytes | bytearray):
            return bytes(value)
        if isinstance(value, str):
            try:
                return base64.b64decode(value.encode("ascii"), validate=True)
            except (binascii.Error, UnicodeEncodeError, ValueError):
                self.fail(f"{self.path}.{name}", "is not valid base64")
        self.fail(f"{self.path}.{name}", f"must be bytes or base64, got {type(value).__name__}")

    def int_array(self, name: str) -> IntArray:
        data = self.blob(name)
        if len(data) % IntArray.itemsize:
            self.fail(f"{self.path}.{name}", f"{len(data)} bytes is not a multiple of 4")
        return IntArray.from_bytes(data)  # type: ignore[no-any-return]

    def float_array(self, name: str) -> FloatArray:
        data = self.blob(name)
        if len(data) % FloatArray.itemsize:
            self.fail(f"{self.path}.{name}", f"{len(data)} bytes is not a multiple of 8")
        return FloatArray.from_bytes(data)  # type: ignore[no-any-return]

    def sub(self, name: str) -> Reader:
        return Reader(self._get(name), f"{self.path}.{name}", self.error)

    def done(self) -> None:
        extra = sorted(set(self.obj) - self.seen)
        if extra:
            self.fail(f"{self.path}.{extra[0]}", "is not a known field")


def blob(data: bytes, binary: bool) -> bytes | str:
    return data if binary else base64.b64encode(data).decode("ascii")


# -- sampling / trajectory ---------------------------------------------------------------------


def sampling_to_plain(s: SamplingParams) -> dict[str, Any]:
    return {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "max_new_tokens": s.max_new_tokens,
        "stop_token_ids": list(s.stop_token_ids),
        "seed": s.seed,
    }


def sampling_from_plain(r: Reader) -> SamplingParams:
    out = sampling_params(
        temperature=r.number("temperature"),
        top_p=r.number("top_p"),
        max_new_tokens=r.integer("max_new_tokens"),
        stop_token_ids=tuple(r.integers("stop_token_ids")),
        seed=r.integer("seed", None),
    )
    r.done()
    return out


def trajectory_to_plain(t: Trajectory, binary: bool) -> dict[str, Any]:
    return {
        "trajectory_id": t.trajectory_id,
        "group_id": t.group_id,
        "prompt_token_ids": blob(t.prompt_token_ids.to_bytes(), binary),
        "sampling": sampling_to_plain(t.sampling),
        "metadata": t.metadata,
        "v_traj": t.v_traj,
        "generated_token_ids": blob(t.generated_token_ids.to_bytes(), binary),
        "generated_logprobs": blob(t.generated_logprobs.to_bytes(), binary),
        "generated_versions": blob(t.generated_versions.to_bytes(), binary),
        "interruptions": t.interruptions,
        "target_length": t.target_length,
    }


def trajectory_from_plain(r: Reader) -> Trajectory:
    out = Trajectory(
        trajectory_id=r.text("trajectory_id"),
        group_id=r.text("group_id"),
        prompt_token_ids=r.int_array("prompt_token_ids"),
        sampling=sampling_from_plain(r.sub("sampling")),
        metadata=r.mapping("metadata"),
        v_traj=r.integer("v_traj", None),
        generated_token_ids=r.int_array("generated_token_ids"),
        generated_logprobs=r.float_array("generated_logprobs"),
        generated_versions=r.int_array("generated_versions"),
        interruptions=r.integer("interruptions"),
        target_length=r.integer("target_length", None),
    )
    r.done()
    return out


# -- engine output -------------------------------------------------------------------------------


def segment_to_plain(s: Segment, binary: bool) -> dict[str, Any]:
    out = {
        "trajectory_id": s.trajectory_id,
        "start": s.start,
        "token_ids": blob(s.token_ids.to_bytes(), binary),
        "logprobs": blob(s.logprobs.to_bytes(), binary),
        "versions": blob(s.versions.to_bytes(), binary),
    }
    if isinstance(s, Completion):
        out["finish_reason"] = s.finish_reason.value
    return out


def _segment_fields(r: Reader) -> dict[str, Any]:
    return {
        "trajectory_id": r.text("trajectory_id"),
        "start": r.integer("start"),
        "token_ids": r.int_array("token_ids"),
        "logprobs": r.float_array("logprobs"),
        "versions": r.int_array("versions"),
    }


def segment_from_plain(r: Reader) -> Segment:
    out = Segment(**_segment_fields(r))
    r.done()
    return out


def completion_from_plain(r: Reader) -> Completion:
    fields = _segment_fields(r)
    reason = _finish_reason(r)
    r.done()
    return Completion(**fields, finish_reason=reason)


def _finish_reason(r: Reader) -> str:
    reason: str = r.text("finish_reason")
    if reason not in FINISH_REASONS:
        r.fail(f"{r.path}.finish_reason", f"must be {FINISH_REASONS_TEXT}, got {reason!r:.40}")
    return reason


def finished_to_plain(f: FinishedTrajectory, binary: bool) -> dict[str, Any]:
    return {
        "trajectory": trajectory_to_plain(f.trajectory, binary),
        "finish_reason": f.finish_reason.value,
        "instance_id": f.instance_id,
    }


def finished_from_plain(r: Reader) -> FinishedTrajectory:
    reason = _finish_reason(r)
    out = FinishedTrajectory(
        trajectory=trajectory_from_plain(r.sub("trajectory")),
        finish_reason=reason,
        instance_id=r.text("instance_id"),
    )
    r.done()
    return out


# -- views -------------------------------------------------------------------------------------


def location_to_plain(loc: Location) -> dict[str, Any]:
    return {"state": loc.state.value, "instance_id": loc.instance_id, "reason": loc.reason}


def location_from_plain(r: Reader) -> Location:
    state = r.text("state")
    if state not in ("queued", "running", "finished", "dropped"):
        r.fail(f"{r.path}.state", f"must be queued|running|finished|dropped, got {state!r:.40}")
    out = Location(
        state=state, instance_id=r.text("instance_id", None), reason=r.text("reason", None)
    )
    r.done()
    return out


def entry_to_plain(e: QueueEntry) -> list[Any]:
    return [e.trajectory_id, e.group_id, e.v_traj, e.prompt_len, e.generated_len, e.interruptions]


def entry_from_plain(value: Any, path: str) -> QueueEntry:
    ok = (
        isinstance(value, list | tuple)
        and len(value) == 6
        and isinstance(value[0], str)
        and isinstance(value[1], str)
        and (value[2] is None or is_int(value[2]))
        and all(is_int(v) for v in value[3:])
    )
    if not ok:
        raise MalformedMessage(
            f"{path}: must be [trajectory_id, group_id, v_traj, prompt_len, generated_len, "
            "interruptions]",
            field=path,
        )
    return QueueEntry(
        trajectory_id=value[0],
        group_id=value[1],
        v_traj=value[2],
        prompt_len=value[3],
        generated_len=value[4],
        interruptions=value[5],
    )


def event_to_plain(e: LedgerEvent) -> dict[str, Any]:
    return {
        "seq": e.seq,
        "trajectory_id": e.trajectory_id,
        "kind": e.kind.value,
        "instance_id": e.instance_id,
        "version": e.version,
        "generated_len": e.generated_len,
        "reason": e.reason,
    }


_EVENT_KINDS = ("submitted", "routed", "returned", "lost", "finished", "dropped", "released")


def event_from_plain(r: Reader) -> LedgerEvent:
    kind = r.text("kind")
    if kind not in _EVENT_KINDS:
        r.fail(f"{r.path}.kind", f"must be one of {'|'.join(_EVENT_KINDS)}, got {kind!r:.40}")
    out = LedgerEvent(
        seq=r.integer("seq"),
        trajectory_id=r.text("trajectory_id"),
        kind=kind,
        instance_id=r.text("instance_id", None),
        version=r.integer("version", None),
        generated_len=r.integer("generated_len"),
        reason=r.text("reason", None),
    )
    r.done()
    return out


def stats_to_plain(s: StoreStats) -> dict[str, Any]:
    return {
        "queued_by_level": [[lv, n] for lv, n in s.queued_by_level.items()],
        "queued": s.queued,
        "running": s.running,
        "finished": s.finished,
        "dropped": s.dropped,
        "released": s.released,
        "running_by_instance": s.running_by_instance,
        "tokens_held": s.tokens_held,
    }


def stats_from_plain(value: Any, path: str) -> StoreStats:
    r = Reader(value, path)
    levels = {}
    for i, pair in enumerate(r.items("queued_by_level")):
        if not (
            isinstance(pair, list)
            and len(pair) == 2
            and (pair[0] is None or is_int(pair[0]))
            and is_int(pair[1])
        ):
            r.fail(f"{path}.queued_by_level[{i}]", "must be [level|null, count]")
        levels[pair[0]] = pair[1]
    by_instance = r.mapping("running_by_instance")
    if not all(isinstance(k, str) and is_int(v) for k, v in by_instance.items()):
        r.fail(f"{path}.running_by_instance", "must map instance ids to counts")
    out = StoreStats(
        queued_by_level=levels,
        queued=r.integer("queued"),
        running=r.integer("running"),
        finished=r.integer("finished"),
        dropped=r.integer("dropped"),
        released=r.integer("released"),
        running_by_instance=by_instance,
        tokens_held=r.integer("tokens_held"),
    )
    r.done()
    return out
