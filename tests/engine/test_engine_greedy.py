"""Greedy decoding through the engine is token-identical to transformers' `generate`, batched or not,
preempted or not; plus the request API's edges (limits, stops, cancel)."""

import pytest
import torch

from agentrl.engine import Engine, EngineConfig, SamplingParams
from agentrl.models import load_model
from tests.helpers import hf_greedy, random_prompts

GREEDY = SamplingParams(max_new_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("tiny-qwen3")
    prompts = random_prompts(16, 3, 60)
    return model, prompts, [hf_greedy(model, p, GREEDY.max_new_tokens) for p in prompts]


@pytest.mark.parametrize("pool", ["ample", "preempting"])
def test_greedy_matches_hf_generate_tiny_qwen3(tiny, pool):
    model, prompts, refs = tiny
    if pool == "ample":
        config = EngineConfig(num_pages=128, max_tokens_per_step=256)
    else:  # 16 prompts of ~30 tokens + 24 generated need ~60 pages at once; 12 force preemption
        config = EngineConfig(num_pages=12, max_tokens_per_step=32)
    engine = Engine(model, config)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == refs
    assert any(o.finish_reason == "stop" for o in outs) and any(o.finish_reason == "length" for o in outs)
    stats = engine.stats
    if pool == "preempting":
        assert stats.preemptions > 0
    else:
        assert stats.preemptions == 0 and stats.batch_occupancy > 8  # the 16 really decoded together
    assert stats.running == stats.waiting == 0
    assert stats.free_pages == stats.total_pages
    engine.pool.check()


@pytest.mark.slow
def test_greedy_matches_hf_generate_smollm2():
    model, tok = load_model("smollm2-135m-instruct")
    questions = ["What is the capital of France?", "Name a prime number.", "Say hi.",
                 "Explain in one sentence why the sky is blue, please, for a child of six years old.",
                 "What is 2 + 2?", "Write a haiku about tools.", "Who wrote Hamlet?", "List three colours.",
                 "What does a compiler do?", "Give me a synonym for quick.", "How many legs does a spider have?",
                 "Translate 'cat' to French.", "What is water made of?", "Define entropy briefly.",
                 "Which planet is the largest?", "Why do we sleep? Answer shortly, in a few words only."]
    context = "You answer briefly. " * 8
    chats = [[{"role": "system", "content": context[:i * 10]}, {"role": "user", "content": q}]
             for i, q in enumerate(questions)]
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True)["input_ids"] for c in chats]
    assert max(map(len, prompts)) - min(map(len, prompts)) > 30
    # Few tokens: transformers' batch-1 decode reads all 540 MB of fp32 weights per token, ~80 ms on CPU.
    sampling = SamplingParams(max_new_tokens=8, temperature=0)
    refs = [hf_greedy(model, p, sampling.max_new_tokens) for p in prompts]
    need = [-(-(len(p) + sampling.max_new_tokens) // 16) for p in prompts]
    small = max(max(need), sum(need) // 3)  # a third of what all need at once: preemption is certain
    for config in (EngineConfig(num_pages=sum(need), max_tokens_per_step=256),
                   EngineConfig(num_pages=small, max_tokens_per_step=64)):
        engine = Engine(model, config)
        outs = engine.generate(prompts, sampling)
        assert [o.token_ids for o in outs] == refs
        assert (engine.stats.preemptions > 0) == (config.num_pages == small)


def test_request_limits_and_stops(tiny):
    model, prompts, refs = tiny
    engine = Engine(model, EngineConfig(num_pages=16, max_model_len=64))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.submit(list(range(64)), GREEDY)
    with pytest.raises(ValueError):
        engine.submit([], GREEDY)
    with pytest.raises(ValueError):
        engine.submit([400], GREEDY)
    with pytest.raises(ValueError, match="exceeds"):
        Engine(model, EngineConfig(num_pages=2, max_model_len=64))
    prompt, ref = prompts[0], refs[0]
    long = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)
    out = engine.generate([list(range(60))], long)[0]
    assert out.finish_reason == "max_model_len" and len(out.prompt_ids) + len(out.token_ids) == 64
    stop = tuple(ref[3:5])
    out = engine.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0, stop_sequences=(stop,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[:5]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0, stop_token_ids=(ref[2],)))[0]
    assert out.token_ids == ref[:ref.index(ref[2]) + 1] and out.finish_reason == "stop"
    rid = engine.submit(prompt, long)
    engine.step()
    engine.cancel(rid)
    done = engine.step()
    assert [(c.request_id, c.finish_reason) for c in done] == [(rid, "cancelled")]
    assert not engine.has_work() and engine.stats.free_pages == engine.stats.total_pages
