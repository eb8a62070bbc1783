"""A deterministic tool-calling policy for tests: a tiny random model whose logits are steered onto a script.

`ScriptedPolicy` wraps a causal LM (the tiny random Qwen3 with the byte tokenizer). After the wrapped model's
own forward, every row whose next token is wanted gets a bonus on the scripted token: its logit becomes the
row's maximum plus `margin`. Greedy decoding therefore follows the script exactly, while the logprob the
engine reports (the plain log-softmax of those logits) still depends on the real model, so a test can check
it against an independent forward (`steer` is the one rule both sides use). The margin is finite on purpose:
sampled at temperature > 0, the policy would leave its script now and then.

The script is a function `script(question, turn) -> str`: the text of assistant turn `turn` (0-based) for the
rollout whose first user message is `question`. Its tokens are emitted one by one, then `<|im_end|>`. Where a
sequence stands is read from the sequence itself: the question from the first `<|im_start|>user` block, the
turn from the number of `<|im_start|>assistant` headers, the position in the turn from the tokens after the
last one.

Where the history comes from: inside the engine each sequence is fed only its new tokens, so the wrapper
mirrors the paged KV layout with one token id per KV slot (written at the step's `slot_mapping`, read
through the sequence's block table): it reads a sequence's history exactly the way paged attention reads its
keys, prefix-cache hits and preemptions included. Nothing in the engine knows it is being scripted.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from agentrl.engine.attention import current_step

IM_START, IM_END = 257, 258
USER_HEADER = [IM_START, *b"user\n"]
ASSISTANT_HEADER = [IM_START, *b"assistant\n"]

Script = Callable[[str, int], str]


def encode(text: str) -> list[int]:
    """Byte-tokenizer ids of `text`; the chat tags in it (`<tool_call>`, `<|im_end|>`, ...) become single ids."""
    from agentrl.tokenizer import byte_tokenizer

    return list(byte_tokenizer().encode(text, add_special_tokens=False))


def steer(logits: torch.Tensor, token, margin: float) -> torch.Tensor:
    """A copy of `logits` (`[V]`, or `[N, V]` with one token per row) with each row's `token` raised to the
    row's maximum + `margin`."""
    rows = logits.reshape(-1, logits.shape[-1]).clone()
    token = torch.as_tensor(token).reshape(-1, 1)
    rows.scatter_(1, token, rows.max(dim=-1, keepdim=True).values + margin)
    return rows.reshape(logits.shape)


def _headers(history: torch.Tensor, header: list[int]) -> list[int]:
    """Start positions of `header` (which begins with a special id) in a 1-d tensor of ids."""
    n = len(header)
    return [i for i in (history == header[0]).nonzero().flatten().tolist()
            if history[i:i + n].tolist() == header]


def question_of(history: torch.Tensor) -> str | None:
    """The first user message's text, or None."""
    users = _headers(history, USER_HEADER)
    if not users:
        return None
    start = users[0] + len(USER_HEADER)
    ends = (history[start:] == IM_END).nonzero()
    if len(ends) == 0:
        return None
    return bytes(history[start:start + int(ends[0])].tolist()).decode("utf-8")


class ScriptedPolicy(nn.Module):
    """`model` steered onto `script`, to be served by `agentrl.engine.Engine` (which makes its own view of it)."""

    def __init__(self, model: nn.Module, script: Script, margin: float = 2.0):
        super().__init__()
        self.inner = model
        self.script = script
        self.margin = margin
        self._turn_ids: dict[tuple[str, int], list[int]] = {}
        self._slot_tokens = torch.zeros(0, dtype=torch.long)  # one token id per KV slot (engine view only)

    @property
    def config(self):
        return self.inner.config

    def turn_ids(self, question: str, turn: int) -> list[int]:
        """The ids assistant turn `turn` generates for `question`: the script's text, then `<|im_end|>`."""
        key = (question, turn)
        if key not in self._turn_ids:
            self._turn_ids[key] = encode(self.script(question, turn)) + [IM_END]
        return self._turn_ids[key]

    def next_token(self, history) -> int:
        """The scripted continuation of a sequence (ids, list or 1-d tensor) that ends inside an assistant turn."""
        history = torch.as_tensor(history, dtype=torch.long)
        question = question_of(history)
        headers = _headers(history, ASSISTANT_HEADER)
        if question is None or not headers:
            raise AssertionError("the scripted policy was asked to continue a sequence with no assistant turn")
        generated = history[headers[-1] + len(ASSISTANT_HEADER):].tolist()
        wanted = self.turn_ids(question, len(headers) - 1)
        if generated != wanted[:len(generated)] or len(generated) > len(wanted):
            raise AssertionError(f"the sequence left the script in turn {len(headers) - 1} of {question!r}: "
                                 f"generated {generated}, scripted {wanted}")
        if len(generated) == len(wanted):
            # The turn is over, but the engine queued this step before it saw the turn's last token (it overlaps
            # step n+1 with step n): whatever is sampled here is discarded.
            return wanted[-1]
        return wanted[len(generated)]

    def forward(self, input_ids, position_ids=None, logits_to_keep=0, **kwargs):
        step = current_step()
        if step is None:
            raise RuntimeError("ScriptedPolicy steers the engine's forward only; use `.inner` for a plain forward")
        out = self.inner(input_ids=input_ids, position_ids=position_ids, logits_to_keep=logits_to_keep, **kwargs)
        meta = step.meta
        slots = meta.slot_mapping.cpu().long()
        written = slots >= 0  # a negative slot is a padding row that writes no KV
        need = int(slots.max()) + 1
        if need > len(self._slot_tokens):
            grown = torch.zeros(max(need, 2 * len(self._slot_tokens)), dtype=torch.long)
            grown[:len(self._slot_tokens)] = self._slot_tokens
            self._slot_tokens = grown
        self._slot_tokens[slots[written]] = input_ids[0].cpu()[written]
        # Rows whose logits were kept are the last query row of the sequences that sample, in batch order.
        ends = {meta.host_query_start[s] + meta.host_query_lens[s] - 1: s for s in range(meta.num_seqs)}
        rows = logits_to_keep.tolist() if torch.is_tensor(logits_to_keep) else []
        tables, ps = meta.block_tables.cpu().long(), meta.page_size
        logits = out.logits
        for j, row in enumerate(rows):
            s = ends[row]
            pos = torch.arange(meta.host_seq_lens[s])
            history = self._slot_tokens[tables[s, pos // ps] * ps + pos % ps]
            logits[0, j] = steer(logits[0, j], self.next_token(history), self.margin)
        return out
