"""Behaviour logprobs are those of the distribution each token was drawn from, checked against a
full-sequence forward; sampling is reproducible from seeds whatever shares the batch."""

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from agentrl.engine import Engine, EngineConfig, SamplingParams
from agentrl.engine.sampler import Sampler
from agentrl.models import load_model
from tests.helpers import random_prompts, recomputed_logits, warped_logprobs


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-qwen3")[0]


def test_greedy_logprobs_match_recompute(model):
    prompts = random_prompts(16, 3, 50, seed=1)
    engine = Engine(model, EngineConfig(num_pages=64, max_tokens_per_step=48))
    for out in engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0)):
        logits = recomputed_logits(model, out)
        assert out.token_ids == logits.argmax(-1).tolist()
        expected = logits.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)
        assert out.versions == [0] * len(out.token_ids)


SAMPLED = [
    SamplingParams(max_new_tokens=16, temperature=0.7, top_k=20, top_p=0.9, seed=11),
    SamplingParams(max_new_tokens=16, temperature=1.3, seed=12),
    SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.8, seed=13),
    SamplingParams(max_new_tokens=16, temperature=0.9, top_k=5, seed=14),
]


def test_sampled_logprobs_match_truncated_recompute(model):
    prompts = random_prompts(16, 3, 50, seed=2)
    params = [SAMPLED[i % len(SAMPLED)] for i in range(len(prompts))]
    engine = Engine(model, EngineConfig(num_pages=64, max_tokens_per_step=48))
    for out, p in zip(engine.generate(prompts, params), params):
        ref = warped_logprobs(recomputed_logits(model, out), p)
        expected = ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert torch.isfinite(expected).all()  # every draw lies inside its truncated support
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)


def test_sampling_is_reproducible_whatever_shares_the_batch(model):
    prompts = random_prompts(8, 3, 40, seed=3)
    params = [SAMPLED[i % len(SAMPLED)] for i in range(len(prompts))]
    first = Engine(model, EngineConfig(num_pages=64)).generate(prompts, params)
    # Same requests, now interleaved with others and under a pool small enough to preempt.
    crowded = Engine(model, EngineConfig(num_pages=10, max_tokens_per_step=24))
    others = random_prompts(8, 3, 40, seed=4)
    mixed = crowded.generate([x for pair in zip(prompts, others) for x in pair],
                             [x for p in params for x in (p, SamplingParams(max_new_tokens=16, temperature=1.0))])
    assert crowded.stats.preemptions > 0
    assert [o.token_ids for o in mixed[::2]] == [o.token_ids for o in first]
    # Without per-request seeds, the engine's seed and the submission order decide.
    unseeded = SamplingParams(max_new_tokens=16, temperature=1.0)
    a = Engine(model, EngineConfig(num_pages=64, seed=5)).generate(prompts, unseeded)
    b = Engine(model, EngineConfig(num_pages=64, seed=5)).generate(prompts, unseeded)
    c = Engine(model, EngineConfig(num_pages=64, seed=6)).generate(prompts, unseeded)
    assert [o.token_ids for o in a] == [o.token_ids for o in b] != [o.token_ids for o in c]


def test_sampler_draws_from_the_truncated_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.95)
    n = 6000
    sampler = Sampler(torch.device("cpu"))
    # one request's successive draws: one seed, counters 0..n-1
    tokens, logprobs = sampler(logits.expand(n, -1), [params] * n, seeds=[0] * n, counters=range(n))
    probs = warped_logprobs(logits[None], params)[0].exp()
    freq = torch.bincount(tokens, minlength=6).double() / n
    assert (freq[probs == 0] == 0).all()
    torch.testing.assert_close(freq, probs.double(), atol=0.02, rtol=0)
    torch.testing.assert_close(logprobs, probs.log()[tokens], atol=1e-5, rtol=0)
