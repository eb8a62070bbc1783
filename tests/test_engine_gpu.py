"""The same engine on CUDA: pinned host copies, device generators and the torch reference kernels there."""

import pytest
import torch

from agentrl.engine import Engine, EngineConfig, SamplingParams
from agentrl.models import load_model
from tests.test_engine_greedy import hf_greedy, random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3.5"])
def test_cuda_greedy_matches_hf_generate_through_release(name):
    model, _ = load_model(name, device="cuda")
    prompts = random_prompts(16, 3, 60, seed=5)
    greedy = SamplingParams(max_new_tokens=16, temperature=0)
    refs = [hf_greedy(model, p, greedy.max_new_tokens) for p in prompts]
    engine = Engine(model, EngineConfig(num_pages=20, max_tokens_per_step=64))
    ids = [engine.submit(p, greedy) for p in prompts]
    done = {}
    while len(done) < len(ids):
        done.update({c.request_id: c for c in engine.step()})
        engine.release_kv()
        engine.restore_kv()
    assert [done[i].token_ids for i in ids] == refs
    assert engine.stats.preemptions > 0
    sampled = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=50, seed=3)
    a = engine.generate(prompts[:4], sampled)
    b = Engine(model, EngineConfig(num_pages=64)).generate(prompts[:4], sampled)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
