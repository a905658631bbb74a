"""``benchmarks/bench_control_bytes.py --smoke``: two short runs of the real deployment (Ray,
trajectory server, parameter server, trainer, sim engine instances) at response lengths 16 and
256; the control process's byte counts are read from the control actor and reported per
trajectory. The full benchmark reports the ratio; this keeps it running and its counts real."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import bench_control_bytes
import pytest

from staleflow_trainer.actors.shell_io import POLL_REASONS

pytestmark = [pytest.mark.ray, pytest.mark.sim, pytest.mark.timeout(900)]


def test_bench_control_bytes_smoke(ray_session: None, tmp_path: Path) -> None:
    out = tmp_path / "control_bytes.json"
    res = bench_control_bytes.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert res["smoke"] is True
    assert [r["response_len"] for r in res["runs"]] == [16, 256]
    for r in res["runs"]:
        assert r["steps"] == 2
        assert r["consumed"] == 2 * 8 * 8
        assert r["trajectories"] >= r["consumed"]
        # every consumed response really is L - 1 or L tokens long (in the store, not here)
        assert r["tokens_generated"] >= r["consumed"] * (r["response_len"] - 1)
        assert all(r["bytes"][k] > 0 for k in bench_control_bytes.KINDS)
        # the per-call split adds up to the per-kind totals
        by_call = r["bytes_per_trajectory_by_call"]
        for k in bench_control_bytes.KINDS:
            part = sum(v for c, v in by_call.items() if c.startswith(k + "."))
            assert part == pytest.approx(r["bytes_per_trajectory"][k]), (k, by_call)
        assert {"instances.route", "instances.poll_answer", "trainer.train", "ts.free"} <= set(
            by_call
        )
        # the poll answers' parts: a breakdown of their bytes (each part pickled alone, so
        # a little more than the answer's share), the snapshot deltas and outcomes among them
        parts = r["bytes_per_trajectory_parts"]
        assert {"instances.poll_answer.snapshot", "instances.poll_answer.outcomes"} <= set(parts)
        assert sum(parts.values()) == pytest.approx(by_call["instances.poll_answer"], rel=0.5)
        assert r["readmissions_per_trajectory"] >= r["interrupts_per_trajectory"] >= 0
        # polls by why each was sent: every instance's first, and those after the routes
        polls = r["polls_per_trajectory"]
        assert set(polls) <= set(POLL_REASONS), polls
        assert polls["no_view"] * r["trajectories"] >= 2 and polls["command"] > 0, polls
        # keeping watch is a part of the instances' bytes (wait_results calls whose time ran
        # out, quiet polls answered None), reported per trajectory and per instance-second
        watch = r["watch_bytes_per_trajectory"]
        assert (
            0
            <= watch
            <= by_call["instances.wait_results"]
            + by_call["instances.poll"]
            + (by_call["instances.poll_answer"])
        )
        assert r["total_without_watch_per_trajectory"] == pytest.approx(
            r["total_bytes_per_trajectory"] - watch
        )
        assert r["watch_bytes_per_instance_s"] == pytest.approx(
            watch * r["trajectories"] / (2 * r["run_wall_s"])
        )
    assert res["length_ratio"] == 16
    assert res["ratio_longest_over_shortest"]["total"] > 0
    # two runs cannot estimate a slope's error: the fits say so instead of printing one
    assert res["fit_total"] == {"length_only": None, "with_readmissions": None}
    # nor a spread to judge the bar by: no verdict, and why
    assert res["verdict"]["met"] is None and "--repeats" in res["verdict"]["why"]
    assert res["verdict_without_watch"]["met"] is None
    # no payload crosses the control process: what it exchanges with the store, the reward
    # workers and the trainer per trajectory does not grow with a 16x longer response
    for kind in ("ts", "rewards", "trainer"):
        assert res["ratio_longest_over_shortest"][kind] < 1.25, (kind, res)


def test_fit_recovers_known_slopes() -> None:
    """The fit the benchmark prints: bytes = 120 + 180 per re-admission + 0 per 1K tokens,
    with small noise, is recovered within its own error bars; on length alone the
    re-admissions (which rise with length here) show up as a per-token slope."""
    import random

    rng = random.Random(3)
    runs = []
    for length in (16, 256, 1024, 2048, 4096):
        for _ in range(3):
            readmit = min(0.25, length / 4000) + rng.uniform(-0.05, 0.05)
            runs.append(
                {
                    "response_len": length,
                    "readmissions_per_trajectory": readmit,
                    "y": 120 + 180 * readmit + rng.gauss(0, 2),
                }
            )
    f = bench_control_bytes._fit(runs, lambda r: r["y"])
    both = f["with_readmissions"]
    assert both is not None
    assert abs(both["per_1k_tokens"]) < 3 * both["per_1k_tokens_se"] + 0.5
    assert abs(both["per_readmission"] - 180) < 3 * both["per_readmission_se"]
    assert abs(both["intercept"] - 120) < 3 * both["intercept_se"]
    assert f["length_only"] is not None and f["length_only"]["per_1k_tokens"] > 5


def test_verdict_tells_flat_from_growing() -> None:
    """The bar's verdict on made-up runs: bytes that only scatter meet it, bytes that rise by
    a few percent over the lengths miss it; a flat mean with a wide spread still meets it
    (the spread is what a rise has to exceed), and says how wide the allowance is."""
    import random

    def runs(rise: float, noise: float) -> dict[int, list[dict[str, Any]]]:
        rng = random.Random(5)
        by_len: dict[int, list[dict[str, Any]]] = {}
        for length in (16, 256, 1024, 2048, 4096):
            by_len[length] = [
                {
                    "response_len": length,
                    "readmissions_per_trajectory": 0.0,
                    "total_bytes_per_trajectory": 100 + rise * length / 4096 + rng.gauss(0, noise),
                }
                for _ in range(3)
            ]
        return by_len

    def verdict(by_len: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
        flat = [r for rs in by_len.values() for r in rs]
        fit = bench_control_bytes._fit(flat, lambda r: r["total_bytes_per_trajectory"])[
            "length_only"
        ]
        return bench_control_bytes._verdict(by_len, fit)

    assert verdict(runs(rise=0, noise=2))["met"] is True
    missed = verdict(runs(rise=20, noise=2))
    assert missed["met"] is False and not missed["ratio_ok"] and not missed["slope_ok"]
    wide = verdict(runs(rise=0, noise=15))
    assert wide["met"] is True and wide["ratio_bound"] > 1.1
