"""``benchmarks/bench_control_bytes.py --smoke``: two short runs of the real deployment (Ray,
trajectory server, parameter server, trainer, sim engine instances) at response lengths 16 and
256; the control process's byte counts are read from the control actor and reported per
trajectory. The full benchmark reports the ratio; this keeps it running and its counts real."""

from __future__ import annotations

import json
from pathlib import Path

import bench_control_bytes
import pytest

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
        assert {"instances.route", "instances.poll_answer", "trainer.train"} <= set(by_call)
        assert r["readmissions_per_trajectory"] >= r["interrupts_per_trajectory"] >= 0
    assert res["length_ratio"] == 16
    assert res["ratio_longest_over_shortest"]["total"] > 0
    # two runs cannot estimate a slope's error: the fits say so instead of printing one
    assert res["fit_total"] == {"length_only": None, "with_readmissions": None}
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
    f = bench_control_bytes._fit(runs, "y")
    both = f["with_readmissions"]
    assert both is not None
    assert abs(both["per_1k_tokens"]) < 3 * both["per_1k_tokens_se"] + 0.5
    assert abs(both["per_readmission"] - 180) < 3 * both["per_readmission_se"]
    assert abs(both["intercept"] - 120) < 3 * both["intercept_se"]
    assert f["length_only"] is not None and f["length_only"]["per_1k_tokens"] > 5
