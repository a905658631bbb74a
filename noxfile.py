"""nox sessions for the StaleFlow workspace.

Every session installs the locked environment (`uv sync --locked`) into its own venv, so what
runs here is what CI runs. Engine sessions fail loudly when their engine cannot start: a test
that needs a missing engine errors, it is never skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "typecheck", "tests", "build"]

ROOT = Path(__file__).parent
PACKAGES = {
    "staleness-protocol": "staleness_protocol",
    "engine-adapters": "engine_adapters",
    "trajectory-server": "trajectory_server",
    "param-server": "param_server",
    "rollout-coordinator": "rollout_coordinator",
}
APPS = {"staleflow-trainer": "apps/trainer"}
BACKENDS = ["sim", "vllm", "sglang"]
ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


def _sync(session: nox.Session, *args: str) -> None:
    """Install the locked environment (only what ``args`` select) plus the dev tools."""
    env = {"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}
    session.run_install("uv", "sync", "--locked", "--active", *args, env=env)
    if "--package" in args:
        # `uv sync --package X` leaves out the root's dev group: add the locked dev tools.
        req = Path(session.create_tmp()) / "dev-requirements.txt"
        session.run_install(
            "uv",
            "export",
            "--locked",
            "--only-dev",
            "--no-hashes",
            "--no-emit-project",
            "--no-emit-workspace",
            "--quiet",
            "-o",
            str(req),
            env=env,
        )
        session.run_install("uv", "pip", "install", "--quiet", "-r", str(req), env=env)


@nox.session
def lint(session: nox.Session) -> None:
    _sync(session, "--all-packages", "--only-dev")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict: the protocol alone (in an environment holding only it), then every
    library package and the trainer app together (as CI runs it)."""
    _sync(session, "--package", "staleness-protocol")
    session.run("mypy", "--strict", "packages/staleness-protocol/src")
    _sync(session, "--all-packages", "--all-extras")
    session.run("mypy", "--strict", *(f"packages/{p}/src" for p in PACKAGES), "apps/trainer/src")


UNIT_TESTS = {
    **{p: f"packages/{p}/tests" for p in PACKAGES},
    "staleflow-trainer": "apps/trainer/tests",
}


@nox.session
@nox.parametrize("package", list(UNIT_TESTS))
def tests(session: nox.Session, package: str) -> None:
    """Unit tests of one package in an environment holding only it and its declared deps."""
    extras = ["--all-extras"] if package in ("engine-adapters", "param-server") else []
    _sync(session, "--package", package, *extras)
    session.run("pytest", UNIT_TESTS[package], env=ENV)


@nox.session
def build(session: nox.Session) -> None:
    session.install("uv")
    out = ROOT / "dist"
    for dist in [*PACKAGES, *APPS]:
        session.run("uv", "build", "--no-sources", "--package", dist, "--out-dir", str(out))


@nox.session
@nox.parametrize("backend", BACKENDS)
def engine(session: nox.Session, backend: str) -> None:
    """The engine-adapter conformance suite against one backend."""
    _sync(session, "--package", "engine-adapters", "--all-extras")
    # Selecting no test is an error (pytest exits 5), so a missing backend never passes.
    session.run(
        "pytest", "packages/engine-adapters/tests", "-k", f"conformance and {backend}", env=ENV
    )


@nox.session
@nox.parametrize("backend", BACKENDS)
def integration(session: nox.Session, backend: str) -> None:
    """The composed-system suite with one engine backend."""
    _sync(session, "--all-packages")
    session.run(
        "pytest",
        "integration_tests",
        "-m",
        backend,
        env={**ENV, "STALEFLOW_REQUIRE_BACKEND": backend},
    )


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks: each writes bench-results/<name>.json and prints side-by-side ratios."""
    _sync(session, "--all-packages")
    os.makedirs(ROOT / "bench-results", exist_ok=True)
    for script in sorted((ROOT / "benchmarks").glob("bench_*.py")):
        if script.name in ("bench_sim_sweep.py", "bench_sim_matrix.py"):  # long: own sessions
            continue
        session.run("python", str(script), env=ENV)


@nox.session(name="bench-sim")
def bench_sim(session: nox.Session) -> None:
    """The preset matrix (every policy, every paper preset, eta 1/2/3/5, two seeds) and its
    bars: `nox -s bench-sim [-- --smoke | --presets ... --policies ... --etas ...]`."""
    _sync(session, "--all-packages")
    session.run("python", "benchmarks/bench_sim_matrix.py", *session.posargs, env=ENV)


@nox.session(name="bench-sim-sweep")
def bench_sim_sweep(session: nox.Session) -> None:
    """Scalability sweeps: `nox -s bench-sim-sweep [-- gpus|response|batch [opts]]`."""
    _sync(session, "--all-packages")
    args = session.posargs
    if args and args[0] in ("gpus", "response", "batch"):
        session.run("python", "benchmarks/bench_sim_sweep.py", *args, env=ENV)
    else:
        for sweep in ("gpus", "response", "batch"):
            session.run(
                "python", "benchmarks/bench_sim_sweep.py", sweep, "--seeds", "0,1", *args, env=ENV
            )


@nox.session
def convergence(session: nox.Session) -> None:
    """The convergence study (not part of CI)."""
    _sync(session, "--all-packages")
    session.run("python", "benchmarks/convergence_study.py", *session.posargs, env=ENV)


@nox.session(name="convergence-recipe")
def convergence_recipe(session: nox.Session) -> None:
    """The study's recipe at simulated staleness, many seeds in-process (~2 min; no Ray/vLLM)."""
    _sync(session, "--all-packages")
    session.run("python", "benchmarks/convergence_recipe.py", *session.posargs, env=ENV)
