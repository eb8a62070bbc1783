"""Overlapped stepping (step n+1 queued before step n's tokens reach the host) changes nothing a caller sees:
the same tokens, logprobs, versions and finish reasons as waiting for every step, under sampling, stop
sequences, length limits, preemption, cancellation and the prefix cache."""

import torch

from agentrl.engine import Engine, EngineConfig, SamplingParams
from agentrl.engine.engine import PLACEHOLDER
from agentrl.models import load_model


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (int(k),), generator=g).tolist() for k in torch.randint(3, 50, (n,), generator=g)]


def mixed_params(n: int) -> list[SamplingParams]:
    out = []
    for i in range(n):
        if i % 4 == 0:
            out.append(SamplingParams(max_new_tokens=5 + i, temperature=0))
        elif i % 4 == 1:
            out.append(SamplingParams(max_new_tokens=20, temperature=1.0, top_k=20, seed=i))
        elif i % 4 == 2:  # a stop sequence any byte pair ending in 'a' would close: several stop early
            out.append(SamplingParams(max_new_tokens=30, temperature=1.2, seed=i, stop_sequences=((97,), (32, 101))))
        else:
            out.append(SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, seed=i, ignore_eos=True))
    return out


def run(model, overlap: bool, num_pages: int):
    engine = Engine(model, EngineConfig(num_pages=num_pages, max_tokens_per_step=48, max_num_seqs=8, overlap=overlap))
    ps = prompts(20)
    first = engine.generate(ps, mixed_params(20))
    engine.bump_version()
    # resubmit each history + 3 new tokens: served from the prefix cache
    second = engine.generate([p + c.token_ids + [1, 2, 3] for p, c in zip(ps, first)], mixed_params(20))
    return engine, first + second


def key(c):
    return c.token_ids, c.versions, c.finish_reason, c.cached_tokens


def test_overlap_gives_identical_completions():
    model, _ = load_model("tiny-qwen3")
    for num_pages in (256, 14):  # ample, and a pool small enough to preempt
        plain_engine, plain = run(model, False, num_pages)
        fast_engine, fast = run(model, True, num_pages)
        assert [key(c) for c in fast] == [key(c) for c in plain]
        # steps group the sequences differently (a finishing one rides one step longer), so float sums differ
        for a, b in zip(fast, plain):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
        assert {c.finish_reason for c in plain} >= {"stop", "length"}
        assert all(PLACEHOLDER not in c.token_ids and len(c.logprobs) == len(c.token_ids) for c in fast)
        if num_pages == 14:
            assert fast_engine.stats.preemptions > 0
        else:
            assert sum(c.cached_tokens for c in fast[20:]) > 0
        fast_engine.pool.check()
        assert fast_engine.stats.free_pages == fast_engine.stats.total_pages


def test_cancel_while_a_step_is_in_flight_drops_the_unresolved_token():
    model, _ = load_model("tiny-qwen3")
    engine = Engine(model, EngineConfig(num_pages=64, overlap=True))
    rid = engine.submit(list(range(10, 30)), SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True))
    for _ in range(6):
        assert engine.step() == []
    seq = engine._live[rid]
    assert seq.tokens[-1] == PLACEHOLDER and seq.unresolved == 1  # step 6 is still in flight
    engine.cancel(rid)
    (done,) = engine.step()
    assert done.finish_reason == "cancelled"
    assert len(done.token_ids) == len(done.logprobs) == 5 and PLACEHOLDER not in done.token_ids
    assert not engine.has_work()
    engine.pool.check()
