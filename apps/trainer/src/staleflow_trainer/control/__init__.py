"""The control core: every decision of a run, events in and effects out (see :mod:`.core`)."""

from staleflow_trainer.control.config import (
    CoreConfig,
    build_protocol,
    coordinator_config,
    core_config,
    protocol_mode,
)
from staleflow_trainer.control.core import ControlCore, CoreHalted

__all__ = [
    "ControlCore",
    "CoreConfig",
    "CoreHalted",
    "build_protocol",
    "coordinator_config",
    "core_config",
    "protocol_mode",
]
