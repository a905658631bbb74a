"""The simulator: the control core driving sim engines and a modeled trainer in virtual time."""

from staleflow_trainer.sim.metrics import RunRecorder
from staleflow_trainer.sim.shell import Simulation, SimulationHalted, run_simulation
from staleflow_trainer.sim.spec import SimSpec, spec_from_app_config, with_policy

__all__ = [
    "RunRecorder",
    "SimSpec",
    "Simulation",
    "SimulationHalted",
    "run_simulation",
    "spec_from_app_config",
    "with_policy",
]
