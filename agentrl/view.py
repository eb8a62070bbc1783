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


def render(records: list[dict]) -> str:
    env = ImmutableSandboxedEnvironment(autoescape=select_autoescape(default=True, default_for_string=True))
    env.filters["highlight"] = lambda text: _highlight(str(env.filters["e"](text)))
    template = env.from_string((Path(__file__).parent / "templates" / "viewer.html.jinja").read_text())
    mean = sum(r.get("reward", 0.0) for r in records) / len(records) if records else 0.0
    return template.render(records=records, mean_reward=mean, delivered=DELIVERED)


def write_viewer(results: str | Path, out: str | Path | None = None) -> Path:
    results = Path(results)
    records = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    target = Path(out) if out else results.with_suffix(".html")
    target.write_text(render(records))
    return target
