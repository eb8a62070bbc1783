"""Where a hotpotqa_search eval's answer F1 is: the per-question JSONL of `agentrl eval --out` split by the searches
each rollout made and by whether its own search results held the gold answer (the environment's `answer_found`
rule: normalized whole words; yes/no answers apart, since no paragraph states them). One column pair (rollouts,
mean F1) per file, so a before and an after eval read side by side. With `--data` (the evaluated HotpotQA file),
also by the question's type (bridge, comparison), matched by sample id.

usage: python benchmarks/eval_breakdown.py before.jsonl after.jsonl [...] [--data dev.jsonl]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from agentrl import Episode
from agentrl.env.execute import ToolCall
from environments.hotpotqa_search import answer_found, normalize_answer, searches_run
from environments.hotpotqa_search.data import load_samples


def _episode(record: dict) -> Episode:
    """What `answer_found` reads of an episode, from one JSONL record: the sample's answer and its own calls (the
    worked examples' search results are in `messages`, not here)."""
    calls = [ToolCall(c["turn"], c["name"], c["arguments"], c["status"], c["content"]) for c in record["tool_calls"]]
    return Episode(sample={"answer": record["gold"]}, tool_calls=calls)


def breakdown(records: list[dict], types: dict[str, str] | None = None) -> dict[str, tuple[int, float]]:
    """Row name -> (rollouts, mean answer F1): by searches made (0, 1, 2, 3+), then by retrieval, then (`types`:
    sample id -> HotpotQA question type) by type."""
    groups: dict[str, list[float]] = defaultdict(list)
    for record in records:
        f1 = float(record["reward_components"]["answer_f1"])
        if types is not None:
            groups[f"type: {types.get(str(record.get('sample_id')), 'unknown')}"].append(f1)
        episode = _episode(record)
        searches = searches_run(episode)
        groups[f"searches: {min(searches, 3)}{'+' if searches >= 3 else ''}"].append(f1)
        if normalize_answer(str(record["gold"])) in ("yes", "no"):
            groups["answer yes/no"].append(f1)
        elif answer_found(episode):
            groups["answer in its search results"].append(f1)
        else:
            groups["answer not in its search results"].append(f1)
        groups["all"].append(f1)
    return {name: (len(v), sum(v) / len(v)) for name, v in sorted(groups.items())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("evals", nargs="+", type=Path, help="`agentrl eval --out` JSONL files")
    ap.add_argument("--data", help="the evaluated HotpotQA file, for the split by question type")
    args = ap.parse_args()
    types = None
    if args.data:
        types = {str(s["id"]): str(s.get("type") or "unknown") for s in load_samples("dev", args.data, seed=0)}
    tables = [breakdown([json.loads(line) for line in p.read_text().splitlines() if line.strip()], types)
              for p in args.evals]
    rows = sorted({name for t in tables for name in t}, key=lambda n: (n == "all", n))
    print("| rollouts | " + " | ".join(f"{p.stem} n | {p.stem} F1" for p in args.evals) + " |")
    print("|---" * (1 + 2 * len(tables)) + "|")
    for name in rows:
        cells = [f"{t[name][0]} | {t[name][1]:.3f}" if name in t else "0 | –" for t in tables]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
