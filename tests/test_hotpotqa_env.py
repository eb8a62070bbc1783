"""hotpotqa_search environment: generated corpus, data loading, search tool, episodes and reward."""

import asyncio
import json

import pytest

import agentrl
from environments.hotpotqa_search import HotpotQASearchEnv, load_environment
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
    assert [m["role"] for m in episode.messages] == ["system", "user"]
    results = asyncio.run(env.step(episode, _call(sample["question"])))
    assert results[0].status == "ok" and results[0].content.startswith("[1] ")
    assert results[0].content.count("\n\n[") == 2  # top_k = 3
    assert not episode.done
    asyncio.run(env.step(episode, f"Found it. <answer>{sample['answer']}</answer>"))
    assert episode.done
    total, parts = env.total_reward(episode)
    assert parts == {"answer_f1": 1.0, "answer_em": 1.0, "search_calls": 1.0}
    assert total == 1.0  # EM and search count carry weight 0


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
    # train.jsonl: the smaller real file (200 questions), enough to exercise loading and search.
    env = load_environment(path=str(shared_data / "hotpotqa" / "train.jsonl"))
    samples = env.load_dataset(limit=4)
    assert len(samples) == 4
    first = samples[0]
    assert set(first) >= {"id", "question", "answer", "context"} and first["id"] == "5ab4435b5542990594ba9bdf"
    assert all(isinstance(t, str) and isinstance(s, list) for t, s in first["context"])
    folder = load_environment(path=str(shared_data / "hotpotqa")).load_dataset(split="train", limit=4)
    assert folder == samples
    # A gold paragraph of the first question is reachable through search on the dev index.
    gold_title = first["supporting_facts"][0][0]
    assert f"] {gold_title}\n" in env.index_for(first).search(gold_title, top_k=3)
    with pytest.raises(FileNotFoundError):
        load_environment(path=str(tmp_path)).load_dataset(split="dev")


def test_plain_json_file(tmp_path):
    rows = [{"_id": "a1", "question": "Q?", "answer": "A", "context": [["T", ["s1", "s2"]]]}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    (sample,) = load_environment(path=str(tmp_path / "d.json")).load_dataset()
    assert sample["id"] == "a1" and sample["context"] == [["T", ["s1", "s2"]]]
