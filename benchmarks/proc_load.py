"""What the processes of a run want of the host: for this process and every descendant, by
process name, the cores its threads used and the threads it kept runnable (on a core or
waiting for one), from ``/proc/<pid>/task/<tid>/schedstat``, over a window that a run's
``metrics.jsonl`` marks (the step records it has written). ``bench_sim_vs_real.py`` takes it
over the measured steps of each real run."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any


def _title(argv0: str) -> str:
    """A process's name in the report: its title without the method a Ray actor is running
    (``ray::ControlActor``, ``VLLM::EngineCore``), or its program's name."""
    if "::" in argv0:
        head, _, rest = argv0.partition("::")
        return f"{head}::{rest.split('.')[0].split(' ')[0]}"
    return Path(argv0).name


def sched_by_process() -> dict[int, tuple[str, float, float]]:
    """Per pid, the name (:func:`_title`) and the seconds so far that the threads of this
    process and of every descendant spent on a core and waiting for one
    (``/proc/<pid>/task/<tid>/schedstat``)."""
    procs: dict[int, int] = {}  # pid -> parent
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:  # it ended meanwhile
                continue
            procs[int(d.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    children: dict[int, list[int]] = {}
    for pid, parent in procs.items():
        children.setdefault(parent, []).append(pid)
    out: dict[int, tuple[str, list[int]]] = {}  # pid -> name, [ns on a core, ns waiting]
    todo = [os.getpid()]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        acc = out.setdefault(pid, (_title(argv0), [0, 0]))[1]
        for task in tasks:
            try:
                run_ns, wait_ns, _ = (task / "schedstat").read_text().split()
            except (OSError, ValueError):
                continue
            acc[0] += int(run_ns)
            acc[1] += int(wait_ns)
    return {pid: (name, run / 1e9, wait / 1e9) for pid, (name, (run, wait)) in out.items()}


class HostLoad:
    """What each process of a real run (this process and its descendants) wanted of the host
    over its measured steps: the time its threads spent on a core and waiting for one, taken
    when the run's warm-up step record lands in its ``metrics.jsonl`` and when the last one
    does, over the wall time between: ``cores`` (on a core), ``runnable`` (on a core or
    waiting: the threads it kept runnable on average)."""

    def __init__(self, run_dir: Path, warmup: int, steps: int) -> None:
        self._metrics = run_dir / "metrics.jsonl"
        self._marks = (warmup, steps)
        self._taken: list[tuple[float, dict[int, tuple[str, float, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _steps_done(self) -> int:
        try:
            return self._metrics.read_bytes().count(b"\n")
        except OSError:
            return 0

    def _watch(self) -> None:
        for mark in self._marks:
            while self._steps_done() < mark:
                if self._stop.wait(0.02):
                    return
            self._taken.append((time.monotonic(), sched_by_process()))

    def result(self) -> dict[str, Any] | None:
        """``window_s`` and ``by_process``: per process name, its ``[cores, runnable]``; None
        when the run ended before both marks were taken."""
        self._stop.set()
        self._thread.join()
        if len(self._taken) < 2:
            return None
        (t0, a), (t1, b) = self._taken
        wall = max(t1 - t0, 1e-9)
        by: dict[str, list[float]] = {}
        for pid, (name, run, wait) in b.items():
            _, run0, wait0 = a.get(pid, (name, 0.0, 0.0))  # 0: it started meanwhile
            got = by.setdefault(name, [0.0, 0.0])
            got[0] += (run - run0) / wall
            got[1] += (run - run0 + wait - wait0) / wall
        return {"window_s": wall, "by_process": dict(sorted(by.items(), key=lambda kv: -kv[1][1]))}
