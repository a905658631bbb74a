"""The simulator: real protocol + real coordinator + sim engines + modeled trainer, virtual time."""

from staleflow_trainer.sim.ledger import SimLedgerError, TrajectoryLedger
from staleflow_trainer.sim.loop import Simulation, run_spec
from staleflow_trainer.sim.metrics import RunRecorder
from staleflow_trainer.sim.spec import FIXED_ETA, POLICIES, SimSpec, spec_from_app_config

__all__ = [
    "FIXED_ETA",
    "POLICIES",
    "RunRecorder",
    "SimLedgerError",
    "SimSpec",
    "Simulation",
    "TrajectoryLedger",
    "run_spec",
    "spec_from_app_config",
]
