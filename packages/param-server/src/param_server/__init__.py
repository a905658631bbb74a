"""Versioned weights over NIXL: atomic Push, concurrent Pull, load-balanced plans."""

__version__ = "0.1.0"
