"""The policy loss on small cases worked out by hand."""

import math

import pytest
import torch

from agentrl.train.config import LossConfig
from agentrl.rollout.groups import group_advantages
from agentrl.train.loss import loss_denominator, policy_loss
from agentrl.train.pack import TrainableTokens


def _tokens(ratios, advantages, sample_index, versions=None, num_samples=None, behaviour=-1.0):
    n = len(ratios)
    tokens = TrainableTokens(
        target_ids=torch.zeros(n, dtype=torch.long),
        behaviour_logprobs=torch.full((n,), behaviour),
        advantages=torch.tensor(advantages, dtype=torch.float32),
        versions=torch.tensor(versions if versions is not None else [0] * n, dtype=torch.long),
        sample_index=torch.tensor(sample_index, dtype=torch.long),
        num_samples=num_samples if num_samples is not None else max(sample_index) + 1,
    )
    logprobs = (behaviour + torch.log(torch.tensor(ratios, dtype=torch.float64))).float().requires_grad_()
    return logprobs, tokens


# Sample 0: two tokens with A = +1 at ratios 1.5 (above the clip) and 0.5; sample 1: one token, A = -2, ratio 1.1.
RATIOS, ADV, INDEX = [1.5, 0.5, 1.1], [1.0, 1.0, -2.0], [0, 0, 1]


def test_grpo_sequence_mean_then_batch_mean():
    lp, tok = _tokens(RATIOS, ADV, INDEX)
    loss, m = policy_loss(lp, tok, LossConfig(type="grpo", clip_eps=0.2, tis_cap=None), current_version=0)
    # surrogates: min(1.5, 1.2) = 1.2 ; min(0.5, 0.8) = 0.5 ; min(-2.2, -2.2) = -2.2
    # sample means 0.85 and -2.2, batch mean -0.675
    assert loss.item() == pytest.approx(0.675, abs=1e-6)
    loss.backward()
    # clipped token: no gradient; others: -w * r * A with w = 1/2 * 1/2 and 1/2 * 1
    torch.testing.assert_close(lp.grad, torch.tensor([0.0, -0.125, 1.1]), atol=1e-6, rtol=0)
    assert m["tokens"] == 3
    assert m["clip_high_frac"] == pytest.approx(1 / 3)
    assert m["clip_low_frac"] == 0.0  # ratio 0.5 is below 0.8 but A > 0, so its gradient still flows
    assert m["is_ratio_max"] == pytest.approx(1.5, rel=1e-6)
    assert m["is_ratio_min"] == pytest.approx(0.5, rel=1e-6)
    assert m["is_ratio_mean"] == pytest.approx(3.1 / 3, rel=1e-6)
    k3 = sum(r - 1 - math.log(r) for r in RATIOS) / 3
    assert m["kl_behaviour_current"] == pytest.approx(k3, rel=1e-5)


def test_dapo_asymmetric_clip_and_token_mean():
    lp, tok = _tokens(RATIOS, ADV, INDEX)
    cfg = LossConfig(type="dapo", clip_eps=0.2, clip_eps_high=0.28, tis_cap=None)
    loss, m = policy_loss(lp, tok, cfg, current_version=0)
    assert loss.item() == pytest.approx(-(1.28 + 0.5 - 2.2) / 3, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([0.0, -0.5 / 3, 2.2 / 3]), atol=1e-6, rtol=0)


def test_dr_grpo_constant_normaliser():
    lp, tok = _tokens(RATIOS, ADV, INDEX)
    cfg = LossConfig(type="dr_grpo", tis_cap=None, dr_grpo_max_tokens=4)
    loss, _ = policy_loss(lp, tok, cfg, current_version=0)
    assert loss.item() == pytest.approx(-(1.2 + 0.5 - 2.2) / 8, abs=1e-6)  # 2 samples x 4 tokens
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([0.0, -0.5 / 8, 2.2 / 8]), atol=1e-6, rtol=0)


def test_low_clip_counts_negative_advantages_only():
    lp, tok = _tokens([0.5, 0.5], [-1.0, 1.0], [0, 1])
    loss, m = policy_loss(lp, tok, LossConfig(type="dapo", tis_cap=None), current_version=0)
    # A = -1: min(-0.5, -0.8) = -0.8, clipped; A = +1: min(0.5, 0.8) = 0.5
    assert loss.item() == pytest.approx(-(-0.8 + 0.5) / 2, abs=1e-6)
    assert m["clip_low_frac"] == 0.5 and m["clip_high_frac"] == 0.0


def test_tis_truncates_the_ratio_weight_instead_of_squaring_it():
    # A negative advantage at ratio 3: the clip does not act (min(-3, -1.2) = -3), so only TIS bounds it.
    lp, tok = _tokens([3.0], [-1.0], [0])
    loss_off, _ = policy_loss(lp, tok, LossConfig(type="dapo", tis_cap=None), current_version=0)
    (g_off,) = torch.autograd.grad(loss_off, lp)
    loss_on, m = policy_loss(lp, tok, LossConfig(type="dapo", tis_cap=2.0), current_version=0)
    (g_on,) = torch.autograd.grad(loss_on, lp)
    assert loss_off.item() == pytest.approx(3.0, rel=1e-6)
    assert g_off.item() == pytest.approx(3.0, rel=1e-6)  # -(r * A)
    assert loss_on.item() == pytest.approx(2.0, rel=1e-6)  # scaled by min(r, 2) / r
    assert g_on.item() == pytest.approx(2.0, rel=1e-6)  # gradient weight min(r, cap), not r * min(r, cap)
    assert m["tis_truncated_frac"] == 1.0
    # under the cap it changes nothing
    lp2, tok2 = _tokens(RATIOS, ADV, INDEX)
    a, _ = policy_loss(lp2, tok2, LossConfig(type="grpo", tis_cap=2.0), current_version=0)
    b, _ = policy_loss(lp2, tok2, LossConfig(type="grpo", tis_cap=None), current_version=0)
    assert a.item() == pytest.approx(b.item(), abs=1e-7)


def test_staleness_drop_and_downweight():
    # versions 5, 3, 5 at current version 5 with max_staleness 1: the middle token (staleness 2) is stale.
    lp, tok = _tokens(RATIOS, ADV, INDEX, versions=[5, 3, 5])
    drop = LossConfig(type="dapo", clip_eps_high=0.28, tis_cap=None, max_staleness=1)
    loss, m = policy_loss(lp, tok, drop, current_version=5)
    assert loss.item() == pytest.approx(-(1.28 - 2.2) / 2, abs=1e-6)  # out of the numerator and the count
    assert m["stale_tokens"] == 1
    assert m["staleness_hist"] == {0: 2, 2: 1}
    assert m["staleness_mean"] == pytest.approx(2 / 3)

    half = LossConfig(type="dapo", clip_eps_high=0.28, tis_cap=None, max_staleness=1, stale_weight=0.5)
    loss, _ = policy_loss(lp, tok, half, current_version=5)
    assert loss.item() == pytest.approx(-(1.28 + 0.5 * 0.5 - 2.2) / 3, abs=1e-6)

    grpo = LossConfig(type="grpo", tis_cap=None, max_staleness=1)
    loss, _ = policy_loss(lp, tok, grpo, current_version=5)
    assert loss.item() == pytest.approx(-(1.2 - 2.2) / 2, abs=1e-6)  # sample 0 is now its one fresh token

    with pytest.raises(ValueError, match="newer than the current"):
        policy_loss(lp, tok, grpo, current_version=4)


def test_micro_batches_sum_to_the_whole_batch_loss():
    lp, tok = _tokens(RATIOS, ADV, INDEX)
    cfg = LossConfig(type="grpo", tis_cap=None)
    whole, _ = policy_loss(lp, tok, cfg, current_version=0)
    d = loss_denominator(tok, cfg, current_version=0)
    parts = []
    for idx in ([0, 1], [2]):  # a sample never straddles micro-batches (they are row partitions)
        sub = TrainableTokens(**{k: (v[idx] if isinstance(v, torch.Tensor) else v) for k, v in tok.__dict__.items()})
        parts.append(policy_loss(lp[idx], sub, cfg, current_version=0, denominator=d)[0])
    assert sum(parts).item() == pytest.approx(whole.item(), abs=1e-6)


def test_entropy_metric_and_empty_batch():
    lp, tok = _tokens(RATIOS, ADV, INDEX)
    _, m = policy_loss(lp, tok, LossConfig(), current_version=0, entropy=torch.tensor([1.0, 2.0, 3.0]))
    assert m["entropy_mean"] == pytest.approx(2.0)
    lp0, tok0 = _tokens([], [], [], num_samples=2)
    loss, m = policy_loss(lp0, tok0, LossConfig(), current_version=0)
    assert loss.item() == 0.0 and m == {"tokens": 0}
    loss.backward()  # still a graph


def test_group_advantages():
    # The driver's advantages (the only ones the trainer uses): population std, so an even split gives +-1.
    assert group_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0) == [1.0, -1.0, -1.0, 1.0]
    assert group_advantages([1.0, 0.0, 0.0, 1.0], mode="mean") == [0.5, -0.5, -0.5, 0.5]
    # rewards 0, 0, 3: mean 1, population std sqrt(2)
    s = math.sqrt(2)
    assert group_advantages([0.0, 0.0, 3.0], eps=0.0) == pytest.approx([-1 / s, -1 / s, 2 / s], abs=1e-12)
    assert group_advantages([3.0, 3.0, 3.0]) == [0.0, 0.0, 0.0]
    # equal scores whose mean rounds off their value: still exactly 0, in both modes
    for value, n in ((0.1, 3), (0.7, 8), (1 / 3, 7)):
        assert group_advantages([value] * n) == [0.0] * n and group_advantages([value] * n, mode="mean") == [0.0] * n
    with pytest.raises(ValueError):
        group_advantages([1.0], mode="std")


def test_deferred_metrics_resolve_to_the_same_values():
    lp, tok = _tokens(RATIOS, ADV, INDEX)
    cfg = LossConfig(type="dapo", tis_cap=2.0)
    loss_now, now = policy_loss(lp, tok, cfg, current_version=1, entropy=torch.tensor([1.0, 2.0, 3.0]))
    loss_later, pending = policy_loss(lp, tok, cfg, current_version=1, entropy=torch.tensor([1.0, 2.0, 3.0]),
                                      defer_metrics=True)
    assert not isinstance(pending, dict) and pending.resolve() == now
    assert torch.equal(loss_now, loss_later)
