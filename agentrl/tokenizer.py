"""A byte-level tokenizer built offline, for tests and tiny models.

Every byte is one token, so any text round-trips exactly and no file or hub download is needed. The chat
special tokens are single ids, which is what the tool-call stop sequences and the trainable masks rely on.
"""

from __future__ import annotations

from functools import lru_cache

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]


@lru_cache(maxsize=1)
def byte_tokenizer():
    """A `PreTrainedTokenizerFast` over the 256 bytes plus `SPECIAL_TOKENS` (ids 256 and up)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    byte_to_unicode = sorted(alphabet, key=_byte_value)
    vocab = {ch: i for i, ch in enumerate(byte_to_unicode)}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    tok.model_max_length = 1 << 20
    return tok


def _byte_value(ch: str) -> int:
    # GPT-2's byte-to-unicode map: printable bytes map to themselves, the rest to 256 + n in order.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
