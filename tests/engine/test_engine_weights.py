"""The engine reads the training model's own tensors: an in-place update is what the next step decodes
with, tokens carry the version that produced them, and a training forward/backward on another thread
neither disturbs nor is disturbed by generation."""

import copy
import inspect

import torch
from transformers import DynamicCache

from agentrl.engine import Engine, EngineConfig, SamplingParams
from agentrl.models import load_model
from tests.helpers import completions_of, perturb_, random_prompts, recomputed_logits

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


def run_with_update(model, kv_on_update: str, steps_before: int = 5):
    prompt = random_prompts(1, 30, 31, seed=9)[0]
    engine = Engine(model, EngineConfig(num_pages=16, kv_on_update=kv_on_update))
    ptrs = [p.data_ptr() for p in model.parameters()]
    rid = engine.submit(prompt, GREEDY)
    for _ in range(steps_before):  # one prefill step, then a token per step
        assert not engine.step()
    old = copy.deepcopy(model)
    with engine.pause():
        perturb_(model, seed=1)
        assert engine.bump_version() == 1
    done = []
    while not done:
        done = engine.step()
    out = done[0]
    assert out.request_id == rid
    assert out.versions == [0] * steps_before + [1] * (GREEDY.max_new_tokens - steps_before)
    # zero copy: the view holds the training tensors themselves, before and after the in-place update
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    for (name, p), (_, q) in zip(model.named_parameters(), engine.view.named_parameters()):
        assert p is q and q.data_ptr() == p.data_ptr(), name
    assert model.config._attn_implementation != engine.view.config._attn_implementation
    return out, old


def test_recompute_mode_is_exactly_on_policy_after_update():
    model = load_model("tiny-qwen3")[0]
    out, old = run_with_update(model, "recompute")
    k = out.versions.index(1)
    new_lp = recomputed_logits(model, out).log_softmax(-1)
    old_lp = recomputed_logits(old, out).log_softmax(-1)
    tokens = torch.tensor(out.token_ids)[:, None]
    got = torch.tensor(out.logprobs)
    torch.testing.assert_close(got[:k], old_lp.gather(1, tokens)[:k, 0], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[k:], new_lp.gather(1, tokens)[k:, 0], atol=1e-4, rtol=0)
    assert (old_lp.gather(1, tokens)[k:, 0] - got[k:]).abs().max() > 1e-2  # the update did change them


def test_keep_mode_decodes_new_weights_over_old_kv():
    model = load_model("tiny-qwen3")[0]
    out, old = run_with_update(model, "keep")
    k = out.versions.index(1)
    ids = out.prompt_ids + out.token_ids
    n = len(out.prompt_ids)
    # Reference: the context up to the last token fed before the update, cached by the old weights; from
    # then on the new weights, one token at a time, over that same cache.
    cache = DynamicCache()
    # transformers renamed the kwarg (5.24 warns on the old name, 5.17 knows only the old one)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        old(input_ids=torch.tensor([ids[:n + k - 1]]), use_cache=True, **{cache_kw: cache})
        expected = []
        for i in range(k, len(out.token_ids)):
            pos = n + i - 1
            logits = model(input_ids=torch.tensor([[ids[pos]]]), position_ids=torch.tensor([[pos]]),
                           use_cache=True, **{cache_kw: cache}).logits[0, -1]
            expected.append(logits.log_softmax(-1)[out.token_ids[i]].item())
    torch.testing.assert_close(torch.tensor(out.logprobs[k:]), torch.tensor(expected), atol=1e-4, rtol=0)


def test_background_generation_alongside_training_on_the_same_module():
    model = load_model("tiny-qwen3")[0]
    prompts = random_prompts(8, 3, 40, seed=10)
    sampling = SamplingParams(max_new_tokens=24, temperature=0)
    reference = Engine(model, EngineConfig(num_pages=64)).generate(prompts, sampling)
    batch = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))

    def train_once():
        model.train()
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        return loss.detach().clone(), [p.grad.clone() for p in model.parameters()]

    ref_loss, ref_grads = train_once()
    engine = Engine(model, EngineConfig(num_pages=64, max_tokens_per_step=16))
    engine.start()
    try:
        ids = [engine.submit(p, sampling) for p in prompts]
        overlapped = 0
        for _ in range(1000):
            busy = engine.has_work()
            if not busy:
                break
            loss, grads = train_once()
            overlapped += busy and engine.has_work()
            torch.testing.assert_close(loss, ref_loss, atol=0, rtol=0)
            for g, r in zip(grads, ref_grads):
                torch.testing.assert_close(g, r, atol=0, rtol=0)
        got = completions_of(engine, ids, timeout=30)
    finally:
        engine.stop()
    assert overlapped >= 1  # at least one training step ran while generation was in flight
    assert [got[i].token_ids for i in ids] == [o.token_ids for o in reference]
    for i, ref in zip(ids, reference):
        torch.testing.assert_close(torch.tensor(got[i].logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)
    assert model.config._attn_implementation == "sdpa"


def test_background_engine_counts_its_idle_and_paused_time():
    import time

    model = load_model("tiny-qwen3")[0]
    engine = Engine(model, EngineConfig(num_pages=16))
    # Bounds from the test's own clock, not from how long a sleep took: a loaded machine oversleeps.
    started = time.perf_counter()
    engine.start()
    try:
        time.sleep(0.3)  # nothing submitted: the thread waits for work, in 0.05 s waits
        idle, wall = engine.stats.idle_seconds, time.perf_counter() - started
        assert 0.3 - 0.1 <= idle <= wall and engine.stats.paused_seconds == 0
        t = time.perf_counter()
        with engine.pause():
            time.sleep(0.2)
        assert 0.2 <= engine.stats.paused_seconds <= time.perf_counter() - t
        rid = engine.submit(random_prompts(1, 5, 40, seed=3)[0], GREEDY)
        assert engine.get_completion(timeout=30).request_id == rid
    finally:
        engine.stop()
    assert engine.stats.generated_tokens == GREEDY.max_new_tokens
