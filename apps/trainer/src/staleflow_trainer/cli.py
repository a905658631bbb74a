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
import contextlib
import importlib
import importlib.util
import logging
import sys
import textwrap
from collections.abc import Iterator, Sequence
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
    from staleflow_trainer.runtime.startup import finished_run_message

    command = f"staleflow train {args.config}"
    finished = finished_run_message(cfg, command=command)
    if finished is not None:  # before importing the deployment (torch, Ray: seconds)
        print(finished)
        return 0
    result = _lazy("staleflow_trainer.runtime.wiring").train(cfg)
    return int(result or 0) if isinstance(result, int) else 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    cfg = _load(args)
    result = _lazy("staleflow_trainer.simulate").simulate(cfg)
    return int(result or 0) if isinstance(result, int) else 0


def _int_list(raw: str, flag: str) -> tuple[int, ...]:
    """``"0,1"`` → ``(0, 1)``; a bad item is a ConfigError naming the flag."""
    out = []
    for item in (x.strip() for x in (raw or "").split(",")):
        if not item:
            continue
        try:
            out.append(int(item))
        except ValueError:
            raise ConfigError(
                f"{flag}: {item!r} is not an integer", key=flag, allowed="integers, comma-separated"
            ) from None
    return tuple(out)


def _list_flag(raw: str | None, flag: str, allowed: str) -> str:
    """A comma-separated flag's value ("" where the flag is left out, for its default); a
    flag given with nothing in it is refused rather than read as its default."""
    if raw is None:
        return ""
    if not raw.replace(",", "").strip():
        raise ConfigError(
            f"{flag}: {raw!r} names nothing (leave the flag out for its default)",
            key=flag,
            allowed=allowed,
        )
    return raw


def _cmd_compare(args: argparse.Namespace) -> int:
    cfg = _load(args)
    raw = _list_flag(args.policies, "--policies", f"comma-separated, from: {_policy_list()}")
    policies = [p.strip() for p in raw.split(",") if p.strip()]
    seeds = _int_list(_list_flag(args.seeds, "--seeds", "integers, comma-separated"), "--seeds")
    result = _lazy("staleflow_trainer.simulate").compare(
        cfg, policies=policies or None, seeds=seeds or None
    )
    return int(result or 0) if isinstance(result, int) else 0


def _cmd_plan(args: argparse.Namespace) -> int:
    cfg = _load(args)
    result = _lazy("staleflow_trainer.report.plan").plan_main(
        cfg,
        policy=args.policy,
        fractions=args.fractions,
        etas=args.etas,
        tolerance=args.tolerance,
    )
    return int(result or 0) if isinstance(result, int) else 0


def _cmd_profile(args: argparse.Namespace) -> int:
    cfg = _load(args)
    result = _lazy("staleflow_trainer.profiling").profile(
        cfg, steps=args.steps, instances=args.instances
    )
    return int(result or 0) if isinstance(result, int) else 0


def _cmd_fit(args: argparse.Namespace) -> int:
    fit = _lazy("rollout_coordinator.fit")
    if not args.rest or any(a in ("-h", "--help") for a in args.rest):
        print(_COMMANDS["fit-cost-model"][0] + "\n")
        print(_examples("fit-cost-model"))
    if not args.rest:  # usage error: show the fitter's options
        with contextlib.suppress(SystemExit):
            fit.fit_cost_model_main(["--help"])
        return 2
    return int(fit.fit_cost_model_main(args.rest))


def _cmd_plot(args: argparse.Namespace) -> int:
    from staleflow_trainer.report.plots import plot_run

    for path in plot_run(args.run_dir):
        print(path)
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    print(yaml.safe_dump(to_dict(_load(args)), sort_keys=False), end="")
    return 0


_DESCRIPTION = """\
StaleFlow: asynchronous RL post-training of LLMs with a bound on every trajectory's
staleness (how many policy versions behind the trainer it was generated).

Every command that takes CONFIG (a YAML file) also takes dotted key=value overrides, e.g.
run_dir=runs/x trainer.steps=50 protocol.eta=3; `staleflow config CONFIG` prints every key
with its resolved value. Exit codes: 0 ok, 2 bad config or usage, 1 other errors.
"""

_EPILOG = """\
examples:
  staleflow train examples/tiny.yaml                  train a tiny model on CPU (Ray, vLLM)
  staleflow simulate examples/sim-tiny.yaml           the same control logic in virtual time
  staleflow compare examples/sim-paper-30b-a3b.yaml run_dir=runs/compare
  staleflow config examples/tiny.yaml                 print the resolved config
  staleflow COMMAND --help                            a command's options and examples
"""

# name -> (one-line help, description, examples); the examples are part of every --help
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": (
        "train with the real system (Ray, rollout engines, trainer)",
        "Start the whole system on Ray (rollout engines, trajectory and parameter servers, "
        "coordinator, reward workers, trainer), train trainer.steps steps, write the run "
        "directory (metrics.jsonl, timeline.jsonl, TensorBoard events, checkpoints, plots) "
        "and print where it is. A run directory with a checkpoint is resumed "
        "(run.resume=auto); one that already reached trainer.steps is reported and left "
        "alone.",
        "  staleflow train examples/tiny.yaml\n"
        "  staleflow train examples/tiny.yaml run_dir=runs/tiny-eta3 protocol.eta=3\n"
        "  staleflow train examples/tiny.yaml trainer.steps=60     # continue a finished run\n"
        "  staleflow train examples/tiny.yaml run.resume=never     # start over\n"
        "  staleflow train examples/tiny.yaml > run.log            # a line per step",
    ),
    "simulate": (
        "simulate a run in virtual time (seconds, no engines)",
        "Run the configured policy with simulated engines and trainer on a virtual clock: "
        "same control logic as train, timings from the cost model. Writes metrics.jsonl, "
        "timeline.jsonl, summary.json and plots into run_dir.",
        "  staleflow simulate examples/sim-tiny.yaml\n"
        "  staleflow simulate examples/sim-paper-30b-a3b.yaml trainer.steps=20 "
        "coordinator.policy=sync",
    ),
    "compare": (
        "simulate several coordinator policies side by side",
        "Simulate every chosen policy at each staleness bound (η = 1, 2, 3; sync and "
        "one-step once at their own bound) on the same workload; writes compare.json, "
        "results/compare.md and results/*.png into run_dir and prints the table.",
        "  staleflow compare examples/sim-paper-30b-a3b.yaml run_dir=runs/compare\n"
        "  staleflow compare examples/sim-tiny.yaml --policies staleflow,sync,one-step",
    ),
    "plan": (
        "search the rollout/training GPU split and η (capacity planning)",
        "Simulate one policy over a grid of rollout fractions of sim.total_gpus and "
        "staleness bounds; writes plan.json and results/ into run_dir and recommends the "
        "smallest η within --tolerance of the best throughput.",
        "  staleflow plan examples/sim-paper-30b-a3b.yaml run_dir=runs/plan trainer.steps=10\n"
        "  staleflow plan examples/sim-tiny.yaml --fractions 0.5,0.75 --etas 1,3",
    ),
    "profile": (
        "measure an engine's decode-step latency",
        "Start rollout engines as staleflow train would (engine arguments, sampling settings, "
        "rollout.cpus_per_instance threads), run decode steps at several (running requests, "
        "KV tokens) points and write RUN_DIR/profile.jsonl, the input of fit-cost-model. "
        "With --instances N, N engines decode every point at the same time, one process "
        "each: instances that share a machine slow each other, and the profile says how much.",
        "  staleflow profile examples/tiny.yaml run_dir=runs/profile\n"
        "  staleflow profile examples/tiny.yaml run_dir=runs/profile --instances 2 --steps 32",
    ),
    "config": (
        "print the resolved config (every key, defaults filled in)",
        "Load CONFIG, apply the overrides, validate, and print the result as YAML. A bad key "
        "or value is reported with the allowed values.",
        "  staleflow config examples/tiny.yaml\n"
        "  staleflow config examples/tiny.yaml protocol.eta=3 trainer.steps=50",
    ),
    "fit-cost-model": (
        "fit the decode-step cost model to profile records",
        "",
        "  staleflow fit-cost-model runs/profile/profile.jsonl -o cost.json",
    ),
    "plot": (
        "write the PNGs of a run directory",
        "Write RUN_DIR/plots/*.png from metrics.jsonl and timeline.jsonl (train and "
        "simulate do this at the end of a run).",
        "  staleflow plot runs/tiny",
    ),
}


def _examples(name: str) -> str:
    text = _COMMANDS[name][2]
    return ("examples:\n" if "\n" in text else "example:\n") + text + "\n"


def _policy_list() -> str:
    from staleflow_trainer.config import POLICIES

    return ", ".join(POLICIES)


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="staleflow", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=raw
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level of the structured log lines on stderr (default: info)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, **kw: Any) -> argparse.ArgumentParser:
        help_, description, _ = _COMMANDS[name]
        return sub.add_parser(
            name,
            help=help_,
            description=textwrap.fill(description, 88) if description else help_,
            epilog=_examples(name),
            formatter_class=raw,
            **kw,
        )

    def with_config(name: str) -> argparse.ArgumentParser:
        p = command(name)
        p.add_argument("config", metavar="CONFIG", help="YAML config file")
        p.add_argument(
            "overrides",
            nargs="*",
            metavar="KEY=VALUE",
            help="dotted overrides, e.g. trainer.steps=10 (staleflow config CONFIG lists keys)",
        )
        return p

    with_config("train").set_defaults(fn=_cmd_train)
    with_config("simulate").set_defaults(fn=_cmd_simulate)
    cmp = with_config("compare")
    cmp.add_argument(
        "--policies",
        default=None,
        metavar="P1,P2",
        help=f"comma-separated policies, from: {_policy_list()} (default: all of them)",
    )
    cmp.add_argument(
        "--seeds",
        default=None,
        metavar="S1,S2",
        help="comma-separated seeds (default: run.seed and the next one)",
    )
    cmp.set_defaults(fn=_cmd_compare)
    pln = with_config("plan")
    pln.add_argument(
        "--policy", default="", help="the policy to plan (default: coordinator.policy)"
    )
    pln.add_argument(
        "--fractions",
        default=None,
        metavar="F1,F2",
        help="rollout fractions of sim.total_gpus to try (default: 0.25 to 0.75)",
    )
    pln.add_argument(
        "--etas", default=None, metavar="E1,E2", help="staleness bounds to try (default: 1,2,3)"
    )
    pln.add_argument(
        "--tolerance",
        default="0.05",
        help="recommend the smallest η within this fraction of the best (default: 0.05)",
    )
    pln.set_defaults(fn=_cmd_plan)
    prof = with_config("profile")
    prof.add_argument(
        "--instances",
        type=int,
        default=1,
        metavar="N",
        help="engines measured side by side, one process each (default: 1, one engine alone)",
    )
    prof.add_argument(
        "--steps",
        type=int,
        default=8,
        metavar="K",
        help="decode steps timed at each point (default: 8; 32 steadies a shared machine)",
    )
    prof.set_defaults(fn=_cmd_profile)
    with_config("config").set_defaults(fn=_cmd_config)
    # the fitter owns its options: everything after the name, ``--help`` included, is
    # handed to it (see main and _cmd_fit)
    fit = command("fit-cost-model", add_help=False)
    fit.add_argument("rest", nargs="*", help="PROFILE.jsonl and the fitter's options")
    fit.set_defaults(fn=_cmd_fit)
    plot = command("plot")
    plot.add_argument(
        "run_dir", metavar="RUN_DIR", help="a run directory written by train or simulate"
    )
    plot.set_defaults(fn=_cmd_plot)
    return parser


def configure_logging(level: str = "info") -> None:
    """Log lines at ``level`` and above, on stderr: stdout carries the run's progress and
    results (a file of step lines when redirected)."""
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr),  # the current stderr
    )


@contextlib.contextmanager
def logging_restored() -> Iterator[None]:
    """Within the block the process's structlog configuration may change; after it, it is as
    it was (unconfigured again if it was)."""
    configured, before = structlog.is_configured(), structlog.get_config()
    try:
        yield
    finally:
        if configured:
            structlog.configure(**before)
        else:
            structlog.reset_defaults()


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> Any:
    """``parser.parse_args(argv)``, except that ``KEY=VALUE`` overrides may also come after a
    command's options (``plan CONFIG --policy P KEY=VALUE``): argparse ends the overrides at
    the first option and would refuse the ones after it."""
    args, extra = parser.parse_known_args(argv)
    if (
        extra
        and hasattr(args, "overrides")
        and not any(a.startswith("-") or "=" not in a for a in extra)
    ):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args: Any = None
    if "fit-cost-model" in argv:  # everything after it (--help included) is the fitter's
        i = argv.index("fit-cost-model")
        args = parser.parse_args(argv[: i + 1])
        args.rest = argv[i + 1 :]
    if args is None or args.command != "fit-cost-model":
        args = _parse(parser, argv)
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
