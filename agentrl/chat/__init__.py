"""Chat layer: tool schemas, tool-call parsing, sandboxed chat templates and token-level turn deltas."""

from agentrl.chat.parse import parse_tool_calls
from agentrl.chat.schema import function_schema

__all__ = ["ChatFormat", "function_schema", "parse_tool_calls", "render", "select_template"]


def __getattr__(name):
    # Lazy, so environments importing the schema helpers do not pay for jinja2 and the template files.
    if name in ("ChatFormat", "render", "select_template"):
        from agentrl.chat import template

        return getattr(template, name)
    raise AttributeError(f"module 'agentrl.chat' has no attribute {name!r}")
