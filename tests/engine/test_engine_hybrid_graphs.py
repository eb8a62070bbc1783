"""Hybrid decode steps as a CUDA graph can capture them, on CPU: the linear-attention layers decode a batch of
sequences from their state slots with tensor ops over slot indices (bit for bit what each sequence alone
gives), and stand-in graphs (see test_engine_graphs.py) replay whole decode steps from static slot buffers."""

import sys

import pytest
import torch

from agentrl.engine import Engine, EngineConfig, SamplingParams
from agentrl.engine.linear_state import Chunk, _chunk_rows, _decode_rows
from agentrl.models import load_model
from tests.helpers import GRAPH_CONFIG, graph_engine, hf_greedy, random_prompts, two_turns

GREEDY = SamplingParams(max_new_tokens=14, temperature=0)
MIXED = [GREEDY, SamplingParams(max_new_tokens=14, temperature=1.0, top_k=20, seed=5),
         SamplingParams(max_new_tokens=14, temperature=0.8, top_p=0.9, seed=6)]


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-qwen3.5")[0]


def test_batched_decode_equals_each_sequence_alone_bit_for_bit(model):
    engine = Engine(model, EngineConfig(num_pages=16, max_num_seqs=8))
    states = engine.linear
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        states.conv.copy_(torch.randn(states.conv.shape, generator=g))
        states.recurrent.copy_(torch.randn(states.recurrent.shape, generator=g) * 0.1)
    start = states.conv.clone(), states.recurrent.clone()
    slots = [5, 0, 3, 7, 2, 6, 1]
    for layer, idx in enumerate(states.layers):
        module = states.modules[idx]
        impl = sys.modules[type(module).__module__]
        x = torch.randn(len(slots), module.in_proj_qkv.in_features, generator=g)
        with torch.no_grad():
            mixed, beta = module.in_proj_qkv(x), module.in_proj_b(x).sigmoid()
            decay = -module.A_log.float().exp() * torch.nn.functional.softplus(module.in_proj_a(x).float()
                                                                                + module.dt_bias)
            states.conv.copy_(start[0])
            states.recurrent.copy_(start[1])
            batched = _decode_rows(module, impl.torch_recurrent_gated_delta_rule, mixed, decay, beta,
                                   states.conv[layer], states.recurrent[layer], torch.tensor(slots))
            after = states.conv.clone(), states.recurrent.clone()
            states.conv.copy_(start[0])
            states.recurrent.copy_(start[1])
            # each sequence alone, through the per-sequence path a one-token chunk takes (conv over its window,
            # transformers' recurrent delta rule on a batch of one)
            alone = torch.cat([
                _chunk_rows(module, impl, mixed[i:i + 1], decay[i:i + 1], beta[i:i + 1], states.conv[layer],
                            states.recurrent[layer], Chunk(0, 1, slot, False, 0, -1), None, None)
                for i, slot in enumerate(slots)])
        assert torch.equal(batched, alone)
        assert torch.equal(after[0], states.conv) and torch.equal(after[1], states.recurrent)
        untouched = [s for s in range(states.num_slots + 1) if s not in slots]
        assert torch.equal(after[1][:, untouched], start[1][:, untouched])
        assert not torch.equal(after[1][layer, slots], start[1][layer, slots])


def test_hybrid_decode_graphs_match_eager(model):
    prompts = random_prompts(12, 3, 40, seed=1)
    params = [MIXED[i % 3] for i in range(len(prompts))]
    tools = random_prompts(12, 1, 20, seed=8)
    reference = two_turns(Engine(model, EngineConfig(**GRAPH_CONFIG)), prompts, params, tools)
    engine = graph_engine(model)
    assert engine.mixed_graphs is None or engine.device.type == "cpu"
    graphs, states = engine.graphs, engine.linear
    seen = []

    def check_buffers(bucket, replay):
        # Live rows decode from their sequences' slots; padding rows from the scratch slot.
        def checked():
            live = int((graphs.seq_lens[:bucket] > 0).sum())
            slots = graphs.linear_slots[:bucket].tolist()
            assert all(s == states.scratch for s in slots[live:])
            assert sorted(slots[:live]) == sorted(set(slots[:live])) and set(slots[:live]) <= set(
                states._slot_of.values())
            seen.append((bucket, live))
            return replay()
        return checked

    graphs.warmup()
    for bucket, replay in list(graphs._graphs.items()):
        graphs._graphs[bucket] = check_buffers(bucket, replay)
    outs = two_turns(engine, prompts, params, tools)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    for out, ref in zip(outs, reference):
        # the graph's attention reads every row's block table to its full width (torch backend, static plan)
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)
    greedy = [o.token_ids for o, p in zip(outs[:len(prompts)], params) if p is GREEDY]
    assert greedy == [hf_greedy(model, p, GREEDY.max_new_tokens) for p, q in zip(prompts, params) if q is GREEDY]
    stats = engine.stats
    assert stats.graph_steps == len(seen) > 0 and any(live < bucket for bucket, live in seen)
    assert stats.snapshot_resumes > 0 and stats.snapshots_taken > 0  # turn 2 resumed from snapshots


def test_graphs_capture_again_when_the_state_slots_move(model):
    prompts = random_prompts(6, 3, 40, seed=2)
    greedy = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    reference = Engine(model, EngineConfig(**GRAPH_CONFIG)).generate(prompts, greedy)
    engine = graph_engine(model)
    ids = [engine.submit(p, greedy) for p in prompts]
    done = {}

    def run(steps):
        for _ in range(steps):
            done.update({c.request_id: c for c in engine.step()})

    run(6)
    assert engine.stats.graph_steps > 0
    captured = engine.graphs.captures
    kv = engine.storage.kv
    engine.release_kv()
    engine.storage._allocate = lambda: kv.zero_()  # the KV pool comes back where it was
    engine.restore_kv()
    # ... and the states elsewhere, as a restore on an accelerator may place them (on CPU they never leave)
    held = engine.linear.conv
    engine.linear.conv = held.clone()
    assert engine.storage.kv.data_ptr() == kv.data_ptr() and engine.linear.conv.data_ptr() != held.data_ptr()
    while len(done) < len(ids):
        run(1)
    assert engine.graphs.captures > captured
    assert [done[i].token_ids for i in ids] == [o.token_ids for o in reference]
