"""Text a tokenizer can take: Python strings may hold lone surrogates, which no UTF-8 encoder accepts.

They reach a conversation from JSON a model writes (`"\\ud800"` decodes to one), from tool output and from
data files; a fast tokenizer refuses such a string outright, and so does writing it to a UTF-8 file. A valid
pair left as two code points is joined into the character it stands for; anything else becomes U+FFFD.
"""

from __future__ import annotations

import re

__all__ = ["encodable"]

_SURROGATE = re.compile("[\ud800-\udfff]")


def encodable(text: str) -> str:
    """`text` with its surrogate code points joined into pairs or replaced by U+FFFD; unchanged (the same
    object) when it has none."""
    if text.isascii() or _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
