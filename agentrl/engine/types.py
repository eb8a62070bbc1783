"""The engine's public value types: what a caller submits and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one request. `temperature == 0` is greedy."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # per-request counter-based noise; None draws a seed from the engine's generator
    stop_token_ids: tuple[int, ...] = ()  # single ids that end the request (eos ids are added by the engine)
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # id sequences that end it, e.g. the end of a tool call
    # Text that ends it however it was tokenized (`stop_strings.py`); needs the engine's tokenizer.
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings must not be empty strings")


@dataclass
class Completion:
    """A finished request. `logprobs[i]` is the behaviour logprob of `token_ids[i]` under the distribution it was
    actually sampled from (after temperature / top-k / top-p); `versions[i]` the policy version that produced it."""

    request_id: int
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "stop" (eos / stop id / stop sequence), "length", "max_model_len", "cancelled"
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
