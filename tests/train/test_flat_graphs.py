"""The trainer's flat forward and backward from graphs per shape bucket (`agentrl.train.flat_graphs`), on CPU: the
bucketed padding computes what the plain padding does, a stand-in capture replays through the same autograd
plumbing and gradient binding the CUDA graphs use, and the forward makes no host reads a capture would refuse.
The CUDA graphs themselves: tests/train/test_flat_graphs_gpu.py."""

import dataclasses

import pytest
import torch

from agentrl.models import load_model
from agentrl.run.build import trainer_graphs
from agentrl.train.linear_conv import use_reference_delta_rule
from agentrl.run.config import TrainConfig
from agentrl.train import varlen_attention as va
from agentrl.train.config import LossConfig, OptimConfig, TrainerConfig
from agentrl.train.flat_graphs import Buckets, FlatGraphs, FlatInputs, RoundUp, stand_in_capture
from agentrl.train.linear_conv import chunk_indices
from agentrl.train.logprobs import _decoder, flat_layout, packed_token_logprobs
from agentrl.train.pack import pack_samples
from agentrl.train.prefix_forward import shared_token_logprobs, tree_flat_layout
from agentrl.train.prefix_pack import pack_shared
from agentrl.train.trainer import Trainer
from tests.helpers import HostReads, train_samples
from tests.train.test_prefix_sharing import _groups

REFERENCE = va.register("agentrl_varlen_reference", va.reference_kernel)  # flash's stand-in on CPU


class _UnwrittenRows(torch.autograd.Function):
    """Flash attention's varlen backward as it is on rows no segment reads: it never writes their gradient, so they
    hold whatever the memory held; NaN here, the worst case."""

    @staticmethod
    def forward(ctx, k, v, cu_k):
        ctx.end = int(cu_k[-1])
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dk, dv):
        dk, dv = dk.clone(), dv.clone()
        dk[ctx.end:], dv[ctx.end:] = float("nan"), float("nan")
        return dk, dv, None


def _flash_like_kernel(q, k, v, cu_q, cu_k, *args):
    k, v = _UnwrittenRows.apply(k, v, cu_k)
    return va.reference_kernel(q, k, v, cu_q, cu_k, *args)


FLASH_LIKE = va.register("agentrl_varlen_unwritten_rows", _flash_like_kernel)


def _model(name="tiny-qwen3", attention=REFERENCE):
    model, _ = load_model(name)
    model.set_attn_implementation(attention)
    return model


# ---------------------------------------------------------------------------------------------- the plan


def test_buckets_give_few_shapes_with_bounded_padding():
    plan = Buckets(128)
    lengths = set()
    for real in range(700, 40_000, 53):
        p = plan(real, 70, 2 * real, 300, 450)
        lengths.add(p.length)
        assert p.length >= real and p.length % 128 == 0
        assert real < 1024 or p.length <= 1.25 * real + 128  # at most a quarter more, past eight multiples
        assert sum(p.tails) == p.length - real and all(0 < t <= p.max_q for t in p.tails)
        assert p.segments >= 70 + len(p.tails) and p.segments & (p.segments - 1) == 0  # a power of two
        assert p.keys >= 2 * real + p.length - real and p.max_q == 512 and p.max_k == 512
    assert len(lengths) <= 24  # 39k lengths from 700 to 40k tokens: two dozen shapes


def test_whole_packed_rows_are_grid_steps():
    """Rows filled close to the packer's capacity pad to it, not to the geometric step above (8,832 for 8,192);
    past one row the grid steps by eighths of a row, so a step's token count moving by a few hundred stays in its
    bucket."""
    plan, plain = Buckets(128, row_tokens=8192), Buckets(128)
    assert plain.grid(8183) == 8832 and plan.grid(8183) == plan.grid(8192) == 8192
    assert plan.grid(3 * 8192 - 500) == 3 * 8192 and plan.grid(3 * 8192 + 1) == 3 * 8192 + 1024
    assert plan.grid(9000) == 9216 and plain.grid(9000) == 11136 and plan.grid(8193) == plain.grid(8193) == 8832
    assert Buckets(128, row_tokens=8000).grid(7999) == 8064  # a capacity off the multiple rounds up to it
    lengths = set()
    for real in range(700, 40_000, 53):
        length = plan.grid(real)
        lengths.add(length)
        assert real <= length <= plain.grid(real) and length % 128 == 0
        assert real < 8192 or length <= real + 1024
    assert len(lengths) <= 60  # 39k lengths over five rows
    assert len({plan.grid(n) for n in range(9300, 10300)}) == 2  # a step's usual spread: two buckets


def test_round_up_is_the_plain_layout():
    p = RoundUp(64)(107, 8, 107, 30, 30)
    assert (p.length, p.tails, p.segments, p.keys, p.max_q) == (128, (21,), 9, 128, 30)
    assert RoundUp(1)(107, 8, 107, 30, 30).tails == ()


def test_bucketed_layouts_pad_with_segments_of_their_own_and_empty_ones():
    batch = pack_samples(train_samples(320, [13, 9, 21, 4, 17, 11, 2, 30]), row_tokens=40)
    plan = Buckets(16)
    layout = flat_layout(batch, padding=plan)
    bounds = layout.cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    assert layout.length == plan.grid(107) == 112 and bounds[-1] == 112
    assert lengths[:8] == [n for segs in batch.segments for _, _, n in segs] and lengths[8] == 5
    assert all(n == 0 for n in lengths[9:]) and len(lengths) == 16 and layout.max_len == 32
    shared = pack_shared(_groups(), row_tokens=64)
    tree = tree_flat_layout(shared, padding=plan)
    cu_q, cu_k = tree.cu_q.tolist(), tree.cu_k.tolist()
    assert cu_q[-1] == tree.length and cu_k[-1] <= tree.kv_index.numel() and len(cu_q) == len(cu_k)
    assert tree.kv_index.numel() == plan.grid(tree.kv_index.numel())


def test_chunk_indices_number_each_sequences_chunks_and_fill_a_fixed_grid_past_the_last_one():
    """flash-linear-attention's (sequence, chunk) pairs, built on the host; a capacity fills the grid with entries
    one chunk past the last non-empty sequence's end (an empty sequence after it is skipped)."""
    assert chunk_indices([130, 0, 64, 1], size=64) == [(0, 0), (0, 1), (0, 2), (2, 0), (3, 0)]
    assert chunk_indices([130, 64, 1, 0, 0], capacity=8, size=64)[5:] == [(2, 1)] * 3
    with pytest.raises(ValueError, match="exceed the capacity"):
        chunk_indices([130], capacity=2, size=64)


def test_a_hybrid_rows_layout_carries_its_chunk_indices_on_the_plans_grid():
    """Exact on the eager plan (the padding tail's chunks too); on the buckets' plan as many as the bucket's fixed
    grid holds, so every micro-batch of a bucket launches fla's kernels over the same grid."""
    batch = pack_samples(train_samples(320, [130, 9, 210, 4, 17, 11, 2, 30]), row_tokens=260)
    segments = [n for segs in batch.segments for _, _, n in segs]
    plain = flat_layout(batch, pad_multiple=128, chunks=True)
    assert plain.chunks.dtype == torch.int32 and plain.chunks.shape[1] == 2
    assert plain.chunks.tolist() == [list(c) for c in chunk_indices(segments + [plain.length - sum(segments)])]
    plan = Buckets(128)
    bucketed = flat_layout(batch, padding=plan, chunks=True)
    bounds = bucketed.cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    capacity = plan(sum(segments), len(segments), sum(segments), max(segments), max(segments)).chunks
    assert capacity == -(-bucketed.length // 64) + len(lengths)
    assert bucketed.chunks.tolist() == [list(c) for c in chunk_indices(lengths, capacity)]
    assert flat_layout(batch, pad_multiple=128).chunks is None  # dense models: none
    ids = torch.zeros(bucketed.length, dtype=torch.long)
    with_chunks = FlatInputs(ids, ids, bucketed.cu_seqlens, bucketed.cu_seqlens, 8, 8, chunks=bucketed.chunks)
    assert with_chunks.key() != FlatInputs(ids, ids, bucketed.cu_seqlens, bucketed.cu_seqlens, 8, 8).key()


@pytest.mark.parametrize("attention", [REFERENCE, FLASH_LIKE])
@pytest.mark.parametrize("shared", [False, True])
def test_bucketed_forward_computes_what_the_plain_padding_does(shared, attention):
    """Logprobs and every gradient, fp32: the padding's own segments and the empty ones change no real token. Also
    under a kernel that leaves the gradient of keys no segment reads unwritten, as flash attention does: a
    prefix-shared row's gathered keys padded to the bucket are such keys, and their gradient must not reach the
    token they point at (it made every gradient NaN in a GPU run, 2026-12-02)."""
    model = _model(attention=attention)
    samples = _groups() if shared else train_samples(model.config.vocab_size, [13, 9, 21, 4, 17, 11, 2, 30])
    batch = pack_shared(samples, row_tokens=64) if shared else pack_samples(samples, row_tokens=40)
    forward = shared_token_logprobs if shared else packed_token_logprobs
    results = []
    for graphs in (None, FlatGraphs(_decoder(model), pad_multiple=16, capture=None)):
        model.zero_grad(set_to_none=True)
        lp, ent = forward(model, batch, chunk_size=16, pad_multiple=16, graphs=graphs)
        (lp.sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), [p.grad.clone() for p in model.parameters()]))
    (lp0, g0), (lp1, g1) = results
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=1e-6)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- replays


def _steps(model, graphs, batches, rows_per_micro_batch=1):
    trainer = Trainer(model, TrainerConfig(row_tokens=64, rows_per_micro_batch=rows_per_micro_batch),
                      LossConfig(), OptimConfig(lr=1e-3), total_steps=len(batches))
    trainer.pad_multiple = 16  # as on GPU (row_pad_multiple there)
    if graphs is not None:
        trainer.graphs = FlatGraphs(_decoder(model), pad_multiple=16, capture=graphs)
    metrics = [trainer.step(samples, policy_version=3) for samples in batches]
    return trainer, metrics


@pytest.mark.parametrize("attention", [REFERENCE, FLASH_LIKE])
def test_replayed_steps_equal_the_padded_eager_steps(attention):
    """Four steps of prefix-shared and plain batches, one row a micro-batch: buckets seen again are replayed (with
    gradients the optimizer set to None in between, and micro-batches of one step mixing eager runs and replays),
    and the weights follow the padded eager trainer's. Under the kernel that leaves unread keys' gradients NaN too:
    a NaN would skip the steps, and the weights would not move."""
    vocab = 300
    plain = train_samples(vocab, [13, 9, 21, 4, 17, 11, 2, 30, 25, 8])
    batches = [_groups(vocab, seed=0), _groups(vocab, seed=0), plain, _groups(vocab, seed=1), plain]
    weights = []
    for capture in (None, stand_in_capture):
        model = _model(attention=attention)
        trainer, metrics = _steps(model, capture, batches)
        weights.append([p.detach().clone() for p in model.parameters()])
        if capture is not None:
            counts = trainer.graphs.counts
            assert counts["captured"] >= 2 and counts["replayed"] >= 4, counts
            assert sum(m["flat_graphs_replayed"] for m in metrics) == counts["replayed"]
            assert metrics[0]["flat_graphs_replayed"] == 0  # the first sight of every bucket runs eagerly
    for a, b in zip(*weights):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    moved = [not torch.equal(a, p) for a, p in zip(weights[0], _model().parameters())]
    assert all(moved)  # every parameter trained, so every one was compared after real updates


def test_replays_bind_the_gradients_back_to_the_captured_tensors():
    model = _model()
    graphs = FlatGraphs(_decoder(model), pad_multiple=16, capture=stand_in_capture)
    batch = pack_samples(train_samples(300, [13, 9, 21]), row_tokens=64)
    grads = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        lp, _ = packed_token_logprobs(model, batch, chunk_size=16, pad_multiple=16, graphs=graphs)
        lp.sum().backward()
        grads.append([p.grad for p in _decoder(model).parameters()])
    assert graphs.counts == {"eager": 1, "captured": 1, "replayed": 2}
    assert all(a is b for a, b in zip(grads[1], grads[2]))  # the captured tensors, every replay
    for a, b in zip(grads[0], grads[2]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)  # cleared in between, not summed


# ---------------------------------------------------------------------------------------------- capturable


def test_the_flat_forward_and_backward_read_nothing_back_to_the_host():
    """The decoder's forward through transformers and its backward, as a graph captures them. The attention
    kernel's stand-in reads its boundaries on the host (flash does not) and is exempt."""
    mode = HostReads()
    name = va.register("agentrl_varlen_host_reads", mode.unwatched(va.reference_kernel))
    model, _ = load_model("tiny-qwen3")
    model.set_attn_implementation(name)
    batch = pack_shared(_groups(), row_tokens=64)
    layout = tree_flat_layout(batch, padding=Buckets(16))
    ids = batch.input_ids.reshape(-1)[layout.index]
    pos = batch.position_ids.reshape(-1)[layout.index]
    pad = layout.length - ids.numel()
    inputs = FlatInputs(torch.cat([ids, ids.new_zeros(pad)]), torch.cat([pos, torch.arange(pad)]), layout.cu_q,
                        layout.cu_k, layout.max_q, layout.max_k, layout.kv_index)
    with mode:
        hidden = inputs.run(_decoder(model))
        hidden.float().square().mean().backward()
    assert hidden.shape == (layout.length, model.config.hidden_size)
    assert not mode.reads, mode.reads
    with mode:  # the check itself sees a read
        bool(hidden.sum() > 0)
    assert mode.reads


# ---------------------------------------------------------------------------------------------- defaults


def test_graphs_are_on_for_flat_cuda_runs_only_unless_set():
    flat, rows, hybrid = _model(), load_model("tiny-qwen3")[0], load_model("tiny-qwen3.5")[0]
    cfg = TrainConfig()
    assert trainer_graphs(cfg, flat, "cuda") is True
    assert trainer_graphs(cfg, flat, "cpu") is False
    assert trainer_graphs(cfg, rows, "cuda") is False  # sdpa / flex rows: no flat layout
    hybrid.set_attn_implementation(flat.config._attn_implementation)  # the varlen attention, as on GPU
    assert trainer_graphs(cfg, hybrid, "cuda") is True  # through fla's varlen kernels, the GPU default
    per_sample = TrainConfig.from_dict({}, ["--model.hybrid_varlen=false"])
    assert trainer_graphs(per_sample, hybrid, "cuda") is False  # its packed rows run sample by sample
    use_reference_delta_rule(hybrid)  # where fla cannot train: the rule reads the boundaries on the host
    assert trainer_graphs(cfg, hybrid, "cuda") is False
    assert trainer_graphs(dataclasses.replace(cfg, deterministic=True), flat, "cuda") is False
    assert trainer_graphs(dataclasses.replace(cfg, release_kv_during_step=True), flat, "cuda") is False
    off = TrainConfig.from_dict({}, ["--trainer.cuda_graphs=false"])
    assert trainer_graphs(off, flat, "cuda") is False
    with pytest.raises(ValueError, match="trainer.cuda_graphs"):
        TrainConfig.from_dict({}, ["--trainer.cuda_graphs=true", "--deterministic=true"])


def test_asking_for_graphs_without_cuda_is_one_clear_error():
    with pytest.raises(ValueError, match="trainer.cuda_graphs=true needs CUDA"):
        Trainer(_model(), TrainerConfig(), LossConfig(), OptimConfig(), total_steps=1, cuda_graphs=True)


def test_a_capture_that_fails_warns_once_and_trains_on_eagerly():
    def broken(fn, pool):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    model = _model()
    graphs = FlatGraphs(_decoder(model), pad_multiple=16, capture=broken)
    batch = pack_samples(train_samples(300, [13, 9, 21]), row_tokens=64)
    want, _ = packed_token_logprobs(model, batch, chunk_size=16, pad_multiple=16, graphs=graphs)
    says = "failed in the forward \\(operation not permitted when stream is capturing\\)"
    with pytest.warns(UserWarning, match=says):
        got, _ = packed_token_logprobs(model, batch, chunk_size=16, pad_multiple=16, graphs=graphs)
    got, _ = packed_token_logprobs(model, batch, chunk_size=16, pad_multiple=16, graphs=graphs)  # no new warning
    assert graphs.capture is None and graphs.counts == {"eager": 3, "captured": 0, "replayed": 0}
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_static_copies_keep_fields_that_are_one_tensor_one():
    """A plain row's query and key boundaries are one tensor; compiled layers guard on that, so a bucket's static
    copy keeps it (split, every layer recompiled inside the GPU capture). The key tells the two apart."""
    ids = torch.arange(8)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    inputs = FlatInputs(ids, ids.clone(), cu, cu, 5, 5)
    copy = inputs.static_copy()
    assert copy.cu_q is copy.cu_k and copy.cu_q is not cu and torch.equal(copy.cu_q, cu)
    assert copy.ids is not copy.pos
    views = torch.cat([torch.zeros(1, dtype=torch.int32), cu]).narrow(0, 1, 3)  # a view at a storage offset
    fresh = FlatInputs(ids, ids, views, views, 5, 5)
    assert fresh.cu_q is fresh.cu_k and fresh.cu_q.storage_offset() == 0 and fresh.ids is fresh.pos
    assert FlatInputs(ids, ids, cu, cu.clone(), 5, 5).key() != inputs.key()


def test_a_capture_failing_in_its_backward_says_so():
    def backward_fails(fn, pool):
        if fn.__name__ == "backward":
            raise RuntimeError("operation failed due to a previous error during capture")
        return fn

    model = _model()
    graphs = FlatGraphs(_decoder(model), pad_multiple=16, capture=backward_fails)
    batch = pack_samples(train_samples(300, [13, 9, 21]), row_tokens=64)
    packed_token_logprobs(model, batch, chunk_size=16, pad_multiple=16, graphs=graphs)
    with pytest.warns(UserWarning, match="failed in the backward \\(operation failed due to a previous error"):
        packed_token_logprobs(model, batch, chunk_size=16, pad_multiple=16, graphs=graphs)


def test_forwards_without_gradients_do_not_count_as_a_buckets_eager_run():
    """The bucket's first micro-batch with gradients runs eagerly whatever forwards without them came first (those
    neither run the backward's kernels nor, compiled, the training graph a capture must find ready), and the one
    after it is captured."""
    model = _model()
    graphs = FlatGraphs(_decoder(model), pad_multiple=16, capture=stand_in_capture)
    batch = pack_samples(train_samples(300, [13, 9, 21]), row_tokens=64)
    with torch.no_grad():
        for _ in range(2):
            packed_token_logprobs(model, batch, chunk_size=16, pad_multiple=16, graphs=graphs)
    assert graphs.counts == {"eager": 2, "captured": 0, "replayed": 0}
    packed_token_logprobs(model, batch, chunk_size=16, pad_multiple=16, graphs=graphs)
    assert graphs.counts == {"eager": 3, "captured": 0, "replayed": 0}
    packed_token_logprobs(model, batch, chunk_size=16, pad_multiple=16, graphs=graphs)
    assert graphs.counts == {"eager": 3, "captured": 1, "replayed": 1}


def test_captures_run_with_the_background_engine_paused_and_steps_beside_it_otherwise():
    """As a run wires it: the trainer steps inside `Engine.beside()` while the engine decodes in its thread, and
    captures under `Engine.pause()` (its guard). No engine step lands inside a capture, none deadlocks, and the
    engine steps beside the replayed micro-batches."""
    import threading
    import time

    from agentrl.engine import Engine, EngineConfig, SamplingParams

    model = _model()
    engine = Engine(load_model("tiny-qwen3")[0], EngineConfig(max_num_seqs=8, max_model_len=96, seed=0))
    capturing, launched_in_capture, launched = threading.Event(), [], []
    launch = engine._launch

    def counted(*args, **kwargs):
        launched.append(1)
        launched_in_capture.append(capturing.is_set())
        return launch(*args, **kwargs)

    engine._launch = counted

    def capture(fn, pool):
        capturing.set()
        try:
            time.sleep(0.3)  # a capture takes a while: long enough for an unguarded engine to step inside it
            return stand_in_capture(fn, pool)
        finally:
            capturing.clear()

    trainer = Trainer(model, TrainerConfig(row_tokens=64, rows_per_micro_batch=1), LossConfig(), OptimConfig(lr=1e-3),
                      total_steps=4)
    trainer.pad_multiple = 16
    trainer.graphs = FlatGraphs(_decoder(model), pad_multiple=16, capture=capture, guard=engine.pause)
    done = threading.Event()
    engine.start()
    try:
        for k in range(40):
            engine.submit([3 + k % 7] * 12, SamplingParams(max_new_tokens=48, temperature=1.0, seed=k))
        def steps():
            with engine.beside():  # as build.step runs the trainer's step
                for _ in range(3):
                    trainer.step(_groups(300), policy_version=3)
            done.set()

        worker = threading.Thread(target=steps, daemon=True)
        worker.start()
        worker.join(timeout=120)
    finally:
        engine.stop()
    assert done.is_set(), "the trainer's steps did not finish beside the engine (a deadlock?)"
    assert trainer.graphs.counts["captured"] >= 1 and trainer.graphs.counts["replayed"] >= 2
    assert launched and not any(launched_in_capture)


def test_at_most_max_graphs_buckets_stay_captured_and_a_dropped_one_is_captured_again():
    model = _model()
    graphs = FlatGraphs(_decoder(model), pad_multiple=16, capture=stand_in_capture, max_graphs=1)
    eager = FlatGraphs(_decoder(model), pad_multiple=16, capture=None)
    short, long = (pack_samples(train_samples(300, lengths), row_tokens=64) for lengths in ([13, 9], [30, 21, 9]))
    for batch in [short, short, long, long, short, short, long]:
        got, _ = packed_token_logprobs(model, batch, chunk_size=16, pad_multiple=16, graphs=graphs)
        want, _ = packed_token_logprobs(model, batch, chunk_size=16, pad_multiple=16, graphs=eager)
        assert torch.equal(got, want)
        assert len(graphs._entries) <= 1
    # short: eager, captured; long: eager, captured (short dropped); short: eager again, captured; long: eager
    assert graphs.counts == {"eager": 4, "captured": 3, "replayed": 3}


def test_a_moved_parameter_drops_the_graphs_that_read_its_old_address():
    """A capture that, like a CUDA graph, reads the parameters where they were when it was recorded: after the
    parameters move (the engine's fused projections re-point them), no old replay may run."""
    model = _model()
    params = list(_decoder(model).parameters())

    def address_bound_capture(fn, pool):
        at_capture = [p.data_ptr() for p in params]

        def replay():
            assert [p.data_ptr() for p in params] == at_capture, "a graph replayed over moved parameters"
            fn()
        return replay

    graphs = FlatGraphs(_decoder(model), pad_multiple=16, capture=address_bound_capture)
    eager = FlatGraphs(_decoder(model), pad_multiple=16, capture=None)
    batch = pack_samples(train_samples(300, [13, 9, 21]), row_tokens=64)
    for step in range(4):
        if step == 2:
            with torch.no_grad():
                for p in params:
                    p.data = p.data * 1.01
        got, _ = packed_token_logprobs(model, batch, chunk_size=16, pad_multiple=16, graphs=graphs)
        want, _ = packed_token_logprobs(model, batch, chunk_size=16, pad_multiple=16, graphs=eager)
        assert torch.equal(got, want)
    # eager, captured; moved: eager again, captured
    assert graphs.counts == {"eager": 2, "captured": 2, "replayed": 2}
