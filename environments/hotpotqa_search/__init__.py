"""hotpotqa_search: multi-hop question answering with a BM25 `search` tool.

The model searches the paragraphs of the loaded split (HotpotQA, or the built-in generated set) and gives
its answer in `<answer>…</answer>`; the reward is the answer's F1 against the gold answer, with exact match
and the number of searches logged beside it.
"""

from __future__ import annotations

from agentrl import Environment, Episode, tool
from environments.hotpotqa_search.data import load_samples
from environments.hotpotqa_search.metrics import answer_em, answer_f1, extract_answer, has_answer_tag, normalize_answer
from environments.hotpotqa_search.search import SearchIndex, paragraphs_from_samples

__all__ = ["HotpotQASearchEnv", "load_environment", "answer_f1", "answer_em", "extract_answer", "predicted_answer",
           "normalize_answer", "SearchIndex"]

SYSTEM_PROMPT = (
    "You answer questions that need facts from more than one encyclopedia paragraph. "
    "Use the `search` tool to look things up, one entity or fact at a time; you may search several times. "
    "When you know the answer, reply with it inside <answer>...</answer> and nothing else after it. "
    "Keep the answer short: a name, a place, a number, or yes/no.\n\n"
    # A worked call in the prompt: small instruction models (SmolLM2-135M) never call a tool from the schema
    # alone (0 of 50 on HotpotQA dev), and RL cannot reinforce a behaviour it never samples.
    "Example of a search call:\n"
    '<tool_call>\n{"name": "search", "arguments": {"query": "Eiffel Tower architect"}}\n</tool_call>'
)


class HotpotQASearchEnv(Environment):
    name = "hotpotqa_search"
    system_prompt = SYSTEM_PROMPT
    # F1 is what HotpotQA reports and what varies smoothly enough to learn from; the others are diagnostics.
    reward_weights = {"answer_f1": 1.0, "answer_em": 0.0, "search_calls": 0.0}

    def __init__(self, path: str | None = None, split: str = "train", limit: int | None = None, seed: int = 0,
                 top_k: int = 3, max_paragraph_chars: int = 500, **kwargs):
        super().__init__(**kwargs)
        self.path, self.split, self.limit, self.seed = path, split, limit, seed
        self.top_k = top_k
        self.max_paragraph_chars = max_paragraph_chars
        # Read-only after construction of each entry, so episodes on any thread may share them.
        self._indexes: dict[tuple, SearchIndex] = {}
        self._index_of_sample: dict[str, SearchIndex] = {}

    # ---- data ----------------------------------------------------------------------------------------

    def load_dataset(self, split: str | None = None, path: str | None = None,
                     limit: int | None = None) -> list[dict]:
        """Samples of `split` from `path` (None: the values given at construction).

        The search index covers the whole split, before `limit`, so a question sees the same search
        results whether it is evaluated alone or among all the others.
        """
        split = split or self.split
        path = path if path is not None else self.path
        limit = limit if limit is not None else self.limit
        samples = load_samples(split, path, seed=self.seed)
        key = (split, None if path is None else str(path), self.seed)
        index = self._indexes.get(key)
        if index is None:
            index = SearchIndex(paragraphs_from_samples(samples), self.max_paragraph_chars)
            self._indexes[key] = index
        for sample in samples:
            self._index_of_sample[_sample_key(sample)] = index
        return samples if limit is None else samples[:limit]

    def index_for(self, sample: dict) -> SearchIndex:
        """The index a sample's searches run against: its split's, or (for a sample that was not loaded
        through `load_dataset`) one over the sample's own context paragraphs."""
        index = self._index_of_sample.get(_sample_key(sample))
        if index is None:
            index = SearchIndex(paragraphs_from_samples([sample]), self.max_paragraph_chars)
        return index

    # ---- rollout -------------------------------------------------------------------------------------

    def start(self, sample: dict) -> Episode:
        # A sample that did not come through load_dataset gets its index here, on the driver's thread, so
        # tools (which run on worker threads) only ever read the mapping. Episode state stays plain data.
        key = _sample_key(sample)
        if key not in self._index_of_sample:
            self._index_of_sample[key] = self.index_for(sample)
        return super().start(sample)

    @tool
    def search(self, query: str, episode: Episode) -> str:
        """Search the encyclopedia and return the best matching paragraphs with their titles.

        Args:
            query: Keywords to look for, such as the name of a person, place or company.
        """
        return self.index_for(episode.sample).search(query, self.top_k)

    def is_done(self, episode: Episode, assistant_text: str, calls: list[dict]) -> bool:
        # An answer ends the episode even if the turn also asked for a search: the answer is final.
        return not calls or has_answer_tag(assistant_text)

    def reward(self, episode: Episode) -> dict[str, float]:
        prediction = predicted_answer(episode)
        gold = str(episode.sample.get("answer", ""))
        searches = sum(1 for c in episode.tool_calls
                       if c.get("name") == "search" and c.get("status") in ("ok", "truncated"))
        return {"answer_f1": answer_f1(prediction, gold), "answer_em": answer_em(prediction, gold),
                "search_calls": float(searches)}


def predicted_answer(episode: Episode) -> str:
    """The episode's answer: from its final turn, or, if it never finished, only from an explicit
    `<answer>` tag in its last assistant turn (an unfinished turn's free text is not an answer)."""
    if episode.final_text is not None:
        return extract_answer(episode.final_text)
    last = next((m.get("content") or "" for m in reversed(episode.messages) if m.get("role") == "assistant"), "")
    return extract_answer(last) if has_answer_tag(last) else ""


def _sample_key(sample: dict) -> str:
    return str(sample.get("id") or sample.get("question", ""))


def load_environment(path: str | None = None, split: str = "train", limit: int | None = None, seed: int = 0,
                     top_k: int = 3, **kwargs) -> HotpotQASearchEnv:
    """The environment; `path` None means the built-in generated corpus, "hub" means HotpotQA from the hub."""
    return HotpotQASearchEnv(path=path, split=split, limit=limit, seed=seed, top_k=top_k, **kwargs)
