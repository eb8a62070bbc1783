"""Answer scoring for HotpotQA-style questions.

The normalisation follows the official HotpotQA evaluation so that rewards computed during training
are the same numbers a paper would report: lower-case, drop punctuation, drop the articles a/an/the,
collapse whitespace. Yes/no questions are all-or-nothing, as in the official script, so a rambling
"yes, but no" cannot collect partial credit from token overlap.
"""

from __future__ import annotations

import re
import string
from collections import Counter

__all__ = ["normalize_answer", "answer_f1", "answer_em", "extract_answer", "has_answer_tag", "SPECIAL_ANSWERS"]

# Answers that are judged by exact match only: partial overlap with them means nothing.
SPECIAL_ANSWERS = ("yes", "no", "noanswer")

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def normalize_answer(text: str) -> str:
    """Lower-case, strip punctuation and articles, collapse whitespace (the official order)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _f1_from_normalised(pred: str, gold: str) -> float:
    if (pred in SPECIAL_ANSWERS or gold in SPECIAL_ANSWERS) and pred != gold:
        return 0.0
    pred_tokens = pred.split()
    gold_tokens = gold.split()
    overlap = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(pred_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def answer_f1(prediction: str, gold: str) -> float:
    """Token-level F1 between the normalised prediction and gold answer, in [0, 1]."""
    return _f1_from_normalised(normalize_answer(prediction or ""), normalize_answer(gold or ""))


def answer_em(prediction: str, gold: str) -> float:
    """1.0 when the normalised prediction equals the normalised gold answer, else 0.0."""
    return float(normalize_answer(prediction or "") == normalize_answer(gold or ""))


def extract_answer(text: str | None) -> str:
    """The model's final answer: the last `<answer>…</answer>` span if any, else the whole text.

    Falling back to the whole text keeps a model that forgot the tags scorable (its F1 is then
    diluted by the extra words, which is the pressure towards using the tags).
    """
    if not text:
        return ""
    spans = _ANSWER_TAG.findall(text)
    if spans:
        return spans[-1].strip()
    return text.strip()


def has_answer_tag(text: str | None) -> bool:
    """Whether the text holds a complete `<answer>…</answer>` span."""
    return bool(text) and _ANSWER_TAG.search(text) is not None
