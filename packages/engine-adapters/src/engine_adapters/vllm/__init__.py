"""The vLLM backend (V1 ``AsyncLLM``). Importing this module does not import vLLM; starting an
adapter does, and raises :class:`engine_adapters.errors.BackendNotInstalled` if it is missing."""

from engine_adapters.vllm._adapter import VllmAdapter
from engine_adapters.vllm._config import LOAD_MODES, VllmConfig
from engine_adapters.vllm._weights import WeightSchema

__all__ = ["LOAD_MODES", "VllmAdapter", "VllmConfig", "WeightSchema"]
