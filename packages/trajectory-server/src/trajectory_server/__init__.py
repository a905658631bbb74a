"""Trajectory payload store with a multi-level queue: Route, Interrupt, nothing lost."""

__version__ = "0.1.0"
