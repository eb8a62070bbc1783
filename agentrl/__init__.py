"""agentrl: reinforcement learning for LLM agents that use tools over many turns."""

__version__ = "0.1.0"

from agentrl.env import Environment, Episode, load_environment, tool  # noqa: E402

__all__ = ["Environment", "Episode", "load_environment", "tool", "__version__"]
