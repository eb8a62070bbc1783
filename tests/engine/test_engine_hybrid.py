"""Hybrid models (Qwen3.5: linear-attention layers with per-sequence state slots beside the paged KV of the
full-attention layers) decode token-identically to transformers, chunked, preempted and released."""

import pytest
import torch

from agentrl.engine import Engine, EngineConfig, SamplingParams
from agentrl.models import load_model
from tests.helpers import hf_greedy, random_prompts, recomputed_logits

GREEDY = SamplingParams(max_new_tokens=16, temperature=0)


@pytest.fixture(scope="module")
def hybrid():
    model, _ = load_model("tiny-qwen3.5")
    prompts = random_prompts(8, 3, 80, seed=3)
    return model, prompts, [hf_greedy(model, p, GREEDY.max_new_tokens) for p in prompts]


@pytest.mark.parametrize("config", [
    EngineConfig(num_pages=64, max_tokens_per_step=256),
    # chunks of prompts carry the recurrent state across steps; 3 slots for 8 requests, and preemption
    EngineConfig(num_pages=8, max_num_seqs=3, max_tokens_per_step=24),
], ids=["ample", "chunked-preempting"])
def test_hybrid_greedy_matches_hf_generate(hybrid, config):
    model, prompts, refs = hybrid
    engine = Engine(model, config)
    assert engine.linear is not None and engine.snapshots is not None  # the prefix cache resumes from snapshots
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == refs
    if config.num_pages == 8:
        assert engine.stats.preemptions > 0


def test_hybrid_default_step_budget_prefills_every_prompt_in_one_step(hybrid):
    """Unset, a hybrid engine's step budget is `HYBRID_STEP_TOKENS` (its prefill steps run eagerly, bound by the
    host's work a layer, so fewer and larger ones are faster) and a dense engine's `DENSE_STEP_TOKENS`; set, it is
    the config's. Twelve prompts of 150-200 tokens (more than a dense engine's budget) then prefill in one step, with
    the tokens of the smaller budget's several."""
    from agentrl.engine.config import DENSE_STEP_TOKENS, HYBRID_STEP_TOKENS

    model = hybrid[0]
    prompts = random_prompts(12, 150, 200, seed=9)
    params = SamplingParams(max_new_tokens=4, temperature=0)
    engine = Engine(model, EngineConfig(num_pages=256))
    assert engine.config.max_tokens_per_step == engine.scheduler.max_tokens == HYBRID_STEP_TOKENS
    outs = engine.generate(prompts, params)
    assert engine.stats.steps == params.max_new_tokens  # one step prefills all and samples each first token
    small = Engine(model, EngineConfig(num_pages=256, max_tokens_per_step=DENSE_STEP_TOKENS))
    assert [o.token_ids for o in small.generate(prompts, params)] == [o.token_ids for o in outs]
    assert small.stats.steps > params.max_new_tokens + 1
    dense, _ = load_model("tiny-qwen3")
    assert Engine(dense, EngineConfig(num_pages=64)).config.max_tokens_per_step == DENSE_STEP_TOKENS


def test_hybrid_sampled_logprobs_and_release(hybrid):
    model, prompts, _ = hybrid
    params = [SamplingParams(max_new_tokens=16, temperature=1.0, seed=i) for i in range(len(prompts))]
    config = EngineConfig(num_pages=32, max_tokens_per_step=32)
    reference = Engine(model, config).generate(prompts, params)
    engine = Engine(model, config)
    ids = [engine.submit(p, s) for p, s in zip(prompts, params)]
    done = {}
    while len(done) < len(ids):
        done.update({c.request_id: c for c in engine.step()})
        engine.release_kv()
        engine.restore_kv()
    for i, ref in zip(ids, reference):
        out = done[i]
        assert out.token_ids == ref.token_ids
        expected = recomputed_logits(model, out).log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None])
        # The decode runs the delta rule's recurrent form, the recompute its chunked form: measured on these
        # prompts, transformers' own cached generate differs from its full recompute by up to 2.0e-4.
        torch.testing.assert_close(torch.tensor(out.logprobs), expected[:, 0], atol=5e-4, rtol=0)
