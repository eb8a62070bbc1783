"""BM25 retrieval over titled paragraphs, with a ranking that is identical in every process.

Rollouts of one run are spread over processes (and compared across runs), so the same query must return
the same text everywhere. Nothing here iterates a set or depends on the hash seed: documents keep the
order in which they were first seen, tokens keep their order in the text, and equal scores are broken by
title.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import numpy as np
from rank_bm25 import BM25Okapi

__all__ = ["tokenize", "paragraphs_from_samples", "SearchIndex"]

_WORD = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    """Lower-case alphanumeric words, in text order."""
    return _WORD.findall(text.lower())


def paragraphs_from_samples(samples: Iterable[dict]) -> list[tuple[str, list[str]]]:
    """Every `(title, sentences)` paragraph of the samples' contexts, once per title.

    The first occurrence of a title wins, so the document list depends only on the order of the
    samples (HotpotQA repeats popular paragraphs across questions, identical in practice).
    """
    seen: dict[str, None] = {}
    paragraphs: list[tuple[str, list[str]]] = []
    for sample in samples:
        for title, sentences in sample.get("context") or []:
            if title in seen:
                continue
            seen[title] = None
            paragraphs.append((title, list(sentences)))
    return paragraphs


class SearchIndex:
    """A read-only BM25 index; one instance is shared by all episodes over the same data."""

    def __init__(self, paragraphs: Sequence[tuple[str, Sequence[str]]], max_paragraph_chars: int = 500):
        self.titles = [title for title, _ in paragraphs]
        self.texts = [" ".join(s.strip() for s in sentences if s.strip()) for _, sentences in paragraphs]
        self.max_paragraph_chars = max_paragraph_chars
        # The title is part of the document: many questions name the entity the paragraph is about.
        docs = [tokenize(f"{title} {text}") for title, text in zip(self.titles, self.texts)]
        # BM25Okapi divides by the corpus size, so an empty corpus simply has no model.
        self._bm25 = BM25Okapi(docs) if docs else None
        # BM25Okapi scores every document for every query term in Python, which is slow over a whole split's
        # paragraphs. Postings (term -> ascending doc ids and term counts) let a query touch only the
        # documents that contain its terms, with the same formula and the same per-document order of
        # additions, hence the same scores.
        freqs = self._bm25.doc_freqs if self._bm25 else []
        term_id: dict[str, int] = {}
        flat_terms, flat_docs, flat_tf = [], [], []
        for i, counts in enumerate(freqs):
            for term, count in counts.items():
                flat_terms.append(term_id.setdefault(term, len(term_id)))
                flat_docs.append(i)
                flat_tf.append(count)
        # One stable sort groups the postings by term, keeping each term's doc ids ascending; a term's
        # postings are then one slice of two flat arrays (far cheaper than an array per term).
        order = np.argsort(np.array(flat_terms, dtype=np.int64), kind="stable")
        self._post_docs = np.array(flat_docs, dtype=np.int64)[order]
        self._post_tf = np.array(flat_tf, dtype=np.float64)[order]
        bounds = np.cumsum(np.bincount(np.array(flat_terms, dtype=np.int64), minlength=len(term_id))).tolist()
        self._postings = {t: (bounds[j - 1] if j else 0, bounds[j]) for t, j in term_id.items()}
        self._doc_len = np.array(self._bm25.doc_len if self._bm25 else [], dtype=np.float64)

    def __len__(self) -> int:
        return len(self.titles)

    def _ranked(self, query: str, top_k: int) -> list[tuple[int, float]]:
        terms = tokenize(query)
        if self._bm25 is None or not terms or top_k <= 0:
            return []
        scores = self.scores(terms)
        # Matching by shared word rather than by positive score matters for tiny corpora, where
        # BM25's idf floor can make every score negative.
        found = [self._post_docs[slice(*self._postings[t])] for t in terms if t in self._postings]
        if not found:
            return []
        matched = np.unique(np.concatenate(found)).tolist()
        matched.sort(key=lambda i: (-float(scores[i]), self.titles[i]))
        return [(i, float(scores[i])) for i in matched[:top_k]]

    def scores(self, terms: list[str]) -> np.ndarray:
        """BM25Okapi's score of every document for the query terms (zero where no term occurs)."""
        bm25 = self._bm25
        out = np.zeros(len(self.titles))
        if bm25 is None:
            return out
        for term in terms:  # repeated terms count again, as in BM25Okapi.get_scores
            if term not in self._postings:
                continue
            span = slice(*self._postings[term])
            ids, tf = self._post_docs[span], self._post_tf[span]
            norm = bm25.k1 * (1 - bm25.b + bm25.b * self._doc_len[ids] / bm25.avgdl)
            out[ids] += (bm25.idf.get(term) or 0) * (tf * (bm25.k1 + 1) / (tf + norm))
        return out

    def rank(self, query: str, top_k: int = 3) -> list[tuple[str, float]]:
        """The best `top_k` (title, score) pairs: score descending, then title ascending."""
        return [(self.titles[i], score) for i, score in self._ranked(query, top_k)]

    def search(self, query: str, top_k: int = 3) -> str:
        """The `top_k` best paragraphs as numbered, titled blocks of text (each capped in length)."""
        hits = self._ranked(query, top_k)
        if not hits:
            return f"No results for {query!r}."
        blocks = []
        for n, (i, _) in enumerate(hits, start=1):
            title, text = self.titles[i], self.texts[i]
            if len(text) > self.max_paragraph_chars:
                text = text[: self.max_paragraph_chars - 3].rstrip() + "..."
            blocks.append(f"[{n}] {title}\n{text}")
        return "\n\n".join(blocks)
