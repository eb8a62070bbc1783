"""Environments + engine → a stream of finished, token-exact, scored trajectories.

Exports are lazy so that `agentrl.rollout.config` can be read by a run's config without importing the driver.
"""

from agentrl.lazy import lazy_exports

_EXPORTS = {"RolloutConfig": "config", "RolloutDriver": "driver", "Group": "groups", "ReadyPool": "groups",
            "group_advantages": "groups", "DriverStats": "metrics", "summarize": "metrics", "Prompt": "prompts",
            "PromptIterator": "prompts", "Trajectory": "trajectory"}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
