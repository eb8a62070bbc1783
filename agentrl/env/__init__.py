"""The environment layer: the `Environment` base class and its per-rollout `Episode`, `@tool` methods and the
JSON schemas built from them, tool execution (timeouts, output caps, statuses) and loading by name.

It knows nothing of tokens, engines or training: it takes parsed calls and gives back `ToolCall` records and
`tool` messages.
"""

from agentrl.env.base import Environment, Episode
from agentrl.env.execute import (DELIVERED, STATUSES, WELL_FORMED, ToolCall, ToolStats, count_statuses,
                                 render_output)
from agentrl.env.loading import available_environments, load_environment
from agentrl.env.schema import function_schema
from agentrl.env.tools import ToolHandle, tool

__all__ = ["DELIVERED", "STATUSES", "WELL_FORMED", "Environment", "Episode", "ToolCall", "ToolHandle", "ToolStats",
           "available_environments", "count_statuses", "function_schema", "load_environment", "render_output",
           "tool"]
