"""Snapshot-command cycle: cost-model routing, per-instance sync, migration, baselines."""

__version__ = "0.1.0"
