"""A hybrid model's flat forward and backward replayed from graphs (`trainer.cuda_graphs=true` with the varlen
kernels), on CPU with flash-linear-attention's kernels in Triton's interpreter and the stand-in capture: the row's
chunk indices travel with its layout on the bucket's fixed grid (`linear_conv.chunk_indices`), so fla builds none
on the device (no read back to the host a capture would refuse), and the replayed steps land on the eager trainer's
weights. Needs the `gpu` extra (package `fla`); the CUDA graphs themselves are a GPU test in test_hybrid_gpu.py."""

import importlib.util

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from agentrl.train import varlen_attention as va
from agentrl.train.config import LossConfig, OptimConfig, TrainerConfig
from agentrl.train.flat_graphs import FlatGraphs, stand_in_capture
from agentrl.train.linear_conv import install_wrappers
from agentrl.train.logprobs import _decoder
from agentrl.train.trainer import Trainer
from tests.helpers import (INTERPRETING, WELL_CONDITIONED_INIT, interpreter_child, patch_triton_interpreter,
                           run_in_interpreter, tiny_qwen35, train_samples)

FLA = importlib.util.find_spec("fla") is not None
REFERENCE = va.register("agentrl_varlen_reference", va.reference_kernel)  # flash's stand-in on CPU


@pytest.mark.skipif(not FLA or INTERPRETING, reason="needs flash-linear-attention (the gpu extra); the child runs it")
def test_hybrid_graph_replays_in_the_interpreter():
    run_in_interpreter(interpreter_child(__file__, "-k", "interpreted"))


class _DeviceBuiltChunks(TorchDispatchMode):
    """Counts `repeat_interleave` over a tensor of counts: how fla builds chunk indices from `cu_seqlens` on the
    device, reading their number back to the host."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name == "aten::repeat_interleave":
            self.count += 1
        return func(*args, **(kwargs or {}))


def _interpreter(monkeypatch):
    from triton.runtime.autotuner import Autotuner

    from tests.train.test_delta_rule_backward import _builtin_range_as_tensors

    patch_triton_interpreter()
    _builtin_range_as_tensors(monkeypatch)
    run = Autotuner.run
    monkeypatch.setattr(Autotuner, "run", lambda self, *a, **k: (setattr(self, "configs", self.configs[:1]),
                                                                  run(self, *a, **k))[1])


def _trainer(capture):
    model = tiny_qwen35(WELL_CONDITIONED_INIT)
    model.set_attn_implementation(REFERENCE)
    install_wrappers(model)
    trainer = Trainer(model, TrainerConfig(row_tokens=96, rows_per_micro_batch=1, share_prefix=False,
                                           skip_zero_advantage=False),
                      LossConfig(), OptimConfig(lr=1e-3, eps=1e-5), total_steps=4, hybrid_varlen=True)
    trainer.pad_multiple = 16  # as on GPU (row_pad_multiple there)
    if capture is not None:
        trainer.graphs = FlatGraphs(_decoder(model), pad_multiple=16, row_tokens=96, capture=capture)
    return trainer


@pytest.mark.skipif(not FLA or not INTERPRETING, reason="runs in the child of the test above")
def test_interpreted_hybrid_replays_land_on_the_eager_weights_and_build_no_chunks_on_the_device(monkeypatch):
    """Three steps of the same two rows (the second and third replay both buckets), one row a micro-batch; fp32,
    the well-conditioned tiny Qwen3.5 (its fp32 rounding is ~1e-6, tests/train/test_linear_conv.py)."""
    _interpreter(monkeypatch)
    samples = train_samples(300, [70, 9, 33, 64, 2, 40, 25])
    weights, counts = [], None
    for capture in (None, stand_in_capture):
        trainer = _trainer(capture)
        mode = _DeviceBuiltChunks()
        with mode:
            for _ in range(3):
                trainer.step(samples, policy_version=0)
        assert mode.count == 0, "fla built chunk indices on the device"
        weights.append([p.detach().clone() for p in trainer.model.parameters()])
        if capture is not None:
            counts = trainer.graphs.counts
    assert counts["captured"] >= 1 and counts["replayed"] >= 2, counts
    initial = list(tiny_qwen35(WELL_CONDITIONED_INIT).parameters())
    for a, b, p in zip(*weights, initial):
        assert not torch.equal(a, p)  # every parameter trained
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
