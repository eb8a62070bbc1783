"""Continuous batching over a paged KV cache, reading the training model's own parameters."""

from agentrl.engine.config import EngineConfig
from agentrl.engine.engine import Engine, EngineStats
from agentrl.engine.types import Completion, SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineStats", "SamplingParams", "Completion"]
