"""Stopping on text: a request ends once its generated text contains one of its stop strings.

A stop sequence of token ids (`SamplingParams.stop_sequences`) misses the same text sampled as other pieces: where
`</tool_call>` is ordinary text rather than an added token (`model.tool_tags=text`), a model can write it as
`\\n</` + `tool` + `_call>` instead of the pieces `encode("</tool_call>")` gives, keep going, and write the tool's
answer itself. Decoding every sampled token would cost the engine's step loop a tokenizer call per sequence; here a
token is decoded only when its own text holds the stop string's last character (a table of such ids is built once
per character from the vocabulary), and then only a window of the last tokens, as long as the string has bytes.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._holding: dict[str, frozenset[int]] = {}

    def tokens_holding(self, char: str) -> frozenset[int]:
        """Ids whose own text contains `char` (the vocabulary decoded once per character asked for)."""
        if char not in self._holding:
            size = len(self.tokenizer)
            texts = self.tokenizer.batch_decode([[i] for i in range(size)])
            self._holding[char] = frozenset(i for i, text in enumerate(texts) if char in text)
        return self._holding[char]

    def hit(self, tokens: list[int], start: int, index: int, stops: tuple[str, ...]) -> bool:
        """Whether generated `tokens[start:index + 1]` contains a stop string that token `index` completes."""
        token = tokens[index]
        for stop in stops:
            if token in self.tokens_holding(stop[-1]):
                # Every token is at least one byte, so the string lies within its byte length of tokens.
                first = max(start, index + 1 - len(stop.encode()))
                if stop in self.tokenizer.decode(tokens[first:index + 1]):
                    return True
        return False
