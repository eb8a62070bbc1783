"""hotpotqa_search environment: generated corpus, data loading, search tool, episodes and reward."""

import asyncio
import json

import pytest

import agentrl
from agentrl.chat import parse_tool_calls
from agentrl.env.execute import ToolCall
from agentrl.chat.template import builtin_template, render
from environments.hotpotqa_search import (EXAMPLES, HotpotQASearchEnv, answer_found, example_messages,
                                          format_reward, load_environment, normalize_answer)
from environments.hotpotqa_search.corpus import generate_samples


def _call(query: str) -> str:
    return '<tool_call>{"name": "search", "arguments": {"query": ' + json.dumps(query) + "}}</tool_call>"


@pytest.fixture(scope="module")
def env():
    return agentrl.load_environment("hotpotqa_search")


@pytest.fixture(scope="module")
def train(env):
    return env.load_dataset()


def test_loads_by_name_with_one_search_tool(env):
    assert isinstance(env, HotpotQASearchEnv)
    (schema,) = env.tools()
    fn = schema["function"]
    assert fn["name"] == "search"
    assert fn["parameters"]["required"] == ["query"]
    assert list(fn["parameters"]["properties"]) == ["query"]  # `episode` is injected, never shown
    assert "search" in env.system_prompt and "<answer>" in env.system_prompt


def test_generated_splits_are_deterministic_and_disjoint(train, env):
    dev = env.load_dataset(split="dev")
    assert (len(train), len(dev)) == (320, 80)
    assert {s["question"] for s in train}.isdisjoint(s["question"] for s in dev)
    assert generate_samples(seed=0, split="train") == train
    assert generate_samples(seed=1, split="train")[0]["question"] != train[0]["question"]
    assert env.load_dataset(split="validation") == dev
    with pytest.raises(ValueError, match="splits"):
        env.load_dataset(split="nonsense")


def test_generated_samples_look_like_hotpotqa_distractor(train):
    types = {s["type"] for s in train}
    assert types == {"bridge", "comparison"}
    yes_no = [s["answer"] for s in train if s["answer"] in ("yes", "no")]
    assert 0 < yes_no.count("yes") and 0 < yes_no.count("no")
    for s in train:
        assert set(s) >= {"id", "question", "answer", "context"}
        titles = [t for t, _ in s["context"]]
        assert len(titles) == 10 and len(set(titles)) == 10
        gold = [t for t, _ in s["supporting_facts"]]
        assert len(set(gold)) == 2 and set(gold) <= set(titles)
        if s["answer"] not in ("yes", "no"):
            # The answer is written in one of the two gold paragraphs (or is one of their titles).
            gold_text = " ".join(t + " " + " ".join(sents) for t, sents in s["context"] if t in gold)
            assert s["answer"] in gold_text, s


def test_bridge_question_needs_two_searches(env, train):
    sample = next(s for s in train if s["question"].startswith("In which country was the founder of"))
    company = sample["question"].removeprefix("In which country was the founder of ").removesuffix(" born?")
    index = env.index_for(sample)
    first = index.search(company, top_k=1)
    assert first.startswith(f"[1] {company}\n") and sample["answer"] not in first
    founder = first.split(" by ", 1)[1].split(".")[0]
    second = index.search(founder, top_k=1)
    assert second.startswith(f"[1] {founder}\n") and sample["answer"] in second


def test_episode_search_answer_and_reward(env, train):
    sample = train[0]
    episode = env.start(sample)
    assert [m["role"] for m in episode.messages] == ["system", *["user", *["assistant", "tool"] * 2, "assistant"] * 4,
                                                     "user"]
    assert episode.messages[-1]["content"] == sample["question"]
    results = asyncio.run(env.step(episode, _call(sample["question"])))
    assert results[0].status == "ok" and results[0].content.startswith("[1] ")
    assert results[0].content.count("\n\n[") == 2  # top_k = 3
    assert not episode.done
    asyncio.run(env.step(episode, f"Found it. <answer>{sample['answer']}</answer>"))
    assert episode.done
    total, parts = env.total_reward(episode)
    assert parts == {"answer_f1": 1.0, "answer_em": 1.0, "search_calls": 1.0, "searched_f1": 1.0}
    assert total == pytest.approx(1.1)  # EM and search count carry weight 0, the format bonus 0.1


def test_partial_answer_and_missing_tags():
    env = load_environment()
    sample = {"id": "x", "question": "Q?", "answer": "Marden City", "context": []}
    episode = env.start(sample)
    asyncio.run(env.step(episode, "It is Marden."))  # no tags: the whole text is the prediction
    total, parts = env.total_reward(episode)
    # P 1/3, R 1/2
    assert parts["answer_f1"] == pytest.approx(0.4) and parts["answer_em"] == 0.0 and total == pytest.approx(0.4)


def test_unfinished_episode_scores_only_explicit_answers(env):
    sample = {"id": "y", "question": "Q?", "answer": "Marden", "context": []}
    episode = env.start(sample)
    episode.messages.append({"role": "assistant", "content": "Marden maybe " + _call("Marden")})
    assert env.reward(episode)["answer_f1"] == 0.0
    episode.messages.append({"role": "assistant", "content": "<answer>Marden</answer> " + _call("x")})
    assert env.reward(episode)["answer_f1"] == 1.0


def test_worked_examples_open_the_conversation(env, train):
    sample = train[0]
    assert env.few_shot == 4
    assert load_environment(few_shot=0).prompt(sample) == [{"role": "system", "content": env.system_prompt},
                                                          {"role": "user", "content": sample["question"]}]
    two = load_environment(few_shot=2).prompt(sample)
    assert two[1:-1] == example_messages(2) and two[-1] == {"role": "user", "content": sample["question"]}
    assert sum(m["role"] == "user" for m in env.prompt(sample)) == len(EXAMPLES) + 1
    # Every example search is a call the parser reads back exactly, to a query the index could answer.
    every = example_messages(len(EXAMPLES))
    for i, (question, searches, answer) in enumerate(EXAMPLES):
        turns = every[6 * i:6 * i + 6]  # user, (assistant call, tool result) x 2, assistant answer
        assert turns[0] == {"role": "user", "content": question}
        for k, (query, result) in enumerate(searches):
            assert parse_tool_calls(turns[1 + 2 * k]["content"]) == [{"name": "search", "arguments": {"query": query}}]
            assert turns[2 + 2 * k] == {"role": "tool", "name": "search", "content": result}
            assert result.startswith("[1] ")
        assert turns[5] == {"role": "assistant", "content": f"<answer>{answer}</answer>"}
    with pytest.raises(ValueError, match="few_shot"):
        load_environment(few_shot=len(EXAMPLES) + 1)
    with pytest.raises(ValueError, match="few_shot"):
        load_environment(few_shot=-1)


def test_example_calls_read_like_the_template_renders_calls():
    # The examples are stored as plain assistant text (as the model's own turns are); under the default template
    # they must be the same text a structured call renders to, so the model sees one call format throughout.
    source = builtin_template("chatml_tools")
    (as_text,) = [m for m in example_messages(1) if m["role"] == "assistant"][:1]
    structured = {"role": "assistant", "content": "",
                  "tool_calls": [{"type": "function", "function": {"name": "search",
                                                                   "arguments": {"query": EXAMPLES[0][1][0][0]}}}]}
    assert render(source, [as_text]) == render(source, [structured])


def test_examples_are_not_the_episodes_answer(env):
    # The examples end in answers (one of them "yes"); an episode that has not answered yet scores nothing.
    sample = {"id": "z", "question": "Q?", "answer": "yes", "context": []}
    episode = env.start(sample)
    assert episode.num_prompt_messages == len(episode.messages) == 2 + 6 * len(EXAMPLES)
    assert env.reward(episode)["answer_f1"] == 0.0
    episode.messages.append({"role": "assistant", "content": "<answer>yes</answer> " + _call("x")})
    assert env.reward(episode)["answer_f1"] == 1.0


def test_bonuses_zero_leave_plain_f1(train):
    env = load_environment(search_bonus=0)
    episode = env.start(train[0])
    asyncio.run(env.step(episode, _call("anything")))
    asyncio.run(env.step(episode, "<answer>wrong</answer>"))
    total, parts = env.total_reward(episode)
    assert parts == {"answer_f1": 0.0, "answer_em": 0.0, "search_calls": 1.0} and total == 0.0
    assert env.reward_weights == HotpotQASearchEnv.reward_weights


@pytest.mark.parametrize("turns,expected_searched,expected_total", [
    ([_call("q"), "<answer>{gold}</answer>"], 1.0, 1.1),  # searched and right: F1 plus the bonus
    ([_call("q"), "<answer>nothing</answer>"], 0.0, 0.0),  # searched, wrong answer: nothing for searching
    ([_call("a"), _call("b"), _call("c"), "<answer>{gold}</answer>"], 1.0, 1.1),  # once per episode
    (["<answer>{gold}</answer>"], 0.0, 1.0),  # right without searching: F1 alone
    (['<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>', "<answer>{gold}</answer>"], 0.0, 1.0),
    (['<tool_call>{"name": "lookup", "arguments": {"query": "x"}}</tool_call>', "<answer>{gold}</answer>"], 0.0, 1.0),
    (["<tool_call>search: x</tool_call>", "<answer>{gold}</answer>"], 0.0, 1.0),
    (['<tool_call>[{"name": "search", "arguments": {"query": "x"}}]</tool_call>', "<answer>{gold}</answer>"], 1.0, 1.1),
])
def test_search_bonus_pays_only_for_right_answers(env, train, turns, expected_searched, expected_total):
    assert env.search_bonus == 0.1 and env.format_bonus == 0.0
    sample = train[0]
    episode = env.start(sample)
    for text in turns:
        asyncio.run(env.step(episode, text.replace("{gold}", sample["answer"])))
    assert episode.done
    total, parts = env.total_reward(episode)
    assert parts["searched_f1"] == expected_searched
    assert total == pytest.approx(expected_total)
    assert set(parts) == {"answer_f1", "answer_em", "search_calls", "searched_f1"}


@pytest.mark.parametrize("turns,expected_format,expected_total", [
    ([_call("q"), "<answer>nothing</answer>"], 1.0, 0.1),  # the flat bonus: a search with a wrong answer pays
    (['<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>', "<answer>nothing</answer>"], 0.0, 0.0),
])
def test_format_bonus_is_a_flat_bonus_for_searching(train, turns, expected_format, expected_total):
    env = load_environment(search_bonus=0, format_bonus=0.1)
    sample = train[0]
    episode = env.start(sample)
    for text in turns:
        asyncio.run(env.step(episode, text))
    total, parts = env.total_reward(episode)
    assert format_reward(episode) == parts["search_format"] == expected_format
    assert total == pytest.approx(expected_total)


@pytest.mark.parametrize("turns,expected_hop", [
    ([_call("who"), _call("where"), "<answer>{gold}</answer>"], 1.0),  # two hops, right answer
    ([_call("who"), _call("where"), "<answer>nothing</answer>"], 0.0),  # two hops, wrong answer: nothing
    ([_call("who"), _call(" WHO "), "<answer>{gold}</answer>"], 0.0),  # the same query twice is one hop
    ([_call("who"), "<answer>{gold}</answer>"], 0.0),  # one hop
])
def test_hop_bonus_pays_for_a_second_search_only_through_a_right_answer(train, turns, expected_hop):
    env = load_environment(search_bonus=0.1, hop_bonus=0.5)
    assert env.reward_weights["two_hop_f1"] == 0.5
    sample = train[0]
    episode = env.start(sample)
    for text in turns:
        asyncio.run(env.step(episode, text.replace("{gold}", sample["answer"])))
    total, parts = env.total_reward(episode)
    assert parts["two_hop_f1"] == expected_hop
    assert total == pytest.approx(parts["answer_f1"] * 1.1 + 0.5 * expected_hop)
    assert "two_hop_f1" not in load_environment().reward_weights  # off by default
    with pytest.raises(ValueError, match="hop_bonus"):
        load_environment(hop_bonus=-1)


def test_found_bonus_pays_for_results_that_hold_the_answer_whatever_the_answer(train):
    env = load_environment(search_bonus=0.1, found_bonus=0.3)
    assert env.reward_weights["answer_found"] == 0.3
    sample = next(s for s in train if normalize_answer(s["answer"]) not in ("yes", "no"))
    episode = env.start(sample)
    asyncio.run(env.step(episode, _call(sample["answer"])))  # the answer's own words find a paragraph holding it
    assert normalize_answer(sample["answer"]) in normalize_answer(episode.tool_calls[0].content)
    asyncio.run(env.step(episode, "<answer>nothing</answer>"))
    total, parts = env.total_reward(episode)
    assert parts["answer_found"] == 1.0 and parts["answer_f1"] == 0.0 and total == pytest.approx(0.3)
    missed = env.start(sample)  # results without the answer: nothing, even for a right answer
    asyncio.run(env.step(missed, _call("zzzz qqqq")))
    assert normalize_answer(sample["answer"]) not in normalize_answer(missed.tool_calls[0].content)
    asyncio.run(env.step(missed, f"<answer>{sample['answer']}</answer>"))
    total, parts = env.total_reward(missed)
    assert parts["answer_found"] == 0.0 and total == pytest.approx(1.1)
    # Whole words only, and never for yes/no answers.
    for gold, content, expected in (("Tess", "[1] Tessa\nA river.", 0.0), ("Tessa", "[1] Lorin\nOn the Tessa.", 1.0),
                                    ("yes", "[1] Yes\nyes, yes", 0.0)):
        episode = agentrl.Episode(sample={"answer": gold}, tool_calls=[ToolCall(0, "search", {}, "ok", content)])
        assert answer_found(episode) == expected, gold
    assert "answer_found" not in load_environment().reward_weights  # off by default
    with pytest.raises(ValueError, match="found_bonus"):
        load_environment(found_bonus=-1)


def test_format_bonus_options():
    assert load_environment(format_bonus=0.25).reward_weights == {"answer_f1": 1.0, "answer_em": 0.0,
                                                                  "search_calls": 0.0, "searched_f1": 0.1,
                                                                  "search_format": 0.25}
    assert HotpotQASearchEnv.reward_weights == {"answer_f1": 1.0, "answer_em": 0.0, "search_calls": 0.0}
    for name in ("format_bonus", "search_bonus"):
        with pytest.raises(ValueError, match=name):
            load_environment(**{name: -0.1})



def test_answer_with_a_tool_call_ends_the_episode(env, train):
    episode = env.start(train[1])
    results = asyncio.run(env.step(episode, "<answer>x</answer>" + _call("anything")))
    assert episode.done and results == []
    assert env.reward(episode)["search_calls"] == 0.0


def test_top_k_and_limit_options():
    env = load_environment(top_k=1, limit=5)
    samples = env.load_dataset()
    assert len(samples) == 5
    assert "[2]" not in env.search("founder company river", episode=env.start(samples[0]))


def test_index_covers_whole_split_before_limit():
    full = load_environment()
    limited = load_environment(limit=3)
    full_samples, few = full.load_dataset(), limited.load_dataset()
    assert len(limited.index_for(few[0])) == len(full.index_for(full_samples[0]))


def test_unloaded_sample_searches_its_own_context(env):
    sample = {"id": "hand-made", "question": "Who?", "answer": "Zed",
              "context": [["Zed Quorn", ["Zed Quorn is a painter."]], ["Other", ["Nothing here."]]]}
    episode = env.start(sample)
    assert env.search("painter", episode=episode) == "[1] Zed Quorn\nZed Quorn is a painter."


def test_constructor_rejects_unknown_options():
    with pytest.raises(TypeError):
        load_environment(no_such_option=1)
    assert load_environment(max_tool_output_chars=300).max_tool_output_chars == 300


def test_local_file_and_folder(shared_data, tmp_path):
    # train.jsonl: the smaller real file, enough to exercise loading and search. Rows load in file order.
    path = shared_data / "hotpotqa" / "train.jsonl"
    env = load_environment(path=str(path))
    samples = env.load_dataset(limit=4)
    assert len(samples) == 4
    first = samples[0]
    expected_id = json.loads(path.open().readline())["_id"]
    assert set(first) >= {"id", "question", "answer", "context"} and first["id"] == expected_id
    assert all(isinstance(t, str) and isinstance(s, list) for t, s in first["context"])
    folder = load_environment(path=str(shared_data / "hotpotqa")).load_dataset(split="train", limit=4)
    assert folder == samples
    # A gold paragraph of the first question is reachable through search on the dev index.
    gold_title = first["supporting_facts"][0][0]
    assert f"] {gold_title}\n" in env.index_for(first).search(gold_title, top_k=3)
    with pytest.raises(FileNotFoundError):
        load_environment(path=str(tmp_path)).load_dataset(split="dev")


def test_generated_questions_join_a_training_file_with_worlds_of_their_own(tmp_path):
    rows = [{"_id": f"r{i}", "question": f"Where is Real Town {i}?", "answer": "Eastland",
             "context": [[f"Real Town {i}", [f"Real Town {i} is a town in Eastland."]]]} for i in range(3)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = load_environment(path=str(tmp_path / "train.jsonl"), generated_questions=700)
    samples = env.load_dataset(split="train")
    real, generated = samples[:3], samples[3:]
    assert [s["id"] for s in real] == ["r0", "r1", "r2"] and len(generated) == 700
    assert len({s["id"] for s in generated}) == 700 and len({s["id"].split("-")[0] for s in generated}) == 2  # 2 worlds
    assert env.load_dataset(split="train") == samples  # the same questions every time
    # A generated question's searches read its own world (its gold paragraph comes back), a real one's never do.
    question = generated[0]
    title = question["supporting_facts"][0][0]
    assert f"] {title}\n" in env.search(title, env.start(question))
    assert "Real Town" not in env.search(title, env.start(question))
    assert all(f"] {p[0]}\n" not in env.search(title, env.start(real[0])) for p in question["context"])
    # Other splits (evals) and the built-in set get none; no negative counts.
    assert len(env.load_dataset(split="dev", path=str(tmp_path / "train.jsonl"))) == 3
    assert len(load_environment(generated_questions=50).load_dataset(split="train")) == \
        len(load_environment().load_dataset(split="train"))
    with pytest.raises(ValueError, match="generated_questions"):
        load_environment(generated_questions=-1)


def test_plain_json_file(tmp_path):
    rows = [{"_id": "a1", "question": "Q?", "answer": "A", "context": [["T", ["s1", "s2"]]]}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    (sample,) = load_environment(path=str(tmp_path / "d.json")).load_dataset()
    assert sample["id"] == "a1" and sample["context"] == [["T", ["s1", "s2"]]]
