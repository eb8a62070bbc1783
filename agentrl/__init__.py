"""agentrl: reinforcement learning for LLM agents that use tools over many turns."""

__version__ = "0.1.0"

__all__ = ["Environment", "Episode", "load_environment", "tool", "__version__"]


def __getattr__(name):
    # Lazy, so `import agentrl.engine` or the CLI's `--help` do not pay for the environment layer.
    if name in ("Environment", "Episode", "load_environment", "tool"):
        from agentrl import env

        return getattr(env, name)
    raise AttributeError(f"module 'agentrl' has no attribute {name!r}")
