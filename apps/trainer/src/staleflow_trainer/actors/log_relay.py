"""The actors' warnings and errors, relayed to the run's own output.

Ray does not send the actors' output to the driver unless ``STALEFLOW_RAY_LOGS`` is set (it
is noisy); their log lines stay in Ray's session logs (``/tmp/ray/session_latest/logs``). Their
warnings and errors are the lines a user must see — an instance that fails or hangs, a
snapshot refused, a connection to the trajectory server that broke, a reward that could not
be computed — so each actor keeps them (:func:`relay_warnings` installs the processor that
does, in its own process) and hands them over (:func:`take`): the control actor with each
``drain``, the others when the driver asks (:class:`KeepsWarnings`, :class:`WarningRelay`).
The driver logs them again (:func:`replay`), with their level, event and fields, under
``relayed_from`` (``control``, ``rollout:<id>``, ``trainer``, ``reward:<k>``,
``param_server``, ``trajectory_server``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
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
_asked = [False]  # whether anyone took the lines yet (a driver that relays them)


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
    _asked[0] = True
    out = [_kept.popleft() for _ in range(len(_kept))]
    dropped = _seen[0] - _seen[1] - len(out)
    _seen[1] = _seen[0]
    if dropped > 0:
        out.insert(0, {"level": "warning", "event": "relayed_lines_dropped", "count": dropped})
    return out


async def handed_over(timeout_s: float) -> bool:
    """Wait, up to ``timeout_s``, until the lines kept so far have been taken (:func:`take`),
    if anyone ever took them: a process about to end itself gives the driver the chance to
    fetch its last lines (why it ends), which would die with it otherwise. True if none are
    left behind."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    while _kept and _asked[0] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return not _kept


def replay(
    lines: list[dict[str, Any]],
    log: Any,
    *,
    skip: frozenset[str] = frozenset(),
    source: str = "control",
) -> None:
    """Log ``lines`` (from :func:`take` in ``source``) again with ``log``, but those whose
    event is in ``skip`` (the driver logs those itself). A field the driver's log call cannot
    take by its name is renamed ``<role>_<name>`` (``control_self``, ``rollout_event``)."""
    role = source.split(":")[0]
    for line in lines:
        fields = dict(line)
        level, event = str(fields.pop("level", "warning")), str(fields.pop("event", "?"))
        if event in skip:
            continue
        fields = {(f"{role}_{k}" if k in _RESERVED else str(k)): v for k, v in fields.items()}
        say = getattr(log, level if level in _LEVELS else "warning")
        try:
            say(event, relayed_from=source, **fields)
        except Exception as e:  # a line the driver cannot log must not end the run
            log.warning("relayed_line_unreadable", relayed_from=source, error=repr(e)[:200])


class KeepsWarnings:
    """An actor whose warning and error lines the driver fetches (:meth:`take_logs`, from
    :class:`WarningRelay`); its ``__init__`` calls :meth:`_keep_warnings`."""

    def _keep_warnings(self) -> None:
        relay_warnings()

    def take_logs(self) -> list[dict[str, Any]]:
        """The warning and error lines logged in this process since the last call."""
        return take()


#: How often (seconds) the driver asks each actor for its kept lines; with many actors, less
#: often: at most :data:`FETCH_PER_S` calls a second in all.
FETCH_EVERY_S = 2.0
FETCH_PER_S = 100.0


def relayed_actors(dep: Any) -> dict[str, Any]:
    """The actors of a ``Deployment`` whose lines :class:`WarningRelay` fetches, by the name
    they are relayed from (the control actor hands its own over with ``drain``)."""
    out = {f"rollout:{iid}": h for iid, h in dep.rollouts.items()}
    out.update({f"reward:{k}": h for k, h in enumerate(dep.rewards)})
    more = (("trainer", dep.trainer), ("param_server", dep.ps), ("trajectory_server", dep.ts))
    out.update({k: h for k, h in more if h is not None})
    return out


class WarningRelay:
    """The driver's side: asks each actor of ``actors()`` for its kept lines (``take_logs``)
    every :data:`FETCH_EVERY_S` (see :data:`FETCH_PER_S`) and logs them again with ``log``.
    It never waits on an actor: a call not answered yet is read at a later :meth:`poll` (a
    frozen actor holds its own lines only), and one that failed (the actor is gone) is
    dropped. Off (``enabled=False``)
    where Ray prints the actors' output itself."""

    def __init__(self, actors: Callable[[], Mapping[str, Any]], log: Any, *, enabled: bool) -> None:
        self._actors, self._log, self.enabled = actors, log, enabled
        self._out: dict[str, Any] = {}  # name -> the call out
        self._asked: dict[str, float] = {}  # name -> when it was last asked

    def poll(self, wait_s: float = 0.0) -> None:
        """Ask the actors due, then log what the answered calls brought (waiting ``wait_s``
        at most for the calls out)."""
        if not self.enabled:
            return
        import ray

        now, actors = time.monotonic(), self._actors()
        every = max(FETCH_EVERY_S, len(actors) / FETCH_PER_S)
        for name, h in actors.items():
            if name not in self._out and now - self._asked.get(name, -every) >= every:
                self._out[name], self._asked[name] = h.take_logs.remote(), now
        for name in [n for n in self._out if n not in actors]:  # left the run
            del self._out[name]
        refs = list(self._out.values())
        if not refs:
            return
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=wait_s)[0])
        for name, ref in list(self._out.items()):
            if ref in ready:
                del self._out[name]
                try:
                    lines = ray.get(ref)
                except Exception:  # gone: its loss is reported by the control side
                    continue
                replay(lines, self._log, source=name)
