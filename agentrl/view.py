"""`agentrl view results.jsonl`: one self-contained HTML page of trajectories (no scripts fetched, no server)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from jinja2 import select_autoescape
from jinja2.sandbox import ImmutableSandboxedEnvironment

from agentrl.env import DELIVERED

_TOOL_CALL = re.compile(r"(&lt;tool_call&gt;.*?(?:&lt;/tool_call&gt;|$))", re.S)
_ANSWER = re.compile(r"(&lt;answer&gt;.*?&lt;/answer&gt;)", re.S)


def _highlight(escaped: str) -> str:
    # Runs on already-escaped text, so the spans added here are the only markup in a message.
    escaped = _TOOL_CALL.sub(r'<span class="call">\1</span>', escaped)
    return _ANSWER.sub(r'<span class="answer">\1</span>', escaped)


def split_messages(record: dict) -> dict:
    """A record's messages in the parts the page draws apart: `head` (the leading system turns), `examples` (the
    worked examples that are part of the prompt: everything between the system turns and the question), the
    `question`, and `own` (the model's own turns and the tool results they got).

    The prompt is the first `num_prompt_messages` messages where the record says so; otherwise it ends with the
    last user message, since a rollout's own turns never include one."""
    messages = list(record.get("messages") or [])
    count = record.get("num_prompt_messages")
    if not isinstance(count, int):
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        count = users[-1] + 1 if users else 0
    prompt, own = messages[:count], messages[count:]
    head = 0
    while head < len(prompt) and prompt[head].get("role") == "system":
        head += 1
    rest = prompt[head:]
    question = rest[-1:] if rest and rest[-1].get("role") == "user" else []
    examples = rest[:len(rest) - len(question)]
    return {"head": prompt[:head], "examples": examples, "question": question, "own": own,
            "example_count": sum(1 for m in examples if m.get("role") == "user") or len(examples)}


def render(records: list[dict]) -> str:
    env = ImmutableSandboxedEnvironment(autoescape=select_autoescape(default=True, default_for_string=True))
    env.filters["highlight"] = lambda text: _highlight(str(env.filters["e"](text)))
    template = env.from_string((Path(__file__).parent / "templates" / "viewer.html.jinja").read_text())
    mean = sum(r.get("reward", 0.0) for r in records) / len(records) if records else 0.0
    return template.render(records=records, parts=[split_messages(r) for r in records], mean_reward=mean,
                           delivered=DELIVERED)


def write_viewer(results: str | Path, out: str | Path | None = None) -> Path:
    results = Path(results)
    records = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    target = Path(out) if out else results.with_suffix(".html")
    target.write_text(render(records))
    return target
