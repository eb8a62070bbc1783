"""The rollout driver end to end on the CPU engine, with a scripted tool-calling policy (tests/scripted_policy.py).

One run of 40 HotpotQA rollouts, 32 in flight, is shared by the tests of this module's first part: every rollout
makes two successful `search` calls in two turns and then answers; two rollouts in three also make calls that
fail, in the same turns and the same batch: a sync tool and an async tool that hang past their timeout, a tool
that raises, an unknown tool, a wrong argument type and malformed JSON. The second part checks the read-once
promise through the driver: three epochs drawn with rollouts in flight, and a checkpoint of the prompt iterator
taken mid-epoch and restored in a fresh "process"."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from agentrl import Environment, tool
from agentrl.chat import ChatFormat
from agentrl.engine import Engine, EngineConfig, SamplingParams
from agentrl.models import load_model
from agentrl.rollout import PromptIterator, RolloutConfig, RolloutDriver, summarize
from environments.hotpotqa_search import HotpotQASearchEnv, answer_f1
from tests.helpers import encode, IM_END, ScriptedPolicy, steer

PAGE = 16
MARGIN = 2.0
IN_FLIGHT = 32
NUM_PROMPTS = 40



# ------------------------------------------------------------------------------------------------ environment
class ChaosSearch(HotpotQASearchEnv):
    """The HotpotQA search environment plus tools that misbehave."""

    @tool(timeout=0.2)
    def hang(self) -> str:
        """Wait for a slow service."""
        time.sleep(1.0)  # abandoned at the timeout; the daemon thread ends on its own
        return "too late"

    @tool(timeout=0.2)
    async def stall(self) -> str:
        """Wait for a slow asynchronous service."""
        await asyncio.sleep(30)
        return "too late"

    @tool
    def explode(self, why: str) -> str:
        """Fail on purpose.

        Args:
            why: The error message.
        """
        raise RuntimeError(why)


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, separators=(",", ":")) + "</tool_call>"


def words(question: str) -> list[str]:
    return [w.strip("?,.") for w in question.split() if len(w) > 3]


# What the calls of each kind of rollout come back as, in order: every kind has two searches that succeed, the
# chaotic kinds' other calls all fail, each in its own way.
STATUSES = {
    "calm": ["ok", "ok"],
    "broken": ["ok", "parse_error", "timeout", "tool_error", "ok"],  # malformed JSON; a sync tool hangs; one raises
    "lost": ["timeout", "ok", "unknown_tool", "bad_arguments", "ok"],  # an async tool hangs; no such tool; bad type
}


class Script:
    """Per question, three turns: two turns of tool calls with one search each, then an answer. Rollouts of the
    chaotic kinds mix failing calls into the same turns."""

    def __init__(self, samples: list[dict]):
        self.index = {s["question"]: i for i, s in enumerate(samples)}
        self.gold = {s["question"]: str(s["answer"]) for s in samples}

    def kind(self, question: str) -> str:
        # Chaos only among the rollouts that start first (prompts are read in order), so their longer scripts
        # overlap the refills instead of trailing after them.
        i = self.index[question]
        return "calm" if i >= IN_FLIGHT else ("calm", "broken", "lost")[i % 3]

    def answer(self, question: str) -> str:
        # Half the rollouts answer right, so rewards differ.
        return self.gold[question] if self.index[question] % 2 == 0 else "nobody knows"

    def __call__(self, question: str, turn: int) -> str:
        w, kind = words(question), self.kind(question)
        if turn == 2:
            return f"<answer>{self.answer(question)}</answer>"
        search = call("search", query=w[turn])
        if kind == "calm":
            return search
        if kind == "broken":
            if turn == 0:
                return search + '<tool_call>{"name":"search","arguments":{</tool_call>'
            return call("hang") + call("explode", why="<&>") + search
        if turn == 0:
            return call("stall") + search
        return call("lookup", query=w[2]) + call("search", query=7) + search


@pytest.fixture(scope="module")
def run():
    # A short system prompt and short search results keep contexts small for the CPU engine.
    # No worked examples: the scripted policy reads its question from the first user turn and its turn number
    # from the assistant headers, which example turns would shift. No search bonus: rewards here are plain F1.
    env = ChaosSearch(top_k=1, max_paragraph_chars=80, system_prompt="Search, then answer inside <answer></answer>.",
                      few_shot=0, search_bonus=0)
    samples = env.load_dataset(split="train", limit=NUM_PROMPTS)
    script = Script(samples)
    model, tok = load_model("tiny-qwen3")
    policy = ScriptedPolicy(model, script, margin=MARGIN)
    fmt = ChatFormat(tok, env.tools())
    # A version per finished group (below) makes a rollout live through dozens of versions, where a run's live
    # through a few; without the age bound its history stays cached throughout (the bound: test_engine_prefix.py).
    engine = Engine(policy, EngineConfig(num_pages=4096, page_size=PAGE, eos_token_ids=tuple(fmt.eos_token_ids),
                                         prefix_cache_max_age=None))
    prompts = PromptIterator(samples, shuffle=False, max_epochs=1)
    config = RolloutConfig(group_size=1, rollouts_in_flight=IN_FLIGHT, temperature=0.0, max_turns=6, max_new_tokens=256)
    driver = RolloutDriver(env, engine, fmt, prompts, config)

    def on_group(group):
        prompts.consumed(group.prompt)  # eval-style: kept as soon as it is written
        engine.bump_version()  # a "trainer step" per group, so versions differ within rollouts

    groups = driver.run(on_group=on_group)
    trajectories = [t for g in groups for t in g.trajectories]
    return SimpleNamespace(env=env, samples=samples, script=script, model=model, policy=policy, fmt=fmt,
                           engine=engine, prompts=prompts, driver=driver, groups=groups, trajs=trajectories)


def question(traj) -> str:
    return next(m["content"] for m in traj.messages if m["role"] == "user")


def turns_of(traj) -> list[tuple[dict, list[dict]]]:
    """(assistant message, the tool messages that answered it) per turn, from the recorded messages."""
    out = []
    for m in traj.messages:
        if m["role"] == "assistant":
            out.append((m, []))
        elif out and m["role"] == "tool":
            out[-1][1].append(m)
    return out


# ------------------------------------------------------------------------------------------------ one run
def test_every_rollout_finishes_with_its_scripted_turns(run):
    assert len(run.groups) == NUM_PROMPTS and len(run.trajs) == NUM_PROMPTS
    assert sorted(t.prompt_index for t in run.trajs) == list(range(NUM_PROMPTS))
    assert run.driver.stats.rollouts_started == run.driver.stats.rollouts_finished == NUM_PROMPTS
    assert run.prompts.exhausted() and run.prompts.state_dict()["outstanding"] == []
    for t in run.trajs:
        q = question(t)
        assert t.finish_reason == "done" and t.num_turns == 3
        assert [m["content"] for m, _ in turns_of(t)] == [run.script(q, k) for k in range(t.num_turns)]
        assert t.answer == run.script(q, t.num_turns - 1)
        gold = run.script.gold[q]
        assert t.gold == gold
        assert t.reward_components["answer_f1"] == pytest.approx(answer_f1(run.script.answer(q), gold))
        assert t.reward == t.reward_components["answer_f1"]
    assert {t.reward for t in run.trajs} >= {0.0, 1.0}


def test_input_ids_are_the_incremental_construction(run):
    fmt = run.fmt
    for t in run.trajs:
        q = question(t)
        opening = t.messages[:next(i for i, m in enumerate(t.messages) if m["role"] == "assistant")]
        assert opening == run.env.prompt(run.samples[run.script.index[q]])
        expected = fmt.prompt_ids(opening)
        assert t.prompt_len == len(expected)
        for k, (assistant, tool_messages) in enumerate(turns_of(t)):
            generated = encode(run.script(q, k)) + [IM_END]  # the script's ids, not the engine's
            assert t.turn_spans[k] == (len(expected), len(expected) + len(generated))
            assert fmt.decode(generated) == assistant["content"]
            expected += generated
            if k < t.num_turns - 1:
                assert len(tool_messages) == sum(c.turn == k for c in t.tool_calls) > 0
                expected += fmt.suffix_ids(tool_messages, generated)
            else:
                assert tool_messages == []
        assert t.input_ids == expected
        # Token-in/token-out agrees with rendering the whole conversation once (ChatML rewrites nothing).
        assert fmt.decode(t.input_ids, strip_eos=False) + "\n" == fmt.render(t.messages)


def test_trainable_mask_logprobs_and_versions_are_aligned(run):
    final_version = run.engine.policy_version
    assert final_version == NUM_PROMPTS
    spread = 0
    for t in run.trajs:
        n = len(t.input_ids)
        assert len(t.trainable) == len(t.behaviour_logprobs) == len(t.versions) == n
        generated = {i for a, b in t.turn_spans for i in range(a, b)}
        assert {i for i in range(n) if t.trainable[i]} == generated
        assert all(t.behaviour_logprobs[i] == 0.0 and t.versions[i] == -1 for i in range(n) if i not in generated)
        versions = [t.versions[i] for i in sorted(generated)]
        assert versions == sorted(versions) and 0 <= versions[0] and versions[-1] <= final_version
        spread += len(set(versions)) > 1
        # Behaviour logprobs, recomputed by a plain transformers forward over the finished sequence.
        positions = torch.tensor(sorted(generated))
        tokens = torch.tensor(t.input_ids)[positions]
        with torch.no_grad():
            logits = run.model(torch.tensor([t.input_ids])).logits[0, positions - 1].float()
        expected = steer(logits, tokens, MARGIN).log_softmax(-1).gather(1, tokens[:, None])[:, 0]
        got = torch.tensor(t.behaviour_logprobs)[positions].float()
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        assert (got < 0).all()  # a real distribution, not a point mass
    assert spread > 0  # the per-token tags saw the weights move mid-rollout


def test_at_least_two_successful_tool_calls_per_rollout(run):
    for t in run.trajs:
        q = question(t)
        ok = [c for c in t.tool_calls if c.status == "ok"]
        assert len(ok) >= 2 and {c.name for c in ok} == {"search"}
        assert len({c.turn for c in ok}) == 2  # over two turns
        tool_messages = [m for _, ms in turns_of(t) for m in ms]
        assert [m["content"] for m in tool_messages] == [c.content for c in t.tool_calls]
        assert [c.status for c in t.tool_calls] == STATUSES[run.script.kind(q)]
        for c in ok:  # what the model read is what the search returns
            episode = run.env.start(run.samples[run.script.index[q]])
            assert c.content == run.env.search(c.arguments["query"], episode)


def test_resubmitted_turns_prefill_only_their_new_tokens(run):
    for t in run.trajs:
        starts = [t.prompt_len] + [a for a, _ in t.turn_spans[1:]]
        assert len(t.prefilled_tokens) == len(t.cached_tokens) == t.num_turns
        for k in range(1, t.num_turns):
            new = starts[k] - starts[k - 1]  # the previous turn's generated ids and the tool messages' suffix
            suffix = starts[k] - t.turn_spans[k - 1][1]
            assert t.prefilled_tokens[k] + t.cached_tokens[k] == starts[k]
            assert t.prefilled_tokens[k] <= new + PAGE
            # tighter: everything up to the last full page before the suffix came from the cache
            assert t.prefilled_tokens[k] <= suffix + PAGE, (t.prompt_index, k, t.prefilled_tokens, suffix)
    stats = run.engine.stats
    assert stats.preemptions == 0 and stats.running == stats.waiting == 0
    assert stats.prompt_tokens == sum(t.prompt_len for t in run.trajs) + sum(
        a for t in run.trajs for a, _ in t.turn_spans[1:])
    assert stats.cached_tokens == sum(sum(t.cached_tokens) for t in run.trajs)
    assert stats.generated_tokens == sum(sum(t.trainable) for t in run.trajs)
    # The engine's own count of prefilled tokens agrees (it files a prompt's last token as a decode when a chunk
    # boundary leaves exactly one: at most one token per submission).
    prefilled = sum(sum(t.prefilled_tokens) for t in run.trajs)
    assert prefilled - sum(t.num_turns for t in run.trajs) <= stats.prefilled_tokens <= prefilled
    assert summarize(run.trajs)["resubmit_cache_hit_share"] > 0.8
    run.engine.pool.check()


def test_in_flight_count_stays_at_target_while_prompts_remain(run):
    seen = run.driver.stats.in_flight_while_refilling
    # 40 prompts, 32 slots: after each wake-up while prompts remained, the finished rollouts had been replaced.
    assert seen and all(n == IN_FLIGHT for n in seen), seen
    assert run.driver.stats.rollouts_started == NUM_PROMPTS


def test_failing_tools_and_malformed_calls_are_counted_by_kind(run):
    kinds = Counter(run.script.kind(question(t)) for t in run.trajs)
    broken, lost = len(range(1, IN_FLIGHT, 3)), len(range(2, IN_FLIGHT, 3))
    assert kinds == {"calm": NUM_PROMPTS - broken - lost, "broken": broken, "lost": lost}
    for t in run.trajs:
        assert t.finish_reason == "done" and t.answer is not None  # every rollout got past its failures
        contents = {c.status: c.content for c in t.tool_calls}
        kind = run.script.kind(question(t))
        if kind == "broken":
            assert contents["timeout"] == "Error: tool 'hang' timed out after 0.2 s."
            assert "RuntimeError: <&>" in contents["tool_error"]
            assert "could not parse" in contents["parse_error"]
        elif kind == "lost":
            assert contents["timeout"] == "Error: tool 'stall' timed out after 0.2 s."
            assert "unknown tool 'lookup'" in contents["unknown_tool"]
            assert "argument 'query' must be a string" in contents["bad_arguments"]
    n = len(run.trajs)
    expected = Counter(s for t in run.trajs for s in STATUSES[run.script.kind(question(t))])
    assert set(expected) == {"ok", "parse_error", "timeout", "tool_error", "unknown_tool", "bad_arguments"}
    summary = summarize(run.trajs)
    for status, count in expected.items():
        assert summary[f"tool_status/{status}"] == pytest.approx(count / n), status
    well_formed = sum(expected[s] for s in ("ok", "tool_error", "timeout"))  # a real tool, valid arguments
    assert summary["tool_call_rate"] == 1.0
    assert summary["tool_calls_per_rollout"] == pytest.approx(well_formed / n)
    calls = sum(expected.values())
    assert summary["tool_error_rate"] == pytest.approx((calls - expected["ok"]) / calls)


# ------------------------------------------------------------------------------------------------ read-once
class Echo(Environment):
    """No tools: one turn, answer in a tag."""

    def reward(self, episode) -> float:
        return float(f"<answer>{episode.sample['answer']}</answer>" in (episode.final_text or ""))


def item(question: str) -> int:
    return int(question.split("#")[1])


def echo_script(question: str, turn: int) -> str:
    return f"<answer>{item(question)}</answer>"


class RecordingIterator(PromptIterator):
    """Logs every draw, so a test sees what the driver read and not only what it handed back."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.drawn = []

    def __next__(self):
        prompt = super().__next__()
        self.drawn.append(prompt)
        return prompt


def digest(ids) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()


@pytest.fixture(scope="module")
def echo():
    model, tok = load_model("tiny-qwen3")
    env = Echo()
    fmt = ChatFormat(tok, env.tools())
    samples = [{"question": f"What is the code of item #{i}#?", "answer": str(i)} for i in range(40)]
    policy = ScriptedPolicy(model, echo_script, margin=MARGIN)

    def engine():
        return Engine(policy, EngineConfig(num_pages=512, page_size=PAGE, eos_token_ids=tuple(fmt.eos_token_ids)))

    prompt_digests = {digest(fmt.prompt_ids(env.prompt(s))) for s in samples}
    assert len(prompt_digests) == len(samples)
    return SimpleNamespace(env=env, fmt=fmt, samples=samples, engine=engine, prompt_digests=prompt_digests,
                           model=model)


def test_the_scripted_policy_reads_its_history_through_cache_hits_and_preemption(echo):
    # The policy reads each sequence's history from a token mirror of the KV slots: check it against an engine
    # whose small pool preempts and recomputes, with prompts sharing cached pages.
    policy = ScriptedPolicy(echo.model, lambda q, turn: "<answer>" + "y" * (3 * item(q)) + "</answer>")
    engine = Engine(policy, EngineConfig(num_pages=24, page_size=PAGE, max_tokens_per_step=64,
                                         eos_token_ids=tuple(echo.fmt.eos_token_ids)))
    samples = echo.samples[10:20]
    prompts = [echo.fmt.prompt_ids(echo.env.prompt(s)) for s in samples]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=128, temperature=0.0))
    assert [o.token_ids for o in outs] == [policy.turn_ids(s["question"], 0) for s in samples]
    stats = engine.stats
    assert stats.preemptions > 0 and stats.cached_tokens > 0


def test_three_epochs_through_the_driver_read_each_prompt_once_per_epoch(echo):
    prompts = RecordingIterator(echo.samples, shuffle=True, seed=11, max_epochs=3)
    config = RolloutConfig(group_size=1, rollouts_in_flight=IN_FLIGHT, temperature=0.0, max_turns=2, max_new_tokens=32)
    driver = RolloutDriver(echo.env, echo.engine(), echo.fmt, prompts, config)
    seen: dict[int, list[str]] = {0: [], 1: [], 2: []}

    def on_group(group):
        for t in group.trajectories:  # the ids the model actually saw, hashed
            seen[t.epoch].append(digest(t.input_ids[:t.prompt_len]))
        prompts.consumed(group.prompt)

    groups = driver.run(on_group=on_group)
    assert len(groups) == 3 * len(echo.samples)
    for epoch, digests in seen.items():
        assert len(digests) == len(echo.samples) and set(digests) == echo.prompt_digests, epoch
    drawn = Counter((p.epoch, p.index) for p in prompts.drawn)
    assert set(drawn.values()) == {1} and len(drawn) == 3 * len(echo.samples)
    orders = [[p.index for p in prompts.drawn if p.epoch == e] for e in range(3)]
    assert len({tuple(o) for o in orders}) == 3  # shuffled afresh each epoch
    assert all(t.reward == 1.0 for g in groups for t in g.trajectories)
    assert driver.stats.in_flight_while_refilling and set(driver.stats.in_flight_while_refilling) == {IN_FLIGHT}
    assert prompts.exhausted() and prompts.state_dict()["outstanding"] == []


def test_checkpoint_of_the_iterator_with_rollouts_in_flight_skips_and_repeats_nothing(echo):
    config = RolloutConfig(group_size=1, rollouts_in_flight=12, temperature=0.0, max_turns=2, max_new_tokens=32)
    n = len(echo.samples)
    checkpoint_after = n + 7  # mid-way through the second of three epochs

    # Segment 1: run until `checkpoint_after` prompts are consumed, checkpoint, and stop as a crash would:
    # whatever finishes after the checkpoint is lost with the process.
    first = RecordingIterator(echo.samples, shuffle=True, seed=5, max_epochs=3)
    driver = RolloutDriver(echo.env, echo.engine(), echo.fmt, first, config)
    consumed, state = [], None

    def on_group_first(group):
        nonlocal state
        if state is not None:
            return
        first.consumed(group.prompt)
        consumed.append((group.prompt.epoch, group.prompt.index))
        if len(consumed) == checkpoint_after:
            state = json.loads(json.dumps(first.state_dict()))  # plain data, as a checkpoint stores it
            driver.stop()

    driver.run(on_group=on_group_first)
    assert state is not None and state["epoch"] == 1
    outstanding = [tuple(k) for k in state["outstanding"]]
    assert len(outstanding) > 0  # rollouts were in flight when it was taken
    drawn_first = [(p.epoch, p.index) for p in first.drawn]
    assert set(outstanding) == set(drawn_first) - set(consumed)

    # Segment 2: a fresh process: new engine, new iterator loaded from the checkpoint, run to the end.
    second = RecordingIterator(echo.samples, shuffle=True, seed=5, max_epochs=3)
    second.load_state_dict(state)
    driver = RolloutDriver(echo.env, echo.engine(), echo.fmt, second, config)

    def on_group_second(group):
        second.consumed(group.prompt)
        consumed.append((group.prompt.epoch, group.prompt.index))

    driver.run(on_group=on_group_second)
    # The prompts in flight at the checkpoint are handed out first, with their original epochs.
    assert [(p.epoch, p.index) for p in second.drawn[:len(outstanding)]] == outstanding
    counts = Counter(consumed)
    assert set(counts.values()) == {1}, [k for k, c in counts.items() if c > 1]
    for epoch in range(3):
        assert sorted(i for e, i in counts if e == epoch) == list(range(n)), epoch
    assert second.exhausted() and second.state_dict()["outstanding"] == []


def test_a_stopped_driver_hands_its_engine_back_clean(echo):
    # Answers of very different lengths, so the first group finishes while the others are far from done.
    policy = ScriptedPolicy(echo.model, lambda q, turn: "<answer>" + "x" * (8 * item(q)) + "</answer>")
    engine = Engine(policy, EngineConfig(num_pages=512, page_size=PAGE, eos_token_ids=tuple(echo.fmt.eos_token_ids)))
    config = RolloutConfig(group_size=1, rollouts_in_flight=8, temperature=0.0, max_turns=1, max_new_tokens=128)
    samples = echo.samples[:10]
    first = RolloutDriver(echo.env, engine, echo.fmt, PromptIterator(samples, shuffle=False, max_epochs=1), config)
    first.run(on_group=lambda group: first.stop())
    second = RolloutDriver(echo.env, engine, echo.fmt, PromptIterator(samples, max_epochs=1), config)
    assert len(second.run()) == len(samples)
    stats = engine.stats
    assert stats.running == stats.waiting == 0


def test_a_group_whose_members_finish_together_is_emitted_once(echo):
    """Greedy members of one group are identical, so they finish in the same engine step and reach the driver in
    the same wait: each returns its (by then complete) group, which must still be scored and emitted once."""
    prompts = PromptIterator(echo.samples[:10], shuffle=False, max_epochs=1)
    config = RolloutConfig(group_size=4, rollouts_in_flight=IN_FLIGHT, temperature=0.0, max_turns=2,
                           max_new_tokens=32)
    groups = RolloutDriver(echo.env, echo.engine(), echo.fmt, prompts, config).run()
    ids = [g.group_id for g in groups]
    assert len(ids) == len(set(ids)) == 10
    assert all(len(g.trajectories) == 4 for g in groups)


def test_a_failed_background_engine_fails_the_driver_and_the_trainer_instead_of_hanging(echo):
    import threading

    from agentrl.run.build import take_groups as _take

    engine = echo.engine()
    real_launch, calls = engine._launch, []

    def launch(batch, version):
        calls.append(1)
        if len(calls) == 5:
            raise OSError("device lost mid-step")
        return real_launch(batch, version)

    engine._launch = launch
    config = RolloutConfig(group_size=1, rollouts_in_flight=8, temperature=0.0, max_turns=2, max_new_tokens=32)
    driver = RolloutDriver(echo.env, engine, echo.fmt, PromptIterator(echo.samples, max_epochs=1), config)
    engine.start()
    driver.start()
    failure: list[BaseException] = []

    def trainer():
        try:
            _take(driver, 1000)  # more than will ever be ready: only a failure ends this wait
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    thread.join(timeout=60)
    engine.stop()
    assert failure, "the trainer was still waiting 60 s after the engine thread died"
    driver.stop()  # only now: a driver still waiting on the dead engine would never stop
    chain, exc = [], failure[0]
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__
    assert isinstance(chain[-1], OSError) and "device lost" in str(chain[-1])
    assert any("engine thread failed" in str(e) for e in chain)
