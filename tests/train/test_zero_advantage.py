"""Samples whose advantage is 0 carry no gradient: the trainer leaves them out of its forward and backward, and the
update is still the one over every sample (the loss denominator counts them, a step with nothing left still
updates)."""

import pytest
import torch

from agentrl.models import load_model
from agentrl.sample import TrainingSample
from agentrl.train.config import LossConfig, OptimConfig, TrainerConfig
from agentrl.train.loss import loss_denominator, samples_loss_denominator
from agentrl.train.pack import pack_samples
from agentrl.train.trainer import Trainer


def _samples(step: int, vocab: int, zero_groups: set[int]) -> list[TrainingSample]:
    """Three groups of four members on a prompt each, members of different lengths and policy versions; the groups
    in `zero_groups` scored alike (advantage 0 for every member)."""
    g = torch.Generator().manual_seed(step)
    samples = []
    for group in range(3):
        prompt = torch.randint(0, vocab, (6 + 3 * group,), generator=g).tolist()
        for member in range(4):
            n = 3 + member + group
            trainable = [0] * len(prompt) + [1] * n
            if n > 4:
                trainable[len(prompt) + 2] = 0  # a tool result inside the completion
            version = step - member % 3
            samples.append(TrainingSample(
                prompt + torch.randint(0, vocab, (n,), generator=g).tolist(), trainable,
                [-0.4 - 0.1 * member if t else 0.0 for t in trainable], [version if t else -1 for t in trainable],
                advantage=0.0 if group in zero_groups else member - 1.5, group_id=(step, group)))
    return samples


def _trainer(skip: bool, loss: LossConfig) -> Trainer:
    model, _ = load_model("tiny-qwen3")
    model.set_attn_implementation("sdpa")
    # eps well above 1e-8: Adam divides a gradient element that is rounding noise (~1e-12) by its own magnitude,
    # which blows a different summation order (fewer packed rows) up to a difference of lr.
    return Trainer(model, TrainerConfig(row_tokens=64, skip_zero_advantage=skip), loss,
                   OptimConfig(lr=1e-3, eps=1e-5), total_steps=10)


@pytest.mark.parametrize("loss", [LossConfig(), LossConfig(type="dapo", max_staleness=1, stale_weight=0.5),
                                  LossConfig(type="dr_grpo", max_staleness=0)], ids=["grpo", "dapo-stale", "dr_grpo"])
def test_leaving_out_zero_advantage_samples_gives_the_same_update(loss):
    """A first step in which every group scored alike runs every sample all the same (the trainer compiles on the
    run's first step, not on the first that has something to run). Then three steps: one group of zero advantage,
    then two, then all three. Skipping them gives the weights of training on every sample (fp32); the last step,
    with nothing to run, still updates (Adam's moments carry on)."""
    everything, skipping = _trainer(False, loss), _trainer(True, loss)
    vocab = everything.model.config.vocab_size
    first = _samples(2, vocab, {0, 1, 2})
    want, got = everything.step(first, policy_version=2), skipping.step(first, policy_version=2)
    assert got["zero_advantage_samples"] == 0 and got["computed_tokens"] == want["computed_tokens"] > 0
    for w, g in zip(everything.model.parameters(), skipping.model.parameters()):
        assert torch.equal(g, w)
    before_last = None
    for step, zero in enumerate(({1}, {0, 2}, {0, 1, 2}), start=3):
        samples = _samples(step, vocab, zero)
        if len(zero) == 3:
            before_last = [p.detach().clone() for p in skipping.model.parameters()]
        want = everything.step(samples, policy_version=step)
        got = skipping.step(samples, policy_version=step)
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5, abs=1e-7)
        assert got["trained_tokens"] == want["trained_tokens"] == sum(len(s) for s in samples)
        assert want["zero_advantage_samples"] == 0 and got["zero_advantage_samples"] == 4 * len(zero)
        left_out = sum(len(s) for s in samples if s.advantage == 0)
        assert got["zero_advantage_tokens"] == left_out
        assert got["computed_tokens"] < want["computed_tokens"]
        for (name, w), g in zip(everything.model.named_parameters(), skipping.model.parameters()):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=0, msg=name)
    assert got["rows"] == 0 and got["computed_tokens"] == 0 and got["grad_norm"] == 0.0
    assert "trained_tokens_per_s" not in got and "trained_tokens_per_s" in want  # no rate for a step that ran nothing
    moved = [not torch.equal(b, p) for b, p in zip(before_last, skipping.model.parameters())]
    assert all(moved)  # the all-zero step updated every parameter, as it does with zero gradients computed


@pytest.mark.parametrize("loss", [LossConfig(), LossConfig(max_staleness=1), LossConfig(type="dapo", max_staleness=0),
                                  LossConfig(type="dapo", max_staleness=1, stale_weight=0.5),
                                  LossConfig(type="dr_grpo")], ids=["grpo", "grpo-drop", "dapo-drop", "dapo-weigh",
                                                                    "dr_grpo"])
def test_the_denominator_of_samples_is_the_packed_batchs(loss):
    samples = _samples(4, 300, set())
    samples[3] = TrainingSample(samples[3].input_ids, samples[3].trainable, samples[3].behaviour_logprobs,
                                [0 if t else -1 for t in samples[3].trainable], advantage=1.0)  # all its tokens stale
    packed = float(loss_denominator(pack_samples(samples, 64).trainable_tokens(), loss, 4))
    assert samples_loss_denominator(samples, loss, 4) == packed > 0


def test_a_malformed_sample_is_refused_whether_or_not_it_would_run():
    """Rollouts are built token by token and checked when the trainer takes them: one left out of the forward too."""
    trainer = _trainer(True, LossConfig())
    for zero in (set(), {0}):
        samples = _samples(3, trainer.model.config.vocab_size, zero)
        samples[1].versions.pop()  # a per-token field one short, as a bug in a rollout would leave it
        with pytest.raises(ValueError, match="versions has"):
            trainer.step(samples, policy_version=3)
