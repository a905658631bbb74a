"""The vLLM backend (V1 ``AsyncLLM``).

Importing this module checks that vLLM is installed (a missing one surfaces through the
registry as :class:`engine_adapters.errors.BackendNotInstalled` naming the ``vllm`` extra) but
does not import it: vLLM (~10 s to import) loads when an adapter starts.
"""

import importlib.util

if importlib.util.find_spec("vllm") is None:
    raise ModuleNotFoundError("No module named 'vllm'", name="vllm")

from engine_adapters.vllm._adapter import VllmAdapter
from engine_adapters.vllm._config import LOAD_MODES, VllmConfig
from engine_adapters.vllm._weights import WeightSchema

from_config = VllmAdapter.from_config

__all__ = ["LOAD_MODES", "VllmAdapter", "VllmConfig", "WeightSchema", "from_config"]
