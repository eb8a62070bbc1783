"""gsm8k_math environment: generated problems, data loading, calculator option, episodes and reward."""

import asyncio
import re

import pytest

import agentrl
from environments.gsm8k_math import GSM8KCalculatorEnv, GSM8KMathEnv, is_correct, load_environment
from environments.gsm8k_math.answer import gold_number
from environments.gsm8k_math.calculator import evaluate
from environments.gsm8k_math.problems import TEMPLATES, generate_problems


def _calc_call(expression: str) -> str:
    return '<tool_call>{"name": "calculate", "arguments": {"expression": "' + expression + '"}}</tool_call>'


def test_loads_by_name_with_calculator_by_default():
    env = agentrl.load_environment("gsm8k_math")
    assert isinstance(env, GSM8KCalculatorEnv)
    assert env.tool_names() == ["calculate"]
    (schema,) = env.tools()
    assert schema["function"]["parameters"]["required"] == ["expression"]
    assert "calculate" in env.system_prompt and "<answer>" in env.system_prompt


def test_use_calculator_false_lists_no_tool():
    env = agentrl.load_environment("gsm8k_math", use_calculator=False)
    assert type(env) is GSM8KMathEnv
    assert env.tools() == [] and env.tool_handle("calculate") is None
    assert "calculate" not in env.system_prompt
    episode = env.start({"question": "1+1?", "answer": "#### 2"})
    results = asyncio.run(env.execute(episode, [{"name": "calculate", "arguments": {"expression": "1+1"}}]))
    assert results[0].status == "unknown_tool"


def test_generated_problems_are_deterministic_and_correct():
    train, dev = generate_problems(seed=0, split="train"), generate_problems(seed=0, split="dev")
    assert (len(train), len(dev)) == (320, 80)
    assert generate_problems(seed=0, split="train") == train
    assert generate_problems(seed=3, split="train") != train
    assert len({p["question"] for p in train + dev}) == 400
    assert len({p["id"] for p in train + dev}) == 400
    for p in train + dev:
        gold = gold_number(p["answer"])
        assert gold is not None and gold.denominator == 1 and gold >= 0
        # Every calculator annotation in the worked solution is itself right.
        for expr, value in re.findall(r"<<([^=]+)=([^>]+)>>", p["answer"]):
            assert evaluate(expr) == pytest.approx(float(value))
        assert is_correct(p["answer"], p["answer"])
    # Every template appears in the held-out split too.
    assert len(dev) >= len(TEMPLATES)
    with pytest.raises(ValueError, match="splits"):
        generate_problems(split="other")


def test_episode_with_calculator_and_reward():
    env = load_environment(limit=3)
    problems = env.load_dataset()
    assert len(problems) == 3
    problem = problems[0]
    episode = env.start(problem)
    gold = problem["answer"].rsplit("####", 1)[1].strip()
    results = asyncio.run(env.step(episode, "Let me compute. " + _calc_call(f"{gold} + 0")))
    assert results[0].status == "ok" and results[0].content == gold
    assert episode.tool_calls[0].name == "calculate" and not episode.done
    asyncio.run(env.step(episode, f"The answer is <answer>{gold}</answer>."))
    assert episode.done
    assert env.total_reward(episode) == (1.0, {"correct": 1.0, "format": 1.0})


def test_reward_components():
    env = load_environment()
    problem = {"id": "p", "question": "?", "answer": "#### 12"}

    def judge(text):
        episode = env.start(problem)
        asyncio.run(env.step(episode, text))
        return env.total_reward(episode)

    assert judge("so 12") == (1.0, {"correct": 1.0, "format": 0.0})  # right, but no marker
    assert judge("\\boxed{13}") == (0.0, {"correct": 0.0, "format": 1.0})  # wrong, well formatted
    assert judge("nothing") == (0.0, {"correct": 0.0, "format": 0.0})


def test_unfinished_episode_counts_only_marked_answers():
    env = load_environment()
    episode = env.start({"question": "?", "answer": "#### 12"})
    episode.messages.append({"role": "assistant", "content": "12 " + _calc_call("3*4")})
    assert env.reward(episode)["correct"] == 0.0
    episode.messages.append({"role": "assistant", "content": "#### 12"})
    assert env.reward(episode)["correct"] == 1.0


def test_calculator_errors_reach_the_model_as_text():
    env = load_environment()
    episode = env.start({"question": "?", "answer": "#### 1"})
    (result,) = asyncio.run(env.step(episode, _calc_call("__import__('os')")))
    assert result.status == "ok" and result.content.startswith("Error: calling __import__")


def test_local_file(shared_data):
    env = load_environment(path=str(shared_data / "gsm8k" / "train.jsonl"), limit=5)
    problems = env.load_dataset()
    assert len(problems) == 5 and problems[0]["id"] == "train-0"
    assert problems[0]["answer"].endswith("#### 72")
    assert env.load_dataset(limit=2) == problems[:2]
    folder = load_environment(path=str(shared_data / "gsm8k")).load_dataset(split="train", limit=5)
    assert folder == problems


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_environment(path=str(tmp_path / "nope.jsonl")).load_dataset()
    with pytest.raises(FileNotFoundError):
        load_environment(path=str(tmp_path)).load_dataset(split="test")
