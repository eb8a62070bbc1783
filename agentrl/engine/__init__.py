"""Continuous batching over a paged KV cache, reading the training model's own parameters.

Exports are lazy so that `agentrl.engine.config` (no torch) can be read by a run's config before anything heavy
loads.
"""

_EXPORTS = {"EngineConfig": "config", "Engine": "engine", "EngineStats": "stats", "SamplingParams": "types",
            "Completion": "types"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"agentrl.engine.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'agentrl.engine' has no attribute {name!r}")
