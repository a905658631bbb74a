"""What a person watching a run sees: step lines, the bar, start-up phases, the finished-run
check, Ray's start-up retry, every command's --help."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from staleflow_trainer import cli
from staleflow_trainer.atomic_files import atomic_write_bytes
from staleflow_trainer.config import load_config
from staleflow_trainer.errors import StartupFailed
from staleflow_trainer.report.progress import (
    JobProgress,
    ProgressBar,
    StartupProgress,
    step_line,
    throughput,
)
from staleflow_trainer.runtime.startup import (
    checkpoint_step,
    finished_run_message,
    ray_init_with_retry,
)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _record(step: int, **kw: Any) -> dict[str, Any]:
    return {
        "step": step,
        "version": step,
        "tokens_per_s": 1234.5,
        "gen_tokens_per_s": 2345.6,
        "reward_mean": 0.4125,
        "max_staleness": 1,
        "mean_staleness": 0.5,
        "trainer_wait_s": 0.4,
        "time_s": 83.21,
        **kw,
    }


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# ---- step lines and the bar -----------------------------------------------------------------


def test_step_line_names_both_rates() -> None:
    line = step_line(_record(3), total=30)
    assert line == (
        "step 3/30 | reward 0.412 | staleness max 1 mean 0.50 | trained 1,234 tok/s | "
        "generated 2,346 tok/s | wait 0.40 s | t 83.2 s"
    )
    assert throughput(_record(1)) == (1234.5, 2345.6)
    streamed = {**_record(3), "trainer": {"stream_busy_s": 0.3}}
    assert "| wait 0.40 s (0.30 s of it streaming) |" in step_line(streamed, total=30)
    # a record of the older control loop: its tokens_per_s counted generated tokens
    assert throughput({"tokens_per_s": 10.0}) == (None, 10.0)


@pytest.mark.parametrize(("log_every", "expected"), [(1, [1, 2, 3, 4, 5]), (2, [2, 4, 5]), (0, [])])
def test_lines_every_log_every_steps_without_a_terminal(
    log_every: int, expected: list[int]
) -> None:
    out = io.StringIO()  # not a TTY: lines, even with progress_bar on
    with ProgressBar(5, enabled=True, log_every=log_every, out=out) as bar:
        assert bar.mode == ("lines" if log_every else "off")
        for s in range(1, 6):
            bar.update(s, _record(s))
    lines = out.getvalue().splitlines()
    assert [int(x.split()[1].split("/")[0]) for x in lines] == expected
    assert all(x.startswith("step ") for x in lines)


def test_bar_keeps_the_elapsed_time_at_80_columns() -> None:
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=80, force_terminal=True, color_system=None)
    bar = ProgressBar(30, enabled=True, console=console)
    assert bar.mode == "bar"
    bar.update(3, _record(3))
    console.print(bar.renderable())
    text = buf.getvalue()
    first, second = text.splitlines()[:2]
    assert "3/30" in first and "0:00:00" in first and "…" not in first
    assert second.startswith("reward 0.412 | staleness max 1, mean 0.50 | tok/s trained 1.2k")
    assert "(run" not in text


def test_job_progress_lines() -> None:
    out = io.StringIO()
    clock = _Clock()
    with JobProgress(3, out=out, clock=clock) as jobs:
        clock.t += 5
        jobs.done("staleflow-eta1")
        jobs.done("sync-eta0")
    assert out.getvalue().splitlines() == [
        "simulations 1/3 done (staleflow-eta1), 5 s",
        "simulations 2/3 done (sync-eta0), 5 s",
    ]
    quiet = io.StringIO()
    with JobProgress(1, out=quiet, lines=False) as jobs:
        jobs.done("x")
    assert quiet.getvalue() == ""


# ---- start-up -------------------------------------------------------------------------------


def test_startup_phases_print_elapsed_seconds() -> None:
    out = io.StringIO()
    clock = _Clock()
    p = StartupProgress(out=out, clock=clock)
    with p.phase("ray", "starting a local Ray"):
        clock.t += 4.1
    with pytest.raises(RuntimeError), p.phase("servers", "starting the servers"):
        clock.t += 1.0
        raise RuntimeError("boom")
    assert out.getvalue().splitlines() == [
        "start-up     0.0 s  ray: starting a local Ray",
        "start-up     4.1 s  ray: ready (4.1 s)",
        "start-up     4.1 s  servers: starting the servers",
        "start-up     5.1 s  servers: failed after 1.0 s (RuntimeError)",
    ]


def test_startup_wait_each_reports_each_engine_and_a_heartbeat() -> None:
    out = io.StringIO()
    clock = _Clock()
    ready_at = {"ref-a": 12.0, "ref-b": 75.0}

    def wait(refs: list[Any], timeout: float) -> list[Any]:
        clock.t += max(timeout, 0.5)
        return [r for r in refs if clock.t - 100.0 >= ready_at[r]][:1]

    p = StartupProgress(out=out, clock=clock)
    got = p.wait_each(
        "engines",
        {"vllm-0": "ref-a", "vllm-1": "ref-b"},
        wait=wait,
        get=lambda r: {"ref": r},
        heartbeat_s=30.0,
    )
    assert got == {"vllm-0": {"ref": "ref-a"}, "vllm-1": {"ref": "ref-b"}}
    lines = out.getvalue().splitlines()
    assert "engines: vllm-0 ready (12.0 s)" in lines[0]
    assert "still waiting for vllm-1 (30.0 s)" in lines[1]
    assert "still waiting for vllm-1 (60.0 s)" in lines[2]
    assert "vllm-1 ready (75.0 s)" in lines[3]


def test_ray_start_timeout_is_retried_then_explained() -> None:
    calls: list[str] = []
    retries: list[str] = []

    def init() -> str:
        calls.append("init")
        if calls.count("init") < 3:
            raise TimeoutError("The node with node id abc has not registered within the timeout")
        return "ok"

    def shutdown() -> None:
        calls.append("shutdown")

    got = ray_init_with_retry(
        init, attempts=3, on_retry=retries.append, shutdown=shutdown, sleep=lambda s: None
    )
    assert got == "ok"
    assert calls == ["init", "shutdown", "init", "shutdown", "init"]
    assert len(retries) == 2 and "retrying (2/3)" in retries[0]

    def always() -> str:
        raise Exception("Timed out after 30 s waiting for the raylet")

    with pytest.raises(StartupFailed, match="Ray did not start: it timed out 2 times") as e:
        ray_init_with_retry(always, attempts=2, shutdown=lambda: None, sleep=lambda s: None)
    assert e.value.component == "ray"

    def broken() -> str:
        raise ValueError("num_cpus must be positive")

    with pytest.raises(ValueError, match="num_cpus"):  # not a time-out: no retry
        ray_init_with_retry(broken, shutdown=lambda: None, sleep=lambda s: None)


# ---- a finished run -------------------------------------------------------------------------


def _finished_run(run: Path, step: int) -> None:
    (run / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    atomic_write_bytes(run / "checkpoints" / "latest", f"step_{step:06d}".encode())


def test_finished_run_message(tmp_path: Path) -> None:
    run = tmp_path / "run"
    over = [f"run_dir={run}", "trainer.steps=4"]
    assert finished_run_message(load_config(EXAMPLES / "tiny.yaml", over)) is None
    _finished_run(run, 3)
    assert checkpoint_step(run) == 3
    assert finished_run_message(load_config(EXAMPLES / "tiny.yaml", over)) is None  # 1 to go
    _finished_run(run, 4)
    cfg = load_config(EXAMPLES / "tiny.yaml", over)
    msg = finished_run_message(cfg, command="staleflow train tiny.yaml")
    assert msg is not None
    assert "already holds a finished run" in msg and "step 4" in msg
    assert "staleflow train tiny.yaml trainer.steps=8" in msg
    assert "run.resume=never" in msg
    never = load_config(EXAMPLES / "tiny.yaml", [*over, "run.resume=never"])
    assert finished_run_message(never) is None


def test_finished_run_reinvoked_exits_in_seconds(tmp_path: Path) -> None:
    """The real command in a fresh process: no deployment, the message, exit 0, < 15 s."""
    run = tmp_path / "run"
    _finished_run(run, 5)
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "staleflow_trainer.cli", "train", str(EXAMPLES / "tiny.yaml"),
         f"run_dir={run}", "trainer.steps=5"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    wall = time.monotonic() - t0
    assert done.returncode == 0, done.stderr
    assert "Nothing to train" in done.stdout and "trainer.steps=10" in done.stdout
    assert wall < 15.0, f"{wall:.1f} s"
    assert not (run / "config.yaml").exists()  # nothing was deployed or written


# ---- --help ---------------------------------------------------------------------------------

COMMANDS = ["train", "simulate", "compare", "plan", "profile", "config", "fit-cost-model", "plot"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_has_an_example(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    examples = out.split("\nexample")[-1]
    assert examples.startswith(("s:\n", ":\n")) and f"  staleflow {command} " in examples
    assert "``" not in out


def test_every_option_and_argument_has_help() -> None:
    import argparse

    parser = cli.build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert sorted(sub.choices) == sorted(COMMANDS)
    for name, p in sub.choices.items():
        for action in p._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, (name, action.dest)


def test_readme_lists_every_command_and_docs_define_the_terms() -> None:
    root = EXAMPLES.parent
    readme = root / "README.md"
    text = " ".join(readme.read_text().split())
    for c in COMMANDS:
        assert f"staleflow {c} " in text, c
    glossary = (root / "docs" / "design.md").read_text().split("## Glossary")[-1]
    terms = [row.split("|")[1] for row in glossary.splitlines() if row.startswith("| ")]
    for term in ("η", "V_traj", "B′", "TIS", "all-vanilla", "staleness", "one-step", "ideal"):
        assert any(term in t for t in terms), term


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert all(c in out for c in COMMANDS)
    assert "``" not in out and "examples:" in out


def test_compare_help_lists_the_policies(capsys: pytest.CaptureFixture[str]) -> None:
    from staleflow_trainer.config import POLICIES

    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert all(p in out.replace("- ", "-") for p in POLICIES) and "default: all" in out


def test_fit_cost_model_help_shows_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["fit-cost-model", "--help"])
    out = capsys.readouterr().out
    assert "--holdout" in out and "--out" in out
    assert cli.main(["fit-cost-model"]) == 2  # no profile: usage, with the options
    assert "--holdout" in capsys.readouterr().out


# ---- throughput keys ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "eta"), [("staleflow", 1), ("staleflow", 3), ("one-step", 1), ("sync", 0)]
)
def test_no_throughput_key_is_zero_on_a_trained_step(policy: str, eta: int) -> None:
    """η ≥ 1 often finds the next batch complete when a step ends: its trained rate is its
    batch over its step time, never the 0 of "nothing generated since the last step"."""
    from staleflow_trainer.sim.shell import Simulation
    from staleflow_trainer.sim.testing import sim_config

    cfg = sim_config(
        policy=policy, eta=eta, steps=8, batch_size=4, group_size=2, rollout_gpus=2,
        train_gpus=1, total_gpus=3, prompt_len=32, response_len_median=64, max_response_len=128,
        kv_capacity_tokens=20_000,
    )  # fmt: skip
    sim = Simulation(cfg)
    sim.run()
    rows = sim.rec.steps
    assert len(rows) == 8
    for r in rows:
        assert r["tokens"] > 0
        rates = {k: v for k, v in r.items() if "per_s" in k}
        assert rates and all(v > 0 for v in rates.values()), (r["step"], rates)


# ---- the bar before the first step, and where TensorBoard is ----------------------------------


def test_bar_says_what_it_waits_for_before_the_first_step() -> None:
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=100, force_terminal=True, color_system=None)
    bar = ProgressBar(30, enabled=True, console=console)
    console.print(bar.renderable())
    first, second = buf.getvalue().splitlines()[:2]
    assert "0/30" in first
    assert second.startswith("waiting for the first step")


def test_train_report_prints_the_tensorboard_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from staleflow_trainer.runtime.wiring import RunSummary, _report

    (tmp_path / "tensorboard").mkdir()
    _report(
        RunSummary(
            run_dir=str(tmp_path), steps_done=3, version=3, wall_s=12.0,
            metrics_path=str(tmp_path / "metrics.jsonl"), checkpoint=None, resumed_from=None,
        )
    )  # fmt: skip
    out = capsys.readouterr().out
    assert f"tensorboard --logdir {tmp_path / 'tensorboard'}" in " ".join(out.split())


def test_simulate_prints_the_tensorboard_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    rc = cli.main(
        ["--log-level", "warning", "simulate", str(EXAMPLES / "sim-tiny.yaml"), f"run_dir={run}",
         "trainer.steps=2", "metrics.tensorboard=true"]
    )  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert f"tensorboard --logdir {run / 'tensorboard'}" in out
    assert any((run / "tensorboard").iterdir())


def test_train_report_never_breaks_a_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from staleflow_trainer.runtime.wiring import RunSummary, _report

    run = tmp_path / ("a-long-run-directory-name-" * 4)
    plots = tuple(str(run / "plots" / f"{n}.png") for n in ("staleness_hist", "throughput",
                                                             "reward", "timeline"))  # fmt: skip
    _report(
        RunSummary(
            run_dir=str(run), steps_done=3, version=3, wall_s=12.0,
            metrics_path=str(run / "metrics.jsonl"), checkpoint=str(run / "checkpoints" / "s3"),
            resumed_from=None, plots=plots,
        )
    )  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert any(line.endswith(f" {run / 'metrics.jsonl'}") for line in lines), lines
    assert any(line.endswith(f" {run / 'checkpoints' / 's3'}") for line in lines), lines
    (plot_line,) = [line for line in lines if line.startswith("plots:")]
    assert plot_line.endswith("(staleness_hist.png, throughput.png, reward.png, timeline.png)")
