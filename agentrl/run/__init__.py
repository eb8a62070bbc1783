"""Wiring a run: configs built from the components' sections, `build_run` / `step`, `train.train`, `evaluate`.

This package is the one place that imports environments, chat, engine, rollout and trainer together. Exports are
lazy so that `agentrl.run.config` (no torch) validates a config before anything heavy loads.
"""

from agentrl.lazy import lazy_exports

# `train` is not exported here: `agentrl.run.train` is the module (import the function from it).
_EXPORTS = {"TrainConfig": "config", "EvalConfig": "config", "Run": "build", "build_run": "build", "step": "build",
            "evaluate": "eval"}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
