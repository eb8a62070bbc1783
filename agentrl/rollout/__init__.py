"""Environments + engine → a stream of finished, token-exact, scored trajectories.

Exports are lazy so that `agentrl.rollout.config` can be read by a run's config without importing the driver.
"""

_EXPORTS = {"RolloutConfig": "config", "RolloutDriver": "driver", "Group": "groups", "ReadyPool": "groups",
            "group_advantages": "groups", "DriverStats": "metrics", "summarize": "metrics", "Prompt": "prompts",
            "PromptIterator": "prompts", "Trajectory": "trajectory"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"agentrl.rollout.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'agentrl.rollout' has no attribute {name!r}")
