"""Test support shipped with the package.

* :mod:`engine_adapters.testing.conformance` — ``EngineConformance``, the behaviour suite every
  backend's tests subclass (imports pytest).
* :mod:`engine_adapters.testing.sim_reference` — a naive per-step model of the sim engine's
  scheduling rules, to check the closed-form core against.
* :mod:`engine_adapters.testing.sglang_standin` — an in-repo stand-in for SGLang's HTTP server.
* :mod:`engine_adapters.testing.real_sglang` — the suite against a real SGLang server (GPU
  machines; configured from the environment).

Nothing is imported here, so ``import engine_adapters.testing`` stays cheap.
"""
