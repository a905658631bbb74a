"""What the PNGs say: integer staleness ticks, η drawn where it bounds the data, units on the
axes, legends off the data, one x-range across compare panels, the simulator's synthetic
reward not titled like a learning curve. The figures are captured just before they are saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from staleflow_trainer.config import load_config
from staleflow_trainer.report import compare_plots, plan, plots
from staleflow_trainer.report.metrics import MetricsWriter, TimelineWriter, staleness_summary

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """file name -> the matplotlib figure written there (drawn, so extents are known)."""
    got: dict[str, Any] = {}
    for module in (plots, compare_plots):
        real = module._save

        def save(fig: Any, out: Path, dpi: int = 100, _real: Any = real) -> Path:
            fig.canvas.draw()
            got[out.name] = fig
            return _real(fig, out, dpi)

        monkeypatch.setattr(module, "_save", save)
    return got


def _run(run: Path, *, eta: int | str, backend: str, steps: int = 6) -> None:
    """A run directory: metrics, a timeline ending after the last step, config.yaml."""
    with MetricsWriter(run, tensorboard=False) as w:
        for s in range(1, steps + 1):
            cap = eta if isinstance(eta, int) else 3  # never beyond the bound
            hist = [0, min(s - 1, cap), min(s - 1, cap)]
            w.log_step(
                {
                    "step": s,
                    "version": s,
                    "time_s": 2.0 * s,
                    "step_s": 2.0,
                    "tokens": 300,
                    "tokens_per_s": 150.0,
                    "gen_tokens_per_s": 90.0,
                    "reward_mean": 0.1 * s,
                    "accuracy": 0.05 * s,
                    "trainer_wait_s": 0.5,
                    **staleness_summary(hist),
                }
            )
    tl = TimelineWriter(run)
    tl.interval("r0", "busy", 0.0, 2.0 * steps + 1.0, version=0)
    tl.interval("r1", "idle", 0.0, 2.0 * steps + 1.0, version=0)
    tl.close()
    (run / "config.yaml").write_text(
        yaml.safe_dump({"protocol": {"eta": eta}, "rollout": {"backend": backend}})
    )


def _bound_lines(ax: Any) -> list[tuple[float, str]]:
    return [
        (float(line.get_ydata()[0]), str(line.get_label()))
        for line in ax.get_lines()
        if "η" in str(line.get_label()) and len(set(line.get_ydata())) == 1
    ]


@pytest.mark.parametrize("eta", [0, 2])
def test_staleness_plot_integer_ticks_and_eta_above_the_allowed_rows(
    tmp_path: Path, figures: dict[str, Any], eta: int
) -> None:
    _run(tmp_path, eta=eta, backend="vllm")
    plots.plot_run(tmp_path)
    ax = figures["staleness_hist.png"].axes[0]
    assert [t for t in ax.get_yticks()] == list(range(eta + 1))
    assert all(float(t).is_integer() for t in ax.get_xticks())
    # the bound sits between the highest allowed staleness and the first forbidden one, and
    # inside the visible range
    assert _bound_lines(ax) == [(eta + 0.5, f"bound η = {eta} (no sample above)")]
    assert ax.get_ylim()[1] > eta + 0.5
    assert "versions" in ax.get_ylabel() and ax.get_xlabel() == "training step"


def test_an_unbounded_run_says_it_has_no_bound(tmp_path: Path, figures: dict[str, Any]) -> None:
    _run(tmp_path, eta="unbounded", backend="vllm")
    plots.plot_run(tmp_path)
    ax = figures["staleness_hist.png"].axes[0]
    assert _bound_lines(ax) == []
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "no staleness bound (η unbounded)" in labels


@pytest.mark.parametrize(("window", "shown"), [(None, "2"), (0.5, "0.5")])
def test_a_verl_async_run_draws_its_window_not_a_bound(
    tmp_path: Path, figures: dict[str, Any], window: float | None, shown: str
) -> None:
    """verl-async keeps no per-trajectory bound: its η (or its own window) is named as the
    window, and no bound line is drawn."""
    _run(tmp_path, eta=2, backend="sim")
    coord: dict[str, Any] = {"policy": "verl-async"}
    if window is not None:
        coord["verl_staleness_threshold"] = window
    cfg = {"protocol": {"eta": 2}, "rollout": {"backend": "sim"}, "coordinator": coord}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    plots.plot_run(tmp_path)
    ax = figures["staleness_hist.png"].axes[0]
    assert _bound_lines(ax) == []
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert f"no staleness bound (verl-async: window s = {shown})" in labels


@pytest.mark.parametrize("backend", ["sim", "vllm"])
def test_reward_and_throughput_titles_and_units(
    tmp_path: Path, figures: dict[str, Any], backend: str
) -> None:
    _run(tmp_path, eta=1, backend=backend)
    plots.plot_run(tmp_path)
    title = figures["reward.png"].axes[0].get_title()
    if backend == "sim":
        assert "synthetic" in title and "not a learning curve" in title
    else:
        assert "synthetic" not in title and "reward" in title
    top, bottom = figures["throughput.png"].axes
    unit = "virtual s" if backend == "sim" else "s"
    assert top.get_ylabel() == f"tokens / {unit}"
    assert bottom.get_ylabel() == f"trainer wait ({unit})"
    assert bottom.get_xlabel() == "training step"
    assert all(float(t).is_integer() for t in bottom.get_xticks())
    timeline = figures["timeline.png"].axes[0]
    assert timeline.get_xlabel().endswith("time since the run started (s)")
    assert timeline.get_xlabel().startswith("virtual") == (backend == "sim")


def _outside(legend: Any, ax: Any) -> bool:
    a, b = legend.get_window_extent(), ax.get_window_extent()
    return a.y0 >= b.y1 - 1 or a.x0 >= b.x1 - 1 or a.y1 <= b.y0 + 1 or a.x1 <= b.x0 + 1


def test_legends_stay_off_the_data(tmp_path: Path, figures: dict[str, Any]) -> None:
    _run(tmp_path, eta=2, backend="vllm")
    plots.plot_run(tmp_path)
    for name in ("staleness_hist.png", "throughput.png", "timeline.png"):
        ax = figures[name].axes[0]
        assert _outside(ax.get_legend(), ax), name
    # the timeline's x-range holds every interval and every step mark
    timeline = figures["timeline.png"].axes[0]
    assert timeline.get_xlim()[1] >= 13.0


def test_compare_panels_share_one_x_range_and_label_it(
    tmp_path: Path, figures: dict[str, Any]
) -> None:
    """Runs that end at different times (sync is slower) are drawn on one time axis, every
    panel labelled, one colour legend; staleness panels share one integer axis with η."""
    from staleflow_trainer.report.compare import run_comparison

    base = load_config(
        EXAMPLES / "sim-tiny.yaml",
        ["trainer.steps=3", "sim.warmup_steps=1", "metrics.log_every=0"],
    )
    report = run_comparison(base, tmp_path, policies=["staleflow", "sync"], seeds=(0,), workers=1)
    timelines = figures["timelines.png"]
    panels = [ax for ax in timelines.axes if ax.get_title()]
    assert len(panels) == 2  # staleflow at η = 3, sync at 0
    assert len({ax.get_xlim() for ax in panels}) == 1
    assert all(ax.get_xlabel() == "virtual time (s)" for ax in panels)
    [legend] = timelines.legends
    assert {t.get_text() for t in legend.get_texts()} == {"busy", "syncing", "idle", "step done"}
    ends = {r["policy"]: r["mean_step_s"] for r in report["results"]}
    assert ends["sync"] != ends["staleflow"]  # the shared range is not a coincidence

    stale = [ax for ax in figures["staleness.png"].axes if ax.get_title()]
    assert len(stale) == 4  # sync η=0, staleflow η=1..3
    assert len({ax.get_xlim() for ax in stale}) == 1
    for ax in stale:
        assert list(ax.get_xticks()) == [0, 1, 2, 3]
        eta = int(ax.get_title().split("η=")[1])
        assert [x for line in ax.get_lines() for x in line.get_xdata()][:1] == [eta + 0.5]
        assert ax.get_xlabel() == "staleness (versions)"

    bars = figures["throughput.png"].axes[0]
    assert bars.get_ylabel().startswith("trained tokens / virtual s")
    assert "not a steady-state measurement" in bars.get_title()  # 2 measured steps
    assert "measured steps <" in bars.get_title()  # and it says why


def test_plan_marks_its_pick_on_labelled_axes(tmp_path: Path, figures: dict[str, Any]) -> None:
    def row(gpus: int, eta: int, tps: float) -> dict[str, Any]:
        return {"rollout_gpus": gpus, "eta": eta, "tokens_per_s": tps, "ideal_tokens_per_s": 9e3}

    results = [row(g, e, 1000.0 * g * e) for g in (2, 3, 4) for e in (1, 2)]
    report = {
        "grid": {"etas": [1, 2], "total_gpus": 6, "policy": "staleflow", "steps": 8,
                 "warmup_steps": 2},
        "results": results,
        "fastest": results[-1],
        "recommended": results[-2],
    }  # fmt: skip
    plan._plot(report, tmp_path / "plan.png")
    ax = figures["plan.png"].axes[0]
    marks = {str(line.get_label()): (line.get_xdata()[0], line.get_ydata()[0])
             for line in ax.get_lines()}  # fmt: skip
    assert marks["fastest (η = 2)"] == (4, 8000.0)
    assert marks["recommended (η = 1)"] == (4, 4000.0)
    assert ax.get_ylabel() == "trained tokens / virtual s\n(mean after 2 warm-up steps)"
    assert ax.get_xlabel() == "rollout GPUs (of 6; the rest train)"
    assert ax.get_ylim()[0] == 0 and _outside(ax.get_legend(), ax)


def test_a_decision_twins_timeline_says_whose_run_it_is(
    tmp_path: Path, figures: dict[str, Any]
) -> None:
    """coarse-async's rows are all-vanilla's runs (a comparison runs the pair once): its
    timeline panel draws that run and says so."""
    from staleflow_trainer.report.compare import run_comparison

    base = load_config(
        EXAMPLES / "sim-tiny.yaml",
        [
            "trainer.steps=3",
            "sim.warmup_steps=1",
            "metrics.log_every=0",
            "protocol.stuck_threshold=0",
        ],
    )
    run_comparison(
        base, tmp_path, policies=["all-vanilla", "coarse-async"], etas=(2,), seeds=(0,), workers=1
    )
    titles = [ax.get_title() for ax in figures["timelines.png"].axes if ax.get_title()]
    assert len(titles) == 2
    assert titles[0].startswith("all-vanilla η=2") and "run:" not in titles[0]
    assert titles[1].startswith("coarse-async η=2")
    assert titles[1].endswith("(all-vanilla's run: the same decisions)")
