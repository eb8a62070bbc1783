"""The README's subclassing example: a built-in environment gains a tool in under 20 lines."""

import asyncio
import importlib.util
from pathlib import Path

from agentrl.chat import parse_tool_calls

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hotpotqa_with_lookup.py"


def load_example():
    spec = importlib.util.spec_from_file_location("hotpotqa_with_lookup", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_subclass_adds_a_working_tool():
    assert len(EXAMPLE.read_text().splitlines()) <= 20
    env = load_example().HotpotQAWithLookup()
    assert [t["function"]["name"] for t in env.tools()] == ["search", "open_page"]
    assert env.tools()[1]["function"]["parameters"] == {
        "type": "object", "required": ["title"],
        "properties": {"title": {"type": "string", "description": "The exact title, as shown in a search result."}}}
    sample = env.load_dataset(split="dev", limit=1)[0]
    episode = env.start(sample)
    title = sample["context"][0][0]
    text = (f'<tool_call>{{"name": "open_page", "arguments": {{"title": "{title}"}}}}</tool_call>'
            '<tool_call>{"name": "open_page", "arguments": {"title": "No Such Page"}}</tool_call>')
    found, missing = asyncio.run(env.execute(episode, parse_tool_calls(text)))
    assert found.status == "ok" and found.content.startswith(" ".join(sample["context"][0][1])[:40])
    assert missing.status == "tool_error" and "search first" in missing.content
