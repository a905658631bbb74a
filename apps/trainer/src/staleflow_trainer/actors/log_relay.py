"""The control actor's warnings and errors, relayed to the run's own output.

Ray does not send the actors' output to the driver unless ``STALEFLOW_RAY_LOGS`` is set (it
is noisy); their log lines stay in Ray's session logs (``/tmp/ray/session_latest/logs``). The
control actor's warnings and errors are the ones a user must see — an instance that fails or
hangs, a snapshot refused, a run that stops with outcomes unread — so the control actor keeps
them (:func:`relay_warnings` installs the processor that does, in its own process) and hands
them over with each ``drain`` (:func:`take`); the driver logs them again (:func:`replay`), with
their level, event and fields, under ``relayed_from="control"``.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import structlog

#: Most lines kept between two drains (the driver drains about twice a second); older ones
#: are dropped and their number relayed with the next line.
KEEP = 1000
_LEVELS = ("warning", "error", "critical")
#: keys the driver's logger sets itself (a traceback stays in the actor's own log)
_OWN = ("timestamp", "level", "exc_info", "stack_info", "stack", "exception")
#: names a relayed field may not take in the driver's log call (renamed ``control_<name>``)
_RESERVED = ("self", "method_name", "event", "level", "relayed_from")
_kept: deque[dict[str, Any]] = deque(maxlen=KEEP)
_seen = [0, 0]  # lines kept since the start, and handed over


def _keep(logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    level = str(event_dict.get("level", method))
    if level in _LEVELS:
        line = {k: _plain(v) for k, v in event_dict.items() if k not in _OWN}
        _kept.append({"level": level, **line})
        _seen[0] += 1
    return event_dict


def _plain(v: Any) -> Any:
    if v is None or isinstance(v, int | float | bool):
        return v
    return (v if isinstance(v, str) else repr(v))[:500]


def relay_warnings() -> None:
    """From now on, keep this process's warning and error lines for :func:`take`."""
    processors = list(structlog.get_config()["processors"])
    if _keep not in processors:
        processors.insert(max(len(processors) - 1, 0), _keep)  # before the renderer
        structlog.configure(processors=processors)


def take() -> list[dict[str, Any]]:
    """The lines kept since the last call (each ``{"level", "event", ...fields}``); if some
    were dropped meanwhile (more than :data:`KEEP`), a first line says how many."""
    out = [_kept.popleft() for _ in range(len(_kept))]
    dropped = _seen[0] - _seen[1] - len(out)
    _seen[1] = _seen[0]
    if dropped > 0:
        out.insert(0, {"level": "warning", "event": "relayed_lines_dropped", "count": dropped})
    return out


def replay(lines: list[dict[str, Any]], log: Any, *, skip: frozenset[str] = frozenset()) -> None:
    """Log ``lines`` (from :func:`take`) again with ``log``, but those whose event is in
    ``skip`` (the driver logs those itself)."""
    for line in lines:
        fields = dict(line)
        level, event = str(fields.pop("level", "warning")), str(fields.pop("event", "?"))
        if event in skip:
            continue
        fields = {(f"control_{k}" if k in _RESERVED else str(k)): v for k, v in fields.items()}
        say = getattr(log, level if level in _LEVELS else "warning")
        try:
            say(event, relayed_from="control", **fields)
        except Exception as e:  # a line the driver cannot log must not end the run
            log.warning("relayed_line_unreadable", relayed_from="control", error=repr(e)[:200])
