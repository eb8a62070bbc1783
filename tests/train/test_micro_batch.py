"""The default micro-batch: as many packed rows as an activation estimate fits in 16 GiB (train/micro_batch.py), so a
small model's rows run in one forward/backward and a large model's one at a time; the gradients are the same. The
estimate for compiled layers is what they were measured to keep."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen3Config

from agentrl.models import load_model
from agentrl.sample import TrainingSample
from agentrl.train.config import LossConfig, OptimConfig, TrainerConfig
from agentrl.train.micro_batch import (ACTIVATION_BUDGET, activation_bytes_per_token, has_head_norms, layers_compiled,
                                       rows_within)
from agentrl.train.trainer import Trainer

SMOLLM2_135M = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                           num_key_value_heads=3, head_dim=64)
QWEN3_06B = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128)


@pytest.mark.parametrize("config, head_norms, compiled, rows", [
    (SMOLLM2_135M, False, True, 4), (QWEN3_06B, True, True, 1),  # compiled layers: the GPU default
    (SMOLLM2_135M, False, False, 2), (QWEN3_06B, True, False, 1),
])
def test_the_estimate_gives_small_models_several_rows_and_large_ones_one(config, head_norms, compiled, rows):
    per_token = activation_bytes_per_token(config, torch.bfloat16, compiled=compiled, head_norms=head_norms)
    assert rows_within(ACTIVATION_BUDGET, per_token, 8192) == rows
    assert rows_within(24 * 2**30 // 4, per_token, 8192) == 1  # a 24 GiB card: a quarter of it holds one row


QWEN25_15B = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2)


@pytest.mark.parametrize("config, head_norms, compiled, measured", [
    (SMOLLM2_135M, False, True, 17_196), (QWEN3_06B, True, True, 45_736), (QWEN25_15B, False, True, 73_784),
    (SMOLLM2_135M, False, False, 24_876), (QWEN3_06B, True, False, 72_360), (QWEN25_15B, False, False, 103_992),
])
def test_the_estimate_is_what_a_layer_keeps(config, head_norms, compiled, measured):
    """Bytes a token, one bf16 layer, as `benchmarks/saved_activations.py` measured them (BENCHMARKS.md): the
    estimate leaves out only fp32 scalars a token (log-sum-exp, norm statistics)."""
    per_layer = activation_bytes_per_token(config, torch.bfloat16, compiled=compiled, head_norms=head_norms)
    per_layer /= config.num_hidden_layers
    assert measured - 200 <= per_layer <= measured


def test_compiled_layers_and_head_norms_are_read_off_the_model():
    model = load_model("tiny-qwen3")[0]
    assert has_head_norms(model) and not layers_compiled(model)
    for layer in model.model.layers:
        layer.compile()  # sets the compiled call; nothing compiles before a forward
    assert layers_compiled(model)
    assert not has_head_norms(LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                           num_attention_heads=2, vocab_size=64)))


def _samples(vocab: int) -> list[TrainingSample]:
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(6):
        ids = torch.randint(0, vocab, (40 + 7 * i,), generator=g).tolist()
        trainable = [0] * 20 + [1] * (len(ids) - 20)
        samples.append(TrainingSample(ids, trainable, [-1.0 if t else 0.0 for t in trainable],
                                      [0 if t else -1 for t in trainable], advantage=(-1.0) ** i))
    return samples


def _step(rows_per_micro_batch):
    model = load_model("tiny-qwen3")[0]
    trainer = Trainer(model, TrainerConfig(row_tokens=96, rows_per_micro_batch=rows_per_micro_batch, share_prefix=False),
                      LossConfig(), OptimConfig(lr=1e-3), total_steps=4)
    forwards = []
    model.get_decoder().register_forward_hook(lambda *_: forwards.append(1))
    metrics = trainer.step(_samples(model.config.vocab_size), policy_version=0)
    return model, trainer, metrics, len(forwards)


def test_the_default_runs_a_tiny_models_rows_in_one_forward_with_the_same_update():
    one_model, _, one, one_forwards = _step(1)
    auto_model, trainer, auto, auto_forwards = _step(None)
    assert one["rows"] >= 3 and one_forwards == one["rows"]
    assert trainer.rows_per_micro_batch > one["rows"] and auto_forwards == 1
    assert auto["loss"] == pytest.approx(one["loss"], abs=1e-6)
    for a, b in zip(auto_model.parameters(), one_model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
