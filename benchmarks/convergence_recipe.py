"""The learning-rate check behind ``examples/convergence.yaml``: GRPO on the ``copy`` task with
staleness simulated in-process, many seeds in minutes.

The real study (``convergence_study.py``) runs the whole system, ~2-4 min per run, so it can
afford two seeds; its runs are not reproducible (asynchronous timing). This script answers the
narrower question "does the training recipe itself learn reliably at staleness η?" with no Ray,
vLLM or coordinator: the trainer of the real system (``staleflow_trainer.trainer.Trainer``, the
same loss, TIS, clipping and optimizer), fed by the plain-HF sampler drawing every batch from
the model **η versions old** (what most samples look like under StaleFlow's lazy sync: at η = 3
the study measures 78 % of samples at staleness 3). Deterministic for a seed.

Prints, per (lr, η, TIS, seed), the consumed-batch reward over the first 6 steps and over the
6 steps ending at 30 / 60 / ... and the final policy's **exact** expected reward (probability
of every one-token answer times its toy score, over the 10 prompts: no sampling noise); writes
``results/convergence/recipe.json``.

    python benchmarks/convergence_recipe.py                                  # the default sweep
    python benchmarks/convergence_recipe.py --lrs 3e-3 --etas 3 --seeds 0-9 --steps 60
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# its sibling benchmark, also when this file is loaded by path (not run as a script)
if (_HERE := str(Path(__file__).resolve().parent)) not in sys.path:
    sys.path.insert(0, _HERE)
from convergence_study import eval_prompts, repo_path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "convergence.yaml"
OUT = ROOT / "results" / "convergence" / "recipe.json"
WINDOW = 6  # as the study's window(60)


def _seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = (int(x) for x in text.split("-", 1))
        return list(range(lo, hi + 1))
    return [int(x) for x in text.split(",")]


def exact_policy_reward(model: Any, tok: Any, max_prompt_len: int, task: str) -> float:
    """Expected toy score of a one-token answer, sampled at temperature 1, over every distinct
    prompt of ``task`` (mean over prompts)."""
    import torch

    from staleflow_trainer.data import toy_score

    records, prompts = eval_prompts(task, tok, max_prompt_len)
    vocab = [tok.decode([i], skip_special_tokens=True) for i in range(len(tok))]
    total = 0.0
    with torch.no_grad():
        for rec, ids in zip(records, prompts, strict=True):
            logits = model(input_ids=torch.tensor([list(ids)])).logits[0, -1].float()
            probs = torch.softmax(logits, dim=-1)
            total += sum(
                float(probs[i]) * toy_score(vocab[i], rec.ground_truth) for i in range(len(vocab))
            )
    return total / len(records)


def run(
    *,
    lr: float | None,
    eta: int,
    tis: bool,
    seed: int,
    steps: int,
    config: Path = CONFIG,
    fifo_ratio: float | None = None,
) -> dict[str, Any]:
    """One deterministic run; ``lr=None`` keeps the config's ``trainer.lr``.

    ``fifo_ratio`` = ρ (trainer speed over rollout speed, < 1) models an unbounded FIFO whose
    rollout outruns the trainer instead of a fixed η: batch ``k`` comes from version ``⌊ρ·k⌋``,
    so its staleness ``k − ⌊ρ·k⌋`` grows all run long."""
    import torch

    from staleflow_trainer.config import load_config
    from staleflow_trainer.data import DataCursor, encode_prompts, load_records
    from staleflow_trainer.tiny_model import EOS_ID, make_char_tokenizer, resolve_model_path
    from staleflow_trainer.trainer import Trainer
    from staleflow_trainer.trainer.local_rollout import sample_responses, toy_train_batch

    with tempfile.TemporaryDirectory(prefix="sf-recipe-") as tmp:
        cfg = load_config(
            config,
            [
                f"run_dir={tmp}",
                f"trainer.steps={steps}",
                *([f"trainer.lr={lr}"] if lr is not None else []),
                f"trainer.use_tis={'true' if tis else 'false'}",
                f"run.seed={seed}",
            ],
        )
        if cfg.rollout.sampling.max_new_tokens != 1 or not cfg.data.toy_task:
            raise SystemExit("--config: needs a toy task with one-token answers")
        tok = make_char_tokenizer()
        records = load_records(cfg)
        cursor = DataCursor(len(records), seed=seed)
        trainer = Trainer(cfg.trainer, resolve_model_path(cfg), max_response_len=1, seed=seed)
        start_policy = exact_policy_reward(
            trainer.model, tok, cfg.data.max_prompt_len, cfg.data.toy_task
        )
        history = [copy.deepcopy(trainer.model)]  # versions v-eta .. v (all, with fifo_ratio)
        gen = torch.Generator().manual_seed(seed)
        n = cfg.protocol.group_size
        rewards: list[float] = []
        for step in range(steps):
            picked = [records[i] for i in cursor.take(cfg.protocol.batch_size)]
            prompts = encode_prompts(picked, tok, max_prompt_len=cfg.data.max_prompt_len)
            if fifo_ratio is None:
                behaviour = history[max(0, len(history) - 1 - eta)]
            else:
                behaviour = history[int(fifo_ratio * step)]
            out = sample_responses(
                behaviour, prompts, n=n, max_new_tokens=1, eos_id=EOS_ID, generator=gen
            )
            batch = toy_train_batch(out, picked, n=n, step=step, tokenizer=tok)
            rewards.append(float(trainer.train_step(batch)["reward_mean"]))
            history = [*history, copy.deepcopy(trainer.model)]
            if fifo_ratio is None:
                history = history[-(eta + 1) :]
        end_policy = exact_policy_reward(
            trainer.model, tok, cfg.data.max_prompt_len, cfg.data.toy_task
        )
    windows = {
        str(k): sum(rewards[k - WINDOW : k]) / WINDOW
        for k in range(30, steps + 1, 30)
        if k >= WINDOW
    }
    return {
        "lr": cfg.trainer.lr,
        "eta": eta if fifo_ratio is None else "unbounded",
        "fifo_ratio": fifo_ratio,
        "tis": tis,
        "seed": seed,
        "steps": steps,
        "reward_start": sum(rewards[:WINDOW]) / WINDOW,
        "reward_at": windows,
        "policy_reward_start": start_policy,
        "policy_reward_end": end_policy,
        "rewards": rewards,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lrs", default="1e-2,3e-3")
    ap.add_argument("--etas", default="0,3")
    ap.add_argument("--tis", default="true", help="true, false or true,false")
    ap.add_argument("--seeds", default="0-4", help="'0-4' or '0,2,7'")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument(
        "--fifo-ratios",
        default="",
        help="also model an unbounded FIFO at these trainer/rollout speed ratios (e.g. 0.3,0.5): "
        "batch k from version floor(ratio*k)",
    )
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    tis_values = []
    for t in args.tis.split(","):
        if t not in ("true", "false"):
            ap.error(f"--tis: {t!r} is not one of true, false")
        tis_values.append(t == "true")
    if args.steps < WINDOW:
        ap.error(f"--steps must be at least {WINDOW}, got {args.steps}")
    ratios = [float(x) for x in args.fifo_ratios.split(",") if x]
    if any(not 0 < r < 1 for r in ratios):
        ap.error(f"--fifo-ratios: each must be in (0, 1), got {ratios}")
    t0 = time.monotonic()
    entries = []
    for lr in (float(x) for x in args.lrs.split(",")):
        for eta in (int(x) for x in args.etas.split(",")):
            for tis in tis_values:
                for seed in _seeds(args.seeds):
                    e = run(lr=lr, eta=eta, tis=tis, seed=seed, steps=args.steps,
                            config=args.config)  # fmt: skip
                    entries.append(e)
                    at = " ".join(f"{k}:{v:.2f}" for k, v in e["reward_at"].items())
                    print(
                        f"lr={lr:g} eta={eta} tis={tis} seed={seed}: reward "
                        f"{e['reward_start']:.2f} -> [{at}]  policy "
                        f"{e['policy_reward_start']:.3f} -> {e['policy_reward_end']:.3f}",
                        flush=True,
                    )
    for lr in (float(x) for x in args.lrs.split(",")):
        for ratio in ratios:
            for tis in tis_values:
                for seed in _seeds(args.seeds):
                    e = run(lr=lr, eta=0, tis=tis, seed=seed, steps=args.steps,
                            config=args.config, fifo_ratio=ratio)  # fmt: skip
                    entries.append(e)
                    print(
                        f"lr={lr:g} fifo ratio={ratio:g} tis={tis} seed={seed}: reward "
                        f"{e['reward_start']:.2f} -> {e['rewards'][-1]:.2f}  policy "
                        f"{e['policy_reward_start']:.3f} -> {e['policy_reward_end']:.3f}",
                        flush=True,
                    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": repo_path(args.config), "runs": entries}, indent=1))
    print(f"wrote {args.out} ({len(entries)} runs, {time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
