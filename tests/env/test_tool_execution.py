"""Executing tool calls: every outcome is a tool message, per-episode state stays per episode."""

import asyncio
import sys
import threading
import time
import types
from typing import Literal, Optional

import pytest

import agentrl
from agentrl import Environment, Episode, tool
from agentrl.chat import parse_tool_calls
from agentrl.env import ToolCall, ToolStats, count_statuses


class Toy(Environment):
    name = "toy"
    system_prompt = "Use the tools."
    max_tool_output_chars = 40
    tool_timeout_s = 2.0

    @tool
    def add(self, a: int, b: int = 0, episode=None) -> int:
        """Add two integers."""
        episode.state["sum"] = a + b
        return a + b

    @tool
    def scale(self, x: float, mode: Literal["up", "down"] = "up", tags: Optional[list[str]] = None,
              flag: bool = False) -> dict:
        """Scale a number."""
        return {"x": x * 2 if mode == "up" else x / 2, "tags": tags, "flag": flag}

    @tool
    def fail(self, why: str) -> str:
        """Always fails."""
        raise ValueError(why)

    @tool
    async def afail(self) -> str:
        """Fails asynchronously with an exception of its own named TimeoutError."""
        raise TimeoutError("upstream")

    @tool(timeout=0.1)
    def hang(self) -> str:
        """Sleeps past its timeout."""
        time.sleep(0.5)
        return "late"

    @tool(timeout=0.1)
    async def ahang(self) -> str:
        """Awaits past its timeout."""
        await asyncio.sleep(5)
        return "late"

    @tool
    def long(self, n: int) -> str:
        """Returns n characters."""
        return "x" * n

    @tool
    async def note(self, text: str, episode: Episode) -> str:
        """Remember a note for this episode only."""
        await asyncio.sleep(0.001)
        episode.state.setdefault("notes", []).append(text)
        return f"{len(episode.state['notes'])} notes"

    def reward(self, episode):
        return {"correct": 1.0 if episode.final_text == "4" else 0.0, "calls": float(len(episode.tool_calls))}


def run(env, episode, text):
    return asyncio.run(env.execute(episode, parse_tool_calls(text)))


def one(name, args=None, env=None, episode=None):
    env = env or Toy()
    episode = episode or env.start({"question": "q"})
    (result,) = asyncio.run(env.execute(episode, [{"name": name, "arguments": args or {}}]))
    return result


def test_ok_call_reaches_episode_state_and_is_recorded():
    env = Toy()
    episode = env.start({"question": "what is 2+2?"})
    (r,) = run(env, episode, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>')
    assert (r.status, r.content, r.delivered) == ("ok", "4", True)
    assert r.message == {"role": "tool", "name": "add", "content": "4"}
    assert episode.state == {"sum": 4}
    assert episode.tool_calls == [ToolCall(turn=0, name="add", arguments={"a": 2, "b": 2}, status="ok", content="4",
                                           seconds=r.seconds)]


@pytest.mark.parametrize("name,args,status,content", [
    ("add", {"a": 2.0}, "ok", "2"),  # an integral float is an integer in JSON
    ("scale", {"x": 3}, "ok", '{"x": 6, "tags": null, "flag": false}'),  # an integer is a number
    ("scale", {"x": 1.5, "mode": "down", "tags": ["a"], "flag": True}, "ok",
     '{"x": 0.75, "tags": ["a"], "flag": true}'),
    ("scale", {"x": 1, "tags": None}, "ok", '{"x": 2, "tags": null, "flag": false}'),
    ("add", {"a": 2.5}, "bad_arguments", "Error: bad arguments for 'add': argument 'a' must be an integer, got number 2.5."),
    ("add", {"a": True}, "bad_arguments", "Error: bad arguments for 'add': argument 'a' must be an integer, got boolean true."),
    ("add", {"a": "2"}, "bad_arguments", "Error: bad arguments for 'add': argument 'a' must be an integer, got string \"2\"."),
    ("add", {"a": None}, "bad_arguments", "Error: bad arguments for 'add': argument 'a' must be an integer, got null."),
    ("add", {}, "bad_arguments", "Error: bad arguments for 'add': missing required argument 'a'."),
    ("add", {"a": 1, "c": 2}, "bad_arguments",
     "Error: bad arguments for 'add': unexpected argument 'c' (expected: a, b)."),
    ("add", {"a": 1, "episode": {}}, "bad_arguments",
     "Error: bad arguments for 'add': unexpected argument 'episode' (expected: a, b)."),
    ("scale", {"x": True}, "bad_arguments", "Error: bad arguments for 'scale': argument 'x' must be a number, got boolean true."),
    ("scale", {"x": 1, "flag": 1}, "bad_arguments",
     "Error: bad arguments for 'scale': argument 'flag' must be a boolean, got integer 1."),
    ("scale", {"x": 1, "mode": "sideways"}, "bad_arguments",
     "Error: bad arguments for 'scale': argument 'mode' must be one of \"up\", \"down\", got \"sideways\"."),
    ("scale", {"x": 1, "tags": ["a", 2]}, "bad_arguments",
     "Error: bad arguments for 'scale': argument 'tags[1]' must be a string, got integer 2."),
    ("scale", {"x": 1, "tags": "a"}, "bad_arguments",
     "Error: bad arguments for 'scale': argument 'tags' must be an array or null, got string \"a\"."),
    ("nope", {}, "unknown_tool",
     "Error: unknown tool 'nope'. Available tools: add, scale, fail, afail, hang, ahang, long, note."),
    ("fail", {"why": "no index"}, "tool_error", "Error: tool 'fail' failed with ValueError: no index"),
    ("afail", {}, "tool_error", "Error: tool 'afail' failed with TimeoutError: upstream"),
    ("hang", {}, "timeout", "Error: tool 'hang' timed out after 0.1 s."),
    ("ahang", {}, "timeout", "Error: tool 'ahang' timed out after 0.1 s."),
    ("long", {"n": 40}, "ok", "x" * 40),
    ("long", {"n": 100}, "truncated", "x" * 40 + "\n[output truncated: 100 characters, showing the first 40]"),
])
def test_outcomes(name, args, status, content):
    r = one(name, args)
    assert (r.status, r.content) == (status, content)
    assert r.message == {"role": "tool", "name": name, "content": content}
    assert r.delivered == (status in ("ok", "truncated"))
    assert r.well_formed == (status in ("ok", "truncated", "tool_error", "timeout"))


def test_parse_errors_become_messages():
    env = Toy()
    episode = env.start({"question": "q"})
    results = run(env, episode, "<tool_call>{oops}</tool_call><tool_call>[1]</tool_call>")
    assert [r.status for r in results] == ["parse_error", "parse_error"]
    assert results[0].content.startswith("Error: could not parse the tool call (invalid JSON: Expecting property")
    assert "got array" in results[1].content and '<tool_call>{"name": ' in results[1].content
    assert results[0].message["role"] == "tool"


def test_a_hung_tool_does_not_stop_the_rollout():
    env = Toy()
    episode = env.start({"question": "q"})
    start = time.perf_counter()
    results = run(env, episode, '<tool_call>{"name": "hang"}</tool_call><tool_call>{"name": "add", "arguments": '
                                '{"a": 1}}</tool_call>')
    assert [r.status for r in results] == ["timeout", "ok"]
    assert time.perf_counter() - start < 0.4
    # the abandoned call runs on in a daemon thread, which never keeps the process alive at exit
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("agentrl-tool"))


def test_concurrent_episodes_keep_their_own_state():
    env = Toy()

    async def rollout(i):
        episode = env.start({"question": str(i)})
        calls = [{"name": "note", "arguments": {"text": f"{i}-{k}"}} for k in range(3)]
        await env.execute(episode, calls)
        return episode

    async def main():
        return await asyncio.gather(*(rollout(i) for i in range(50)))

    episodes = asyncio.run(main())
    for i, ep in enumerate(episodes):
        assert ep.state["notes"] == [f"{i}-0", f"{i}-1", f"{i}-2"]
        assert [c.content for c in ep.tool_calls] == ["1 notes", "2 notes", "3 notes"]


def test_tool_stats_and_counts():
    env = Toy()
    episode = env.start({"question": "q"})
    results = run(env, episode, '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{"name": '
                                '"long", "arguments": {"n": 99}}</tool_call><tool_call>{"name": "x"}</tool_call>'
                                "<tool_call>bad</tool_call>")
    assert count_statuses(results) == {"ok": 1, "truncated": 1, "unknown_tool": 1, "parse_error": 1}
    assert count_statuses(episode.tool_calls) == count_statuses(results)
    metrics = ToolStats().add(results).add(episode.tool_calls).metrics()
    assert metrics["tools/calls"] == 8 and metrics["tools/ok"] == 2 and metrics["tools/timeout"] == 0
    assert metrics["tools/error_rate"] == 0.5
    assert ToolStats().metrics()["tools/error_rate"] == 0.0


def test_message_level_step_loop_and_reward():
    env = Toy()
    episode = env.start({"question": "2+2?"})
    assert episode.messages == [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "2+2?"}]
    results = asyncio.run(env.step(episode, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>'))
    assert [r.status for r in results] == ["ok"] and not episode.done
    assert episode.messages[-1] == {"role": "tool", "name": "add", "content": "4"}
    assert asyncio.run(env.step(episode, "4")) == []
    assert episode.done and episode.final_text == "4" and episode.turns == 2
    assert env.total_reward(episode) == (2.0, {"correct": 1.0, "calls": 1.0})
    env.reward_weights = {"calls": 0.0}  # logged, not rewarded
    assert env.total_reward(episode) == (1.0, {"correct": 1.0, "calls": 1.0})
    env.reward_weights = {"typo": 1.0}
    with pytest.raises(KeyError, match="typo"):
        env.total_reward(episode)


def test_each_call_is_recorded_once_with_the_turn_that_made_it():
    class WithExample(Toy):  # a worked example's assistant turn in the prompt is not one of the episode's turns
        def prompt(self, sample):
            return [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
                    {"role": "user", "content": sample["question"]}]

    env = WithExample()
    episode = env.start({"question": "2+2?"})
    assert episode.num_prompt_messages == 3 and episode.turns == 0
    first = asyncio.run(env.step(episode, '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'))
    second = asyncio.run(env.step(episode, '<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>'
                                           '<tool_call>{"name": "nope"}</tool_call>'))
    assert episode.turns == 2
    assert [(c.turn, c.name, c.status) for c in episode.tool_calls] == [(0, "add", "ok"), (1, "add", "ok"),
                                                                         (1, "nope", "unknown_tool")]
    assert all(c is r for c, r in zip(episode.tool_calls, first + second, strict=True))  # returned = recorded
    assert episode.tool_calls[1].to_json() == {"turn": 1, "name": "add", "arguments": {"a": 3}, "status": "ok",
                                               "content": "3", "seconds": second[0].seconds}
    assert episode.messages[-2:] == [{"role": "tool", "name": "add", "content": "3"}, second[1].message]


def test_defaults_of_the_base_class():
    env = Environment()
    assert env.prompt({"question": "hi"}) == [{"role": "user", "content": "hi"}]
    assert env.is_done(env.start({"question": "hi"}), "done", []) is True
    assert env.is_done(env.start({"question": "hi"}), "<tool_call>x", [{"error": "e", "raw": "x"}]) is False
    with pytest.raises(NotImplementedError):
        env.reward(env.start({"question": "hi"}))
    with pytest.raises(NotImplementedError):
        env.load_dataset()

    class Scalar(Environment):
        def reward(self, episode):
            return 0.5

    assert Scalar().total_reward(Scalar().start({"question": "q"})) == (0.5, {})


def test_keyword_overrides_of_class_settings():
    env = Toy(max_tool_output_chars=5, tool_timeout_s=1.0)
    assert env.max_tool_output_chars == 5 and Toy.max_tool_output_chars == 40
    assert one("long", {"n": 6}, env=env).status == "truncated"
    assert env.tool_handle("add").timeout == 1.0
    for bad in ({"nonsense": 1}, {"tools": 1}, {"_handles": {}}):
        with pytest.raises(TypeError, match="unexpected keyword"):
            Toy(**bad)


def test_load_environment(monkeypatch):
    module = types.ModuleType("environments.toy_for_test")
    module.load_environment = lambda **kw: Toy(**kw)
    monkeypatch.setitem(sys.modules, "environments.toy_for_test", module)
    env = agentrl.load_environment("toy_for_test", max_tool_output_chars=7)
    assert isinstance(env, Toy) and env.max_tool_output_chars == 7
    with pytest.raises(ValueError, match="unknown environment 'no_such_env'; available: "):
        agentrl.load_environment("no_such_env")
    module.load_environment = lambda **kw: object()
    with pytest.raises(TypeError, match="not an Environment"):
        agentrl.load_environment("toy_for_test")
