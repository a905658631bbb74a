"""The convergence study: does the staleness bound preserve learning?

Runs ``staleflow train`` (the whole system: Ray, 2 vLLM-CPU rollout instances, NIXL parameter
server, StaleFlow coordinator) once per (setting, seed), one deployment at a time, on
``examples/convergence.yaml``. Settings: η ∈ {0, 1, 3, 10} and "unbounded" with truncated
importance sampling (TIS), and η = 3 without TIS. "unbounded" is no staleness control
(``protocol.eta=unbounded``: a FIFO instead of the protocol, greedy global sync with
``coordinator.policy=all-vanilla``); the others run StaleFlow's coordinator. The *slow-trainer*
settings (``--settings slow``) run the same deployment with ``trainer.step_delay_s`` (the
trainer slower than the rollout, so that without a bound staleness keeps growing): η = 1,
η = 3, "unbounded", and η = 3 under the ``coarse-async-drop`` baseline. Every run consumes the
same number of samples (``trainer.steps × B × n``) and seed ``s`` means the same initial model
and prompt order in every setting.

Writes ``results/convergence/summary.json`` (one entry per run, see :func:`run_entry`),
``reward_vs_samples.png``, ``staleness_hist.png`` and ``policy_reward.png``; each run's own
directory (``--runs-dir``) keeps its metrics.jsonl, summary.json and log.

    python benchmarks/convergence_study.py                       # the full study (~22-45 min here)
    python benchmarks/convergence_study.py --seeds 0 --settings eta0,eta3 --steps 20
    python benchmarks/convergence_study.py --plots-only          # re-aggregate existing runs
    python benchmarks/convergence_study.py --settings slow       # only the slow-trainer group

Runs of settings or seeds not in this invocation stay in ``summary.json`` as they were.

Runs go seed-major (every setting at seed 0, then seed 1, ...) so a study cut short by
``--budget-s`` still covers every setting; runs that were not started are listed in the summary
with ``"status": "not_run"``, failed ones with ``"status": "failed"`` — nothing is skipped
silently. ``--reuse`` keeps a finished run whose run directory already matches the request.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from staleflow_trainer.config import FIFO_POLICIES
from staleflow_trainer.runtime.prepare import WORKER_ENV

# its sibling module, also when this file is loaded by path (not run as a script)
if (_HERE := str(Path(__file__).resolve().parent)) not in sys.path:
    sys.path.insert(0, _HERE)
import convergence_plots as plots

ROOT = Path(__file__).resolve().parents[1]


def repo_path(path: Path) -> str:
    """``path`` as results record it: relative to the repository root where it lies inside
    it (the same on every checkout), else as given."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


CONFIG = ROOT / "examples" / "convergence.yaml"
OUT = ROOT / "results" / "convergence"
RUN_TIMEOUT_S = 15 * 60
EVAL_SAMPLES = 200  # per distinct prompt, for the final-policy evaluation
# what every process of a run is given (one list: the app's), plus a 1 GiB vLLM KV cache
ENV = {**WORKER_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}


#: ``trainer.step_delay_s`` of the slow-trainer settings: the trainer step (~0.3 s of compute)
#: becomes several times a batch's rollout time (~0.3 s on an idle machine, ~1.2 s on a loaded
#: one), so without a bound the rollout runs ahead and the FIFO of finished groups (and with it
#: staleness) grows all run long.
SLOW_STEP_DELAY_S = 2.0


@attrs.frozen(kw_only=True)
class Setting:
    name: str
    eta: int | str  # an int, or "unbounded"
    tis: bool
    label: str
    policy: str = "staleflow"  # coordinator.policy
    step_delay_s: float = 0.0  # trainer.step_delay_s
    study: str = "base"  # "base" (the deployment as configured) or "slow" (a slower trainer)


def _slow(name: str, eta: int | str, label: str, policy: str = "staleflow") -> Setting:
    return Setting(name=f"slow-{name}", eta=eta, tis=True, label=f"{label}, slow trainer",
                   policy=policy, step_delay_s=SLOW_STEP_DELAY_S, study="slow")  # fmt: skip


SETTINGS = (
    Setting(name="eta0", eta=0, tis=True, label="η=0 (synchronous)"),
    Setting(name="eta1", eta=1, tis=True, label="η=1"),
    Setting(name="eta3", eta=3, tis=True, label="η=3"),
    Setting(name="eta10", eta=10, tis=True, label="η=10"),
    # no staleness control (UnboundedFifo): FIFO consumption, 2 batches in flight, greedy sync
    Setting(name="unbounded", eta="unbounded", tis=True, label="unbounded", policy="all-vanilla"),
    Setting(name="eta3-notis", eta=3, tis=False, label="η=3, no TIS"),
    # the same deployment with a trainer slower than the rollout (trainer.step_delay_s)
    _slow("eta1", 1, "η=1"),
    _slow("eta3", 3, "η=3"),
    _slow("unbounded", "unbounded", "unbounded", "all-vanilla"),
    # strict async that keeps η by dropping what ages out (GcFifo), against StaleFlow at η=3
    _slow("drop-eta3", 3, "η=3 coarse-async-drop", "coarse-async-drop"),
)
BY_NAME = {s.name: s for s in SETTINGS}


# ----------------------------------------------------------------------------- one run


def overrides(setting: Setting, seed: int, steps: int, run_dir: Path) -> list[str]:
    return [
        f"run_dir={run_dir}",
        f"trainer.steps={steps}",
        f"protocol.eta={setting.eta}",
        f"coordinator.policy={setting.policy}",
        f"trainer.use_tis={'true' if setting.tis else 'false'}",
        f"trainer.step_delay_s={setting.step_delay_s}",
        f"run.seed={seed}",
        "run.resume=never",
        # a FIFO has no buffer to get stuck (the config's threshold is for the buffers)
        *(["protocol.stuck_threshold=0"] if fifo_protocol(setting) else []),
    ]


def fifo_protocol(setting: Setting) -> bool:
    """Whether the setting runs over one FIFO (eta unbounded, a FIFO baseline)."""
    return setting.eta == "unbounded" or setting.policy in FIFO_POLICIES


def staleflow_command() -> list[str]:
    """The ``staleflow`` console script of this interpreter's environment."""
    script = Path(sys.executable).with_name("staleflow")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "staleflow_trainer.cli"]


def run_train(
    setting: Setting, seed: int, steps: int, run_dir: Path, config: Path, timeout_s: float
) -> tuple[int, float, str]:
    """``staleflow train`` in a subprocess; (exit code, wall seconds, log path)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "train.log"
    for stale in ("metrics.jsonl", "summary.json"):
        (run_dir / stale).unlink(missing_ok=True)
    cmd = [*staleflow_command(), "train", str(config), *overrides(setting, seed, steps, run_dir)]
    t0 = time.monotonic()
    with log_path.open("w") as log:
        try:
            rc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                env={**os.environ, **ENV}, check=False,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.monotonic() - t0, str(log_path)


# ------------------------------------------------------------------------------ metrics


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def window(steps: int) -> int:
    """Steps averaged for reward_start / reward_end: the first / last tenth (at least 3)."""
    return max(3, steps // 10)


def staleness_hist(rows: Sequence[dict[str, Any]]) -> dict[int, int]:
    hist: dict[int, int] = {}
    for r in rows:
        for s, c in r["staleness_hist"].items():
            hist[int(s)] = hist.get(int(s), 0) + int(c)
    return dict(sorted(hist.items()))


def run_stats(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Reward and staleness numbers of one run's metrics.jsonl (rows in step order).

    ``reward_*`` are the mean reward of the *consumed* batches (what the trainer learned from,
    generated by possibly stale policies); ``reward_auc`` is the mean over all steps, i.e. the
    area under reward-vs-consumed-samples divided by the samples consumed."""
    rewards = [float(r["reward_mean"]) for r in rows]
    w = window(len(rows))
    hist = staleness_hist(rows)
    n = sum(hist.values())
    tokens = sum(int(r.get("tokens", 0)) for r in rows)
    response = sum(int(r.get("response_tokens", 0)) for r in rows)
    generated = sum(int(r.get("gen_tokens", 0)) for r in rows)
    loop_s = float(rows[-1]["time_s"]) if rows else 0.0
    return {
        "steps": len(rows),
        "reward_start": sum(rewards[:w]) / w,
        "reward_end": sum(rewards[-w:]) / w,
        "reward_auc": sum(rewards) / len(rewards),
        "max_staleness": max(hist),
        "mean_staleness": sum(s * c for s, c in hist.items()) / n,
        "tokens_per_s": tokens / loop_s if loop_s > 0 else 0.0,
        "staleness_hist": {str(k): v for k, v in hist.items()},
        "staleness_by_step": [round(float(r["mean_staleness"]), 3) for r in rows],
        "max_staleness_by_step": [int(r["max_staleness"]) for r in rows],
        "response_tokens": response,
        "generated_tokens": generated,
        "response_tokens_per_sample": response / n,
        "rewards": rewards,
        "samples_per_step": n // len(rows),
    }


def eval_prompts(task: str, tok: Any, max_prompt_len: int) -> tuple[list[Any], list[Any]]:
    """Every distinct prompt of a toy task, in prompt order: (records, encoded prompts) — the
    set both the study's and the recipe check's policy evaluations score."""
    from staleflow_trainer.data import encode_prompts, toy_records

    distinct = {r.prompt: r for r in toy_records(task, size=1000, seed=0)}
    records = [distinct[p] for p in sorted(distinct)]
    return records, encode_prompts(records, tok, max_prompt_len=max_prompt_len)


def policy_reward(run_dir: Path, *, final: bool, seed: int = 1234) -> float | None:
    """Expected toy reward of the initial (``final=False``) or the final trained policy,
    sampled at the rollout temperature with the plain-HF sampler: every distinct prompt of the
    run's toy task, ``EVAL_SAMPLES`` samples each. The consumed-batch reward cannot show this
    for stale settings (their batches come from old policies)."""
    import torch
    from transformers import AutoModelForCausalLM

    from staleflow_trainer.config import load_config
    from staleflow_trainer.data import toy_score
    from staleflow_trainer.tiny_model import EOS_ID, make_char_tokenizer
    from staleflow_trainer.trainer.checkpoint import load_torch
    from staleflow_trainer.trainer.local_rollout import sample_responses

    cfg = load_config(run_dir / "config.yaml", [])
    model = AutoModelForCausalLM.from_pretrained(str(run_dir / "model"), dtype=torch.float32)
    if final:
        latest = run_dir / "checkpoints" / "latest"
        if not latest.is_file():
            return None
        payload = load_torch(latest.parent / latest.read_text().strip() / "trainer.pt")
        model.load_state_dict(payload["model"], strict=False)
        model.tie_weights()
    tok = make_char_tokenizer()
    records, prompts = eval_prompts(cfg.data.toy_task, tok, cfg.data.max_prompt_len)
    gen = torch.Generator().manual_seed(seed)
    out = sample_responses(
        model,
        prompts,
        n=EVAL_SAMPLES,
        max_new_tokens=cfg.rollout.sampling.max_new_tokens,
        eos_id=EOS_ID,
        temperature=cfg.rollout.sampling.temperature,
        generator=gen,
    )
    scores = [
        toy_score(
            tok.decode(list(r.response_ids), skip_special_tokens=True),
            records[i // EVAL_SAMPLES].ground_truth,
        )
        for i, r in enumerate(out)
    ]
    return sum(scores) / len(scores)


def run_entry(
    setting: Setting, seed: int, run_dir: Path, *, wall_s: float | None, status: str, note: str = ""
) -> dict[str, Any]:
    """One summary.json entry. The fields the issue asks for come first; ``status`` is ok |
    failed | not_run; failed and not-run runs carry nulls."""
    entry: dict[str, Any] = {
        "setting": setting.name,
        "eta": setting.eta,
        "tis": setting.tis,
        "seed": seed,
        "reward_start": None,
        "reward_end": None,
        "reward_auc": None,
        "max_staleness": None,
        "mean_staleness": None,
        "tokens_per_s": None,
        "wall_s": None if wall_s is None else round(wall_s, 1),
        "status": status,
        "run_dir": repo_path(run_dir),
    }
    if note:
        entry["note"] = note
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if status == "ok" and rows:
        stats = run_stats(rows)
        entry.update(stats)
        entry["policy_reward_start"] = policy_reward(run_dir, final=False)
        entry["policy_reward_end"] = policy_reward(run_dir, final=True)
        summary = run_dir / "summary.json"
        if summary.is_file():
            s = json.loads(summary.read_text())
            entry["counters"] = {
                k: s["counters"].get(k, 0) for k in ("syncs", "migrations", "interrupts", "aborts")
            }
            entry["dropped_reasons"] = dict(s.get("ledger", {}).get("dropped_reasons", {}))
            entry["ledger_problems"] = len(s.get("ledger", {}).get("problems", []))
    return entry


def finished_run_matches(run_dir: Path, setting: Setting, seed: int, steps: int) -> bool:
    """True when ``run_dir`` holds a finished run of exactly this request (for ``--reuse``)."""
    cfg_path, summary = run_dir / "config.yaml", run_dir / "summary.json"
    if not (cfg_path.is_file() and summary.is_file()):
        return False
    import yaml

    cfg = yaml.safe_load(cfg_path.read_text())
    done = json.loads(summary.read_text()).get("steps_done")
    return (
        done == steps
        and str(cfg["protocol"]["eta"]) == str(setting.eta)
        and bool(cfg["trainer"]["use_tis"]) == setting.tis
        and cfg["coordinator"]["policy"] == setting.policy
        and float(cfg["trainer"].get("step_delay_s", 0.0)) == setting.step_delay_s
        and int(cfg["run"]["seed"]) == seed
    )


# --------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--settings",
        default=",".join(s.name for s in SETTINGS),
        help="comma-separated; 'base' / 'slow' = every setting of that group",
    )
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "convergence")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--budget-s", type=float, default=60 * 60, help="start no run after this")
    ap.add_argument("--run-timeout-s", type=float, default=RUN_TIMEOUT_S)
    ap.add_argument("--reuse", action="store_true", help="keep finished matching runs")
    ap.add_argument("--plots-only", action="store_true", help="re-aggregate existing runs")
    args = ap.parse_args(argv)

    groups = {g: [s.name for s in SETTINGS if s.study == g] for g in ("base", "slow")}
    names = [m for n in args.settings.split(",") for m in groups.get(n, [n])]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"--settings: unknown {unknown}; choose from {[*groups, *BY_NAME]}")
    settings = [BY_NAME[n] for n in names]
    seeds = [int(s) for s in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    entries: list[dict[str, Any]] = []
    for seed in seeds:
        for setting in settings:
            run_dir = args.runs_dir / f"{setting.name}-seed{seed}"
            tag = f"{setting.name} seed {seed}"
            if args.plots_only or (
                args.reuse and finished_run_matches(run_dir, setting, seed, args.steps)
            ):
                done = finished_run_matches(run_dir, setting, seed, args.steps)
                wall = None
                if done:
                    wall = json.loads((run_dir / "summary.json").read_text()).get("study_wall_s")
                entries.append(
                    run_entry(
                        setting, seed, run_dir, wall_s=wall, status="ok" if done else "not_run"
                    )
                )
                print(f"[reuse] {tag}: {entries[-1]['status']}", flush=True)
                continue
            if time.monotonic() - t0 > args.budget_s:
                entries.append(
                    run_entry(
                        setting,
                        seed,
                        run_dir,
                        wall_s=None,
                        status="not_run",
                        note=f"study budget of {args.budget_s:.0f} s spent",
                    )
                )
                print(f"[skip ] {tag}: budget spent", flush=True)
                continue
            print(f"[run  ] {tag} ...", flush=True)
            rc, wall, log = run_train(
                setting, seed, args.steps, run_dir, args.config, args.run_timeout_s
            )
            ok = rc == 0 and (run_dir / "summary.json").is_file()
            if ok:  # remember the subprocess wall time beside the run's own summary
                s = json.loads((run_dir / "summary.json").read_text())
                s["study_wall_s"] = wall
                (run_dir / "summary.json").write_text(json.dumps(s, indent=1))
            note = "" if ok else f"staleflow train exited {rc}; see {log}"
            entries.append(
                run_entry(
                    setting, seed, run_dir, wall_s=wall, status="ok" if ok else "failed", note=note
                )
            )
            e = entries[-1]
            print(
                f"[done ] {tag}: status={e['status']} wall={wall:.0f}s "
                f"reward {e['reward_start']} -> {e['reward_end']} "
                f"policy {e.get('policy_reward_start')} -> {e.get('policy_reward_end')} "
                f"staleness max={e['max_staleness']} mean={e['mean_staleness']}",
                flush=True,
            )
            write(entries, args.out)  # after every run: a cut-short study keeps what ran
    write(entries, args.out)
    print(plots.setting_table(entries, SETTINGS))
    print(plots.run_table(entries, SETTINGS))
    print(f"study wall time: {time.monotonic() - t0:.0f} s")
    return 0 if all(e["status"] == "ok" for e in entries) else 1


def write(entries: Sequence[dict[str, Any]], out: Path) -> None:
    """``summary.json``, ``reward_curves.json``, ``table.md`` and the figures. Runs of other
    settings or seeds already in ``out`` are kept (a study of one group does not erase the
    other's results); a run of this study replaces the stored one of its setting and seed."""
    mine = {(e["setting"], e["seed"]) for e in entries}
    kept: list[dict[str, Any]] = []
    old_summary, old_curves = out / "summary.json", out / "reward_curves.json"
    if old_summary.is_file():
        curves = json.loads(old_curves.read_text()) if old_curves.is_file() else {}
        for e in json.loads(old_summary.read_text()):
            key = f"{e['setting']}-seed{e['seed']}"
            if (e["setting"], e["seed"]) not in mine and e["setting"] in BY_NAME:
                kept.append({**e, **({"rewards": curves[key]} if key in curves else {})})
    order = {s.name: i for i, s in enumerate(SETTINGS)}
    every = sorted([*kept, *entries], key=lambda e: (e["seed"], order[e["setting"]]))
    slim = [{k: v for k, v in e.items() if k != "rewards"} for e in every]
    curves = {f"{e['setting']}-seed{e['seed']}": e["rewards"] for e in every if "rewards" in e}
    out.mkdir(parents=True, exist_ok=True)
    old_summary.write_text(json.dumps(slim, indent=1) + "\n")
    old_curves.write_text(json.dumps(curves) + "\n")
    if any(e["status"] == "ok" for e in every):
        draw(every, out)
    (out / "table.md").write_text(
        plots.setting_table(every, SETTINGS) + "\n\n" + plots.run_table(every, SETTINGS) + "\n\n"
        + plots.trained_table(every, [BY_NAME["slow-eta3"], BY_NAME["slow-drop-eta3"]]) + "\n"
    )  # fmt: skip


def draw(entries: Sequence[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    base = [s for s in SETTINGS if s.study == "base"]
    slow = [s for s in SETTINGS if s.study == "slow"]
    system = "staleflow train, 2 vLLM-CPU instances, toy copy task"
    paths = [
        plots.plot_rewards(entries, base, out / "reward_vs_samples.png",
                           title=f"Reward vs consumed samples ({system})"),
        plots.plot_staleness(entries, base, out / "staleness_hist.png", grid=(2, 3)),
        plots.plot_policy(entries, SETTINGS, out / "policy_reward.png"),
    ]  # fmt: skip
    if not any(e["status"] == "ok" and BY_NAME[e["setting"]].study == "slow" for e in entries):
        return paths
    return [
        *paths,
        plots.plot_rewards(
            entries, slow, out / "slow_reward_vs_samples.png", grid=(2, 3),
            reference=[BY_NAME["eta0"], BY_NAME["eta3"]],
            title=f"Slow trainer (trainer.step_delay_s={SLOW_STEP_DELAY_S:g}): reward vs consumed "
            f"samples ({system})",
        ),
        plots.plot_staleness(entries, slow, out / "slow_staleness_hist.png", grid=(1, 4)),
        plots.plot_staleness_by_step(
            entries, slow, out / "slow_staleness_by_step.png",
            title=f"Consumed staleness per step, slow trainer (step_delay_s={SLOW_STEP_DELAY_S:g})",
        ),
    ]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
