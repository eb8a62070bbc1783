"""The custom-tool example runs as documented: the added tool is offered to the model and executes."""

import asyncio
import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

from agentrl.chat import ChatFormat, parse_tool_calls
from agentrl.tokenizer import byte_tokenizer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_tool_env.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("custom_tool_env", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # inspect.getsource finds a class's file through its module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_added_tool_is_short_and_in_the_schema(example):
    source = inspect.getsource(example.CountryFactsPlus)
    assert len(source.strip().splitlines()) <= 20
    env = example.load_environment()
    assert [t["function"]["name"] for t in env.tools()] == ["lookup", "compare"]
    compare = env.tools()[1]["function"]
    assert compare["description"] == "Compare the populations of two countries."
    assert compare["parameters"] == {"type": "object", "required": ["first", "second"], "properties": {
        "first": {"type": "string", "description": "a country name."},
        "second": {"type": "string", "description": "another country name."}}}
    assert '"name": "compare"' in ChatFormat(byte_tokenizer(), env.tools()).render([{"role": "user", "content": "q"}])


def test_added_tool_executes_through_execute(example):
    env = example.load_environment()
    episode = env.start({"question": "q", "answer": "Japan"})
    text = ('<tool_call>{"name": "compare", "arguments": {"first": "Japan", "second": "Peru"}}</tool_call>'
            '<tool_call>{"name": "compare", "arguments": {"first": "Japan", "second": "Atlantis"}}</tool_call>')
    ok, failed = asyncio.run(env.execute(episode, parse_tool_calls(text)))
    assert (ok.status, ok.content) == ("ok", "Japan has 3.62 times the population of Peru.")
    assert failed.status == "tool_error" and "known countries: france, japan, kenya, peru" in failed.content
    assert episode.state == {"comparisons": 1}


def test_scripted_episode_and_main(example, capsys):
    env = example.load_environment()
    episode = asyncio.run(example.scripted_episode(env))
    assert episode.done and episode.final_text == "Japan"
    assert env.total_reward(episode) == (1.0, {"correct": 1.0, "tool_calls": 1.0})
    assert len(env.load_dataset(limit=2)) == 2
    example.main()
    assert "[tool] Japan has 3.62 times the population of Peru." in capsys.readouterr().out
