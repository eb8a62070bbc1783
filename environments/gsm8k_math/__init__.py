"""gsm8k_math: grade-school math word problems, with an optional `calculate` tool.

The reward is 1.0 when the final answer equals the gold answer numerically, else 0.0; whether the answer
was given in an explicit format (`<answer>`, `\\boxed{}`, `#### n`) is logged beside it with weight 0.
"""

from __future__ import annotations

from agentrl import Environment, Episode, tool
from environments.gsm8k_math.answer import extract_answer, extract_marked, is_correct
from environments.gsm8k_math.calculator import calculate as _calculate
from environments.gsm8k_math.data import load_problems

__all__ = ["GSM8KMathEnv", "GSM8KCalculatorEnv", "load_environment", "extract_answer", "is_correct"]

_ANSWER_RULE = "Give the final answer as a single number inside <answer>...</answer>, e.g. <answer>42</answer>."


class GSM8KMathEnv(Environment):
    """Plain reasoning: no tools, one answer turn."""

    name = "gsm8k_math"
    system_prompt = "Solve the math word problem step by step. " + _ANSWER_RULE
    # Correctness is the task; the format flag shows whether a model learns the answer convention.
    reward_weights = {"correct": 1.0, "format": 0.0}

    def __init__(self, path: str | None = None, split: str = "train", limit: int | None = None, seed: int = 0,
                 **kwargs):
        super().__init__(**kwargs)
        self.path, self.split, self.limit, self.seed = path, split, limit, seed

    def load_dataset(self, split: str | None = None, path: str | None = None,
                     limit: int | None = None) -> list[dict]:
        """Problems of `split` from `path` (None: the values given at construction).

        A local file's rows are checked as `environments.gsm8k_math.data` says: a malformed row is an error
        naming its file and line; a row with a null or blank question or answer, or an answer without a final
        number, is skipped and counted (`limit` counts the rows kept).
        """
        problems = load_problems(split or self.split, path if path is not None else self.path, seed=self.seed)
        limit = limit if limit is not None else self.limit
        return problems if limit is None else problems[:limit]

    def is_done(self, episode: Episode, assistant_text: str, calls: list[dict]) -> bool:
        # An explicit answer ends the episode even if the turn also called a tool.
        return not calls or extract_marked(assistant_text)[1]

    def reward(self, episode: Episode) -> dict[str, float]:
        text = final_answer_text(episode)
        gold = str(episode.sample.get("answer", ""))
        return {"correct": float(is_correct(text, gold)),
                "format": float(bool(text) and extract_marked(text)[0] is not None)}


class GSM8KCalculatorEnv(GSM8KMathEnv):
    """The same task with a `calculate` tool for the arithmetic."""

    system_prompt = ("Solve the math word problem step by step. Use the `calculate` tool for arithmetic "
                     "instead of computing large numbers in your head. " + _ANSWER_RULE)

    @tool
    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression and return its value.

        Args:
            expression: Numbers with + - * / // % ** and parentheses, e.g. "(48 / 2) + 24";
                sqrt, abs, round, min, max, floor and ceil are allowed.
        """
        return _calculate(expression)


def final_answer_text(episode: Episode) -> str:
    """The text the answer is read from: the final turn, or, if the episode never finished, its last
    assistant turn only when that holds an explicit answer marker (free text mid-work is no answer)."""
    if episode.final_text is not None:
        return episode.final_text
    last = next((m.get("content") or "" for m in reversed(episode.messages) if m.get("role") == "assistant"), "")
    return last if extract_marked(last)[1] else ""


def load_environment(path: str | None = None, split: str = "train", limit: int | None = None, seed: int = 0,
                     use_calculator: bool = True, **kwargs) -> GSM8KMathEnv:
    """The environment, with the `calculate` tool unless `use_calculator=False`; `path` None means the
    built-in generated problems, "hub" means GSM8K from the hub."""
    cls = GSM8KCalculatorEnv if use_calculator else GSM8KMathEnv
    return cls(path=path, split=split, limit=limit, seed=seed, **kwargs)
