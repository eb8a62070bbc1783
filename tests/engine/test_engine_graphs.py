"""The GPU fast path's logic, on CPU: decode-graph buckets, static buffers and padding, re-capture after a
pool restore or a re-assigned parameter, the step layout, the counter-based sampler, and the Triton backend
(under Triton's interpreter, in a child process).

CUDA graphs cannot run here, so `DecodeGraphs` gets a stand-in capture: it returns a replay that calls the
captured function again. To stand for a real graph's baked-in addresses, the replay asserts that the KV pool
and every parameter are still where they were at capture: a graph kept across a move fails the test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from agentrl.engine import Engine, EngineConfig, SamplingParams
from agentrl.engine.backends import make_backend
from agentrl.engine.cuda_graphs import batch_buckets, token_buckets
from agentrl.engine.sampler import Sampler, uniform_bits
from agentrl.engine.scheduler import Scheduled, Sequence
from agentrl.engine.step_layout import layout_step, tile_table
from agentrl.engine.torch_backend import TorchPagedAttention
from agentrl.models import load_model
from tests.children import Child, run_child
from tests.helpers import GRAPH_CONFIG, graph_engine, perturb_, random_prompts, two_turns, warped_logprobs

MIXED = [SamplingParams(max_new_tokens=14, temperature=0),
         SamplingParams(max_new_tokens=14, temperature=1.0, top_k=20, seed=5),
         SamplingParams(max_new_tokens=14, temperature=0.8, top_p=0.9, seed=6)]


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-qwen3")[0]


def test_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(16) == (1, 2, 4, 8, 16)
    assert batch_buckets(100)[-3:] == (64, 96, 100)
    assert batch_buckets(512)[-3:] == (256, 384, 512)
    assert batch_buckets(1000)[-3:] == (512, 768, 1000)


def test_graph_decode_matches_eager(model):
    prompts = random_prompts(12, 3, 40, seed=1)
    params = [MIXED[i % 3] for i in range(len(prompts))]
    reference = Engine(model, EngineConfig(**GRAPH_CONFIG)).generate(prompts, params)
    engine = graph_engine(model)
    seen = []

    def check_buffers(bucket, replay):
        # The static buffers as a replay sees them: live rows first, then padding that writes and reads nothing.
        def checked():
            g = engine.graphs
            lens, pos, slots = g.seq_lens[:bucket].long(), g.pos[:bucket], g.slots[:bucket]
            live = int((lens > 0).sum())
            assert (lens[:live] > 0).all() and g.bucket(live) == bucket
            assert (slots[live:] == -1).all() and (pos[live:] == 0).all()
            assert torch.equal(pos[:live] + 1, lens[:live])
            tables = g.block_tables[:live].long()
            ps = engine.pool.page_size
            assert torch.equal(slots[:live], tables.gather(1, (pos[:live] // ps)[:, None])[:, 0] * ps + pos[:live] % ps)
            seen.append((bucket, live))
            return replay()
        return checked

    engine.graphs.warmup()
    for bucket, replay in list(engine.graphs._graphs.items()):
        engine.graphs._graphs[bucket] = check_buffers(bucket, replay)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    for out, ref in zip(outs, reference):
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)
    stats = engine.stats
    assert stats.graph_steps > 0 and stats.graph_captures == 5 and engine.graphs.captured == [1, 2, 4, 8, 16]
    assert len({bucket for bucket, _ in seen}) >= 3  # the batch drained through several buckets
    assert any(live < bucket for bucket, live in seen)  # padding rows were exercised


def test_the_first_step_that_prefills_captures_every_token_bucket_largest_first(model):
    """As the decode graphs do at the first decode step: no later step pays a capture (in training one waits for
    the trainer's work beside it), and the smaller graphs reuse the largest one's memory in the shared pool."""
    engine = graph_engine(model, mixed=True, max_tokens_per_step=200)
    graphs = engine.mixed_graphs
    order, original = [], graphs._capture
    graphs._capture = lambda bucket: order.append(bucket) or original(bucket)
    engine.generate(random_prompts(3, 3, 20, seed=2), SamplingParams(max_new_tokens=4, temperature=0))
    assert order == sorted(token_buckets(200), reverse=True) and graphs.captured == list(token_buckets(200))
    engine.generate(random_prompts(12, 3, 90, seed=3), SamplingParams(max_new_tokens=4, temperature=0))
    assert len(order) == len(token_buckets(200)) and engine.stats.mixed_graph_steps > 1  # no capture since
    ahead = graph_engine(model, mixed=True, max_tokens_per_step=200)
    ahead.warmup()  # both kinds before any step
    assert ahead.mixed_graphs.captured == list(token_buckets(200))
    assert ahead.graphs.captured == list(ahead.graphs.buckets)


def test_mixed_step_graphs_match_eager(model):
    config = dict(max_tokens_per_step=200)
    prompts = random_prompts(12, 3, 90, seed=7)
    params = [MIXED[i % 3] for i in range(len(prompts))]
    tools = random_prompts(12, 1, 30, seed=8)
    reference = two_turns(Engine(model, EngineConfig(**{**GRAPH_CONFIG, **config})), prompts, params, tools)
    engine = graph_engine(model, mixed=True, **config)
    seen = []
    graphs = engine.mixed_graphs
    original = graphs._capture

    def capture(bucket):
        replay = original(bucket)

        def checked():  # the static buffers as a replay sees them
            qsl = graphs.query_start_loc[:graphs.seqs(bucket) + 1]
            tokens, live = int(qsl[-1]), int((graphs.seq_lens > 0).sum())
            assert tokens <= bucket and (graphs.slots[tokens:bucket] == -1).all()
            assert (qsl[live:] == tokens).all() and (graphs.seq_lens[live:] == 0).all()
            tiles = graphs.tiles[:graphs.table_rows(bucket)]
            lens = (qsl[1:] - qsl[:-1]).tolist()
            used = tiles[tiles[:, 0] >= 0]
            assert sorted(map(tuple, used.tolist())) == sorted(
                (s, t) for s, n in enumerate(lens) if n > 1 for t in range(-(-n // graphs.tokens_per_tile)))
            seen.append((bucket, tokens, live, int(sum(n == 1 for n in lens[:live]))))
            return replay()

        graphs._graphs[bucket] = checked
        return checked

    graphs._capture = capture
    outs = two_turns(engine, prompts, params, tools)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    for out, ref in zip(outs, reference):
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)
    stats = engine.stats
    assert stats.mixed_graph_steps == len(seen) > 0 and stats.graph_steps > 0
    assert len({bucket for bucket, *_ in seen}) >= 2 and set(graphs.captured) <= set(token_buckets(200))
    assert any(tokens < bucket for bucket, tokens, *_ in seen)  # padded token rows
    assert any(decodes and decodes < live for *_, live, decodes in seen)  # decodes beside chunks in one replay
    assert sum(o.cached_tokens for o in outs[len(prompts):]) > 0  # turn 2 prefilled after cached prefixes


def test_tile_table():
    # sequences: a decode, a 5-token prompt, a 20-token chunk after 40 cached tokens, a 1-token chunk
    table = tile_table([1, 5, 20, 1], [31, 5, 60, 9], tokens_per_tile=8, capacity=7)
    # tiles of sequence 2 see 48, 56 and 60 keys, sequence 1's only tile 5: most keys first, then empty rows
    assert table.tolist() == [[2, 2], [2, 1], [2, 0], [1, 0], [-1, 0], [-1, 0], [-1, 0]]
    with pytest.raises(ValueError, match="exceed"):
        tile_table([1, 5, 20, 1], [31, 5, 60, 9], tokens_per_tile=8, capacity=3)
    assert token_buckets(1024) == (64, 128, 256, 512, 1024) and token_buckets(200) == (64, 128, 200)
    assert token_buckets(64) == (64,) and token_buckets(10) == (10,)


def test_release_restore_recaptures_only_when_the_pool_moves(model):
    prompts = random_prompts(10, 3, 40, seed=2)
    params = [MIXED[i % 3] for i in range(len(prompts))]
    reference = Engine(model, EngineConfig(**GRAPH_CONFIG)).generate(prompts, params)
    log = []
    engine = graph_engine(model, log)
    ids = [engine.submit(p, s) for p, s in zip(prompts, params)]
    done = {}

    def run(steps):
        for _ in range(steps):
            done.update({c.request_id: c for c in engine.step()})

    run(6)
    assert engine.stats.graph_steps > 0
    captured = engine.graphs.captures
    # Restored at the same address (what the caching allocator usually does): the graphs stay.
    old = engine.storage.kv
    engine.release_kv()
    engine.storage._allocate = lambda: old.zero_()
    engine.restore_kv()
    assert engine.storage.kv.data_ptr() == old.data_ptr()
    run(3)
    assert engine.graphs.captures == captured
    # Restored elsewhere (the old tensor is still held, so the new one cannot take its place): re-captured.
    del engine.storage._allocate
    engine.release_kv()
    engine.restore_kv()
    assert engine.storage.kv.data_ptr() != old.data_ptr()
    while len(done) < len(ids):
        run(1)
    assert engine.graphs.captures > captured
    assert all(bound[0] == engine.storage.kv.data_ptr() for bound in log[captured:])
    assert [done[i].token_ids for i in ids] == [o.token_ids for o in reference]


def test_in_place_update_keeps_graphs_and_a_reassigned_parameter_recaptures():
    model = load_model("tiny-qwen3")[0]
    prompts = random_prompts(6, 3, 40, seed=3)
    greedy = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    engine = graph_engine(model, kv_on_update="recompute")  # the prefix cache must not serve old-weight KV
    before = engine.generate(prompts, greedy)
    captured = engine.graphs.captures
    with engine.pause():
        perturb_(model, seed=4)  # p.add_(...) under no_grad: the same storage, new values
        engine.bump_version()
    after = engine.generate(prompts, greedy)
    assert engine.graphs.captures == captured
    fresh = Engine(model, EngineConfig(**GRAPH_CONFIG)).generate(prompts, greedy)
    assert [o.token_ids for o in after] == [o.token_ids for o in fresh] != [o.token_ids for o in before]
    weight = model.model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        weight.data = weight.data.clone()  # same values at a new address
    again = engine.generate(prompts, greedy)
    assert engine.graphs.captures > captured
    assert [o.token_ids for o in again] == [o.token_ids for o in fresh]


def _seq(tokens, pages, computed=0):
    seq = Sequence(0, len(tokens), list(tokens), SamplingParams(), frozenset())
    seq.pages, seq.num_computed = list(pages), computed
    return seq


def test_layout_step_slots_and_padding():
    ps = 4
    a = _seq(range(9), [7, 2, 5], computed=8)  # decodes position 8 (page 5, offset 0)
    b = _seq(range(14), [3, 9, 1, 6])  # a chunk of positions 2..12 crossing four pages, not its last token
    c = _seq(range(3), [4])  # a whole prompt: samples
    batch = [Scheduled(a, 8, 1, decode=True), Scheduled(b, 2, 11), Scheduled(c, 0, 3)]
    host = layout_step(batch, ps)
    per_token = [item.seq.pages[p // ps] * ps + p % ps for item in batch
                 for p in range(item.start, item.start + item.length)]
    assert host.parts["slots"].tolist() == per_token
    assert host.parts["ids"].tolist() == [8] + list(range(2, 13)) + [0, 1, 2]
    assert host.parts["qsl"].tolist() == [0, 1, 12, 15] and host.parts["ctx"].tolist() == [9, 13, 3]
    assert host.parts["rows"].tolist() == [0, 14] and host.num_decodes == 1 and host.width == 4
    assert host.parts["tables"].reshape(3, 4).tolist() == [[7, 2, 5, 0], [3, 9, 1, 6], [4, 0, 0, 0]]
    padded = layout_step(batch[:1], ps, pad_to=4)
    assert padded.parts["slots"].tolist() == [20, -1, -1, -1] and padded.parts["ctx"].tolist() == [9, 0, 0, 0]
    assert padded.parts["ids"].tolist() == [8, 0, 0, 0] and padded.parts["pos"].tolist() == [8, 0, 0, 0]


def test_backend_choice():
    cpu = torch.device("cpu")
    assert type(make_backend("auto", cpu, 16)) is TorchPagedAttention
    with pytest.raises(ValueError, match="attention_backend"):
        make_backend("nope", cpu, 16)
    with pytest.raises(ValueError, match="power-of-two"):
        make_backend("triton", cpu, 12)


def test_uniform_bits_are_reproducible_and_uniform():
    a = uniform_bits([7] * 20000, range(20000))
    assert np.array_equal(a, uniform_bits([7] * 20000, range(20000)))
    assert (a >= 0).all() and (a < 2 ** 53).all()
    u = a / 2.0 ** 53
    counts = np.histogram(u, bins=50, range=(0, 1))[0]
    chi2 = ((counts - 400) ** 2 / 400).sum()
    assert chi2 < 100  # 49 degrees of freedom: the 99.99th percentile is about 95
    assert not np.array_equal(a[:100], uniform_bits([8] * 100, range(100)))
    assert uniform_bits([-1], [0])[0] == uniform_bits([2 ** 64 - 1], [0])[0]  # seeds wrap to 64 bits


def test_sampler_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.7, top_k=5, seed=2), SamplingParams(temperature=1.2, top_p=0.8, seed=3),
              SamplingParams(temperature=0.9, top_k=10, top_p=0.9, seed=4), SamplingParams(temperature=0)]
    seeds, counters = [p.seed or 0 for p in params], [11, 12, 13, 14, 15, 16]
    sampler = Sampler(torch.device("cpu"))
    tokens, logprobs = sampler(logits, params, seeds=seeds, counters=counters)
    for i, p in enumerate(params):
        alone_t, alone_lp = sampler(logits[i:i + 1], [p], seeds=seeds[i:i + 1], counters=counters[i:i + 1])
        assert alone_t.item() == tokens[i].item()
        torch.testing.assert_close(alone_lp, logprobs[i:i + 1], atol=1e-6, rtol=0)
        ref = warped_logprobs(logits[i:i + 1], p if p.temperature > 0 else SamplingParams(temperature=1.0))[0]
        assert torch.isfinite(ref[tokens[i]]) and abs(ref[tokens[i]] - logprobs[i]) < 1e-5
    assert tokens[0] == logits[0].argmax() and tokens[5] == logits[5].argmax()
    # columns built once on the host (as the engine uploads them) give the same draws
    columns = Sampler.columns(params, seeds, counters)
    assert torch.equal(sampler(logits, params, torch.from_numpy(columns))[0], tokens)


TRITON_SCRIPT = r"""
import torch
torch.set_num_threads(1)
from tests.children import patch_triton_interpreter
patch_triton_interpreter()
from agentrl.engine import Engine, EngineConfig, SamplingParams
from agentrl.engine.triton_backend import TritonPagedAttention
from agentrl.models import load_model
from tests.helpers import GRAPH_CONFIG, graph_engine
from tests.helpers import random_prompts
model = load_model("tiny-qwen3")[0]
prompts = random_prompts(5, 3, 40, seed=6)
params = [SamplingParams(max_new_tokens=6, temperature=0), SamplingParams(max_new_tokens=6, temperature=1.0, seed=1)]
params = [params[i % 2] for i in range(len(prompts))]
ref = Engine(model, EngineConfig(**GRAPH_CONFIG)).generate(prompts, params)
eager = Engine(model, EngineConfig(**GRAPH_CONFIG, attention_backend="triton"))
assert isinstance(eager.backend, TritonPagedAttention)
graphs = graph_engine(model, attention_backend="triton", mixed=True)
for engine in (eager, graphs):
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref], "tokens differ from the torch backend"
    err = max(abs(a - b) for o, r in zip(outs, ref) for a, b in zip(o.logprobs, r.logprobs))
    assert err < 1e-4, err
assert graphs.stats.graph_steps > 0 and graphs.stats.mixed_graph_steps > 0
print("ok")
"""


ROOT = Path(__file__).resolve().parents[2]
TRITON_RUN = Child((sys.executable, "-c", TRITON_SCRIPT), ROOT, (("TRITON_INTERPRET", "1"), ("PYTHONPATH", str(ROOT))))


@pytest.mark.child(TRITON_RUN)
def test_triton_backend_in_the_interpreter():
    pytest.importorskip("triton")
    run = run_child(TRITON_RUN)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-3000:] + run.stderr[-6000:]
