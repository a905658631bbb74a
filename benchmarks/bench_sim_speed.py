"""The simulator's speed, side by side: one simulated run of a preset from another git ref
(before) and from this tree (after), alternated for ``--pairs`` pairs (before, after, before,
after, ...). Per run: CPU and wall seconds of the simulation loop (``Simulation.run``, without
start-up or writing files) and its cycles; the medians per side and the before/after ratios
(above 1: this tree is faster). Both sides must compute the same run: the step records, the
per-instance timeline and the summary are compared exactly and the verdict printed
(``identical``); a difference is an error. A field that only one side writes (a step-record
key a later tree added, say) is not a difference: it is listed (``fields_only_in``), and every
field both sides write must be equal.

CPU seconds are the number to read on a shared machine: wall seconds grow with the load
other processes put on the cores, CPU seconds much less. Both sides run the same preset and
overrides in separate processes, each tree with its own locked environment (the ref's
checkout is the cached ``git worktree`` of ``bench_e2e.py``, ``bench-results/e2e/ref-<sha>``).

    .venv/bin/python benchmarks/bench_sim_speed.py [--ref HEAD] [--pairs 2] \\
        [--preset examples/sim-paper-30b-a3b.yaml] [KEY=VALUE ...]
    .venv/bin/python benchmarks/bench_sim_speed.py --smoke   # this tree on both sides, tiny

Writes ``bench-results/sim_speed.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# its sibling benchmark, also when this file is loaded by path (not run as a script)
if (_HERE := str(Path(__file__).resolve().parent)) not in sys.path:
    sys.path.insert(0, _HERE)
from bench_e2e import ROOT, BenchError, _clean_env, prepare_ref

SIDES = ("before", "after")
#: The last commit: a change in this tree must compute the same run, and shows its speed. (An
#: older ref computes the same run only while nothing since has changed what runs.)
DEFAULT_REF = "HEAD"
DEFAULT_PRESET = "examples/sim-paper-30b-a3b.yaml"
SMOKE = ("trainer.steps=3", "sim.warmup_steps=1")
# Runs inside each tree's own environment: only APIs both sides have.
_RUN = """
import json, sys, time
from pathlib import Path
from staleflow_trainer.config import load_config
from staleflow_trainer.sim.shell import Simulation
preset, out, *over = sys.argv[1:]
cfg = load_config(preset, [f"run.run_dir={out}", "metrics.timeline=true", *over])
sim = Simulation(cfg)
cpu, wall = time.process_time(), time.perf_counter()
sim.run()
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
rec = sim.rec
Path(out).mkdir(parents=True, exist_ok=True)
result = {"steps": rec.steps, "timeline": rec.timeline, "summary": rec.summary()}
Path(out, "result.json").write_text(json.dumps(result, sort_keys=True, default=str))
print(json.dumps({"cpu_s": cpu, "wall_s": wall, "cycles": sim.cycles}))
"""


def run_once(
    python: Path, tree: Path, preset: str, over: Sequence[str], out: Path
) -> dict[str, Any]:
    proc = subprocess.run(
        [str(python), "-c", _RUN, preset, str(out), *over],
        cwd=tree, capture_output=True, text=True, env=_clean_env(), check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise BenchError(f"simulation in {tree} failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def same_run(
    before: Mapping[str, Any], after: Mapping[str, Any]
) -> tuple[bool, dict[str, list[str]]]:
    """Whether two sides computed the same run: equal in every field both write (step records,
    timeline, summary); and the fields only one side writes, per side (``steps.<key>``,
    ``summary.<key>``)."""
    result = {"before": before, "after": after}
    step_keys = {side: {k for rec in result[side]["steps"] for k in rec} for side in SIDES}
    summary_keys = {side: set(result[side]["summary"]) for side in SIDES}
    steps_both = step_keys["before"] & step_keys["after"]
    summary_both = summary_keys["before"] & summary_keys["after"]
    only = {
        side: sorted([f"steps.{k}" for k in step_keys[side] - steps_both]
                     + [f"summary.{k}" for k in summary_keys[side] - summary_both])
        for side in SIDES
    }  # fmt: skip

    def shared(r: Mapping[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        steps = [{k: v for k, v in rec.items() if k in steps_both} for rec in r["steps"]]
        return steps, {k: v for k, v in r["summary"].items() if k in summary_both}

    equal = shared(before) == shared(after) and before["timeline"] == after["timeline"]
    return equal, only


def compare(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """Medians per side and the before/after ratios of CPU and wall seconds."""
    med = {
        side: {k: statistics.median(r[k] for r in runs[side]) for k in ("cpu_s", "wall_s")}
        for side in SIDES
    }
    return {
        "median": med,
        "cpu_ratio": med["before"]["cpu_s"] / med["after"]["cpu_s"],
        "wall_ratio": med["before"]["wall_s"] / med["after"]["wall_s"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for both sides")
    ap.add_argument(
        "--ref", default=DEFAULT_REF, help=f"the 'before' git ref (default {DEFAULT_REF})"
    )
    ap.add_argument("--preset", default=DEFAULT_PRESET)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--out", default="bench-results/sim_speed.json")
    ap.add_argument("--smoke", action="store_true",
                    help="this tree on both sides, examples/sim-tiny.yaml, 1 pair of 3 steps")  # fmt: skip
    a = ap.parse_args(argv)
    if a.pairs < 1:
        raise BenchError(f"--pairs must be >= 1, got {a.pairs}")
    preset, pairs, over = a.preset, a.pairs, list(a.overrides)
    here = (ROOT, ROOT / ".venv" / "bin" / "python")
    if a.smoke:
        preset, pairs, over = "examples/sim-tiny.yaml", 1, [*SMOKE, *over]
        trees = {"before": here, "after": here}
        ref = "this tree"
    else:
        tree, sha = prepare_ref(a.ref, ROOT / "bench-results" / "e2e")
        trees = {"before": (tree, tree / ".venv" / "bin" / "python"), "after": here}
        ref = f"{a.ref} ({sha[:12]})"
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    identical = True
    only: dict[str, set[str]] = {side: set() for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="sim_speed_") as tmp:
        for k in range(pairs):
            results = {}
            for side in SIDES:
                tree, python = trees[side]
                out = Path(tmp) / f"{side}-{k}"
                r = run_once(python, tree, preset, over, out)
                runs[side].append(r)
                results[side] = json.loads((out / "result.json").read_text())
                print(f"pair {k + 1}/{pairs} {side:6s}: {r['cpu_s']:7.2f} s CPU "
                      f"{r['wall_s']:7.2f} s wall, {r['cycles']} cycles", flush=True)  # fmt: skip
            equal, only_k = same_run(results["before"], results["after"])
            identical = identical and equal
            for side in SIDES:
                only[side].update(only_k[side])
    cmp = compare(runs)
    res = {
        "smoke": a.smoke, "ref": ref, "preset": preset, "overrides": over, "pairs": pairs,
        "runs": runs, "identical": identical,
        "fields_only_in": {side: sorted(only[side]) for side in SIDES}, **cmp,
    }  # fmt: skip
    med = cmp["median"]
    print(f"{preset} {' '.join(over)}: before ({ref}) {med['before']['cpu_s']:.2f} s CPU, "
          f"{med['before']['wall_s']:.2f} s wall; after {med['after']['cpu_s']:.2f} s CPU, "
          f"{med['after']['wall_s']:.2f} s wall; before/after {cmp['cpu_ratio']:.2f}x CPU, "
          f"{cmp['wall_ratio']:.2f}x wall; results identical: {identical}")  # fmt: skip
    for side in SIDES:
        if only[side]:
            print(f"fields only the {side} side writes (not compared): "
                  f"{', '.join(sorted(only[side]))}")  # fmt: skip
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    if not identical:
        raise BenchError(
            "the two sides computed different runs (a field both write differs in the steps, "
            "the timeline or the summary)"
        )
    return res


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        sys.exit(f"bench_sim_speed: {e}")
