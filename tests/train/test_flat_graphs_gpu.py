"""The trainer's flat forward and backward replayed from CUDA graphs (`agentrl.train.flat_graphs`) on the GPU, with
the compiled layers and the varlen attentions (flash's, the layers broken around it; cuDNN's, traced into them, the
default on Hopper): replays train to the weights the same padded micro-batches give eagerly, and the bucketed
padding (its own segments, empty ones, gathered keys no segment reads) to the unpadded trainer's within bf16
rounding, with the allocator's free memory full of NaN. Runs where CUDA and flash attention are; the CPU versions
are tests/train/test_flat_graphs.py.
"""

import pytest
import torch

from agentrl.engine.model_view import compile_decoder_layers
from agentrl.models import load_model
from agentrl.run.build import TRAINER_COMPILE
from agentrl.train import varlen_attention as va
from agentrl.train.config import LossConfig, OptimConfig, TrainerConfig
from agentrl.train.cudnn_attention import cudnn_kernel, cudnn_varlen_available
from agentrl.train.flat_graphs import FlatGraphs, cuda_capture
from agentrl.train.logprobs import _decoder
from agentrl.train.trainer import Trainer
from tests.helpers import train_samples
from tests.train.test_prefix_sharing import _groups

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not va.varlen_attention_available(),
                                                  reason="needs CUDA with flash attention")]


def _batches(vocab):
    plain = train_samples(vocab, [130, 90, 210, 40, 170, 110, 20, 300, 250, 80])
    return [_groups(vocab, seed=0), plain, _groups(vocab, seed=0), plain, _groups(vocab, seed=1), plain]


def _poison_free_memory():
    """Free blocks of the caching allocator full of NaN, large and small: a kernel that leaves part of an output
    unwritten (flash attention's backward on keys no segment reads) then shows NaN instead of stale finite values."""
    blocks = [torch.full((64 << 20,), float("nan"), dtype=torch.bfloat16, device="cuda")]
    blocks += [torch.full((1 << 17,), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(256)]
    del blocks


def _attention(kind: str) -> str:
    if kind == "flash":
        return va.register()
    return va.register(va.CUDNN_IMPLEMENTATION, cudnn_kernel, traced=True)  # the default on Hopper


def _train(capture, graphs=True, attention="flash"):
    torch.manual_seed(0)
    _poison_free_memory()
    model = load_model("tiny-qwen3", dtype=torch.bfloat16, device="cuda")[0]
    model.set_attn_implementation(_attention(attention))
    model.train()
    compile_decoder_layers(model, **TRAINER_COMPILE)
    trainer = Trainer(model, TrainerConfig(row_tokens=512, rows_per_micro_batch=1), LossConfig(),
                      OptimConfig(lr=1e-4), total_steps=6)
    if graphs:
        trainer.graphs = FlatGraphs(_decoder(model), pad_multiple=trainer.pad_multiple, capture=capture)
    losses = [trainer.step(b, policy_version=3)["loss"] for b in _batches(model.config.vocab_size)]
    return model, trainer, losses


@pytest.mark.parametrize("attention", ["flash", pytest.param("cudnn_traced", marks=pytest.mark.skipif(
    not cudnn_varlen_available(), reason="needs nvidia-cudnn-frontend"))])
def test_replays_train_to_the_eager_weights_and_the_buckets_to_the_unpadded_ones(attention):
    eager, _, eager_losses = _train(None, attention=attention)
    graphed, trainer, losses = _train(cuda_capture, attention=attention)
    counts = trainer.graphs.counts
    assert counts["captured"] >= 2 and counts["replayed"] >= 3, counts
    # Same kernels on the same shapes, launched from a graph instead of from Python.
    assert losses == eager_losses
    for a, b in zip(graphed.parameters(), eager.parameters()):
        assert torch.equal(a, b)
    # Against no bucketing at all: bf16 rounding of GEMMs over more rows, not a different computation. Buckets pad a
    # prefix-shared row's gathered keys with entries no segment reads (their gradient must be dropped, not summed).
    plain, _, plain_losses = _train(None, graphs=False, attention=attention)
    for got, want in zip(losses, plain_losses):
        assert abs(got - want) <= 1e-2 * max(1.0, abs(want)), (losses, plain_losses)
    for a, b in zip(graphed.parameters(), plain.parameters()):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
