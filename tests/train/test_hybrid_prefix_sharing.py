"""Prefix-shared training of a hybrid model: each suffix continues its prefix's convolution window and recurrent
state (`linear_conv.packed_conv_boundaries` with `tree`), so the loss and every gradient equal unshared packing's.

On CPU in fp32: the flat layout with flash's varlen attention stood in by per-sample SDPA, the delta rule through
transformers' PyTorch reference sample by sample (the path a run takes where flash-linear-attention cannot train;
with the package, its kernel runs the same two phases with per-sequence states, and the trainer's check compares it
with unshared packing before relying on it)."""

import pytest
import torch

import agentrl.train.logprobs as logprobs
from agentrl.models import load_model
from agentrl.train import varlen_attention as va
from agentrl.train.config import LossConfig, OptimConfig, TrainerConfig
from agentrl.train.linear_conv import use_reference_delta_rule
from agentrl.train.pack import pack_samples
from agentrl.train.prefix_forward import prefix_sharing_error, prefix_sharing_unsupported
from agentrl.train.prefix_pack import SharedBatch, pack_shared
from agentrl.train.trainer import Trainer
from tests.train.test_prefix_sharing import _groups, _sample, _shared_forward, _unshared_keys

REFERENCE = va.register("agentrl_varlen_reference", va.reference_kernel)


def _hybrid(monkeypatch):
    monkeypatch.setattr(logprobs, "varlen_kernels_installed", lambda: True)
    model = load_model("tiny-qwen3.5")[0]
    model.set_attn_implementation(REFERENCE)
    use_reference_delta_rule(model)
    return model


def _samples(vocab):
    """The dense tests' groups, and one whose 75-token prompt crosses the delta rule's 64-token chunk, with members
    diverging after 1, 2 and 30 tokens (shorter and longer than the convolution's window)."""
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, vocab, (75,), generator=g).tolist()
    long = [_sample(prompt + torch.randint(0, vocab, (n,), generator=g).tolist(), [0] * 75 + [1] * n, a, 9, seed=k)
            for k, (n, a) in enumerate([(1, 1.0), (2, -0.5), (30, 0.25), (12, -1.0)])]
    return _groups(vocab) + long


def _unshared_forward(model, micro):
    return logprobs.packed_token_logprobs(model, micro, chunk_size=16, hybrid_varlen=True)


def test_hybrids_share_on_the_flat_layout_only(monkeypatch):
    assert prefix_sharing_unsupported(_hybrid(monkeypatch)) is None
    rows = load_model("tiny-qwen3.5")[0]  # sdpa rows, the CPU default
    assert "flat layout" in prefix_sharing_unsupported(rows)


def _logprobs_and_grads(model, batch, keys, forward):
    """Each trained token's logprob keyed (sample, token), and the gradients of a weighted sum of them (weights
    fixed per key, so both layouts' losses are the same function of the same logprobs)."""
    model.zero_grad(set_to_none=True)
    lp, _ = forward(model, batch)
    g = torch.Generator().manual_seed(0)
    weights = {k: float(torch.randn((), generator=g)) for k in sorted(keys)}
    (lp * torch.tensor([weights[k] for k in keys])).sum().backward()
    return dict(zip(keys, lp.tolist())), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(model, samples, row_tokens=160):
    shared, unshared = pack_shared(samples, row_tokens=row_tokens), pack_samples(samples, row_tokens=row_tokens)
    assert shared.num_tokens < unshared.num_tokens * 0.7  # the prefixes are computed once
    shared_keys = list(zip(shared.tokens.sample_index.tolist(), shared.entry_token.tolist()))
    want_lp, want_grads = _logprobs_and_grads(model, unshared, _unshared_keys(unshared, samples), _unshared_forward)
    got_lp, got_grads = _logprobs_and_grads(model, shared, shared_keys, _shared_forward(pad_multiple=16))
    assert sorted(got_lp) == sorted(want_lp)
    assert want_grads.keys() == got_grads.keys() and len(want_grads) > 20
    got = torch.tensor([got_lp[k] for k in want_lp])
    return got, torch.tensor(list(want_lp.values())), got_grads, want_grads


def test_a_prefix_ending_on_a_chunk_boundary_gives_unshareds_logprobs(monkeypatch):
    """The delta rule runs in 64-token chunks: a 64-token prompt ends on a chunk boundary both ways, so the suffixes'
    recurrent layers go through the same operations from the same state, and what is left is the attention stand-in's
    rounding (a suffix's SDPA with an explicit mask over prefix + own keys against one causal SDPA unshared): the dense
    tests' tolerance, 1e-5 (measured 9.5e-6 at most, 0 for suffixes past the window). Suffixes of 1 and 2 tokens
    take most of their convolution window from the prefix."""
    model = _hybrid(monkeypatch)
    vocab, g = model.config.vocab_size, torch.Generator().manual_seed(5)
    prompt = torch.randint(0, vocab, (64,), generator=g).tolist()
    samples = [_sample(prompt + torch.randint(0, vocab, (n,), generator=g).tolist(), [0] * 64 + [1] * n, 1.0, 0,
                       seed=k) for k, n in enumerate([1, 2, 30, 12])]
    got, want, _, _ = _compare(model, samples, row_tokens=200)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)


def test_shared_logprobs_and_gradients_equal_unshared_packing(monkeypatch):
    """Prefixes of every length, ending inside a chunk: the suffix's chunks start at its prefix's end rather than
    64-aligned from the sample's start, and transformers' reference rule computes in fp32 whatever the model's dtype,
    so this is rounding of another chunking. At the tiny model's initializer range (1.0) fp32 is itself off from
    fp64 by 2.7e-4 in the last hidden states (`tests/train/test_hybrid_gpu.py::well_conditioned`), so two correct
    chunkings differ by that much: logprobs within 5e-4 absolute (measured 1.2e-4 at a logprob of -7.5 on an AMD
    EPYC, 1.8e-4 at -46 elsewhere; a 1e-5 relative bound failed on the first); gradients within 1e-3 of each
    tensor's largest entry (measured 1.3e-4; the backward reaches the prefix through its final state rather than
    through the chunk recurrence). Without the prefix's state the logprobs move by 16."""
    model = _hybrid(monkeypatch)
    got, want, got_grads, want_grads = _compare(model, _samples(model.config.vocab_size))
    torch.testing.assert_close(got, want, atol=5e-4, rtol=0)
    for name, w in want_grads.items():
        assert (got_grads[name] - w).abs().max() <= 1e-3 * w.abs().max(), name


def test_without_the_prefix_state_the_suffixes_differ(monkeypatch):
    """Control: suffixes started from zero state and zero window (the layout without parents) are not the same."""
    from agentrl.train import prefix_forward

    model = _hybrid(monkeypatch)
    samples = _samples(model.config.vocab_size)
    batch = pack_shared(samples, row_tokens=160)
    with torch.no_grad():
        good, _ = prefix_forward.shared_token_logprobs(model, batch, chunk_size=16)
        original = prefix_forward.tree_flat_layout

        def orphaned(*args, **kwargs):
            layout = original(*args, **kwargs)
            layout.parents = [-1] * len(layout.parents)
            return layout

        monkeypatch.setattr(prefix_forward, "tree_flat_layout", orphaned)
        bad, _ = prefix_forward.shared_token_logprobs(model, batch, chunk_size=16)
    assert (good - bad).abs().max() > 1e-2


def test_the_trainer_shares_a_hybrids_prefixes_after_its_check(monkeypatch):
    model = _hybrid(monkeypatch)
    assert prefix_sharing_error(model) < 1e-5
    samples = _samples(model.config.vocab_size)
    trainer = Trainer(model, TrainerConfig(row_tokens=160), LossConfig(), OptimConfig(lr=1e-3), total_steps=1,
                      hybrid_varlen=True)
    assert isinstance(trainer.pack(samples), SharedBatch) and trainer.share_prefix
    metrics = trainer.step(samples, policy_version=3)
    assert metrics["prefix_shared_tokens"] > 0.3 * metrics["trained_tokens"]


def test_a_shared_backward_that_fails_leaves_the_trainer_on_unshared_packing(monkeypatch):
    """The trainer's check runs a hybrid's shared forward backward: a kernel that cannot differentiate through the
    prefix's state (here: the delta rule refusing a state that needs a gradient) is found before a step."""
    from agentrl.train import linear_conv

    model = _hybrid(monkeypatch)
    per_segment = linear_conv.by_sequence

    def refusing(reference, query, key, value, g, beta, bounds, initial_state=None, **kwargs):
        if initial_state is not None and initial_state.requires_grad:
            class Refuse(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x):
                    return x.clone()

                @staticmethod
                def backward(ctx, grad):
                    raise RuntimeError("this kernel has no backward for initial states here")

            initial_state = Refuse.apply(initial_state)
        return per_segment(reference, query, key, value, g, beta, bounds, initial_state, **kwargs)

    monkeypatch.setattr(linear_conv, "by_sequence", refusing)
    samples = _samples(model.config.vocab_size)
    trainer = Trainer(model, TrainerConfig(row_tokens=160), LossConfig(), OptimConfig(lr=1e-3), total_steps=1,
                      hybrid_varlen=True)
    for attempt in range(3):  # a check that raises is tried in two more steps, unshared meanwhile, then given up
        with pytest.warns(UserWarning, match="no backward for initial states"):
            batch = trainer.pack(samples)
        assert not isinstance(batch, SharedBatch) and trainer.share_prefix is (attempt < 2)
    assert all(p.grad is None for p in model.parameters())
