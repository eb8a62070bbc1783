"""The same engine on CUDA: pinned host copies, the Triton kernels (the default there) and decode steps replayed
from CUDA graphs, checked against transformers and against the engine on CPU."""

import pytest
import torch

from agentrl.engine import Engine, EngineConfig, SamplingParams
from agentrl.models import load_model
from tests.helpers import completions_of, hf_greedy, random_prompts, two_turns

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


# ids name the kind, so `-k "not hybrid"` leaves out the case that waits on fla's autotuning on a cold cache
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3.5"], ids=["dense", "hybrid"])
def test_cuda_greedy_matches_hf_generate_through_release(name):
    model, _ = load_model(name, device="cuda")
    prompts = random_prompts(16, 3, 60, seed=5)
    greedy = SamplingParams(max_new_tokens=16, temperature=0)
    refs = [hf_greedy(model, p, greedy.max_new_tokens) for p in prompts]
    engine = Engine(model, EngineConfig(num_pages=20, max_tokens_per_step=64))
    assert type(engine.backend).__name__ == "TritonPagedAttention"
    ids = [engine.submit(p, greedy) for p in prompts]
    done = {}
    while len(done) < len(ids):
        done.update({c.request_id: c for c in engine.step()})
        engine.release_kv()
        engine.restore_kv()
    assert [done[i].token_ids for i in ids] == refs
    assert engine.stats.preemptions > 0
    assert engine.stats.graph_steps > 0  # hybrid models too: their decode steps are captured like dense ones
    sampled = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=50, seed=3)
    a = engine.generate(prompts[:4], sampled)
    b = Engine(model, EngineConfig(num_pages=64)).generate(prompts[:4], sampled)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_triton_graphs_match_the_cpu_reference_fp32():
    """Greedy tokens of the GPU fast path (Triton kernels, CUDA graphs, fp32) equal the CPU engine's (torch
    reference kernels), over mixed prompt lengths, chunked prefill, preemption and a drain through buckets."""
    cpu_model, _ = load_model("tiny-qwen3")
    gpu_model, _ = load_model("tiny-qwen3", device="cuda")
    prompts = random_prompts(40, 3, 120, seed=7)
    greedy = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    config = dict(num_pages=160, max_tokens_per_step=256, max_num_seqs=48)
    tools = random_prompts(40, 1, 40, seed=8)
    reference = two_turns(Engine(cpu_model, EngineConfig(**config)), prompts, greedy, tools)
    engine = Engine(gpu_model, EngineConfig(**config))
    assert engine.graphs is not None and engine.mixed_graphs is not None
    outs = two_turns(engine, prompts, greedy, tools)  # turn 2: chunks after cached prefixes, beside decodes
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    for out, ref in zip(outs, reference):
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)
    stats = engine.stats
    assert stats.graph_steps > 0 and stats.mixed_graph_steps > 0
    assert stats.graph_captures == len(engine.graphs.buckets) + len(engine.mixed_graphs.captured)
    # Preempting under a small pool, sampled, graphs on vs off: the same draws.
    small = dict(num_pages=40, max_tokens_per_step=128, max_num_seqs=32)
    sampled = [SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=i) for i in range(len(prompts))]
    on = Engine(gpu_model, EngineConfig(**small))
    a = on.generate(prompts, sampled)
    b = Engine(gpu_model, EngineConfig(**small, cuda_graphs=False)).generate(prompts, sampled)
    assert on.stats.preemptions > 0 and on.stats.graph_steps > 0
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_graph_replay_reads_parameters_updated_in_place():
    """Graphs read the parameters by address: after `p.add_` on every parameter (and a version bump), replays
    decode and prefill with the new values, exactly as a graph-free engine does, without capturing again."""
    model, _ = load_model("tiny-qwen3", device="cuda")
    prompts = random_prompts(24, 3, 60, seed=8)
    greedy = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    config = dict(num_pages=128, max_num_seqs=32, kv_on_update="recompute")  # recompute: no old-weight KV kept
    engine = Engine(model, EngineConfig(**config))
    before = engine.generate(prompts, greedy)
    captures = engine.stats.graph_captures
    assert captures > 0
    perturb_in_place(model, engine)
    after = engine.generate(prompts, greedy)
    eager = Engine(model, EngineConfig(**config, cuda_graphs=False)).generate(prompts, greedy)
    assert engine.stats.graph_captures == captures and engine.stats.mixed_graph_steps > 0
    assert [o.token_ids for o in after] == [o.token_ids for o in eager] != [o.token_ids for o in before]
    for out, ref in zip(after, eager):
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)
    assert all(v == 1 for o in after for v in o.versions)


def test_hybrid_decode_graphs_match_hf_generate_across_an_in_place_update():
    """Qwen3.5 (gated delta net layers beside full attention), fp32: with decode steps replayed from CUDA graphs
    (the linear-attention state gathered and scattered by a slot buffer) greedy tokens equal transformers'
    generate on 16 prompts of mixed lengths, before and after an in-place update of every parameter, without a
    capture again; a second turn resumed from state snapshots equals generate on the whole history."""
    model, _ = load_model("tiny-qwen3.5", device="cuda")
    prompts = random_prompts(16, 3, 60, seed=11)
    tools = random_prompts(16, 1, 12, seed=12)
    greedy = SamplingParams(max_new_tokens=16, temperature=0)
    config = dict(num_pages=128, max_num_seqs=32, kv_on_update="recompute")
    engine = Engine(model, EngineConfig(**config))
    assert engine.graphs is not None and engine.mixed_graphs is None  # prefill stays eager
    before = engine.generate(prompts, greedy)
    assert [o.token_ids for o in before] == [hf_greedy(model, p, greedy.max_new_tokens) for p in prompts]
    captures = engine.stats.graph_captures
    assert captures == len(engine.graphs.buckets) and engine.stats.graph_steps > 0
    perturb_in_place(model, engine)
    outs = two_turns(engine, prompts, greedy, tools)
    contexts = prompts + [p + o.token_ids + t for p, o, t in zip(prompts, outs, tools)]
    assert [o.token_ids for o in outs] == [hf_greedy(model, c, greedy.max_new_tokens) for c in contexts]
    assert [o.token_ids for o in outs[:len(prompts)]] != [o.token_ids for o in before]
    stats = engine.stats
    assert stats.graph_captures == captures and stats.snapshot_resumes > 0
    assert all(v == 1 for o in outs for v in o.versions)
    eager = two_turns(Engine(model, EngineConfig(**config, cuda_graphs=False)), prompts, greedy, tools)
    assert [o.token_ids for o in eager] == [o.token_ids for o in outs]
    for out, ref in zip(outs, eager):
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)


def test_graphs_survive_release_to_a_new_address():
    """A restore that lands the KV pool elsewhere drops the graphs and captures them again; decoding
    continues exactly."""
    model, _ = load_model("tiny-qwen3", device="cuda")
    prompts = random_prompts(12, 3, 60, seed=9)
    greedy = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    config = EngineConfig(num_pages=96, max_num_seqs=16)
    reference = Engine(model, EngineConfig(num_pages=96, max_num_seqs=16, cuda_graphs=False)).generate(prompts, greedy)
    engine = Engine(model, config)
    ids = [engine.submit(p, greedy) for p in prompts]
    done = {}
    held = []
    while len(done) < len(ids):
        done.update({c.request_id: c for c in engine.step()})
        if engine.stats.graph_steps and len(held) < 3:
            held.append(engine.storage.kv)  # still referenced, so the restored pool must land elsewhere
            engine.release_kv()
            engine.restore_kv()
            assert engine.storage.kv.data_ptr() != held[-1].data_ptr()
    assert [done[i].token_ids for i in ids] == [o.token_ids for o in reference]
    assert engine.stats.graph_captures > len(engine.graphs.buckets)


def perturb_in_place(model, engine) -> None:
    """Every parameter moved in place (the optimizer's way: same storage), then the engine told of a new version."""
    with engine.pause():
        g = torch.Generator(device="cuda").manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g, device="cuda") * 0.05)
        engine.bump_version()


@pytest.mark.parametrize("separate_stream", [False, True])
def test_background_engine_never_reads_weights_written_inside_pause(separate_stream):
    """The background engine (on the trainer's stream, or on its own: `engine.separate_stream`) while this thread
    repeatedly zeroes every parameter inside `pause()` and writes it back before leaving: a decode step that ran, on
    the GPU, during the zeroed window (a queued step not waited for, or the next one not ordered after the restore)
    would change tokens. Greedy output equals the engine's alone."""
    model, _ = load_model("tiny-qwen3", device="cuda")
    prompts = random_prompts(16, 3, 60, seed=12)
    greedy = SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True)
    config = EngineConfig(num_pages=256, max_tokens_per_step=64, separate_stream=separate_stream)
    reference = Engine(model, config).generate(prompts, greedy)
    engine = Engine(model, config)
    saved = [p.detach().clone() for p in model.parameters()]
    engine.start()
    try:
        ids = [engine.submit(p, greedy) for p in prompts]
        windows = 0
        while engine.has_work():
            with engine.pause():
                for p in model.parameters():
                    p.data.zero_()
                torch.cuda._sleep(200_000)  # keep the zeroed window open on the GPU
                for p, s in zip(model.parameters(), saved):
                    p.data.copy_(s)
            windows += 1
        got = completions_of(engine, ids, timeout=60)
    finally:
        engine.stop()
    assert windows > 10
    assert [got[i].token_ids for i in ids] == [r.token_ids for r in reference]
