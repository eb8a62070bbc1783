"""`agentrl eval --compare BEFORE AFTER`: two `agentrl eval --out` files, metric by metric, with intervals from a
paired bootstrap over questions.

Both files are resampled with the same question indices, so what the two evaluations share (hard questions, easy
ones) cancels in the difference, and its interval is as narrow as the pairing allows. Every metric is a ratio of
per-question sums (a mean over rollouts, or over tool calls for the error rate, as the eval summary pools it), so a
question with several rollouts counts as one unit. Needs numpy only: no model, no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from agentrl.env.execute import DELIVERED, WELL_FORMED

# Record fields that name a question, the first that every record of both files carries wins: `sample_id` is the
# dataset sample's own id (eval writes it when the data has one). `prompt_index` is the question's position in the
# evaluated dataset, so two files match by it only when they evaluated the same data.
ID_FIELDS = ("sample_id", "id", "prompt_index")
HEADLINE = ("answer_f1", "answer_em", "correct")  # reward components shown first, where an environment has them
TOOL_METRICS = ("tool_call_rate", "tool_calls_per_rollout", "tool_error_rate", "mean_turns", "truncated_rate")
SHOWN_IDS = 10  # excluded question ids listed by name; the rest are counted


class CompareError(ValueError):
    """Input that cannot be compared: a missing file, a line that is not a JSON object, no common question."""


def read_results(path: str) -> list[dict]:
    """The records of one `agentrl eval --out` file, one JSON object per non-blank line."""
    if not Path(path).is_file():
        raise CompareError(f"{path}: no such file")
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise CompareError(f"{path}:{number}: not JSONL ({exc.msg})") from None
                if not isinstance(record, dict) or "reward" not in record:
                    raise CompareError(f"{path}:{number}: not a record of `agentrl eval --out` (no reward field)")
                records.append(record)
    except UnicodeDecodeError:
        raise CompareError(f"{path}: not JSONL (not UTF-8 text)") from None
    if not records:
        raise CompareError(f"{path}: no records")
    return records


def record_metrics(record: dict) -> dict[str, tuple[float, float]]:
    """{metric: (numerator, denominator)} of one rollout, the same quantities the eval summary reports."""
    calls = record.get("tool_calls") or []
    well_formed = sum(c.get("status") in WELL_FORMED for c in calls)
    failed = sum(c.get("status") not in DELIVERED for c in calls)
    out = {key: (float(value), 1.0) for key, value in (record.get("reward_components") or {}).items()}
    out["reward"] = (float(record["reward"]), 1.0)
    out["tool_call_rate"] = (float(well_formed > 0), 1.0)
    out["tool_calls_per_rollout"] = (float(well_formed), 1.0)
    out["tool_error_rate"] = (float(failed), float(len(calls)))  # pooled over calls
    out["mean_turns"] = (float(record.get("num_turns", len(record.get("turn_spans") or []))), 1.0)
    out["truncated_rate"] = (float(record.get("finish_reason") == "truncated"), 1.0)
    return out


def _question_key(value):
    return value if isinstance(value, (str, int)) else json.dumps(value, sort_keys=True)


def _by_question(records: list[dict], field: str | None) -> tuple[dict, dict]:
    """({question id: per-metric [numerator, denominator] summed over its rollouts}, {question id: gold}), in file
    order."""
    questions: dict = {}
    golds: dict = {}
    for position, record in enumerate(records):
        key = position if field is None else _question_key(record[field])
        golds.setdefault(key, record.get("gold"))
        sums = questions.setdefault(key, {})
        for metric, (num, den) in record_metrics(record).items():
            acc = sums.setdefault(metric, [0.0, 0.0])
            acc[0] += num
            acc[1] += den
    return questions, golds


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    return np.divide(num, den, out=np.zeros(np.broadcast(num, den).shape), where=den > 0)  # no calls: rate 0


def bootstrap_sums(values: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    """Column sums of `values` (questions x columns) over `resamples` resamples of its rows with replacement: each
    resample's counts per question, times `values`, in blocks that bound memory whatever the number of questions."""
    rng = np.random.default_rng(seed)
    n = len(values)
    out = np.empty((resamples, values.shape[1]))
    block = max(1, (1 << 22) // n)
    for start in range(0, resamples, block):
        rows = min(block, resamples - start)
        picks = rng.integers(0, n, size=(rows, n)) + n * np.arange(rows)[:, None]
        counts = np.bincount(picks.ravel(), minlength=rows * n).reshape(rows, n)
        out[start:start + rows] = counts.astype(np.float64) @ values
    return out


def compare(before_path: str, after_path: str, resamples: int = 10_000, seed: int = 0, level: float = 0.95) -> dict:
    """Means before and after, their difference, and `level` percentile intervals of all three, per metric."""
    if resamples < 1:
        raise CompareError(f"--resamples {resamples}: must be at least 1")
    before, after = read_results(before_path), read_results(after_path)
    field = next((f for f in ID_FIELDS if all(r.get(f) is not None for r in before + after)), None)
    (qb, gold_b), (qa, gold_a) = _by_question(before, field), _by_question(after, field)
    common = [key for key in qb if key in qa]
    only_before = [key for key in qb if key not in qa]
    only_after = [key for key in qa if key not in qb]
    if not common:
        raise CompareError(f"{before_path} and {after_path} have no question in common "
                           f"(matched by {field or 'position'})")
    in_before = {m for key in common for m in qb[key]}
    in_after = {m for key in common for m in qa[key]}
    components = sorted((in_before & in_after) - {"reward", *TOOL_METRICS, *HEADLINE})
    metrics = [m for m in (*HEADLINE, *components, "reward", *TOOL_METRICS) if m in in_before & in_after]
    # Columns: per metric, before's numerator and denominator, then after's; a question without a metric adds 0/0.
    values = np.array([[x for m in metrics for q in (qb[key], qa[key]) for x in q.get(m, (0.0, 0.0))]
                       for key in common]).reshape(len(common), len(metrics), 2, 2)
    sums = bootstrap_sums(values.reshape(len(common), -1), resamples, seed).reshape(resamples, len(metrics), 2, 2)
    point = values.sum(axis=0)
    lo, hi = 50 * (1 - level), 50 * (1 + level)
    rows = {}
    for i, metric in enumerate(metrics):
        b, a = _ratio(*point[i, 0]), _ratio(*point[i, 1])
        boot_b, boot_a = _ratio(sums[:, i, 0, 0], sums[:, i, 0, 1]), _ratio(sums[:, i, 1, 0], sums[:, i, 1, 1])
        intervals = np.percentile(np.stack([boot_b, boot_a, boot_a - boot_b]), [lo, hi], axis=1).T.tolist()
        rows[metric] = {"before": float(b), "after": float(a), "difference": float(a - b),
                        "before_ci": intervals[0], "after_ci": intervals[1], "difference_ci": intervals[2]}
    return {"before_file": before_path, "after_file": after_path, "matched_by": field or "position",
            "resamples": resamples, "seed": seed, "level": level, "metrics": rows,
            "n": {"before": len(qb), "after": len(qa), "compared": len(common)},
            "only_in_before": only_before, "only_in_after": only_after,
            "only_one_file_metrics": sorted(in_before ^ in_after),
            "gold_differs": sum(gold_b[key] != gold_a[key] for key in common)}


def format_table(result: dict) -> str:
    """The comparison as aligned text: one row per metric, then n, then notes on anything left out."""
    def cell(mean, ci, sign=""):
        return f"{mean:{sign}.4f} [{ci[0]:{sign}.4f}, {ci[1]:{sign}.4f}]"

    pct = f"{100 * result['level']:g}%"
    lines = [("metric", f"before [{pct} CI]", f"after [{pct} CI]", f"after - before [{pct} CI]")]
    for metric, r in result["metrics"].items():
        lines.append((metric, cell(r["before"], r["before_ci"]), cell(r["after"], r["after_ci"]),
                      cell(r["difference"], r["difference_ci"], "+")))
    n = result["n"]
    lines.append(("n (questions)", str(n["before"]), str(n["after"]), f"{n['compared']} paired"))
    widths = [max(len(row[i]) for row in lines) for i in range(4)]
    text = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines]
    by = result["matched_by"]
    matched = "matched by position (the records carry no question id)" if by == "position" else f"matched by {by}"
    text.append(f"paired bootstrap over questions: {result['resamples']} resamples, seed {result['seed']}; {matched}")
    for side in ("before", "after"):
        ids = result[f"only_in_{side}"]
        if ids:
            shown = ", ".join(map(str, ids[:SHOWN_IDS])) + (f", ... ({len(ids) - SHOWN_IDS} more)"
                                                            if len(ids) > SHOWN_IDS else "")
            questions = f"{len(ids)} question{'s' * (len(ids) != 1)}"
            text.append(f"excluded: {questions} only in {result[f'{side}_file']}: {shown}")
    if result["only_one_file_metrics"]:
        text.append(f"not compared (in one file only): {', '.join(result['only_one_file_metrics'])}")
    if result["gold_differs"]:
        text.append(f"warning: {result['gold_differs']} paired questions have different gold answers; "
                    "the files may come from different data")
    return "\n".join(text)
