"""StaleFlow trainer app: thin wiring of the StaleFlow packages (train, simulate, compare)."""

__version__ = "0.1.0"
