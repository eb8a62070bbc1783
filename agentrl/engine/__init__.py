"""Continuous batching over a paged KV cache, reading the training model's own parameters.

Exports are lazy so that `agentrl.engine.config` (no torch) can be read by a run's config before anything heavy
loads.
"""

from agentrl.lazy import lazy_exports

_EXPORTS = {"EngineConfig": "config", "Engine": "engine", "EngineStats": "stats", "SamplingParams": "types",
            "Completion": "types"}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
