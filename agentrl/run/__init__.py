"""Wiring a run: configs built from the components' sections, `build_run` / `step`, `train.train`, `evaluate`.

This package is the one place that imports environments, chat, engine, rollout and trainer together. Exports are
lazy so that `agentrl.run.config` (no torch) validates a config before anything heavy loads.
"""

# `train` is not exported here: `agentrl.run.train` is the module (import the function from it).
_EXPORTS = {"TrainConfig": "config", "EvalConfig": "config", "Run": "build", "build_run": "build", "step": "build",
            "evaluate": "eval"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"agentrl.run.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'agentrl.run' has no attribute {name!r}")
