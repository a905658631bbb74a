"""``benchmarks/bench_e2e.py --smoke``: one before/after pair of real ``staleflow train``
processes (this tree on both sides, sim engines, 2 steps), read back from their run directories
and compared in the table. The full benchmark compares against a checkout of a git ref; this
keeps the runs, the parsing and the comparison working. The records of older trees (other key
names for the same counts) are read by the same function, checked below against this tree's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import bench_e2e
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.sim, pytest.mark.timeout(600)]


def test_bench_e2e_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "e2e.json"
    res = bench_e2e.main(["--smoke", "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert res["smoke"] is True and res["ref_sha"] == res["head_sha"]
    assert [(r["side"], r["pair"]) for r in res["runs"]] == [("before", 1), ("after", 1)]
    for r in res["runs"]:
        assert r["samples"] == 8 * 8  # step 2's batch: B x n
        assert r["trained_tokens"] >= r["samples"]  # every response has a token
        assert r["trained_tok_s"] > 0 and r["samples_s"] > 0
        assert 0 < r["steady_s"] < r["loop_s"] < r["process_s"]
        assert r["startup_s"] is not None and 0 < r["startup_s"] < r["process_s"]
        rows = [json.loads(x) for x in (tmp_path / "work" / "runs" / f"{r['side']}-1" / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
        assert r["trained_tokens"] == rows[1]["response_tokens"]
    ratio = res["ratio_after_over_before"]
    # every column with a non-zero "before" median (the sim engines' step 2 generates nothing)
    assert {"trained_tok_s", "samples_s", "train_s", "loop_s", "process_s"} <= set(ratio)
    assert set(ratio) <= set(bench_e2e.COLUMNS)
    assert all(v["pairs_min"] == v["pairs_max"] == v["of_medians"] for v in ratio.values())
    printed = capsys.readouterr().out
    assert "median before" in printed and "after/before" in printed


def _as_older_tree_wrote_it(row: dict[str, Any]) -> dict[str, Any]:
    """A record of this tree with the keys an older tree used for the same counts: ``tokens``
    held the generated tokens, the trained ones were only the trainer's ``tokens``, and there
    was no ``samples``."""
    old = {k: v for k, v in row.items() if k not in ("response_tokens", "gen_tokens", "samples")}
    old["tokens"] = row["gen_tokens"]
    return old


def test_older_trees_records_read_as_the_same_counts(tmp_path: Path) -> None:
    rows = [
        {"step": s, "time_s": 10.0 + s, "response_tokens": 180 + s, "gen_tokens": 300 * (s % 2),
         "samples": 64, "tokens": 440 + s, "staleness_hist": {"0": 60, "1": 4},
         "trainer_wait_s": 0.5, "train_s": 0.25, "trainer": {"tokens": 180.0 + s, "train_time_s": 0.1}}
        for s in range(1, 5)
    ]  # fmt: skip
    new = bench_e2e.summarize(rows, 4)
    old = bench_e2e.summarize([_as_older_tree_wrote_it(r) for r in rows], 4)
    assert old == new
    assert new["trained_tokens"] == 182 + 183 + 184 and new["gen_tokens"] == 300
    assert new["samples_s"] == pytest.approx(3 * 64 / 3.0)
    with pytest.raises(bench_e2e.BenchError, match=r"steps 1\.\.5"):
        bench_e2e.summarize(rows, 5)
