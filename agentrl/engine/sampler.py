"""Next-token choice and its behaviour logprob.

The behaviour logprob is the log-probability of the chosen token under the distribution it was actually
drawn from: logits / temperature, then top-k, then top-p (the order transformers' warpers use), then
log-softmax. A trainer's importance ratio divides by exactly that. Greedy rows (temperature 0) choose the
argmax, and report the model's plain log-softmax (temperature 1, no truncation), since the point mass they
were "drawn" from would report 0 for every token.

Each sampled request owns a generator, seeded from its `SamplingParams.seed` or, failing that, from the
engine's seed at submission, so a request's draws do not depend on what else shares its batch and
survive preemption (a recomputed prefix draws nothing).
"""

from __future__ import annotations

import torch

from agentrl.engine.types import SamplingParams


def truncate_logits(logits: torch.Tensor, temperature: list[float], top_k: list[int],
                    top_p: list[float]) -> torch.Tensor:
    """Tempered and truncated logits `[N, V]` (removed tokens at -inf). `top_k` 0 and `top_p` 1 are off.
    The knobs come as host lists so that deciding which truncations run costs no device sync."""
    device, vocab = logits.device, logits.shape[-1]
    x = logits / torch.tensor(temperature, dtype=logits.dtype, device=device)[:, None]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    if any(k < vocab for k in ks):
        kth = x.topk(max(ks), dim=-1).values.gather(1, torch.tensor(ks, device=device)[:, None] - 1)
        x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th value stay, as in transformers
    if any(p < 1 for p in top_p):
        ordered, order = x.sort(dim=-1)  # ascending
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - torch.tensor(top_p, dtype=x.dtype, device=device))[:, None]
        drop[:, -1] = False  # the most likely token always stays
        x = x.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return x


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device

    def make_generator(self, seed: int) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        return gen

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens `[N]` and their behaviour logprobs `[N]` for logits `[N, V]`."""
        logits = logits.float()
        greedy_logp = logits.log_softmax(dim=-1)
        greedy_tokens = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        if not sampled:
            return greedy_tokens, greedy_logp.gather(1, greedy_tokens[:, None])[:, 0]
        rows = torch.tensor(sampled, device=logits.device)
        sub = [params[i] for i in sampled]
        x = truncate_logits(logits[rows], [p.temperature for p in sub], [p.top_k for p in sub],
                            [p.top_p for p in sub])
        logp = x.log_softmax(dim=-1)
        # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) is an exact draw from p, and each row's noise
        # comes from its own generator, so the batch around a request never changes its draws.
        noise = torch.empty_like(logp)
        for r, i in enumerate(sampled):
            noise[r].exponential_(generator=generators[i])
        choice = (logp.exp() / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
        tokens = greedy_tokens.clone()
        logprobs = greedy_logp.gather(1, greedy_tokens[:, None])[:, 0]
        tokens[rows] = choice
        logprobs[rows] = logp.gather(1, choice[:, None])[:, 0]
        return tokens, logprobs
