"""The loss's gradient taken in the lm_head's forward (`ChunkedHeadLoss`) equals the loss backpropagated through
the logprobs (`ChunkedLMHead` then `policy_loss`): logprobs, loss, and the hidden states' and weight's gradients."""

import pytest
import torch

from agentrl.train.config import LossConfig
from agentrl.train.lm_head import chunked_logprobs
from agentrl.train.logprobs import packed_token_logprobs
from agentrl.train.loss import TokenLoss, loss_denominator, policy_loss
from agentrl.train.pack import TrainableTokens, pack_samples
from agentrl.train.prefix_forward import shared_token_logprobs
from agentrl.train.prefix_pack import pack_shared
from tests.train.test_prefix_sharing import _groups, _model


def _tokens(n, samples, gen):
    return TrainableTokens(target_ids=torch.zeros(n, dtype=torch.long),
                           behaviour_logprobs=-torch.rand(n, generator=gen) * 6,
                           advantages=torch.randn(n, generator=gen),
                           versions=torch.randint(0, 4, (n,), generator=gen),
                           sample_index=torch.randint(0, samples, (n,), generator=gen), num_samples=samples)


def _head(n=37, width=8, vocab=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, width, generator=gen, dtype=torch.float64).float()
    weight = torch.randn(vocab, width, generator=gen, dtype=torch.float64).float()
    targets = torch.randint(0, vocab, (n,), generator=gen)
    return hidden, weight, targets, _tokens(n, 5, gen)


CONFIGS = [LossConfig(type="grpo"), LossConfig(type="dapo", clip_eps_high=0.28, tis_cap=None),
           LossConfig(type="dr_grpo", max_staleness=1, stale_weight=0.5)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("chunk", [5, 16, 64])
def test_fused_head_equals_the_loss_through_the_logprobs(cfg, chunk):
    hidden, weight, targets, tokens = _head()
    denominator = float(loss_denominator(tokens, cfg, 3)) * 1.5  # a micro-batch's share of a larger batch

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = chunked_logprobs(h1, w1, targets, temperature=0.7, chunk_size=chunk)
    want, _ = policy_loss(lp, tokens, cfg, current_version=3, denominator=denominator)
    want.backward()

    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    terms = TokenLoss(tokens, cfg, current_version=3, denominator=denominator)
    lp2, ent2, got = chunked_logprobs(h2, w2, targets, temperature=0.7, chunk_size=chunk, token_loss=terms)
    assert not lp2.requires_grad and not ent2.requires_grad
    got.backward()

    torch.testing.assert_close(lp2, lp.detach(), rtol=0, atol=0)
    torch.testing.assert_close(ent2, ent.detach(), rtol=0, atol=0)
    torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)
    assert h1.grad.abs().max() > 0 and w1.grad.abs().max() > 0
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-5, atol=1e-7)


def test_the_incoming_gradient_scales_the_fused_one():
    hidden, weight, targets, tokens = _head(n=20)
    terms = TokenLoss(tokens, LossConfig(), current_version=3)
    grads = []
    for scale in (1.0, -2.5):
        h = hidden.clone().requires_grad_()
        _, _, loss = chunked_logprobs(h, weight, targets, chunk_size=8, token_loss=terms)
        (loss * scale).backward()
        grads.append(h.grad)
    torch.testing.assert_close(grads[1], grads[0] * -2.5, rtol=1e-6, atol=0)


def test_without_gradients_the_loss_is_the_terms_sum():
    hidden, weight, targets, tokens = _head(n=20)
    terms = TokenLoss(tokens, LossConfig(), current_version=3)
    with torch.no_grad():
        lp, _, loss = chunked_logprobs(hidden, weight, targets, chunk_size=8, token_loss=terms)
    want, _ = policy_loss(lp, tokens, LossConfig(), current_version=3)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-7)


def _gradients(model, forward):
    model.zero_grad(set_to_none=True)
    lp, loss = forward()
    loss.backward()
    return lp.detach(), float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("shared", [False, True], ids=["packed", "prefix-shared"])
def test_fused_head_through_the_model(shared):
    """A tiny model in fp32 over groups whose shared histories hold trained tokens (one head row, several entries
    with their own advantages): every parameter's gradient equals the unfused path's."""
    torch.manual_seed(0)
    model = _model().float()
    samples = _groups()
    capacity = sum(len(s) for s in samples)
    batch = pack_shared(samples, capacity) if shared else pack_samples(samples, capacity)
    forward = shared_token_logprobs if shared else packed_token_logprobs
    cfg = LossConfig(type="grpo", tis_cap=1.5)
    tokens = batch.trainable_tokens()

    def unfused():
        lp, ent = forward(model, batch, chunk_size=16)
        return lp, policy_loss(lp, tokens, cfg, current_version=3, entropy=ent)[0]

    def fused():
        lp, _, loss = forward(model, batch, chunk_size=16,
                              token_loss=TokenLoss(tokens, cfg, current_version=3))
        return lp, loss

    lp_want, loss_want, want = _gradients(model, unfused)
    lp_got, loss_got, got = _gradients(model, fused)
    if shared:  # the case the row loss exists for: entries that share a head row
        assert len(batch.entry_head) > len(torch.unique(batch.entry_head))
    torch.testing.assert_close(lp_got, lp_want, rtol=0, atol=0)
    assert loss_got == pytest.approx(loss_want, rel=1e-6)
    assert want.keys() == got.keys() and len(want) > 10
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-7, msg=name)
