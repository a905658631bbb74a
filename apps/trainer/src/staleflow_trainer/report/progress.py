"""What a person watching a run sees: start-up phases, a progress bar or a line per step, and
the progress of commands that run many simulations (compare, plan, the sweeps).

* On a terminal (stdout is a TTY and ``metrics.progress_bar`` is on) a training run shows a
  progress bar with the last step's reward, staleness and throughput.
* Otherwise (a cluster job, ``> run.log``) it prints one plain line every
  ``metrics.log_every`` steps (and at the last step)::

      step 3/30 | reward 0.412 | staleness max 1 mean 0.50 | trained 1,234 tok/s | generated 2,345 tok/s | wait 0.40 s | t 83.2 s

  ``trained`` is the step's trained tokens (prompt + response) per second since the previous
  step; ``generated`` the tokens the rollout instances generated per second over the last few
  steps (see :mod:`staleflow_trainer.control.report` and ``docs/watching-a-run.md``); ``t`` the
  run's clock (wall seconds, or virtual seconds in the simulator). ``wait`` is how long the
  trainer waited for the batch to be complete; with ``trainer.stream_batch`` it adds how much
  of that wait the trainer spent on the batch's groups streamed in (``wait 3.10 s (2.95 s of it
  streaming)``).
* :class:`StartupProgress` prints one line per start-up phase with the seconds since start-up
  began, and names what it still waits for every ``heartbeat_s`` seconds.
* :class:`JobProgress` counts finished simulations (a bar on a terminal, a line per run
  otherwise).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = [
    "JobProgress",
    "ProgressBar",
    "StartupProgress",
    "is_terminal",
    "step_line",
    "throughput",
]


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default: stdout) is an interactive terminal."""
    s = sys.stdout if stream is None else stream
    try:
        return bool(s.isatty())
    except (AttributeError, ValueError):  # closed or not a real file
        return False


def throughput(record: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """``(trained tokens/s, generated tokens/s)`` of a step record (None where it has none).

    Records of the control core carry both (``tokens_per_s``, ``gen_tokens_per_s``). Records
    without ``gen_tokens_per_s`` come from an older control loop whose ``tokens_per_s``
    counted the tokens generated since the previous step: it is reported as generated."""
    tps = record.get("tokens_per_s")
    gen = record.get("gen_tokens_per_s")
    if gen is None:
        return None, None if tps is None else float(tps)
    return (None if tps is None else float(tps)), float(gen)


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def step_line(record: Mapping[str, Any], *, total: int) -> str:
    """One plain line describing a step record (the format in the module docstring)."""
    trained, generated = throughput(record)
    parts = [
        f"step {int(record.get('step', 0))}/{total}",
        f"reward {float(record.get('reward_mean', 0.0)):.3f}",
        f"staleness max {int(record.get('max_staleness', 0))} mean "
        f"{float(record.get('mean_staleness', 0.0)):.2f}",
    ]
    if trained is not None:
        parts.append(f"trained {_rate(trained)} tok/s")
    if generated is not None:
        parts.append(f"generated {_rate(generated)} tok/s")
    wait = f"wait {float(record.get('trainer_wait_s', 0.0)):.2f} s"
    busy = (record.get("trainer") or {}).get("stream_busy_s")
    if busy:  # trainer.stream_batch: the trainer worked on settled groups meanwhile
        wait += f" ({float(busy):.2f} s of it streaming)"
    parts.append(wait)
    if record.get("time_s") is not None:
        parts.append(f"t {float(record['time_s']):.1f} s")
    return " | ".join(parts)


def _short(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


def bar_info(record: Mapping[str, Any]) -> str:
    """The line under the progress bar: the last step's numbers, compact (fits 80 columns)."""
    trained, generated = throughput(record)
    tok = []
    if trained is not None:
        tok.append(f"trained {_short(trained)}")
    if generated is not None:
        tok.append(f"gen {_short(generated)}")
    return (
        f"reward {float(record.get('reward_mean', 0.0)):.3f} | "
        f"staleness max {int(record.get('max_staleness', 0))}, "
        f"mean {float(record.get('mean_staleness', 0.0)):.2f} | "
        f"tok/s {' '.join(tok)}"
    )


def _rich_progress(label: str, console: Any) -> Any:
    """A rich progress bar (label, bar, done/total, elapsed) with a free text line under it
    (the task's ``info`` field), so the numbers never squeeze the elapsed time."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.table import Column
    from rich.text import Text

    class _WithInfo(Progress):
        def get_renderables(self) -> Any:
            yield self.make_tasks_table(self.tasks)
            for task in self.tasks:
                info = str(task.fields.get("info", ""))
                if info:
                    yield Text(info, no_wrap=True, overflow="ellipsis")

    return _WithInfo(
        TextColumn(f"[bold]{label}"),
        BarColumn(bar_width=None),
        MofNCompleteColumn(table_column=Column(no_wrap=True, min_width=7)),
        TimeElapsedColumn(table_column=Column(no_wrap=True, min_width=7)),
        console=console,
        expand=True,
    )


class ProgressBar:
    """Training progress: a rich bar on a terminal, otherwise a line per ``log_every`` steps.

    ``enabled`` allows the bar (``metrics.progress_bar``); without it, or when ``out`` (default
    stdout) is not a terminal, step lines are printed instead; ``log_every=0`` prints none.
    The bar shows steps done / total and the elapsed time; the line under it the last step's
    reward, staleness and tokens per second, ``trained`` and ``gen`` (generated), as in
    :func:`step_line`.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        enabled: bool = True,
        start_step: int = 0,
        log_every: int = 1,
        out: TextIO | None = None,
        console: Any = None,
    ) -> None:
        self.total = total_steps
        self.log_every = log_every
        self._out = out
        self._progress: Any = None
        self._task: Any = None
        self.mode = "lines" if log_every > 0 else "off"
        if not enabled or (console is None and not is_terminal(out)):
            return
        from rich.console import Console

        self.mode = "bar"
        self._progress = _rich_progress("train", console or Console(file=out))
        self._task = self._progress.add_task(
            "train",
            total=total_steps,
            completed=start_step,
            info="waiting for the first step (first batch generated, first training step)",
        )

    def __enter__(self) -> ProgressBar:
        if self._progress is not None:
            self._progress.start()
        return self

    def update(self, step: int, record: Mapping[str, Any]) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=bar_info(record))
        elif self.mode == "lines" and (step % self.log_every == 0 or step >= self.total):
            out = self._out if self._out is not None else sys.stdout
            out.write(step_line(record, total=self.total) + "\n")
            out.flush()

    def renderable(self) -> Any:
        """The bar as rich renders it now (tests render it at a given width)."""
        return None if self._progress is None else self._progress.get_renderable()

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


class StartupProgress:
    """One line per start-up phase, with the seconds since start-up began::

    start-up    0.0 s  ray: starting a local Ray (2 CPUs)
    start-up    4.1 s  ray: ready (4.1 s)
    start-up   61.7 s  engines: vllm-0 ready (52.3 s)
    start-up   91.0 s  engines: still waiting for vllm-1 (81.6 s)
    """

    def __init__(
        self,
        *,
        out: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        enabled: bool = True,
    ) -> None:
        self._out = out
        self._clock = clock
        self.enabled = enabled
        self.t0 = clock()
        self.lines: list[str] = []

    def elapsed(self) -> float:
        return self._clock() - self.t0

    def line(self, phase: str, message: str) -> None:
        text = f"start-up {self.elapsed():7.1f} s  {phase}: {message}"
        self.lines.append(text)
        if self.enabled:
            out = self._out if self._out is not None else sys.stdout
            out.write(text + "\n")
            out.flush()

    @contextmanager
    def phase(self, phase: str, doing: str) -> Iterator[None]:
        """``with progress.phase("ray", "starting a local Ray"):`` prints the phase as it
        starts and, with its duration, when it is ready (or failed)."""
        t = self._clock()
        self.line(phase, doing)
        try:
            yield
        except BaseException as e:
            self.line(phase, f"failed after {self._clock() - t:.1f} s ({type(e).__name__})")
            raise
        self.line(phase, f"ready ({self._clock() - t:.1f} s)")

    def wait_each(
        self,
        phase: str,
        pending: Mapping[str, Any],
        *,
        wait: Callable[[list[Any], float], Sequence[Any]] | None = None,
        get: Callable[[Any], Any] | None = None,
        heartbeat_s: float = 30.0,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Wait for every ``name -> ref`` of ``pending`` (Ray object refs unless ``wait`` and
        ``get`` say otherwise), printing each as it becomes ready and what is still pending
        every ``heartbeat_s``; returns ``name -> result`` in ``pending``'s order. An error
        of one ref is raised as soon as that ref is ready; after ``timeout_s`` (if given) a
        :class:`TimeoutError` naming what is still pending."""
        if wait is None or get is None:
            import ray

            def ray_wait(refs: list[Any], timeout: float) -> Sequence[Any]:
                ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
                return list(ready)

            wait = wait or ray_wait
            get = get or ray.get
        t = self._clock()
        left = dict(pending)
        by_ref = {ref: name for name, ref in left.items()}  # Ray refs hash by object id
        results: dict[str, Any] = {}
        next_beat = t + heartbeat_s
        while left:
            if timeout_s is not None and self._clock() - t > timeout_s:
                raise TimeoutError(f"{', '.join(left)} not ready after {timeout_s:g} s")
            ready = wait(list(left.values()), max(0.0, min(1.0, next_beat - self._clock())))
            for ref in ready:
                name = by_ref[ref]
                results[name] = get(ref)
                del left[name]
                self.line(phase, f"{name} ready ({self._clock() - t:.1f} s)")
            if left and self._clock() >= next_beat:
                self.line(
                    phase,
                    f"still waiting for {', '.join(left)} ({self._clock() - t:.1f} s)",
                )
                next_beat = self._clock() + heartbeat_s
        return {name: results[name] for name in pending}


class JobProgress:
    """Finished simulations out of ``total``: a bar when ``bar`` is on and ``out`` (default
    stdout) is a terminal, else a line per finished run when ``lines`` is on."""

    def __init__(
        self,
        total: int,
        *,
        label: str = "simulations",
        out: TextIO | None = None,
        bar: bool = True,
        lines: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.label = label
        self.done_count = 0
        self._out = out
        self._clock = clock
        self._t0 = clock()
        self._progress: Any = None
        self._task: Any = None
        self.enabled = lines
        if bar and is_terminal(out):
            from rich.console import Console

            self._progress = _rich_progress(label, Console(file=out))
            self._task = self._progress.add_task(label, total=total, info="")

    def __enter__(self) -> JobProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def done(self, name: str) -> None:
        self.done_count += 1
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done_count, info=f"last: {name}")
        elif self.enabled:
            out = self._out if self._out is not None else sys.stdout
            out.write(
                f"{self.label} {self.done_count}/{self.total} done ({name}), "
                f"{self._clock() - self._t0:.0f} s\n"
            )
            out.flush()

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
