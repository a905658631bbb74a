"""The simulator against the real system on this machine: step time, tokens/s, staleness.

What it does, per staleness bound η (``--etas``, default 0, 1, 3):

1. **Profile and fit** (once): ``staleflow profile --instances 2`` on the config below
   (decode-step latency on a grid of running trajectories × KV tokens, the config's two
   vLLM-CPU engines decoding side by side as in training, with its sampling settings and one
   thread each), then ``staleflow fit-cost-model`` on it: the engines' cost model.
2. **A real run**: ``staleflow train`` on the config (Ray, 2 vLLM-CPU instances, the trajectory
   and parameter servers, the PyTorch trainer), ``--steps`` steps.
3. **Calibrate what is not the rollout** from that run's step records, over its measured steps
   (after ``--warmup``): the trainer's step time as ``a + b × tokens`` (least squares on
   ``train_s`` minus the push), the push (median ``trainer.push_s``), an instance's weight sync
   (median ``syncing`` span of the timeline), the model's bytes; and the workload: the mean
   prompt length, and every trained group's response lengths (the step records'
   ``response_lengths``) as a group trace, which the simulator resamples (each simulated group
   is one of them, drawn with replacement).
4. **Simulate** the same config (``staleflow simulate``, ``rollout.backend=sim``) with the fitted
   cost model as the engines' speed and the calibration above, same η, steps and seed.
5. **Compare** over the measured steps: mean step time, trained tokens/s and samples/s, and the
   staleness histogram of the trained samples (total variation distance between the two, 0 =
   same), each with the simulator's error against the real run.
6. **With η = 0 among the runs**, once more with the cost model scaled by the engines' pace in
   the real synchronous run: the factor at which the simulated η = 0 run waits for its batches
   as long as the real one (at η = 0 that wait is the rollout, with the control cycle and the
   syncs). It folds in what the profile of one idle engine does not see; the η = 0 row is then
   calibrated, the other rows are predictions.
7. **And as a shared host** (rows ``shared``): the scaled cost model again, with
   ``sim.host_cores`` = the cores this machine gives the run, and the trainer's time alone for
   every η — the η = 0 run's calibration, where the trainer computes while the engines wait
   for its weights. While the trainer computes beside the engines, every thread gets its share
   of the cores: the engines slow down and the trainer's step takes longer (at η ≥ 1 the two
   overlap; the calibrations of steps 3 and 6 hold each run's own trainer time, slowed as it
   was, and give the engines the whole host).
8. **And as a shared host with the threads it runs** (rows ``loaded``): step 7 with what the
   real η = 0 run kept runnable on the host over its measured steps, from ``/proc`` (each
   thread's time on a core and waiting for one, per process: every real run's is in its
   report, ``host_load``): ``sim.host_instance_threads``, an instance with work's engine and
   rollout actor over the instances with work on average, and ``sim.host_load_threads``,
   every other process but the trainer's (the control actor, the trajectory and parameter
   servers, the reward worker, Ray, the driver).

The config is ``examples/tiny.yaml`` with responses of up to ``MAX_NEW_TOKENS`` tokens (its 3
would leave nothing for the rollout model to predict). Predicted, not calibrated: everything
the rollout does (decode and its batching, routing, syncs' timing, interrupts, waiting for the
tail), the control cycle, and how they add up under η. Not modelled by the simulator: the
prefill of prompts (at most 16 tokens here; set to 0), reward scoring time, Ray and RPC
latencies between the processes, and (but in steps 7 and 8) that on this 2-core machine the
engines also share the CPU with the trainer, the control process, the trajectory server and
the reward worker (the profile measures the two engines alone).

    .venv/bin/python benchmarks/bench_sim_vs_real.py [--etas 0,1,3] [--steps 33] [--warmup 3]
    .venv/bin/python benchmarks/bench_sim_vs_real.py --smoke   # eta 1, 6 steps, 2 warm-up
    .venv/bin/python benchmarks/bench_sim_vs_real.py --keep DIR [--reuse]  # keep the runs;
        # --reuse: simulate again against the profile and real runs kept in DIR

Writes ``bench-results/sim_vs_real.json``. The target is the step time within 15 % at every η:
the report's ``met`` holds the verdict for the profile's cost model (the last line printed),
``met_shared`` and ``met_loaded`` for the shared-host rows (printed above them; None without an
η = 0 run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from proc_load import HostLoad

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "tiny.yaml"
MAX_NEW_TOKENS = 64
MAX_MODEL_LEN = 80  # 16 prompt tokens + 64
PACE_ROUNDS = 6  # fixed-point rounds for the pace factor (each one simulated run, < 1 s)
TARGET = 0.15  # step-time error the simulator aims for (the paper's cost model: 10.5 %)


def _common(run_dir: Path, eta: int, steps: int) -> list[str]:
    return [
        f"run_dir={run_dir}",
        f"protocol.eta={eta}",
        f"trainer.steps={steps}",
        f"rollout.sampling.max_new_tokens={MAX_NEW_TOKENS}",
        f"rollout.max_model_len={MAX_MODEL_LEN}",
        "run.checkpoint_every=0",
        "run.resume=never",  # a kept directory's earlier run is never taken for this one
        "metrics.tensorboard=false",
        "metrics.progress_bar=false",
    ]


def _cli(*args: str) -> None:
    from staleflow_trainer.cli import main

    rc = main(list(args))
    if rc != 0:
        raise RuntimeError(f"staleflow {' '.join(args[:2])} exited {rc}")


#: a process's role in a real run, by its title: an instance is its engine (``engines``) and
#: the rollout actor that turns the engine's steps into tokens (``actors``); what is none of
#: them nor the trainer is the load beside them (the control actor, the trajectory and
#: parameter servers, the reward worker, Ray's own processes, the driver)
ROLES = (
    ("VLLM::EngineCore", "engines"),
    ("ray::RolloutActor", "actors"),
    ("ray::TrainerActor", "trainer"),
)
ROLE_NAMES = ("engines", "actors", "trainer", "other")
HOST_LOAD = "host_load.json"  # in a real run's directory


def _role(name: str) -> str:
    return next((r for prefix, r in ROLES if name.startswith(prefix)), "other")


def real_run(run_dir: Path, eta: int, steps: int, warmup: int) -> None:
    """``staleflow train`` on the config, with what its processes used of the host over its
    measured steps (:class:`proc_load.HostLoad`) written to ``run_dir / HOST_LOAD``."""
    for old in (run_dir / "metrics.jsonl", run_dir / HOST_LOAD):  # an earlier run's (--keep)
        old.unlink(missing_ok=True)
    load = HostLoad(run_dir, warmup, steps)
    try:
        _cli("train", str(CONFIG), *_common(run_dir, eta, steps))
    finally:
        measured = load.result()
    (run_dir / HOST_LOAD).write_text(json.dumps(measured))


def host_load(run_dir: Path) -> dict[str, Any] | None:
    """What :func:`real_run` measured, with the sums per role (:data:`ROLE_NAMES`) of the
    processes' ``cores`` and ``runnable``; None for a run without it, or cut short."""
    f = run_dir / HOST_LOAD
    load = json.loads(f.read_text()) if f.exists() else None
    if load is None:
        return None
    roles = {r: [0.0, 0.0] for r in ROLE_NAMES}
    for name, (cores, runnable) in load["by_process"].items():
        roles[_role(name)][0] += cores
        roles[_role(name)][1] += runnable
    load["cores"] = {r: v[0] for r, v in roles.items()}
    load["runnable"] = {r: v[1] for r, v in roles.items()}
    return load


def host_threads(run_dir: Path, warmup: int) -> dict[str, float] | None:
    """The shared host's threads from a real run's load (:func:`host_load`; None without it):
    ``host_instance_threads``, what an instance with work kept runnable (its engine's and its
    rollout actor's threads over the instances with work on average, from the step records'
    ``instance_busy_frac``, weighted by the steps' times), and ``host_load_threads``, what the
    other processes but the trainer kept runnable."""
    load = host_load(run_dir)
    if load is None:
        return None
    rows = _records(run_dir, warmup)
    busy = sum(sum(r["instance_busy_frac"].values()) * r["step_s"] for r in rows) / sum(
        r["step_s"] for r in rows
    )
    n = load["runnable"]
    return {
        "host_instance_threads": round((n["engines"] + n["actors"]) / max(busy, 1e-9), 3),
        "host_load_threads": round(n["other"], 3),
    }


def fit_cost_model(work: Path) -> Path:
    """Profile the config's engines side by side, as a training run starts them, and fit the
    cost model; the JSON's path."""
    from staleflow_trainer.config import load_config
    from staleflow_trainer.profiling import profile

    cfg = load_config(CONFIG, _common(work / "profile", 1, 1))
    if profile(cfg, steps=32, instances=cfg.rollout.num_instances) != 0:
        raise RuntimeError("staleflow profile failed")
    out = work / "cost_model.json"
    _cli("fit-cost-model", str(work / "profile" / "profile.jsonl"), "-o", str(out))
    return out


def _records(run_dir: Path, warmup: int) -> list[dict[str, Any]]:
    from staleflow_trainer.report.metrics import read_jsonl

    measured = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] > warmup]
    if not measured:
        raise RuntimeError(f"{run_dir}: no steps after the {warmup} warm-up steps")
    return measured


def calibrate(run_dir: Path, warmup: int, work: Path) -> dict[str, Any]:
    """The simulator settings a real run's measured steps give (see the module docstring)."""
    from staleflow_trainer.report.metrics import read_jsonl

    rows = _records(run_dir, warmup)
    tokens = np.array([r["tokens"] for r in rows], dtype=float)
    push = np.array([r["trainer"].get("push_s", 0.0) for r in rows], dtype=float)
    train = np.array([r["train_s"] for r in rows], dtype=float) - push
    if np.ptp(tokens) > 0:
        b, a = np.polyfit(tokens, train, 1)
    else:
        b, a = 0.0, float(train.mean())
    # least squares under a >= 0 and b >= 0: refit the intercept with b >= 0, and
    # if it is still negative, refit the slope through the origin
    b = max(float(b), 0.0)
    a = float(np.mean(train - b * tokens))
    if a < 0:
        a, b = 0.0, float(tokens @ train / (tokens @ tokens))
    first = rows[0]["time_s"] - rows[0]["step_s"]
    spans = [
        t["end_s"] - t["start_s"]
        for t in read_jsonl(run_dir / "timeline.jsonl")
        if t["state"] == "syncing" and t["start_s"] >= first
    ]
    model_bytes = sum(p.stat().st_size for p in (run_dir / "model").glob("*.safetensors"))
    overhead = float(np.median(push)) if len(push) else 0.0
    sync_s = float(np.median(spans)) if spans else overhead
    trace = work / f"groups-{run_dir.name}.jsonl"
    with trace.open("w") as f:
        for r in rows:
            for g in r["response_lengths"]:
                f.write(json.dumps({"lengths": [max(1, int(n)) for n in g]}) + "\n")
    prompt = sum(r["tokens"] - r["response_tokens"] for r in rows) / sum(r["samples"] for r in rows)
    return {
        "prompt_len": max(1, round(prompt)),
        "trainer_time_a_s": a,
        "trainer_time_b_s_per_token": b,
        "transfer_overhead_s": overhead,
        "sync_s": sync_s,
        "syncs_measured": len(spans),
        "model_bytes": model_bytes,
        # the push is the overhead alone; a pull takes the measured sync span
        "push_bandwidth_gb_s": 1e6,
        "pull_bandwidth_gb_s": model_bytes / max(sync_s - overhead, 1e-4) / 1e9,
        "trace": str(trace),
    }


def _kv_capacity_tokens() -> int:
    """The real engines' KV capacity: the whole GiB ``prepare.engine_kwargs`` gives vLLM-CPU
    over the tiny model's bytes per token: layers × KV heads × head size × 2 (K, V) × the
    element size of ``model.dtype``. (It never binds here: 64 responses of at most 80 tokens.)"""
    import torch

    from staleflow_trainer.config import load_config
    from staleflow_trainer.runtime.prepare import engine_kwargs

    cfg = load_config(CONFIG, [])
    t = cfg.model.tiny
    width = torch.empty(0, dtype=getattr(torch, cfg.model.dtype)).element_size()
    per_token = t.num_layers * t.num_kv_heads * (t.hidden_size // t.num_heads) * 2 * width
    return int(engine_kwargs(cfg, 0, ROOT)["cpu_kv_cache_gib"]) * (1 << 30) // per_token


def simulate(run_dir: Path, eta: int, steps: int, warmup: int, cost: Path,
             cal: dict[str, Any], *extra: str) -> None:  # fmt: skip
    _cli(
        "simulate",
        str(CONFIG),
        *_common(run_dir, eta, steps),
        "rollout.backend=sim",
        f"sim.cost_model={cost}",
        "sim.total_gpus=3",
        "sim.train_gpus=1",
        f"sim.kv_capacity_tokens={_kv_capacity_tokens()}",
        "sim.prefill_s_per_token=0",
        "sim.prefill_s_per_token_position=0",
        "sim.trainer_model=linear",
        f"sim.trainer_time_a_s={cal['trainer_time_a_s']}",
        f"sim.trainer_time_b_s_per_token={cal['trainer_time_b_s_per_token']}",
        f"sim.model_bytes={cal['model_bytes']}",
        f"sim.push_bandwidth_gb_s={cal['push_bandwidth_gb_s']}",
        f"sim.pull_bandwidth_gb_s={cal['pull_bandwidth_gb_s']}",
        f"sim.transfer_overhead_s={cal['transfer_overhead_s']}",
        f"sim.warmup_steps={warmup}",
        "sim.workload.kind=group_trace",
        f"sim.workload.prompt_len={cal['prompt_len']}",
        "sim.workload.prompt_len_sigma=0",
        f"sim.workload.trace_path={cal['trace']}",
        *extra,
    )


def _alone(cal: dict[str, Any], sync_cal: dict[str, Any]) -> dict[str, Any]:
    """``cal`` with the trainer's time alone: the η = 0 run's (``sync_cal``) fit."""
    keys = ("trainer_time_a_s", "trainer_time_b_s_per_token")
    return {**cal, **{k: sync_cal[k] for k in keys}}


def _scaled(work: Path, fitted: dict[str, Any], factor: float) -> Path:
    """The fitted cost model with every coefficient times ``factor`` (a slower engine)."""
    out = work / f"cost_model_x{factor:.4f}.json"
    coef = {k: fitted[k] * factor for k in ("k1", "k2", "k3", "k4", "b")}
    out.write_text(json.dumps({**fitted, **coef}))
    return out


def pace_factor(work: Path, steps: int, warmup: int, fitted: dict[str, Any],
                sync_run: tuple[dict[str, Any], dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """The factor on the fitted cost model at which the simulated η = 0 run waits for its
    batches as long as the real one did (at η = 0 the trainer's wait is the rollout, with the
    control cycle and the syncs, which the factor does not scale: a few fixed-point rounds).
    Returns the factor, the rounds run and the last round's real ÷ simulated wait (1 within
    2 %: converged)."""
    real, cal = sync_run
    factor, ratio, rounds = 1.0, float("nan"), 0
    for i in range(PACE_ROUNDS):
        d = work / f"sim-pace-{i}"
        simulate(d, 0, steps, warmup, _scaled(work, fitted, factor), cal)
        ratio = real["wait_s"] / max(measure(d, warmup)["wait_s"], 1e-9)
        rounds = i + 1
        if abs(ratio - 1) < 0.02:
            break
        factor *= ratio
    return {"factor": factor, "rounds": rounds, "last_wait_ratio": ratio,
            "converged": abs(ratio - 1) < 0.02}  # fmt: skip


def measure(run_dir: Path, warmup: int) -> dict[str, Any]:
    """Mean step time, trained tokens/s and the staleness histogram over the measured steps."""
    rows = _records(run_dir, warmup)
    hist: dict[str, int] = {}
    for r in rows:
        for k, v in r["staleness_hist"].items():
            hist[k] = hist.get(k, 0) + int(v)
    return {
        "steps": len(rows),
        "step_s": statistics.fmean(r["step_s"] for r in rows),
        "wait_s": statistics.fmean(r["trainer_wait_s"] for r in rows),
        "train_s": statistics.fmean(r["train_s"] for r in rows),
        # trajectories interrupted (migrations, bounces, protocol aborts) a step
        "interrupts": statistics.fmean(r["interrupts"] for r in rows),
        "tokens_per_s": sum(r["tokens"] for r in rows) / sum(r["step_s"] for r in rows),
        "samples_per_s": sum(r["samples"] for r in rows) / sum(r["step_s"] for r in rows),
        "staleness_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
    }


def _tv(a: dict[str, int], b: dict[str, int]) -> float:
    """Total variation distance between two histograms (0: the same shares, 1: disjoint)."""
    na, nb = sum(a.values()) or 1, sum(b.values()) or 1
    return 0.5 * sum(abs(a.get(k, 0) / na - b.get(k, 0) / nb) for k in set(a) | set(b))


def compare(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, float]:
    return {
        "step_s_error": sim["step_s"] / real["step_s"] - 1,
        "tokens_per_s_error": sim["tokens_per_s"] / real["tokens_per_s"] - 1,
        "samples_per_s_error": sim["samples_per_s"] / real["samples_per_s"] - 1,
        "staleness_tv": _tv(real["staleness_hist"], sim["staleness_hist"]),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--etas", default="0,1,3", help="staleness bounds, comma list")
    ap.add_argument("--steps", type=int, default=33, help="training steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of every figure")
    ap.add_argument("--smoke", action="store_true", help="eta 1, 6 steps, 2 warm-up")
    ap.add_argument("--out", default=None, help="default: bench-results/sim_vs_real.json")
    ap.add_argument("--keep", default=None, help="keep the runs in this directory (default: a "
                    "temporary one, removed)")  # fmt: skip
    ap.add_argument("--reuse", action="store_true", help="with --keep: reuse the cost model "
                    "and the real runs found there (simulate again only)")  # fmt: skip
    a = ap.parse_args(argv)
    if a.reuse and not a.keep:
        ap.error("--reuse needs --keep DIR (where the earlier runs are)")
    etas = [1] if a.smoke else [int(x) for x in a.etas.split(",") if x]
    steps, warmup = (6, 2) if a.smoke else (a.steps, a.warmup)
    if not etas or any(e < 0 for e in etas):
        ap.error(f"--etas needs staleness bounds >= 0, got {a.etas!r}")
    if warmup < 0 or steps <= warmup:
        ap.error(f"--steps ({a.steps}) must exceed --warmup ({a.warmup}), which must be >= 0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-sim-vs-real-") as d:
        work = Path(a.keep or d)
        cost = work / "cost_model.json"
        if not (a.reuse and cost.exists()):
            cost = fit_cost_model(work)
        fitted = json.loads(cost.read_text())
        runs = {}
        for eta in etas:
            real_dir, sim_dir = work / f"real-eta{eta}", work / f"sim-eta{eta}"
            if not (a.reuse and (real_dir / "summary.json").exists()):
                real_run(real_dir, eta, steps, warmup)
            cal = calibrate(real_dir, warmup, work)
            simulate(sim_dir, eta, steps, warmup, cost, cal)
            runs[eta] = (measure(real_dir, warmup), cal)
            real, sim = runs[eta][0], measure(sim_dir, warmup)
            rows.append({"eta": eta, "real": real, "sim": sim, "calibration": cal,
                         "host_load": host_load(real_dir), **compare(real, sim)})  # fmt: skip
        pace: dict[str, Any] | None = None
        if 0 in runs:  # the engines' real pace here, from the synchronous run (see the docstring)
            pace = pace_factor(work, steps, warmup, fitted, runs[0])
            scaled = _scaled(work, fitted, pace["factor"])
            from staleflow_trainer.runtime.prepare import effective_cpus

            host = effective_cpus()
            threads = host_threads(work / "real-eta0", warmup)
            for row in rows:
                eta = row["eta"]
                simulate(work / f"sim-scaled-eta{eta}", eta, steps, warmup, scaled, runs[eta][1])
                sim = measure(work / f"sim-scaled-eta{eta}", warmup)
                row["scaled"] = {"sim": sim, **compare(row["real"], sim)}
                cal = _alone(runs[eta][1], runs[0][1])
                d = work / f"sim-shared-eta{eta}"
                simulate(d, eta, steps, warmup, scaled, cal, f"sim.host_cores={host}")
                sim = measure(d, warmup)
                row["shared"] = {"sim": sim, "host_cores": host, **compare(row["real"], sim)}
                if threads is None:
                    continue
                d = work / f"sim-loaded-eta{eta}"
                simulate(d, eta, steps, warmup, scaled, cal, f"sim.host_cores={host}",
                         *(f"sim.{k}={v}" for k, v in threads.items()))  # fmt: skip
                sim = measure(d, warmup)
                row["loaded"] = {"sim": sim, "host_cores": host, **threads,
                                 **compare(row["real"], sim)}  # fmt: skip
        for row in rows:
            row["calibration"].pop("trace")
    worst = max(abs(r["step_s_error"]) for r in rows)
    res = {
        "smoke": a.smoke,
        "steps": steps,
        "warmup": warmup,
        "cost_model": {k: fitted[k] for k in ("k1", "k2", "k3", "k4", "b") if k in fitted},
        "speed_factor": None if pace is None else pace["factor"],
        "pace_fit": pace,
        "rows": rows,
        "target_step_s_error": TARGET,
        "met": worst <= TARGET,
        "met_shared": None
        if pace is None
        else all(abs(r["shared"]["step_s_error"]) <= TARGET for r in rows),
        "met_loaded": None
        if pace is None or any("loaded" not in r for r in rows)
        else all(abs(r["loaded"]["step_s_error"]) <= TARGET for r in rows),
    }
    out = Path(a.out) if a.out else ROOT / "bench-results" / "sim_vs_real.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    _print(res)
    return res


def _row(label: str, re: dict[str, Any], si: dict[str, Any], c: dict[str, Any]) -> str:
    return (f"{label:>10} {re['step_s']:>11.3f} {si['step_s']:>7.3f} {c['step_s_error']:>+7.1%} "
            f"{re['tokens_per_s']:>10.0f} {si['tokens_per_s']:>7.0f} "
            f"{c['tokens_per_s_error']:>+7.1%} {c['samples_per_s_error']:>+9.1%} "
            f"{c['staleness_tv']:>8.2f}  {re['staleness_hist']} | {si['staleness_hist']}")  # fmt: skip


def _print(res: dict[str, Any]) -> None:
    print(f"{res['steps'] - res['warmup']} measured steps after {res['warmup']} warm-up; "
          f"cost model fitted on this machine: {res['cost_model']}")  # fmt: skip
    print(f"{'eta':>10} {'step s real':>11} {'sim':>7} {'error':>7} {'tok/s real':>10} "
          f"{'sim':>7} {'error':>7} {'smp/s err':>9} {'stale TV':>8}  staleness real | sim")  # fmt: skip
    for r in res["rows"]:
        print(_row(f"{r['eta']}", r["real"], r["sim"], r))
    if res["speed_factor"] is not None:
        p = res["pace_fit"]
        print(f"the profile's cost model x {res['speed_factor']:.2f} (the engines' pace in the "
              f"eta = 0 run, {'converged' if p['converged'] else 'NOT converged'} in "
              f"{p['rounds']} rounds; that row is calibrated, the others predicted):")  # fmt: skip
        for r in res["rows"]:
            print(_row(f"{r['eta']} scaled", r["real"], r["scaled"]["sim"], r["scaled"]))
        cores = res["rows"][0]["shared"]["host_cores"]
        print(f"as a shared host ({cores} cores; the trainer's time alone, from the eta = 0 "
              f"run; step time within {res['target_step_s_error']:.0%} at every eta: "
              f"{'MET' if res['met_shared'] else 'MISSED'}):")  # fmt: skip
        for r in res["rows"]:
            print(_row(f"{r['eta']} shared", r["real"], r["shared"]["sim"], r["shared"]))
        if res["met_loaded"] is not None:
            x = res["rows"][0]["loaded"]
            print(f"as a shared host with the threads runnable in the eta = 0 run: "
                  f"{x['host_instance_threads']:.2f} an instance with work, "
                  f"{x['host_load_threads']:.2f} beside the instances and the trainer "
                  f"(step time within {res['target_step_s_error']:.0%} at every eta: "
                  f"{'MET' if res['met_loaded'] else 'MISSED'}):")  # fmt: skip
            for r in res["rows"]:
                print(_row(f"{r['eta']} loaded", r["real"], r["loaded"]["sim"], r["loaded"]))
    for r in res["rows"]:
        u = r["host_load"]
        if u is not None:
            c, n = u["cores"], u["runnable"]
            print(f"eta {r['eta']} real run over {u['window_s']:.1f} s of measured steps, cores "
                  f"used (threads runnable): "
                  + ", ".join(f"{k} {c[k]:.2f} ({n[k]:.2f})" for k in ROLE_NAMES))  # fmt: skip
            top = list(u["by_process"].items())[:8]
            print("  by process: " + ", ".join(f"{k} {v[0]:.2f} ({v[1]:.2f})" for k, v in top))
    for r in res["rows"]:
        c = r["calibration"]
        print(f"eta {r['eta']} calibration: trainer {c['trainer_time_a_s']:.3f} s + "
              f"{c['trainer_time_b_s_per_token'] * 1e6:.1f} us/token, push "
              f"{c['transfer_overhead_s']:.3f} s, sync {c['sync_s']:.3f} s "
              f"({c['syncs_measured']} measured), prompts {c['prompt_len']} tokens")  # fmt: skip
    worst = max(abs(r["step_s_error"]) for r in res["rows"])
    print(f"target (step time within {res['target_step_s_error']:.0%} at every eta, the "
          f"profile's cost model): {'MET' if res['met'] else 'MISSED'} -- worst error "
          f"{worst:.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
