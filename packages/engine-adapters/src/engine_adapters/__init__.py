"""One async contract for rollout engines (sim, vLLM, SGLang), loaded lazily."""

__version__ = "0.1.0"
