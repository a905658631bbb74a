"""The ``staleflow`` command line.

::

    staleflow train CONFIG [key=value ...]        the real system (Ray, engines, trainer)
    staleflow simulate CONFIG [key=value ...]     same wiring, sim engines, virtual clock
    staleflow compare CONFIG [key=value ...] [--policies a,b,...]
    staleflow plan CONFIG [key=value ...] [--policy P] [--fractions F,...] [--etas E,...]
    staleflow fit-cost-model PROFILE.jsonl [-o OUT.json] ...
    staleflow profile CONFIG [key=value ...]      profile an engine's decode-step latency
    staleflow plot RUN_DIR                        PNGs from metrics.jsonl / timeline.jsonl
    staleflow config CONFIG [key=value ...]       print the resolved config

``run_dir=DIR`` and ``trainer.steps=N`` are valid overrides for train and simulate. Exit
codes: 0 ok, 2 bad config / usage, 1 other errors.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import structlog
import yaml

from staleflow_trainer.config import AppConfig, load_config, to_dict
from staleflow_trainer.errors import CommandUnavailable, ConfigError, StaleflowError


def _lazy(module: str) -> ModuleType:
    """Import a command's implementation; CommandUnavailable if it is not installed."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        raise CommandUnavailable(f"{module} is not available yet (module missing)", module=module)
    return importlib.import_module(module)


def _load(args: argparse.Namespace) -> AppConfig:
    try:
        return load_config(args.config, args.overrides)
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{args.config}: not UTF-8 text (byte {e.start}: {e.reason})",
            key="<file>",
            allowed="a UTF-8 YAML file",
        ) from None


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = _load(args)
    result = _lazy("staleflow_trainer.wiring").train(cfg)
    return int(result or 0) if isinstance(result, int) else 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    cfg = _load(args)
    result = _lazy("staleflow_trainer.simulate").simulate(cfg)
    return int(result or 0) if isinstance(result, int) else 0


def _cmd_compare(args: argparse.Namespace) -> int:
    cfg = _load(args)
    policies = [p for p in (args.policies or "").split(",") if p]
    result = _lazy("staleflow_trainer.simulate").compare(cfg, policies=policies or None)
    return int(result or 0) if isinstance(result, int) else 0


def _cmd_plan(args: argparse.Namespace) -> int:
    cfg = _load(args)
    result = _lazy("staleflow_trainer.plan").plan_main(
        cfg,
        policy=args.policy,
        fractions=args.fractions,
        etas=args.etas,
        tolerance=args.tolerance,
    )
    return int(result or 0) if isinstance(result, int) else 0


def _cmd_profile(args: argparse.Namespace) -> int:
    cfg = _load(args)
    result = _lazy("staleflow_trainer.wiring").profile(cfg)
    return int(result or 0) if isinstance(result, int) else 0


def _cmd_fit(args: argparse.Namespace) -> int:
    fit = _lazy("rollout_coordinator.fit")
    return int(fit.fit_cost_model_main(args.rest))


def _cmd_plot(args: argparse.Namespace) -> int:
    from staleflow_trainer.plots import plot_run

    for path in plot_run(args.run_dir):
        print(path)
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    print(yaml.safe_dump(to_dict(_load(args)), sort_keys=False), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="staleflow", description=__doc__.split("::")[0])
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(name: str, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("config", help="YAML config file")
        p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
        return p

    with_config("train", "run the real system").set_defaults(fn=_cmd_train)
    with_config("simulate", "run the simulator (virtual time)").set_defaults(fn=_cmd_simulate)
    cmp = with_config("compare", "simulate several coordinator policies side by side")
    cmp.add_argument("--policies", default="", help="comma-separated policy names")
    cmp.set_defaults(fn=_cmd_compare)
    pln = with_config("plan", "search the rollout/training split and eta (capacity planning)")
    pln.add_argument("--policy", default="", help="policy to plan (default: the config's)")
    pln.add_argument(
        "--fractions", default="", help="rollout fractions of sim.total_gpus (0.25,...,0.75)"
    )
    pln.add_argument("--etas", default="", help="staleness bounds to try (default 1,2,3)")
    pln.add_argument(
        "--tolerance", default="0.05", help="recommend the smallest eta within this of the best"
    )
    pln.set_defaults(fn=_cmd_plan)
    with_config("profile", "profile an engine's decode-step latency").set_defaults(fn=_cmd_profile)
    with_config("config", "print the resolved config").set_defaults(fn=_cmd_config)
    fit = sub.add_parser("fit-cost-model", help="fit the cost model to profile records")
    fit.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the fitter")
    fit.set_defaults(fn=_cmd_fit)
    plot = sub.add_parser("plot", help="write PNGs for a run directory")
    plot.add_argument("run_dir")
    plot.set_defaults(fn=_cmd_plot)
    return parser


def configure_logging(level: str = "info") -> None:
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args: Any = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    configure_logging(args.log_level)
    try:
        return int(args.fn(args))
    except ConfigError as e:
        print(f"staleflow: config error at {e.key}: {e}", file=sys.stderr)
        if e.allowed:
            print(f"  allowed: {e.allowed}", file=sys.stderr)
        return 2
    except CommandUnavailable as e:
        print(f"staleflow {args.command}: {e}", file=sys.stderr)
        return 1
    except StaleflowError as e:
        print(f"staleflow {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
