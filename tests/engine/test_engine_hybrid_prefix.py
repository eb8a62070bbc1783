"""The prefix cache on hybrid models (Qwen3.5): resubmitted turns resume from linear-attention state snapshots
taken at page boundaries, prefill only what is new, and decode exactly as with the cache off, through eviction,
preemption and release of the KV memory."""

from types import SimpleNamespace

import pytest
import torch

from agentrl.engine import Engine, EngineConfig, SamplingParams
from agentrl.engine.kv_pool import PagePool, chain_keys
from agentrl.engine.scheduler import Scheduler, Sequence
from agentrl.engine.state_snapshots import StateSnapshots
from agentrl.models import load_model
from tests.helpers import random_prompts

GREEDY = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
PAGE = 16


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-qwen3.5")[0]


def assert_same(got, ref):
    """Same tokens, logprobs within 3e-5: a resumed sequence's state comes from decode steps (the delta rule's
    recurrent form) where the cache-off engine recomputes the history with the chunked form (the eviction test
    measured 1.15e-5 on CPU torch 2.13; a state restored from the wrong page differs by whole units)."""
    assert got.token_ids == ref.token_ids
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=3e-5, rtol=0)


def conversation(engine, context, turns, sampling=GREEDY):
    """`turns` turns of one conversation, each resubmitting the history with its completion and a tool result;
    yields (context, completion, tokens prefilled, the tool result appended)."""
    for turn in range(turns):
        before = engine.stats.prefilled_tokens
        out = engine.generate([context], sampling)[0]
        new = [100 + turn, 101, 102, 103, 104, 105, 106]
        yield context, out, engine.stats.prefilled_tokens - before
        context = context + out.token_ids + new


def test_three_turn_resubmission_prefills_only_new_tokens_and_matches_the_cache_off_engine(model):
    engine = Engine(model, EngineConfig(num_pages=64, page_size=PAGE))
    assert engine.config.enable_prefix_cache and engine.snapshots is not None
    reference = Engine(model, EngineConfig(num_pages=64, page_size=PAGE, enable_prefix_cache=False))
    system = random_prompts(1, 40, 41, seed=7)[0]
    other = engine.generate([system + [9, 9]], GREEDY)[0]  # another conversation with the same system prompt
    assert other.cached_tokens == 0
    start = system + [5, 6, 7]
    refs = [out for _, out, _ in conversation(reference, start, 3)]
    new = None
    for turn, ((context, out, prefilled), ref) in enumerate(zip(conversation(engine, start, 3), refs)):
        if turn == 0:
            # the system prompt's full pages, resumed from the snapshot the other conversation took inside them
            assert out.cached_tokens == len(system) // PAGE * PAGE
            assert out.token_ids == ref.token_ids and out.logprobs == ref.logprobs  # nothing differs yet
        else:
            # the tool result, plus the last sampled token (never fed) and the partial last page
            assert prefilled <= len(new) + PAGE, (turn, prefilled, len(new))
            assert out.cached_tokens == len(context) - prefilled
        assert_same(out, ref)
        new = [100 + turn, 101, 102, 103, 104, 105, 106]
    stats = engine.stats
    assert stats.snapshot_resumes == 3 and stats.state_snapshots > 0
    assert stats.snapshot_bytes == engine.snapshots.capacity * engine.linear.bytes_per_state
    engine.pool.check()
    engine.snapshots.check(engine.pool)


def test_a_cached_prefix_is_cut_back_to_the_deepest_page_with_a_snapshot():
    pool = PagePool(num_pages=8, page_size=4)
    tokens = list(range(14))
    keys = chain_keys(tokens, 4)
    pages = pool.allocate(3)
    for page, key in zip(pages, keys):
        pool.register(page, key)
    pool.release(pages)
    with_snapshot = {pages[0]}  # only the first page can be resumed after
    scheduler = Scheduler(pool, max_num_seqs=4, max_tokens_per_step=64, resumable=with_snapshot.__contains__)
    seq = Sequence(0, len(tokens), tokens, GREEDY, frozenset())
    scheduler.add(seq)
    batch = scheduler.schedule()
    assert seq.pages[:1] == pages[:1] and seq.resume_page == pages[0] and pages[1] not in seq.pages
    assert (batch[0].start, batch[0].length) == (4, 10) and scheduler.prefix_hit_tokens == seq.cached_tokens == 4
    assert pool.refs[pages[1]] == pool.refs[pages[2]] == 0 and pool.num_cached == 3  # still cached, not held
    pool.check()
    dense = Scheduler(PagePool(8, 4), 4, 64)  # a dense model resumes after any cached page
    assert dense.resumable is None


def test_snapshot_eviction_order():
    states = SimpleNamespace(allocate=lambda n: (torch.zeros(1, n, 1), torch.zeros(1, n, 1)), bytes_per_state=8)
    snaps = StateSnapshots(states, capacity=3)
    a, b, c = (Sequence(i, 1, [0], GREEDY, frozenset()) for i in range(3))
    snaps.begin_step()
    first = snaps.take(1, a)
    snaps.begin_step()
    snaps.take(2, a)  # a's newest: page 1 is now evicted first
    snaps.take(3, b)
    snaps.begin_step()
    assert snaps.take(4, c) == first and not snaps.has(1) and snaps.has(2) and snaps.evicted == 1
    snaps.index(2)  # resumed from: the last to go
    snaps.begin_step()
    snaps.take(5, c)
    assert not snaps.has(3) and snaps.has(2)
    snaps.begin_step()
    for page, seq in ((6, a), (7, b), (8, c)):
        snaps.take(page, seq)
    d = Sequence(3, 1, [0], GREEDY, frozenset())
    assert snaps.take(9, d) == -1 and len(snaps) == 3  # every snapshot is written by this step: none taken
    assert snaps.nbytes == 24


def test_forgetting_a_page_drops_its_snapshot(model):
    engine = Engine(model, EngineConfig(num_pages=64, page_size=PAGE))
    prompt = random_prompts(1, 50, 51, seed=3)[0]
    engine.generate([prompt], GREEDY)
    snaps, pool = engine.snapshots, engine.pool
    held = [p for p in range(pool.num_pages) if snaps.has(p)]
    assert held and all(p in pool._key_of for p in held)
    pool.drop_unreferenced()
    assert len(snaps) == 0 and len(snaps._free) == snaps.capacity
    out = engine.generate([prompt], GREEDY)[0]
    assert out.cached_tokens == 0  # nothing cached is left to resume from


def test_eviction_under_a_small_pool_drops_snapshots_with_pages_and_stays_exact(model):
    page = 8
    contexts = [random_prompts(1, 20, 45, seed=s)[0] for s in range(4)]
    tools = random_prompts(8, 2, 9, seed=11)
    config = dict(num_pages=28, page_size=page, max_tokens_per_step=96, state_snapshots=3)
    engine = Engine(model, EngineConfig(**config))
    reference = Engine(model, EngineConfig(**config, enable_prefix_cache=False))
    assert engine.snapshots.capacity == 3
    sampling = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    for turn in range(3):  # the conversations advance together, so their pages and snapshots compete
        ids = [engine.submit(c, sampling) for c in contexts]
        done = {}
        while len(done) < len(ids):
            done.update({c.request_id: c for c in engine.step()})
            engine.pool.check()
            engine.snapshots.check(engine.pool)
        refs = reference.generate(contexts, sampling)
        for i, ref in zip(ids, refs):
            assert_same(done[i], ref)
        contexts = [c + done[i].token_ids + tools[(turn * 4 + k) % 8] for k, (c, i) in enumerate(zip(contexts, ids))]
    stats = engine.stats
    assert engine.pool.evictions > 0 and engine.snapshots.evicted > 0
    assert stats.snapshot_resumes > 0 and stats.cached_tokens > 0
    assert stats.prefilled_tokens < reference.stats.prefilled_tokens


def test_preemption_restarts_from_snapshots_exactly(model):
    prompts = random_prompts(8, 20, 70, seed=5)
    sampling = [SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True) if i % 2 else
                SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, seed=i) for i in range(len(prompts))]
    # Prompts prefilled whole: a budget that cuts them into chunks would cut them where the two engines' schedules
    # (which differ once one resumes and the other recomputes) put the cut, and the chunked delta rule rounds
    # differently at every cut.
    config = dict(num_pages=14, page_size=8, max_num_seqs=4, max_tokens_per_step=512)
    engine = Engine(model, EngineConfig(**config))
    reference = Engine(model, EngineConfig(**config, enable_prefix_cache=False))
    outs = engine.generate(prompts, sampling)
    refs = reference.generate(prompts, sampling)
    for out, ref in zip(outs, refs):
        assert_same(out, ref)
    stats = engine.stats
    assert stats.preemptions > 0 and stats.snapshot_resumes > 0  # preempted sequences resumed from their own
    assert stats.prefilled_tokens < reference.stats.prefilled_tokens
    engine.snapshots.check(engine.pool)


def test_release_keeps_the_snapshots_of_live_pages_and_drops_the_others(model):
    prompts = random_prompts(6, 20, 60, seed=9)
    tools = random_prompts(6, 2, 9, seed=10)
    config = dict(num_pages=80, page_size=8, max_tokens_per_step=512)  # turn 2 admitted at once, before a release
    sampling = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    reference = Engine(model, EngineConfig(**config))  # the same engine, never released
    engine = Engine(model, EngineConfig(**config))
    first = engine.generate(prompts, sampling)
    second = [p + o.token_ids + t for p, o, t in zip(prompts, first, tools)]
    refs = reference.generate(prompts, sampling) + reference.generate(second, sampling)
    ids = [engine.submit(p, sampling) for p in second]
    done, releases = {}, 0
    snaps = engine.snapshots
    while len(done) < len(ids):
        done.update({c.request_id: c for c in engine.step()})
        live = set(engine.pool.live_pages())
        kept = {p: (snaps.conv[:, i].clone(), snaps.recurrent[:, i].clone()) for p, i in snaps._index_of.items()
                if p in live}
        engine.release_kv()
        assert set(snaps._index_of) == set(kept) and snaps.conv is None  # only live pages' snapshots are kept
        assert set(engine.pool._key_of) <= live
        engine.restore_kv()
        for page, (conv, recurrent) in kept.items():
            i = snaps._index_of[page]
            assert torch.equal(snaps.conv[:, i], conv) and torch.equal(snaps.recurrent[:, i], recurrent)
        releases += bool(kept)
        snaps.check(engine.pool)
    outs = first + [done[i] for i in ids]
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert [o.logprobs for o in outs] == [r.logprobs for r in refs]  # bit for bit: a release changes nothing
    assert releases > 0 and engine.stats.snapshot_resumes == reference.stats.snapshot_resumes == len(prompts)


def test_snapshot_memory_is_paid_out_of_the_pool_budget(model):
    budget = 1 << 20
    dense_pages = Engine(model, EngineConfig(kv_memory_bytes=budget, enable_prefix_cache=False)).pool.num_pages
    engine = Engine(model, EngineConfig(kv_memory_bytes=budget, state_snapshots=5))
    per_page = budget // dense_pages
    assert engine.snapshots.capacity == 5
    assert engine.pool.num_pages == (budget - 5 * engine.linear.bytes_per_state) // per_page
    off = Engine(model, EngineConfig(num_pages=16, state_snapshots=0))
    assert off.snapshots is None and not off.config.enable_prefix_cache
    default = Engine(model, EngineConfig(num_pages=16, max_num_seqs=6))
    assert default.snapshots.capacity == 6
