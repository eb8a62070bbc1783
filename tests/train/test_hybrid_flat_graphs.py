"""A hybrid model's flat forward and backward replayed from graphs (`trainer.cuda_graphs=true` with the varlen
kernels), on CPU with flash-linear-attention's kernels in Triton's interpreter and the stand-in capture: the row's
chunk indices travel with its layout on the bucket's fixed grid (`linear_conv.chunk_indices`), so fla builds none
on the device (no read back to the host a capture would refuse), and the replayed steps land on the eager trainer's
weights. Needs the `gpu` extra (package `fla`); the CUDA graphs themselves are a GPU test in test_hybrid_gpu.py."""

import importlib.util

import pytest
import torch

from agentrl.engine.model_view import compile_decoder_layers
from agentrl.run.build import TRAINER_COMPILE
from agentrl.train import varlen_attention as va
from agentrl.train.config import LossConfig, OptimConfig, TrainerConfig
from agentrl.train.flat_graphs import FlatGraphs
from agentrl.train.linear_conv import install_wrappers
from agentrl.train.logprobs import _decoder
from agentrl.train.trainer import Trainer
from tests.children import INTERPRETING, interpret_fla, interpreter_child, run_in_interpreter
from tests.helpers import WELL_CONDITIONED_INIT, HostReads, tiny_qwen35, train_samples

FLA = importlib.util.find_spec("fla") is not None


@pytest.mark.skipif(not FLA or INTERPRETING, reason="needs flash-linear-attention (the gpu extra); the child runs it")
def test_hybrid_graph_replays_in_the_interpreter():
    run_in_interpreter(interpreter_child(__file__, "-k", "interpreted"))


MODE = HostReads()
ATTENTION = va.register("agentrl_varlen_reference_unwatched", MODE.unwatched(va.reference_kernel))
# Reads of host tensors (the layout) and of the step's results (the loss's denominator), outside the decoder
HOST_SIDE = {"logprobs.py:flat_layout", "loss.py:samples_loss_denominator", "trainer.py:step"}


def _trainer(capture, compiled: bool):
    model = tiny_qwen35(WELL_CONDITIONED_INIT)
    model.set_attn_implementation(ATTENTION)
    install_wrappers(model)
    if compiled:  # as `agentrl train` compiles them (`model.compile_layers=true`), a backend without a C++ toolchain
        compile_decoder_layers(model, backend="aot_eager", **TRAINER_COMPILE)
    trainer = Trainer(model, TrainerConfig(row_tokens=96, rows_per_micro_batch=1, share_prefix=False,
                                           skip_zero_advantage=False),
                      LossConfig(), OptimConfig(lr=1e-3, eps=1e-5), total_steps=4, hybrid_varlen=True)
    trainer.pad_multiple = 16  # as on GPU (row_pad_multiple there)
    if capture is not None:
        trainer.graphs = FlatGraphs(_decoder(model), pad_multiple=16, row_tokens=96, capture=capture)
    return trainer


def rehearsed_capture(fn, pool):
    """`stand_in_capture` whose first replay runs as a CUDA capture records, where nothing may compile (a compile
    inside a capture synchronizes, which invalidates it). Later replays run `fn` again."""
    first = [True]

    def replay():
        if not first:
            return fn()
        first.clear()
        frames = torch._dynamo.utils.counters["frames"]
        before = frames["ok"]
        out = fn()
        assert frames["ok"] == before, f"{frames['ok'] - before} frames compiled inside a capture"
        return out
    return replay


@pytest.mark.skipif(not FLA or not INTERPRETING, reason="runs in the child of the test above")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager-layers", "compiled-layers"])
def test_interpreted_hybrid_replays_land_on_the_eager_weights_and_build_no_chunks_on_the_device(compiled,
                                                                                               monkeypatch):
    """Three steps of the same two rows (the second and third replay both buckets), one row a micro-batch; fp32,
    the well-conditioned tiny Qwen3.5 (its fp32 rounding is ~1e-6, tests/train/test_linear_conv.py). After the
    first step nothing in the steps builds chunk indices on the device or reads a tensor back but the step's
    metrics, and compiled layers compile nothing more, nor inside a bucket's capture. The compiled case answers
    the backward call fla refuses on some hosts with agentrl's PyTorch version, compiled with the layers as a run
    compiles it there, and it stays compiled (under the test's dispatch mode it used to fail its whole-graph compile
    and fall back for good). These rows do not reproduce the GPU run's recompile inside a capture (a view's guards):
    tests/train/test_delta_rule_backward.py's one-graph test covers that."""
    interpret_fla(monkeypatch)
    if compiled:
        from agentrl.train import delta_rule_backward

        monkeypatch.setattr(delta_rule_backward, "refused_by_fla", lambda g: g is not None)
        monkeypatch.setattr(delta_rule_backward, "_COMPILE", None)
        assert delta_rule_backward.install()
        delta_rule_backward.compile_stand_in(backend="aot_eager")
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["frames"]
    samples = train_samples(300, [70, 9, 33, 64, 2, 40, 25])
    weights, counts = [], None
    for capture in (None, rehearsed_capture):
        torch._dynamo.reset()  # each trainer compiles afresh, as a run's does
        trainer = _trainer(capture, compiled)
        for step in range(3):
            if step == 0:  # the run's first step also checks prefix sharing and tunes kernels: not captured
                trainer.step(samples, policy_version=0)
                continue
            MODE.reads.clear()
            before = frames["ok"]
            with MODE:
                trainer.step(samples, policy_version=0)
            assert frames["ok"] == before, f"step {step} compiled {frames['ok'] - before} frames"
            # Reads on the host's own tensors (the layout) and of the step's results (the loss's denominator, the
            # optimizer's checks) only: none in the decoder's forward and backward that a capture would meet.
            inside = {where for _, where in MODE.reads if not where.startswith("optim.py:")} - HOST_SIDE
            assert not inside, MODE.reads
        weights.append([p.detach().clone() for p in trainer.model.parameters()])
        if capture is not None:
            counts = trainer.graphs.counts
    assert counts["captured"] >= 1 and counts["replayed"] >= 2, counts
    if compiled:
        from agentrl.train import delta_rule_backward

        assert delta_rule_backward._COMPILE is not None  # compiled to the end, never fallen back to eager
    initial = list(tiny_qwen35(WELL_CONDITIONED_INIT).parameters())
    for a, b, p in zip(*weights, initial):
        assert not torch.equal(a, p)  # every parameter trained
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
