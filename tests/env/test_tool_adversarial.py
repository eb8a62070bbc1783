"""Adversarial tool calls through the real path: parse → execute → suffix ids.

Anything a sampled model writes and anything a tool does must come back as a `tool` message the model can read:
no exception out of `Environment.execute`, a status from STATUSES, content within `max_tool_output_chars`, text
the tokenizer takes, a record that serialises to JSON, and a rollout that can go on (a plain call after each case
still works). Each case names the outcome chosen for its class of input.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from typing import Any, Callable

import pytest

from agentrl import Environment, Episode, tool
from agentrl.chat import ChatFormat, parse_tool_calls
from agentrl.env import STATUSES, ToolCall
from agentrl.env.execute import CANCEL_GRACE_S, MIN_MESSAGE_CHARS
from agentrl.tokenizer import byte_tokenizer

from tests.env.adversarial_corpus import (  # noqa: E402
    Adversary, CASES, Case, NOTICE, TIMEOUT, block)


# ----------------------------------------------------------------------------------------------- the checks

@functools.lru_cache(maxsize=1)
def chat_format() -> ChatFormat:
    """The offline byte tokenizer (the tiny test models' own) with the corpus's tools."""
    return ChatFormat(byte_tokenizer(), Adversary().tools())


def content_limit(env: Environment, status: str) -> float:
    """How long a content may be before its truncation notice: a tool's output is held to the limit; an error
    message to the limit, but never less than the floor that keeps it readable."""
    limit = env.max_tool_output_chars
    if limit is None:
        return float("inf")
    return limit if status in ("ok", "truncated") else max(limit, MIN_MESSAGE_CHARS)


def guarded(main: Callable[[], Any], seconds: float = 10.0) -> Any:
    """asyncio.run(main()) in a thread of its own, so that a hang fails the test instead of the suite and an
    escaping BaseException (SystemExit, KeyboardInterrupt) fails it instead of ending pytest."""
    outcome: dict = {}

    def target():
        try:
            outcome["result"] = asyncio.run(main())
        except BaseException as exc:  # whatever escaped is the failure being tested
            outcome["escaped"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "hung"
    if "escaped" in outcome:
        exc = outcome["escaped"]
        if isinstance(exc, AssertionError):
            raise exc
        pytest.fail(f"{type(exc).__name__[:80]} escaped: {str(exc)[:200]}")
    return outcome["result"]


def run_case(env: Environment, episode: Episode, calls) -> dict:
    """execute(calls), then a plain call; a tool that waits for `release` is let go once execute returned."""
    release = threading.Event()
    episode.state["release"] = release
    outcome: dict = {}

    async def main():
        try:
            start = time.perf_counter()
            outcome["records"] = await env.execute(episode, calls)
            outcome["seconds"] = time.perf_counter() - start
        finally:
            release.set()
        outcome["after"] = await env.execute(episode, [{"name": "nothing", "arguments": {}}])
        return outcome

    try:
        return guarded(main)
    finally:
        release.set()


def check_record(env: Environment, record: ToolCall) -> None:
    assert record.status in STATUSES
    assert isinstance(record.content, str) and isinstance(record.name, str)
    assert record.message == {"role": "tool", "name": record.name, "content": record.content}
    body = NOTICE.sub("", record.content)
    assert len(body) <= content_limit(env, record.status)
    assert len(record.content) - len(body) < 80  # the notice itself is one short line
    assert len(record.name) <= 100  # a name is echoed in the tool message
    # the record (the trajectory's, the eval JSONL's) serialises, and its text is valid UTF-8
    text = json.dumps(record.to_json(), ensure_ascii=False)
    text.encode("utf-8")
    assert json.loads(text)["content"] == record.content


def test_the_corpus_is_large_and_each_case_named_once():
    assert len(CASES) >= 100
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_adversarial_call(case: Case):
    env = Adversary(**case.env)
    episode = env.start({"question": "q"})
    calls = parse_tool_calls(case.text) if case.text is not None else case.calls
    outcome = run_case(env, episode, calls)
    records, after = outcome["records"], outcome["after"]

    assert [r.status for r in records] == list(case.statuses)
    if records:
        assert case.content(records[0].content), records[0].content[:300]
        assert case.record(records[0])
    assert outcome["seconds"] <= case.max_seconds * max(len(records), 1)
    for record in records + after:
        check_record(env, record)
    # The rollout goes on: the next call works and every call is recorded, in order, whatever the tools did.
    limit = env.max_tool_output_chars
    assert [r.status for r in after] == ["ok" if limit is None or limit >= len("done") else "truncated"]
    assert after[0].content.startswith("done"[:limit])
    assert list(episode.tool_calls)[-len(records) - 1:] == records + after

    # The suffix the driver appends tokenises, and carries exactly the contents recorded.
    fmt = chat_format()
    messages = [r.message for r in records + after]
    for generated in ([fmt.end_of_turn_id], []):
        suffix = fmt.suffix_ids(messages, generated)
        text = fmt.tokenizer.decode(suffix)
        at = 0
        for record in records + after:
            at = text.index(f"<tool_response>\n{record.content}\n</tool_response>", at)


# --------------------------------------------------------------------------- cancellation of the caller


@pytest.mark.parametrize("tool_name", ["atricky", "tricky"])
def test_cancelling_the_caller_still_cancels_it(tool_name):
    """A driver being stopped cancels its rollouts: that cancellation must reach the rollout, not be taken for a
    tool's failure (the tool's own CancelledError is one; the caller's is not)."""
    env = Adversary(tool_timeout_s=30.0)
    episode = env.start({"question": "q"})
    release = threading.Event()
    episode.state["release"] = release

    async def main():
        task = asyncio.create_task(env.execute(episode, [{"name": tool_name, "arguments": {"kind": "hang"}}]))
        await asyncio.sleep(0.05)
        task.cancel()
        start = time.perf_counter()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.perf_counter() - start < 1.0
        release.set()
        return episode.tool_calls

    try:
        assert guarded(main) == []  # nothing was recorded for the cancelled call
    finally:
        release.set()


def test_cancelling_the_caller_cancels_an_async_tool():
    seen = []

    class Watcher(Adversary):
        @tool
        async def watch(self) -> str:
            """Records its cancellation."""
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise
            return "late"

    env = Watcher(tool_timeout_s=30.0)

    async def main():
        task = asyncio.create_task(env.execute(env.start({"question": "q"}), [{"name": "watch", "arguments": {}}]))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.01)

    guarded(main)
    assert seen == ["cancelled"]


def test_a_timed_out_tool_that_ignores_cancellation_is_abandoned_after_a_short_grace():
    env = Adversary()
    episode = env.start({"question": "q"})
    release = threading.Event()
    episode.state["release"] = release

    async def main():
        start = time.perf_counter()
        (record,) = await env.execute(episode, [{"name": "atricky", "arguments": {"kind": "swallow"}}])
        seconds = time.perf_counter() - start
        release.set()
        return record, seconds

    try:
        record, seconds = guarded(main)
    finally:
        release.set()
    assert record.status == "timeout"
    assert TIMEOUT + CANCEL_GRACE_S <= seconds < TIMEOUT + CANCEL_GRACE_S + 0.3


# --------------------------------------------------------------------------- text the tokenizer takes


def test_lone_surrogates_reach_the_tokenizer_as_replacement_characters():
    fmt = ChatFormat(byte_tokenizer(), Adversary().tools())
    tool_message = {"role": "tool", "name": "echo", "content": "a\ud800b"}
    assert fmt.suffix_ids([tool_message], []) == fmt.suffix_ids([{**tool_message, "content": "a\ufffdb"}], [])
    prompt = [{"role": "user", "content": "why \udfff?"}]
    assert fmt.prompt_ids(prompt) == fmt.prompt_ids([{"role": "user", "content": "why \ufffd?"}])
    assert fmt.encode("\ud83d\ude00") == fmt.encode("\U0001f600")  # a pair left as two code points is joined


def test_a_trajectory_with_odd_calls_serialises():
    from agentrl.rollout.trajectory import Trajectory

    env = Adversary()
    episode = env.start({"question": "q"})
    text = (block("echo", {"text": "a\ud800"}) + block("na\udc00me", {"k\ud800": "v\udfff"})
            + block("give", {"kind": "surrogate in JSON"}))
    episode.messages.append({"role": "assistant", "content": text})
    outcome = run_case(env, episode, parse_tool_calls(text))
    episode.messages.extend(r.message for r in outcome["records"])
    traj = Trajectory(input_ids=[1], trainable=[0], behaviour_logprobs=[0.0], versions=[-1])
    traj.messages, traj.tool_calls = episode.messages, episode.tool_calls
    line = json.dumps(traj.to_json(), ensure_ascii=False).encode("utf-8")
    record = json.loads(line)
    assert [c["status"] for c in record["tool_calls"]] == ["ok", "unknown_tool", "ok", "ok"]
    assert record["tool_calls"][1]["arguments"] == {"k\ufffd": "v\ufffd"}
    assert record["tool_calls"][1]["name"] == "na\ufffdme"
