"""Next-token choice and its behaviour logprob, for a whole step's rows in a handful of tensor ops.

The behaviour logprob is the log-probability of the chosen token under the distribution it was actually
drawn from: logits / temperature, then top-k, then top-p (the order transformers' warpers use), then
log-softmax. A trainer's importance ratio divides by exactly that. Greedy rows (temperature 0) choose the
argmax, and report the model's plain log-softmax (temperature 1, no truncation), since the point mass they
were "drawn" from would report 0 for every token.

Randomness is counter-based: the draw for the token at index `i` of a request with seed `s` uses one
uniform number that is a pure function of `(s, i)` (an integer hash, `uniform_bits`), and picks the token
by inverting the row's cumulative distribution at it. So a request's draws do not depend on what else
shares its batch, survive preemption (a recomputed prefix draws nothing, and the next index is the same),
and need no generator state. One uniform per row, not one per vocabulary entry: the hash runs on the host
over `[rows]` (it rides in the step's single host-to-device copy, see `Sampler.columns`), where an
exponential race would need noise over all `[rows, vocab]` entries, a dozen passes over 78M values per
step at 512 x 152k. Inversion is an exact draw: token j is chosen when the uniform falls in
`[cdf[j-1], cdf[j])`, an interval of width p_j; the CDF is summed in float64, so a truncated token (p = 0,
an empty interval) is never chosen.
"""

from __future__ import annotations

import numpy as np
import torch

from agentrl.engine.types import SamplingParams

# Odd 64-bit multipliers for the mixing rounds (drawn at random once; checked for avalanche: flipping any
# input bit flips each output bit with probability 0.5 within sampling noise), and 2^64 / golden ratio to
# spread consecutive counters before mixing.
_M1, _M2 = np.uint64(0x9448300879882DBD), np.uint64(0xF11B22D049497209)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MASK64 = (1 << 64) - 1
NUM_COLUMNS = 4  # uniform bits, temperature, top_k, top_p


def _mix(x: np.ndarray) -> np.ndarray:
    # uint64 arrays wrap on overflow (numpy only warns for scalars), which is the arithmetic wanted here
    x = x ^ (x >> np.uint64(32))
    x = x * _M1
    x = x ^ (x >> np.uint64(29))
    x = x * _M2
    return x ^ (x >> np.uint64(32))


def uniform_bits(seeds, counters) -> np.ndarray:
    """53 random bits per `(seed, counter)` pair, as int64 in [0, 2^53): `bits * 2^-53` is uniform in [0, 1)."""
    s = np.array([int(v) & _MASK64 for v in seeds], dtype=np.uint64)
    c = np.array(counters, dtype=np.uint64)
    x = _mix(_mix(s) + (c + np.uint64(1)) * _GOLDEN)
    return (x >> np.uint64(11)).astype(np.int64)


def truncate_logits(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_k: int,
                    any_top_p: bool) -> torch.Tensor:
    """Top-k then top-p over tempered logits `[N, V]` (removed tokens at -inf). `top_k` 0 and `top_p` 1 are off.
    `max_k` (the largest active k, 0 if none) and `any_top_p` come from the host, so that deciding which
    truncations run costs no device sync."""
    vocab = x.shape[-1]
    if max_k:
        has_k = (top_k > 0) & (top_k < vocab)
        kth = x.topk(max_k, dim=-1).values.gather(1, (torch.where(has_k, top_k, max_k) - 1)[:, None])
        kth = kth.masked_fill(~has_k[:, None], float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th value stay, as in transformers
    if any_top_p:
        ordered, order = x.sort(dim=-1)  # ascending
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p.to(x.dtype))[:, None]
        drop[:, -1] = False  # the most likely token always stays
        x = x.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return x


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device

    @staticmethod
    def columns(params: list[SamplingParams], seeds, counters) -> np.ndarray:
        """Per-row knobs of one step as one int64 array `[NUM_COLUMNS * N]` (floats bit-cast), so they travel
        in the step's single host-to-device copy: uniform bits of `(seed, counter)`, temperature, top_k, top_p.
        Greedy rows get no truncation, so their logprobs are the plain log-softmax."""
        temp = np.array([p.temperature for p in params], dtype=np.float64)
        top_k = np.array([p.top_k if p.temperature > 0 else 0 for p in params], dtype=np.int64)
        top_p = np.array([p.top_p if p.temperature > 0 else 1.0 for p in params], dtype=np.float64)
        return np.concatenate([uniform_bits(seeds, counters), temp.view(np.int64), top_k, top_p.view(np.int64)])

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], columns=None, *, seeds=None,
                 counters=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens `[N]` and their behaviour logprobs `[N]` for logits `[N, V]`. `columns` is what `columns()`
        built (a device tensor, or the host array); without it, it is built from `seeds` and `counters`."""
        n, vocab = logits.shape
        if logits.is_cuda and all(p.temperature == 0 for p in params):
            from agentrl.engine.triton_sampling import greedy

            return greedy(logits)
        logits = logits.float()
        if all(p.temperature == 0 for p in params):
            # log_softmax at the argmax is -log(sum(exp(x - max))): no [N, V] log-softmax written for one entry
            top, tokens = logits.max(dim=-1)
            return tokens, -(logits - top[:, None]).exp().sum(dim=-1).log()
        if columns is None:
            columns = self.columns(params, seeds, counters)
        if isinstance(columns, np.ndarray):
            columns = torch.from_numpy(columns).to(logits.device)
        bits, temp, top_k, top_p = columns.view(NUM_COLUMNS, n)
        temp, top_p = temp.view(torch.float64), top_p.view(torch.float64)
        greedy = temp == 0
        x = logits / torch.where(greedy, 1.0, temp).to(logits.dtype)[:, None]
        max_k = max((p.top_k for p in params if p.temperature > 0 and 0 < p.top_k < vocab), default=0)
        x = truncate_logits(x, top_k, top_p, max_k, any(p.temperature > 0 and p.top_p < 1 for p in params))
        logp = x.log_softmax(dim=-1)
        cdf = logp.exp().cumsum(dim=-1, dtype=torch.float64)
        # u < 1, so u * total < total = cdf[-1] exactly in float64: some entry is greater, and the first one
        # (right=True skips entries equal to the target) closes a non-empty interval, a token with p > 0.
        target = bits.to(torch.float64) * 2.0 ** -53 * cdf[:, -1]
        tokens = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp_max_(vocab - 1)
        if any(p.temperature == 0 for p in params):
            tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
        return tokens, logp.gather(1, tokens[:, None])[:, 0]
