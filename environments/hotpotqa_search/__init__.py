"""hotpotqa_search: multi-hop question answering with a BM25 `search` tool.

The model searches the paragraphs of the loaded split (HotpotQA, or the built-in generated set) and gives
its answer in `<answer>…</answer>`; the reward is the answer's F1 against the gold answer, with exact match
and the number of searches logged beside it, plus a bonus for a right answer reached by searching
(`search_bonus`: the F1 again, weighted, when a search ran; `hop_bonus`, off by default: again when two different
searches ran), so searching pays only through the answers it finds; `found_bonus`, off by default, pays for search
results that hold the gold answer, whatever the answer given. Worked examples (`few_shot`) open the conversation.
"""

from __future__ import annotations

import json

from agentrl import Environment, Episode, tool
from environments.hotpotqa_search.corpus import generate_samples
from environments.hotpotqa_search.data import load_samples, split_index
from environments.hotpotqa_search.metrics import answer_em, answer_f1, extract_answer, has_answer_tag, normalize_answer
from environments.hotpotqa_search.search import SearchIndex, paragraphs_from_samples

__all__ = ["HotpotQASearchEnv", "load_environment", "answer_f1", "answer_em", "extract_answer", "predicted_answer",
           "normalize_answer", "SearchIndex", "SYSTEM_PROMPT", "EXAMPLES", "example_messages", "format_reward",
           "searched_f1", "two_hop_f1", "distinct_searches", "answer_found", "searches_run"]

SYSTEM_PROMPT = (
    "You answer questions that need facts from more than one encyclopedia paragraph. "
    "Use the `search` tool to look things up, one entity or fact at a time; you may search several times. "
    "When you know the answer, reply with it inside <answer>...</answer> and nothing else after it. "
    "Keep the answer short: a name, a place, a number, or yes/no."
)

# Worked examples, shown as real conversation turns (question, searches with their results, answer) before the
# sample's question: a small model learns the call format from turns it can imitate far better than from the
# instructions and schema alone (BENCHMARKS.md, the few-shot eval). Entities are made up so that no example gives away a real answer, and results have the
# search tool's own layout.
EXAMPLES: tuple[tuple[str, tuple[tuple[str, str], ...], str], ...] = (
    ("Which river flows through the city where the founder of Norbel Foods was born?", (
        ("Norbel Foods", "[1] Norbel Foods\nNorbel Foods is a food company founded in 1921 by Ada Korsch."),
        ("Ada Korsch", "[1] Ada Korsch\nAda Korsch (1890-1960) was a businesswoman born in Lorin, a city on the "
                       "river Tessa.")),
     "Tessa"),
    ("Were the directors of the films Blue Harbor and Night Train of the same nationality?", (
        ("Blue Harbor film", "[1] Blue Harbor\nBlue Harbor is a 1998 drama film directed by the Danish director "
                             "Per Olsen."),
        ("Night Train film", "[1] Night Train\nNight Train is a 2004 thriller film directed by the Danish director "
                             "Mette Lund.")),
     "yes"),
    ("In what year was the university attended by the author of The Glass Orchard founded?", (
        ("The Glass Orchard", "[1] The Glass Orchard\nThe Glass Orchard is a 2010 novel by Hana Reis, who studied "
                              "at Calvey University."),
        ("Calvey University", "[1] Calvey University\nCalvey University is a public university founded in 1885.")),
     "1885"),
    ("What sport does the team owned by Marco Delle play?", (
        ("Marco Delle", "[1] Marco Delle\nMarco Delle is a businessman and the owner of the Riverton Hawks."),
        ("Riverton Hawks", "[1] Riverton Hawks\nThe Riverton Hawks are a professional ice hockey team.")),
     "ice hockey"),
)


def search_call_text(query: str) -> str:
    """An assistant turn calling `search`, written the way the default chat template renders a call."""
    return '<tool_call>\n{"name": "search", "arguments": {"query": ' + json.dumps(query, ensure_ascii=False) + \
        "}}\n</tool_call>"


def example_messages(count: int) -> list[dict]:
    """The first `count` worked examples as user / assistant / tool messages."""
    messages: list[dict] = []
    for question, searches, answer in EXAMPLES[:count]:
        messages.append({"role": "user", "content": question})
        for query, result in searches:
            # Plain assistant text, as the model's own turns are recorded, so the examples read exactly like a
            # rollout of this environment (and show up as such in the viewer).
            messages.append({"role": "assistant", "content": search_call_text(query)})
            messages.append({"role": "tool", "name": "search", "content": result})
        messages.append({"role": "assistant", "content": f"<answer>{answer}</answer>"})
    return messages


def searches_run(episode: Episode) -> int:
    """`search` calls whose results reached the model (status ok or truncated)."""
    return sum(1 for c in episode.tool_calls if c.name == "search" and c.delivered)


def format_reward(episode: Episode) -> float:
    """1.0 if at least one search ran, else 0.0. Once per episode, so repeating searches earns nothing more;
    `format_bonus` is its weight."""
    return float(searches_run(episode) > 0)


def distinct_searches(episode: Episode) -> int:
    """Delivered `search` calls with different queries (case and spacing aside): a repeated query is no new hop."""
    queries = {" ".join(str(c.arguments.get("query", "")).lower().split()) for c in episode.tool_calls
               if c.name == "search" and c.delivered and isinstance(c.arguments, dict)}
    return len(queries)


def two_hop_f1(episode: Episode, f1: float) -> float:
    """The answer's F1 if at least two different searches ran, else 0.0. HotpotQA's questions take two hops, and a
    model that searches twice answers far better than one that searches once (BENCHMARKS.md, learning), yet RL left
    its rate of second searches where it was; this pays for the second hop only through the answer it leads to.
    `hop_bonus` is its weight."""
    return f1 if distinct_searches(episode) >= 2 else 0.0


def answer_found(episode: Episode) -> float:
    """1.0 if a delivered search result holds the gold answer (normalized as F1 normalizes it, matched as whole words),
    else 0.0; 0.0 for yes/no answers, which no paragraph states. A reward for retrieval, the step before answering:
    most held-out rollouts of a trained 1.5B model never saw the answer, and those that did scored several times the
    F1 (BENCHMARKS.md, learning). It pays only for finding the answer, so searching cannot rise on its own, and it
    gives a gradient in groups whose answers all score 0 but whose searches differ. `found_bonus` is its weight."""
    gold = normalize_answer(str(episode.sample.get("answer", "")))
    if not gold or gold in ("yes", "no"):
        return 0.0
    needle = f" {gold} "
    return float(any(needle in f" {normalize_answer(c.content)} " for c in episode.tool_calls
                     if c.name == "search" and c.delivered))


def searched_f1(episode: Episode, f1: float) -> float:
    """The answer's F1 if at least one search ran, else 0.0: a search followed by a wrong answer earns nothing,
    so tool use cannot rise on its own, only with the answers it leads to. `search_bonus` is its weight."""
    return f1 if searches_run(episode) > 0 else 0.0


class HotpotQASearchEnv(Environment):
    name = "hotpotqa_search"
    system_prompt = SYSTEM_PROMPT
    # F1 is what HotpotQA reports and what varies smoothly enough to learn from; the others are diagnostics.
    reward_weights = {"answer_f1": 1.0, "answer_em": 0.0, "search_calls": 0.0}
    # Worked examples before the question (see EXAMPLES); 0 shows the question alone.
    few_shot: int = 4
    # Weight of `searched_f1`: a right answer found by searching scores (1 + search_bonus) x F1, the same answer
    # without a search F1 alone, a wrong one 0 either way. F1 alone does not favour searching where a model's
    # answers score about the same with or without a search; a flat bonus for searching (format_bonus below)
    # makes searching rise on its own while the answers stay wrong (BENCHMARKS.md, the SmolLM2 run).
    search_bonus: float = 0.1
    # Weight of `format_reward` (1.0 once any search ran, whatever the answer): 0.0 by default, for the reason above.
    format_bonus: float = 0.0
    # Weight of `two_hop_f1`: a right answer after two different searches scores hop_bonus x F1 more. 0.0 by default.
    hop_bonus: float = 0.0
    # Weight of `answer_found` (1.0 when the search results held the gold answer). 0.0 by default; kept below the
    # answer's own weight by the recipes that use it, so a right answer still pays more than finding it.
    found_bonus: float = 0.0
    # Generated two-hop questions (the built-in corpus: invented entities, so only searching answers them) added to a
    # training split read from a file: fresh questions beside a small real set, which a long run otherwise draws again
    # and again. Each invented world has its own index, so a real question's searches never meet invented paragraphs.
    # Never added to another split (evals read "dev"). 0 by default.
    generated_questions: int = 0

    def __init__(self, path: str | None = None, split: str = "train", limit: int | None = None, seed: int = 0,
                 top_k: int = 3, max_paragraph_chars: int = 500, **kwargs):
        super().__init__(**kwargs)
        if not 0 <= self.few_shot <= len(EXAMPLES):
            raise ValueError(f"few_shot must be between 0 and {len(EXAMPLES)}, got {self.few_shot}")
        for name in ("search_bonus", "format_bonus", "hop_bonus", "found_bonus", "generated_questions"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.reward_weights = dict(type(self).reward_weights)
        if self.search_bonus:
            self.reward_weights["searched_f1"] = float(self.search_bonus)
        if self.format_bonus:
            self.reward_weights["search_format"] = float(self.format_bonus)
        if self.hop_bonus:
            self.reward_weights["two_hop_f1"] = float(self.hop_bonus)
        if self.found_bonus:
            self.reward_weights["answer_found"] = float(self.found_bonus)
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
        results whether it is evaluated alone or among all the others. A local file's rows are checked as
        `environments.hotpotqa_search.data` says: a malformed row is an error naming its file and line, a row
        with a null or blank question or answer is skipped and counted (`limit` counts the rows kept).
        """
        split = split or self.split
        path = path if path is not None else self.path
        limit = limit if limit is not None else self.limit
        samples = load_samples(split, path, seed=self.seed)
        key = (split, None if path is None else str(path), self.seed)
        index = self._indexes.get(key)
        if index is None:
            # Shared with any other environment of this process over the same data (the command line's input
            # check loads the split once before the run does).
            index = split_index(samples, split, path, self.seed, self.max_paragraph_chars)
            self._indexes[key] = index
        for sample in samples:
            self._index_of_sample[_sample_key(sample)] = index
        if self.generated_questions and split == "train" and path is not None:
            samples = samples + self._generated(int(self.generated_questions))
        return samples if limit is None else samples[:limit]

    def _generated(self, n: int) -> list[dict]:
        """`n` generated training questions from as many invented worlds as it takes, each world searched through an
        index of its own paragraphs. The worlds' seeds are apart from the built-in set's (0 and the run's seed)."""
        out, world = [], 0
        while len(out) < n:
            seed = _GENERATED_SEEDS + 1000 * self.seed + world
            samples = generate_samples(seed=seed, split="train", num_questions=n - len(out), dev_fraction=0.0)
            key = ("generated", seed, len(samples), self.max_paragraph_chars)  # the paragraphs of these questions
            index = self._indexes.get(key)
            if index is None:
                index = self._indexes[key] = SearchIndex(paragraphs_from_samples(samples), self.max_paragraph_chars)
            for sample in samples:
                self._index_of_sample[_sample_key(sample)] = index
            out += samples
            world += 1
        return out

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

    def prompt(self, sample: dict) -> list[dict]:
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages += example_messages(self.few_shot)
        messages.append({"role": "user", "content": str(sample["question"])})
        return messages

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
        f1 = answer_f1(prediction, gold)
        parts = {"answer_f1": f1, "answer_em": answer_em(prediction, gold), "search_calls": float(searches_run(episode))}
        if self.search_bonus:
            parts["searched_f1"] = searched_f1(episode, f1)
        if self.format_bonus:
            parts["search_format"] = format_reward(episode)
        if self.hop_bonus:
            parts["two_hop_f1"] = two_hop_f1(episode, f1)
        if self.found_bonus:
            parts["answer_found"] = answer_found(episode)
        return parts


def predicted_answer(episode: Episode) -> str:
    """The episode's answer: from its final turn, or, if it never finished, only from an explicit
    `<answer>` tag in its last assistant turn (an unfinished turn's free text is not an answer)."""
    if episode.final_text is not None:
        return extract_answer(episode.final_text)
    turns = episode.messages[episode.num_prompt_messages:]  # the worked examples' answers are not the episode's
    last = next((m.get("content") or "" for m in reversed(turns) if m.get("role") == "assistant"), "")
    return extract_answer(last) if has_answer_tag(last) else ""


_GENERATED_SEEDS = 100_000  # the first invented world's seed for `generated_questions`


def _sample_key(sample: dict) -> str:
    return str(sample.get("id") or sample.get("question", ""))


def load_environment(path: str | None = None, split: str = "train", limit: int | None = None, seed: int = 0,
                     top_k: int = 3, **kwargs) -> HotpotQASearchEnv:
    """The environment; `path` None means the built-in generated corpus, "hub" means HotpotQA from the hub."""
    return HotpotQASearchEnv(path=path, split=split, limit=limit, seed=seed, top_k=top_k, **kwargs)
