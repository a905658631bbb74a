"""Per-trajectory staleness bound: Reserve / Occupy / Consume over per-version buffers (sans-IO)."""

__version__ = "0.1.0"
