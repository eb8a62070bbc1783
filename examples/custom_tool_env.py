"""Adding a tool to an environment: subclass it and write one decorated method.

`CountryFacts` is a small self-contained task (questions answered from a table through a `lookup` tool);
`CountryFactsPlus` is the point of the example: it adds a `compare` tool in a few lines. The type hints and
the docstring are all the model is told about the tool, and the `episode` parameter, hidden from the
model, is how a tool keeps per-rollout state.

Run: python examples/custom_tool_env.py   (plays a scripted episode, no model needed; agentrl must be
installed, `pip install -e .`, or on the path, `PYTHONPATH=.`)
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

from agentrl import Environment, Episode, tool

FACTS = {
    "france": {"capital": "Paris", "population_millions": 68.4},
    "japan": {"capital": "Tokyo", "population_millions": 124.5},
    "kenya": {"capital": "Nairobi", "population_millions": 55.1},
    "peru": {"capital": "Lima", "population_millions": 34.4},
}


class CountryFacts(Environment):
    name = "country_facts"
    system_prompt = "Use the tools to look facts up. Reply with only the final answer."

    @tool
    def lookup(self, country: str, field: Literal["capital", "population_millions"]) -> str:
        """Look up one fact about a country.

        Args:
            country: the country's English name.
            field: which fact to return.
        """
        return str(self.row(country)[field])

    def row(self, country: str) -> dict:
        key = country.strip().lower()
        if key not in FACTS:  # the message reaches the model, so it names what would have worked
            raise ValueError(f"no data for {country!r}; known countries: {', '.join(sorted(FACTS))}")
        return FACTS[key]

    def load_dataset(self, split: str = "train", path: str | None = None, limit: int | None = None) -> list[dict]:
        samples = [{"question": f"What is the capital of {c.title()}?", "answer": f["capital"]} for c, f in FACTS.items()]
        return samples[:limit] if limit is not None else samples

    def reward(self, episode: Episode) -> dict[str, float]:
        answer = (episode.final_text or "").strip().rstrip(".").lower()
        return {"correct": float(answer == str(episode.sample["answer"]).lower()),
                "tool_calls": float(len(episode.tool_calls))}

    reward_weights = {"tool_calls": 0.0}  # logged, never rewarded


class CountryFactsPlus(CountryFacts):
    @tool(timeout=2.0)
    def compare(self, first: str, second: str, episode: Episode) -> str:
        """Compare the populations of two countries.

        Args:
            first: a country name.
            second: another country name.
        """
        ratio = self.row(first)["population_millions"] / self.row(second)["population_millions"]
        episode.state["comparisons"] = episode.state.get("comparisons", 0) + 1
        return f"{first} has {ratio:.2f} times the population of {second}."


def load_environment(**kwargs) -> CountryFactsPlus:
    return CountryFactsPlus(**kwargs)


async def scripted_episode(env: Environment) -> Episode:
    """One episode with the model's turns written out, as a driver would run it with a real model."""
    episode = env.start({"question": "Which has more people, Japan or Peru? Answer with the country.",
                         "answer": "Japan"})
    turns = ['<tool_call>{"name": "compare", "arguments": {"first": "Japan", "second": "Peru"}}</tool_call>',
             "Japan"]
    for text in turns:
        await env.step(episode, text)
    return episode


def main() -> None:
    env = load_environment()
    print(json.dumps(env.tools()[-1], indent=2))
    episode = asyncio.run(scripted_episode(env))
    for message in episode.messages:
        print(f"[{message['role']}] {message['content']}")
    print("reward:", env.total_reward(episode), "state:", episode.state)


if __name__ == "__main__":
    main()
