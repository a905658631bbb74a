"""Response-length workloads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine_adapters.errors import InvalidRequest
from engine_adapters.workload import LengthSampler, WorkloadConfig


def test_deterministic_under_seed_and_stream() -> None:
    cfg = WorkloadConfig(kind="lognormal", seed=7)
    a = LengthSampler(cfg).groups(50, 8, stream=3)
    b = LengthSampler(cfg).groups(50, 8, stream=3)
    c = LengthSampler(cfg).groups(50, 8, stream=4)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_lognormal_median_and_cap_pile_up() -> None:
    cfg = WorkloadConfig(kind="lognormal", median=1000, sigma=1.5, max_length=8000)
    x = LengthSampler(cfg).sample(40_000)
    assert x.max() == 8000 and x.min() >= 1
    assert abs(np.median(x) - 1000) < 50
    # P(lognormal > 8000) = 1 - Φ(ln 8 / 1.5) ≈ 0.0827: all of it sits exactly on the cap
    assert (x == 8000).mean() == pytest.approx(0.0827, abs=0.006)
    assert (x > 8000).sum() == 0


def test_power_law_tail() -> None:
    cfg = WorkloadConfig(kind="power_law", x_min=100, alpha=1.2, max_length=10**9)
    x = LengthSampler(cfg).sample(40_000)
    assert x.min() >= 100
    # Pareto survival: P(X > 1000) = (100/1000)^1.2 ≈ 0.0631
    assert (x > 1000).mean() == pytest.approx(0.0631, abs=0.006)


def test_bimodal_weights() -> None:
    cfg = WorkloadConfig(
        kind="bimodal", median=500, sigma=0.2, median2=10_000, sigma2=0.1, weight2=0.25
    )
    x = LengthSampler(cfg).sample(20_000)
    assert (x > 3000).mean() == pytest.approx(0.25, abs=0.015)


def test_group_correlation() -> None:
    def corr(rho: float) -> float:
        g = LengthSampler(WorkloadConfig(group_correlation=rho, max_length=10**9)).groups(4000, 2)
        return float(np.corrcoef(np.log(g[:, 0]), np.log(g[:, 1]))[0, 1])

    assert abs(corr(0.0)) < 0.05
    assert corr(0.8) == pytest.approx(0.8, abs=0.05)


def test_trace_replay(tmp_path: Path) -> None:
    path = tmp_path / "lengths.jsonl"
    path.write_text("\n".join([json.dumps(v) for v in [10, 20, 30]] + ['{"length": 40000}']))
    cfg = WorkloadConfig(kind="trace", trace_path=str(path), max_length=100)
    x = LengthSampler(cfg).sample(4000)
    assert set(np.unique(x)) == {10, 20, 30, 100}
    assert (x == 100).mean() == pytest.approx(0.25, abs=0.03)


def test_bad_trace(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("12\n-3\n")
    with pytest.raises(InvalidRequest, match=r"bad\.jsonl:2"):
        LengthSampler(WorkloadConfig(kind="trace", trace_path=str(path)))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kind": "gaussian"}, "kind"),
        ({"group_correlation": 1.5}, "group_correlation"),
        ({"max_length": 0}, "max_length"),
        ({"kind": "trace"}, "trace_path"),
        ({"weight2": -0.1}, "weight2"),
    ],
)
def test_config_validation(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        WorkloadConfig(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_from_mapping_rejects_unknown() -> None:
    with pytest.raises(InvalidRequest, match="medain"):
        WorkloadConfig.from_mapping({"medain": 3})


# ---- traces of whole groups ----------------------------------------------------------------


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_group_trace_keeps_each_group_inside_one_record(tmp_path: Path) -> None:
    records = [[100, 110, 120, 130], [5000, 5100, 5200, 5300], [20_000, 19_000, 18_000, 17_000]]
    p = _write(tmp_path / "g.jsonl", "".join(json.dumps({"lengths": r}) + "\n" for r in records))
    cfg = WorkloadConfig(kind="group_trace", trace_path=str(p), max_length=18_500, seed=3)
    groups = LengthSampler(cfg).groups(300, 4)
    capped = [sorted(min(x, 18_500) for x in r) for r in records]
    for g in groups:
        assert sorted(g.tolist()) in capped  # all four members from one record
    # every record is drawn, and the draw is deterministic under seed and stream
    assert {min(g) for g in groups.tolist()} == {100, 5000, 17_000}
    assert np.array_equal(groups, LengthSampler(cfg).groups(300, 4))
    assert not np.array_equal(groups, LengthSampler(cfg).groups(300, 4, stream=1))
    # bigger groups than the records: drawn with replacement, still from one record
    big = LengthSampler(cfg).groups(50, 10)
    for g in big:
        assert any(set(g.tolist()) <= set(r) for r in capped)


def test_group_trace_csv(tmp_path: Path) -> None:
    p = _write(tmp_path / "g.csv", "group,length\na,10\nb,900\na,12\nb,950\n")
    groups = LengthSampler(WorkloadConfig(kind="group_trace", trace_path=str(p))).groups(40, 2)
    assert {tuple(sorted(g)) for g in groups.tolist()} == {(10, 12), (900, 950)}
    # columns in either order
    q = _write(tmp_path / "h.csv", "length,group\n7,x\n8,x\n")
    assert LengthSampler(WorkloadConfig(kind="group_trace", trace_path=str(q))).groups(
        1, 2
    ).tolist() in ([[7, 8]], [[8, 7]])


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("a.jsonl", '{"lengths": [1, 2]}\nnot json\n', ":2: line"),
        ("a.jsonl", '{"lengths": [1, 2]}\n[3, 4]\n', ":2: line"),
        ("a.jsonl", '{"lens": [1]}\n', ":1: lens"),
        ("a.jsonl", '{"id": 3, "lengths": [1]}\n', ":1: id"),
        ("a.jsonl", "{}\n", ":1: lengths"),
        ("a.jsonl", '{"lengths": []}\n', ":1: lengths"),
        ("a.jsonl", '{"lengths": [5, 0]}\n', ":1: lengths[1]"),
        ("a.jsonl", '{"lengths": [5, 2.5]}\n', ":1: lengths[1]"),
        ("a.jsonl", "\n\n", "holds no groups"),
        ("a.csv", "grp,length\nx,1\n", ":1: header"),
        ("a.csv", "group,length\nx,1\ny,ten\n", ":3: length"),
        ("a.csv", "group,length\nx,1\ny,-4\n", ":3: length"),
        ("a.csv", "group,length\nx,1,2\n", ":2: row"),
        ("a.csv", "group,length\n,5\n", ":2: group"),
    ],
)
def test_group_trace_errors_name_line_and_field(
    tmp_path: Path, name: str, text: str, where: str
) -> None:
    p = _write(tmp_path / name, text)
    with pytest.raises(InvalidRequest, match=where.replace("[", r"\[").replace("]", r"\]")):
        LengthSampler(WorkloadConfig(kind="group_trace", trace_path=str(p)))


def test_group_trace_needs_a_path_and_a_readable_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest) as ei:
        WorkloadConfig(kind="group_trace")
    assert ei.value.field == "trace_path"
    with pytest.raises(InvalidRequest, match="cannot read trace"):
        LengthSampler(WorkloadConfig(kind="group_trace", trace_path=str(tmp_path / "nope.jsonl")))
