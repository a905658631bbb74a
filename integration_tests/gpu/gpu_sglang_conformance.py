"""The engine conformance suite against a REAL SGLang server (GPU machines only)."""

import pytest

from engine_adapters.testing.real_sglang import RealSglangConformance

pytestmark = [pytest.mark.sglang, pytest.mark.gpu]


class TestRealSglangConformance(RealSglangConformance):
    pass
