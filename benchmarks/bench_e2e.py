"""End-to-end throughput of the tiny example: this tree against a git ref, side by side.

Runs ``staleflow train examples/tiny.yaml`` as its own process, alternately from a checkout of
``--ref`` (before, default ``5107366``) and from this tree (after): before, after, before,
after, ... for ``--pairs`` pairs, so drift in the machine's load falls on both sides. Each run
uses its own tree's code, environment and ``examples/tiny.yaml``, with a fresh run directory,
``run.resume=never``, no TensorBoard, no progress bar and ``trainer.steps=--steps``.

The ref's checkout is a detached ``git worktree`` in ``bench-results/e2e/ref-<sha>`` with its
own ``.venv`` (``uv sync --locked --all-packages`` there). It is kept and reused by later runs
(the sync is then a no-op); ``--remove-ref`` removes it at the end (``git worktree remove``).

Read from each run directory's ``metrics.jsonl`` (keys both versions write; where they differ,
each version's file is read as that version wrote it):

* trained tokens: the response tokens of each step's batch (``response_tokens``; older trees:
  the trainer's ``trainer.tokens``, the same count);
* generated tokens: tokens the instances generated since the previous step (``gen_tokens``;
  older trees wrote that count as ``tokens``);
* samples: trained trajectories of the step (``samples``; older trees: the staleness
  histogram's total);
* ``time_s`` (seconds since the control process started), ``trainer_wait_s`` (the trainer
  waiting for its batch), ``train_s`` (from handing the batch over to the new version
  published) and the trainer's own ``trainer.train_time_s`` (its forward/backward/step).

Rates are over the steady part of the loop, from the end of step 1 to the end of the last
step (step 1 holds the first generation and warm-up); ``wait s``, ``train s`` and
``compute s`` are the sums over the same steps. Also printed per run: the training loop's
wall time (``time_s`` of the last step), the start-up time the run logs
(``deployment_started seconds=``) and the whole process's wall time, measured here. Then the
medians per side and the ratio after / before (of the medians, and the per-pair ratios'
range). Writes ``bench-results/e2e.json``; each run's output is in
``bench-results/e2e/runs/<side>-<pair>.log``.

    .venv/bin/python benchmarks/bench_e2e.py [--ref 5107366] [--pairs 3] [--steps 30]
    .venv/bin/python benchmarks/bench_e2e.py --smoke   # this tree on both sides, sim engines
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from staleflow_trainer.runtime.prepare import WORKER_ENV

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_REF = "5107366"
SIDES = ("before", "after")
# what every process of a run is given (one list: the app's), plus a 1 GiB vLLM KV cache
ENV = {**WORKER_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}
# the sim engines in place of vLLM (the smoke run): what the integration tests use
SIM_OVERRIDES = (
    "rollout.backend=sim",
    "sim.total_gpus=3",
    "sim.workload.response_len_median=2",
)
RATES = ("trained_tok_s", "gen_tok_s", "samples_s")
COLUMNS = (*RATES, "wait_s", "train_s", "compute_s", "loop_s", "startup_s", "process_s")
STARTED = re.compile(r"deployment_started\b.*?\bseconds=([0-9.]+)")


class BenchError(RuntimeError):
    """A run failed or wrote no usable metrics."""


# ---- the trees ---------------------------------------------------------------------------------


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def _clean_env() -> dict[str, str]:
    """This process's environment without the variables that would point ``uv`` at this
    tree's (or nox's) environment instead of the ref's own ``.venv``."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT")
    }
    return {**env, **ENV}


def prepare_ref(ref: str, cache: Path) -> tuple[Path, str]:
    """A checkout of ``ref`` with its locked environment: ``(directory, full sha)``."""
    try:
        sha = _git("rev-parse", "--verify", f"{ref}^{{commit}}")
    except subprocess.CalledProcessError as e:
        raise BenchError(f"--ref {ref!r} is not a commit of this repository: {e.stderr}") from e
    tree = cache / f"ref-{sha[:12]}"
    if tree.exists() and (
        not (tree / ".git").exists() or _git("rev-parse", "HEAD", cwd=tree) != sha
    ):
        raise BenchError(f"{tree} exists and is not a checkout of {sha}; remove it")
    if not tree.exists():
        cache.mkdir(parents=True, exist_ok=True)
        _git("worktree", "add", "--detach", str(tree), sha)
    uv = shutil.which("uv") or str(Path.home() / ".local" / "bin" / "uv")
    if not Path(uv).exists():
        raise BenchError("uv is not installed (the ref's environment is made with uv sync)")
    t0 = time.perf_counter()
    # compiled as this tree's environment is (its workspace sets compile-bytecode): an older
    # ref's modules would otherwise compile from source in every process, and its start-up
    # and any import inside a timed region would measure that, not the code
    subprocess.run(
        [uv, "sync", "--locked", "--all-packages", "--quiet", "--compile-bytecode"],
        cwd=tree,
        env=_clean_env(),
        check=True,
    )
    print(f"ref {ref} ({sha[:12]}): {tree} (synced in {time.perf_counter() - t0:.0f} s)")
    return tree, sha


def staleflow_of(tree: Path, venv_bin: Path) -> list[str]:
    """The ``staleflow`` command of a tree's environment, after checking that it imports that
    tree's code (not an installed copy of another one)."""
    exe = venv_bin / "staleflow"
    if not exe.exists():
        raise BenchError(f"no staleflow in {venv_bin}; sync the environment of {tree}")
    where = subprocess.run(
        [str(venv_bin / "python"), "-c", "import staleflow_trainer; print(staleflow_trainer.__file__)"],
        capture_output=True, text=True, check=True, env=_clean_env(),
    ).stdout.strip()  # fmt: skip
    if not Path(where).resolve().is_relative_to(tree.resolve()):
        raise BenchError(f"{exe} imports staleflow_trainer from {where}, not from {tree}")
    return [str(exe)]


# ---- one run -----------------------------------------------------------------------------------


def overrides(run_dir: Path, steps: int, backend: str) -> list[str]:
    over = [
        f"run_dir={run_dir}",
        "run.resume=never",
        f"trainer.steps={steps}",
        "metrics.tensorboard=false",
        "metrics.progress_bar=false",
    ]
    return over + list(SIM_OVERRIDES) if backend == "sim" else over


def _step_counts(row: Mapping[str, Any]) -> tuple[float, float, float]:
    """(trained response tokens, generated tokens, samples) of one metrics.jsonl record, read
    as the tree that wrote it named them."""
    trained = row["response_tokens"] if "response_tokens" in row else row["trainer"]["tokens"]
    gen = row["gen_tokens"] if "gen_tokens" in row else row["tokens"]
    samples = row["samples"] if "samples" in row else sum(row["staleness_hist"].values())
    return float(trained), float(gen), float(samples)


def summarize(rows: Sequence[Mapping[str, Any]], steps: int) -> dict[str, float]:
    """The per-run figures from a run's step records (see the module docstring)."""
    if len(rows) != steps or [int(r["step"]) for r in rows] != list(range(1, steps + 1)):
        raise BenchError(f"expected steps 1..{steps} in metrics.jsonl, got {len(rows)} records")
    steady = rows[1:]
    span = float(rows[-1]["time_s"]) - float(rows[0]["time_s"])
    if span <= 0:
        raise BenchError(f"the steady window is {span} s long")
    trained, gen, samples = (sum(c) for c in zip(*(_step_counts(r) for r in steady), strict=True))
    return {
        "trained_tok_s": trained / span,
        "gen_tok_s": gen / span,
        "samples_s": samples / span,
        "wait_s": sum(float(r["trainer_wait_s"]) for r in steady),
        "train_s": sum(float(r["train_s"]) for r in steady),
        "compute_s": sum(float(r["trainer"]["train_time_s"]) for r in steady),
        "steady_s": span,
        "loop_s": float(rows[-1]["time_s"]),
        "first_step_s": float(rows[0]["time_s"]),
        "trained_tokens": trained,
        "gen_tokens": gen,
        "samples": samples,
    }


def run_once(
    cmd: list[str], tree: Path, run_dir: Path, steps: int, backend: str, log: Path
) -> dict[str, Any]:
    """One ``staleflow train`` of ``tree``'s tiny example; its figures."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    argv = [
        *cmd,
        "train",
        str(tree / "examples" / "tiny.yaml"),
        *overrides(run_dir, steps, backend),
    ]
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(
            argv, cwd=tree, env=_clean_env(), stdout=f, stderr=subprocess.STDOUT
        ).returncode
    process_s = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    if rc != 0:
        raise BenchError(f"{' '.join(argv)} exited {rc}; last output:\n{text[-3000:]}")
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    started = STARTED.search(text)
    return {
        **summarize(rows, steps),
        "startup_s": float(started.group(1)) if started else None,
        "process_s": process_s,
    }


# ---- the comparison ----------------------------------------------------------------------------


def compare(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians per side, and after / before: the ratio of the medians and the per-pair
    ratios' median and range."""
    med = {
        side: {k: statistics.median(float(r[k]) for r in runs if r["side"] == side and r[k] is not None)
               for k in COLUMNS if any(r[k] is not None for r in runs if r["side"] == side)}
        for side in SIDES
    }  # fmt: skip
    pairs: dict[int, dict[str, Mapping[str, Any]]] = {}
    for r in runs:
        pairs.setdefault(int(r["pair"]), {})[str(r["side"])] = r
    ratio: dict[str, dict[str, float]] = {}
    for k in COLUMNS:
        if k not in med["before"] or k not in med["after"] or not med["before"][k]:
            continue
        per = [
            p["after"][k] / p["before"][k] for p in pairs.values() if len(p) == 2 and p["before"][k]
        ]
        ratio[k] = {
            "of_medians": med["after"][k] / med["before"][k],
            "pairs_median": statistics.median(per),
            "pairs_min": min(per),
            "pairs_max": max(per),
        }
    return {"median": med, "ratio_after_over_before": ratio}


HEAD = ("run", "trained tok/s", "gen tok/s", "samples/s", "wait s", "train s", "compute s",
        "loop s", "start-up s", "process s")  # fmt: skip


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def table(runs: Sequence[Mapping[str, Any]], cmp: Mapping[str, Any]) -> str:
    rows = [[f"{r['side']} {r['pair']}", *(_fmt(r[k]) for k in COLUMNS)] for r in runs]
    rows += [[f"median {s}", *(_fmt(cmp["median"][s].get(k)) for k in COLUMNS)] for s in SIDES]
    rat = cmp["ratio_after_over_before"]
    rows.append(
        ["after/before", *(f"{rat[k]['of_medians']:.2f}" if k in rat else "-" for k in COLUMNS)]
    )
    rows.append(["pairs min-max", *(f"{rat[k]['pairs_min']:.2f}-{rat[k]['pairs_max']:.2f}"
                                    if k in rat else "-" for k in COLUMNS)])  # fmt: skip
    width = [max(len(x[i]) for x in [list(HEAD), *rows]) for i in range(len(HEAD))]

    def line(cells: Sequence[str]) -> str:
        pad = [
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, width, strict=True))
        ]
        return "  ".join(pad)

    return "\n".join([line(HEAD), *(line(r) for r in rows)])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--ref", default=DEFAULT_REF, help=f"the 'before' git ref (default {DEFAULT_REF})"
    )
    ap.add_argument(
        "--pairs", type=int, default=3, help="before/after pairs, alternated (default 3)"
    )
    ap.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    ap.add_argument("--backend", choices=("vllm", "sim"), default="vllm",
                    help="rollout engines: the example's vllm (default) or the sim engines")  # fmt: skip
    ap.add_argument(
        "--remove-ref", action="store_true", help="remove the ref's worktree at the end"
    )
    ap.add_argument("--smoke", action="store_true",
                    help="this tree on both sides (no worktree), sim engines, 1 pair of 2 steps")  # fmt: skip
    ap.add_argument("--work-dir", default=None, help="default: bench-results/e2e")
    ap.add_argument("--out", default=None, help="default: bench-results/e2e.json")
    a = ap.parse_args(argv)
    if a.smoke:
        a.pairs, a.steps, a.backend = 1, 2, "sim"
    if a.pairs < 1:
        ap.error(f"--pairs must be >= 1, got {a.pairs}")
    if a.steps < 2:
        ap.error(f"--steps must be >= 2 (rates are taken after step 1), got {a.steps}")
    work = Path(a.work_dir) if a.work_dir else ROOT / "bench-results" / "e2e"
    (work / "runs").mkdir(parents=True, exist_ok=True)
    head = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    after_cmd = staleflow_of(ROOT, Path(sys.executable).parent)
    ref_tree: Path | None = None
    if a.smoke:  # the parsing, the alternation and the table, not a second checkout
        trees = {"before": (ROOT, after_cmd), "after": (ROOT, after_cmd)}
        ref_sha = head
    else:
        ref_tree, ref_sha = prepare_ref(a.ref, work)
        trees = {"before": (ref_tree, staleflow_of(ref_tree, ref_tree / ".venv" / "bin")),
                 "after": (ROOT, after_cmd)}  # fmt: skip
    runs: list[dict[str, Any]] = []
    try:
        for pair in range(1, a.pairs + 1):
            for side in SIDES:
                tree, cmd = trees[side]
                name = f"{side}-{pair}"
                print(
                    f"[{time.strftime('%H:%M:%S')}] {name}: staleflow train from {tree}", flush=True
                )
                r = run_once(
                    cmd,
                    tree,
                    work / "runs" / name,
                    a.steps,
                    a.backend,
                    work / "runs" / f"{name}.log",
                )
                runs.append({"side": side, "pair": pair, **r})
                print(f"    trained {r['trained_tok_s']:.1f} tok/s, loop {r['loop_s']:.1f} s, "
                      f"process {r['process_s']:.1f} s", flush=True)  # fmt: skip
    finally:
        if a.remove_ref and ref_tree is not None:
            _git("worktree", "remove", "--force", str(ref_tree))
    cmp = compare(runs)
    res = {
        "smoke": a.smoke,
        "ref": a.ref,
        "ref_sha": ref_sha,
        "head_sha": head,
        "head_dirty": dirty,
        "backend": a.backend,
        "steps": a.steps,
        "pairs": a.pairs,
        "runs": runs,
        **cmp,
    }
    out = Path(a.out) if a.out else ROOT / "bench-results" / "e2e.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"before: {a.ref} ({ref_sha[:12]})   after: this tree ({head[:12]}{', modified' if dirty else ''})"
          f"   {a.backend} engines, {a.steps} steps, {a.pairs} pair(s); rates from step 1 to {a.steps}")  # fmt: skip
    print(table(runs, cmp))
    return res


if __name__ == "__main__":
    main()
