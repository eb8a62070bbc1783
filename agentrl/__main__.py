"""`python -m agentrl ...` runs the `agentrl` command."""

from agentrl.cli import entrypoint

entrypoint()
