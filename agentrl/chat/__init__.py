"""Chat layer: tool-call parsing, sandboxed chat templates and token-level turn deltas.

Tool schemas come in as plain dicts (built by `agentrl.env` from a tool's signature); this layer only renders
and parses them.
"""

from agentrl.chat.parse import parse_tool_calls

__all__ = ["ChatFormat", "parse_tool_calls", "render", "select_template"]


def __getattr__(name):
    # Lazy, so importing the parser (the rollout driver, `Environment.step`) does not pay for jinja2 and the
    # template files.
    if name in ("ChatFormat", "render", "select_template"):
        from agentrl.chat import template

        return getattr(template, name)
    raise AttributeError(f"module 'agentrl.chat' has no attribute {name!r}")
