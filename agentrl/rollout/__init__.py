"""Environments + engine → a stream of finished, token-exact, scored trajectories."""

from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.driver import RolloutDriver
from agentrl.rollout.groups import Group, ReadyPool, group_advantages
from agentrl.rollout.metrics import DriverStats, summarize
from agentrl.rollout.prompts import Prompt, PromptIterator
from agentrl.rollout.trajectory import Trajectory

__all__ = ["DriverStats", "Group", "Prompt", "PromptIterator", "ReadyPool", "RolloutConfig", "RolloutDriver",
           "Trajectory", "group_advantages", "summarize"]
