"""Prefix-shared training: layout and counts, and logprobs, loss and gradients equal to unshared packing."""

import warnings

import pytest
import torch

from agentrl.models import load_model
from agentrl.sample import TrainingSample
from agentrl.train import varlen_attention as va
from agentrl.train.config import LossConfig, OptimConfig, TrainerConfig
from agentrl.train.logprobs import packed_token_logprobs
from agentrl.train.loss import loss_denominator, policy_loss
from agentrl.train.pack import pack_samples
from agentrl.train.prefix_forward import (prefix_sharing_error, prefix_sharing_unsupported, shared_token_logprobs,
                                          token_locations)
from agentrl.train.prefix_pack import longest_common_prefix, pack_shared, prefix_tree_tokens
from agentrl.train.trainer import Trainer


def _sample(ids, trainable, advantage, group_id, seed=0):
    g = torch.Generator().manual_seed(seed)
    behaviour = [(-0.1 - float(torch.rand(1, generator=g))) if t else 0.0 for t in trainable]
    return TrainingSample(list(ids), list(trainable), behaviour, [3 if t else -1 for t in trainable],
                          advantage=advantage, group_id=group_id)


def _groups(vocab=300, seed=0):
    """Four groups of four members: prompts of different lengths; members diverging right after the prompt, late
    in a multi-turn history (trained turns and untrained tool results inside the shared prefix), identical members,
    a member that is the prefix plus one token; and one sample without a group."""
    g = torch.Generator().manual_seed(seed)

    def r(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    samples = []
    # Group 0: a 9-token prompt, members diverge at its end; one member is the prompt plus one token.
    prompt = r(9)
    for k, extra in enumerate((6, 11, 1, 4)):
        tail = r(extra)
        samples.append(_sample(prompt + tail, [0] * 9 + [1] * extra, 1.0 - k * 0.7, 0, seed=k))
    # Group 1: multi-turn. Prompt (5) + turn 1 (trained, 4) + tool result (untrained, 3) shared by all; members
    # diverge in turn 2, at different depths; two members identical; holes in every loss mask.
    prompt, turn1, tool = r(5), r(4), r(3)
    head = prompt + turn1 + tool
    head_mask = [0] * 5 + [1] * 4 + [0] * 3
    turn2 = r(6)
    variants = [turn2[:2] + r(5), turn2[:4] + r(3) + r(2), turn2 + r(2), turn2 + r(2)]
    variants[3] = variants[2]  # identical members (different advantages)
    for k, v in enumerate(variants):
        mask = head_mask + [1] * len(v)
        if len(v) > 5:
            mask[len(head) + 3] = 0  # a tool result inside the member's own part
        samples.append(_sample(head + v, mask, [0.5, -1.5, 2.0, -0.25][k], 1, seed=10 + k))
    # Group 2: a 14-token prompt, two members diverge immediately, two after three generated tokens.
    prompt, common = r(14), r(3)
    for k, tail in enumerate((r(5), r(7), common + r(4), common + r(2))):
        samples.append(_sample(prompt + tail, [0] * 14 + [1] * len(tail), -1.25 + k, 2, seed=20 + k))
    # Group 3: every member the whole shared history (identical), trained inside it.
    history = r(4) + r(5)
    for k in range(4):
        samples.append(_sample(history, [0] * 4 + [1] * 5, 0.3 * k - 0.4, 3, seed=30 + k))
    samples.append(_sample(r(8), [0] * 3 + [1] * 5, 0.9, None, seed=40))
    return samples


def _model(impl="sdpa", name="tiny-qwen3"):
    model, _ = load_model(name)
    model.set_attn_implementation(impl)
    return model


def _keyed(values, tokens_sample, tokens_token):
    return {(s, t): v for s, t, v in zip(tokens_sample.tolist(), tokens_token.tolist(), values.tolist())}


def _unshared_keys(batch, samples):
    """(sample, token index) of each trained target of an unshared batch, in its trainable_tokens order."""
    keys = []
    for r, segs in enumerate(batch.segments):
        for i, start, n in segs:
            for t in range(1, n):
                if batch.loss_mask[r, start + t - 1]:
                    keys.append((i, t, r, start + t - 1))
    keys.sort(key=lambda k: (k[2], k[3]))
    return [(i, t) for i, t, _, _ in keys]


def _step_gradients(model, batch, cfg, forward):
    """Loss and every parameter's gradient of one step over `batch`, one row per micro-batch as the trainer runs."""
    model.zero_grad(set_to_none=True)
    denominator = float(loss_denominator(batch.trainable_tokens(), cfg, 3))
    total, logprobs = 0.0, []
    for r in range(batch.shape[0]):
        micro = batch.select_rows(r, r + 1)
        lp, ent = forward(model, micro)
        loss, _ = policy_loss(lp, micro.trainable_tokens(), cfg, current_version=3, entropy=ent,
                              denominator=denominator)
        loss.backward()
        total += float(loss.detach())
        logprobs.append(lp.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}, torch.cat(logprobs)


def _shared_forward(pad_multiple=1):
    return lambda model, micro: shared_token_logprobs(model, micro, chunk_size=16, pad_multiple=pad_multiple)


def _unshared_forward(model, micro):
    return packed_token_logprobs(model, micro, chunk_size=16)


# ------------------------------------------------------------------------------------------------- layout


def test_a_group_becomes_its_prefix_then_each_suffix():
    p = [10, 11, 12]
    a = _sample(p + [20, 21], [0, 0, 0, 1, 1], 1.0, "g")
    b = _sample(p + [30], [0, 0, 0, 1], -1.0, "g")
    c = _sample(p, [0, 0, 0], 0.5, "g")  # the whole history is the prefix
    d = _sample([40, 41, 42], [0, 1, 1], 2.0, None)
    batch = pack_shared([a, b, c, d], row_tokens=9, pad_token_id=99, pad_to_multiple=4)
    assert batch.shape == (1, 12) and batch.num_tokens == 9 and batch.unshared_tokens == 5 + 4 + 3 + 3
    assert batch.input_ids[0].tolist() == [10, 11, 12, 20, 21, 30, 40, 41, 42, 99, 99, 99]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2, 0, 1, 2]
    assert batch.segment_ids[0].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert batch.branch_ids[0].tolist() == [0, 0, 0, 1, 1, 2, 1, 1, 1, 0, 0, 0]
    # The last prefix position predicts a's 20 and b's 30: two head rows there; c has nothing to predict.
    assert batch.head_index.tolist() == [2, 2, 3, 6, 7]
    assert batch.head_targets.tolist() == [20, 30, 21, 41, 42]
    tokens = batch.trainable_tokens()
    assert tokens.sample_index.tolist() == [0, 1, 0, 3, 3]
    assert batch.entry_token.tolist() == [3, 3, 4, 1, 2]
    assert batch.entry_head.tolist() == [0, 1, 2, 3, 4]
    assert tokens.target_ids.tolist() == [20, 30, 21, 41, 42]
    assert tokens.advantages.tolist() == [1.0, -1.0, 1.0, 2.0, 2.0]
    assert torch.equal(tokens.behaviour_logprobs, torch.tensor([a.behaviour_logprobs[3], b.behaviour_logprobs[3],
                                                                a.behaviour_logprobs[4], d.behaviour_logprobs[1],
                                                                d.behaviour_logprobs[2]]))


def test_a_trained_prefix_token_is_one_head_row_and_one_entry_per_member():
    shared = [1, 2, 3, 4]  # tokens 2 and 3 generated by both members (a multi-turn history's first turn)
    a = _sample(shared + [5], [0, 1, 1, 0, 1], 1.0, 0)
    b = _sample(shared + [6], [0, 1, 1, 0, 1], -2.0, 0)
    batch = pack_shared([a, b], row_tokens=8)
    assert batch.head_index.tolist() == [0, 1, 3, 3] and batch.head_targets.tolist() == [2, 3, 5, 6]
    assert batch.entry_head.tolist() == [0, 0, 1, 1, 2, 3]
    assert batch.tokens.sample_index.tolist() == [0, 1, 0, 1, 0, 1]
    assert batch.tokens.advantages.tolist() == [1.0, -2.0, 1.0, -2.0, 1.0, -2.0]


def test_computed_tokens_drop_by_what_the_groups_share():
    samples = _groups()
    batch = pack_shared(samples, row_tokens=64)
    saved = 0
    for group in range(4):
        members = [s.input_ids for s in samples if s.group_id == group]
        saved += (len(members) - 1) * longest_common_prefix(members)
    assert saved == 3 * (9 + 14 + 9) + 3 * (12 + 2)
    assert batch.unshared_tokens == sum(len(s) for s in samples) == pack_samples(samples, 64).num_tokens
    assert batch.num_tokens == batch.unshared_tokens - saved
    assert batch.num_trainable == sum(s.num_trainable for s in samples)  # every trained token, once per member
    assert all(sum(u.length for u in units) <= 64 for units in batch.units)


def test_a_group_too_long_for_a_row_is_split_into_runs_that_fit():
    samples = _groups()
    group = [s for s in samples if s.group_id == 0]  # prompt 9, members of 15, 20, 10, 13 tokens
    batch = pack_shared(group, row_tokens=30)
    units = [u for row in batch.units for u in row]
    assert all(u.length <= 30 for row in batch.units for u in row)
    assert sorted(i for u in units for i in u.members) == [0, 1, 2, 3]
    assert [u.members for u in units if len(u.members) > 1]  # still shared where members fit together
    with pytest.raises(ValueError, match="more than a row holds"):
        pack_shared(group, row_tokens=19)


def test_prefix_tree_counts_each_distinct_prefix_once():
    assert prefix_tree_tokens([[1, 2, 3], [1, 2, 4], [1, 5]]) == 5  # 1, 2, 3, 4, 5
    assert prefix_tree_tokens([[1, 2], [1, 2]]) == 2
    assert longest_common_prefix([[1, 2, 3], [1, 2, 4], [1, 5]]) == 1


# ------------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_logprobs_loss_and_gradients_equal_unshared_packing(loss_type):
    model = _model()
    samples = _groups(model.config.vocab_size)
    cfg = LossConfig(type=loss_type)
    shared, unshared = pack_shared(samples, row_tokens=64), pack_samples(samples, row_tokens=64)
    assert shared.shape[0] < unshared.shape[0]  # fewer rows: fewer forwards
    want_loss, want_grads, want_lp = _step_gradients(model, unshared, cfg, _unshared_forward)
    got_loss, got_grads, got_lp = _step_gradients(model, shared, cfg, _shared_forward())

    keys = list(zip(shared.tokens.sample_index.tolist(), shared.entry_token.tolist()))
    want = dict(zip(_unshared_keys(unshared, samples), want_lp.tolist()))
    assert sorted(keys) == sorted(want)  # the same trained tokens, each once
    # fp32 rounding of another summation order; this random-weight model's logprobs reach -40, hence the rtol
    torch.testing.assert_close(got_lp, torch.tensor([want[k] for k in keys]), atol=1e-5, rtol=1e-6)
    assert abs(got_loss - want_loss) < 1e-5
    for name, w in want_grads.items():
        torch.testing.assert_close(got_grads[name], w, atol=1e-5, rtol=1e-5, msg=name)


def test_a_reference_without_sharing_differs():
    """Control: dropping the tree (letting suffixes see their siblings) changes the logprobs."""
    model = _model()
    samples = _groups(model.config.vocab_size)
    batch = pack_shared(samples, row_tokens=64)
    leaky = pack_shared(samples, row_tokens=64)
    leaky.branch_ids.zero_()  # every token a "prefix" token: causal over the whole unit
    with torch.no_grad():
        good, _ = shared_token_logprobs(model, batch)
        bad, _ = shared_token_logprobs(model, leaky)
    assert (good - bad).abs().max() > 1e-2


def test_eager_attention_takes_the_additive_tree_mask():
    sdpa, eager = _model("sdpa"), _model("eager")
    samples = _groups(sdpa.config.vocab_size)
    batch = pack_shared(samples, row_tokens=64)
    with torch.no_grad():
        want, _ = shared_token_logprobs(sdpa, batch)
        got, _ = shared_token_logprobs(eager, batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # two kernels: rounding relative to |logprob|


def test_flat_varlen_layout_gathers_each_suffixs_keys():
    """The varlen path (the CPU reference kernel standing in for flash): prefix as one sequence, every suffix
    attending to the prefix's keys then its own; logprobs and gradients equal unshared padded rows."""
    flat = _model(va.register("agentrl_varlen_reference", va.reference_kernel))
    rows = _model("sdpa")
    samples = _groups(rows.config.vocab_size)
    shared, unshared = pack_shared(samples, row_tokens=64), pack_samples(samples, row_tokens=64)
    cfg = LossConfig()
    want_loss, want_grads, _ = _step_gradients(rows, unshared, cfg, _unshared_forward)
    got_loss, got_grads, _ = _step_gradients(flat, shared, cfg, _shared_forward(pad_multiple=16))
    assert abs(got_loss - want_loss) < 1e-5
    for name, w in want_grads.items():
        torch.testing.assert_close(got_grads[name], w, atol=1e-5, rtol=1e-5, msg=name)


def test_flex_attention_block_mask_matches_the_dense_tree_mask():
    """flex_attention has no CPU backward; its BlockMask forward is checked here, gradients on GPU."""
    sdpa, flex = _model("sdpa"), _model("flex_attention")
    samples = _groups(sdpa.config.vocab_size)
    batch = pack_shared(samples, row_tokens=128)
    with torch.no_grad():
        want, _ = shared_token_logprobs(sdpa, batch)
        got, _ = shared_token_logprobs(flex, batch)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_token_locations_cover_every_sample_token():
    samples = _groups()
    batch = pack_shared(samples, row_tokens=64)
    flat = batch.input_ids.reshape(-1)
    for s, where in zip(samples, token_locations(batch, samples)):
        assert flat[where].tolist() == s.input_ids


# ---------------------------------------------------------------------------------------------- the trainer


def _trainer(model, share, **kwargs):
    return Trainer(model, TrainerConfig(row_tokens=64, share_prefix=share, **kwargs), LossConfig(),
                   OptimConfig(lr=1e-3), total_steps=2)


def test_trainer_shares_by_default_and_steps_to_the_same_parameters():
    samples = _groups()
    results, params = [], []
    for share in (True, False):
        model = _model()
        trainer = _trainer(model, share)
        assert trainer.share_prefix is share
        results.append(trainer.step(samples, policy_version=3))
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    shared, unshared = results
    total = sum(len(s) for s in samples)
    assert shared["trained_tokens"] == unshared["trained_tokens"] == unshared["computed_tokens"] == total
    assert shared["computed_tokens"] == total - shared["prefix_shared_tokens"] == total - 3 * (9 + 14 + 9) - 3 * 14
    assert unshared["prefix_shared_tokens"] == 0
    assert shared["prefix_tree_shared_tokens"] >= shared["prefix_shared_tokens"]
    assert shared["generated_tokens"] == unshared["generated_tokens"] == sum(s.num_trainable for s in samples)
    assert shared["rows"] < unshared["rows"]
    assert abs(shared["loss"] - unshared["loss"]) < 1e-5
    for name, want in params[1].items():
        torch.testing.assert_close(params[0][name], want, atol=1e-5, rtol=1e-5, msg=name)


def test_a_row_without_trained_tokens_steps_like_unshared_packing():
    samples = _groups()
    untrained = [_sample(s.input_ids, [0] * len(s), 0.0, "context") for s in samples if s.group_id == 2]
    mixed = samples[:4] + untrained  # one row holds only the untrained group
    params = []
    for share in (True, False):
        model = _model()
        trainer = Trainer(model, TrainerConfig(row_tokens=32, share_prefix=share), LossConfig(),
                          OptimConfig(lr=1e-3), total_steps=2)
        trainer.step(mixed, policy_version=3)
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(params[0], params[1], atol=1e-5, rtol=1e-5)


def test_a_batch_whose_groups_share_nothing_takes_the_plain_packing():
    from agentrl.train.pack import PackedBatch
    from agentrl.train.prefix_pack import SharedBatch

    trainer = _trainer(_model(), True)
    samples = _groups()
    assert isinstance(trainer.pack(samples), SharedBatch)
    loners = [_sample(s.input_ids, s.trainable, 1.0, None) for s in samples]  # no group ids
    assert type(trainer.pack(loners)) is PackedBatch
    # and the metrics say nothing was shared
    assert trainer.step(loners, policy_version=3)["prefix_shared_tokens"] == 0


def test_trainer_config_defaults_to_sharing():
    assert TrainerConfig().share_prefix is True


def test_hybrid_models_fall_back_to_unshared_packing():
    model = _model("sdpa", "tiny-qwen3.5")
    assert "hybrid" in prefix_sharing_unsupported(model)
    trainer = _trainer(model, True)
    assert trainer.share_prefix is False
    metrics = trainer.step(_groups(model.config.vocab_size)[:8], policy_version=3)
    assert metrics["prefix_shared_tokens"] == 0 and metrics["computed_tokens"] == metrics["trained_tokens"]


def _top_left_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, dropout):
    """A kernel aligning the causal mask to the start of the keys (SDPA's is_causal convention) instead of their end."""
    import torch.nn.functional as F

    out = []
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for q0, q1, k0, k1 in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale,
                                                  enable_gqa=q.shape[1] != k.shape[1])[0].transpose(0, 1))
    return torch.cat(out)


def test_a_kernel_that_misreads_the_tree_is_caught_and_the_trainer_falls_back():
    assert prefix_sharing_error(_model("sdpa")) < 1e-5
    assert prefix_sharing_error(_model(va.register("agentrl_varlen_reference", va.reference_kernel))) < 1e-5
    model = _model(va.register("agentrl_varlen_top_left", _top_left_kernel))
    assert prefix_sharing_error(model) > 0.1
    _steps_unshared_with_a_warning(model, "unshared packing")


def test_a_forward_that_fails_turns_sharing_off(monkeypatch):
    # A kernel that cannot run the tree mask at all (bf16 flex_attention at a tiny head size fails to compile in
    # inductor on GPU) must not take the run down: the check fails, the trainer warns and packs unshared. A failure
    # may pass (a kernel autotuned by another thread at the same moment), so the next two steps check again.
    import agentrl.train.trainer as trainer_module

    calls = []

    def cannot_compile(model):
        calls.append(1)
        raise RuntimeError("LoweringException: NoValidChoicesError: No choices to select\nmore detail")

    monkeypatch.setattr(trainer_module, "prefix_sharing_error", cannot_compile)
    model = _model("sdpa")
    trainer = _trainer(model, True)
    for step in range(4):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            metrics = trainer.step(_groups(model.config.vocab_size), policy_version=3)
        says = [str(w.message) for w in caught if "failed (RuntimeError: LoweringException" in str(w.message)]
        assert metrics["prefix_shared_tokens"] == 0
        if step < 2:
            assert len(says) == 1 and "the next one checks again" in says[0] and trainer.share_prefix
        elif step == 2:
            assert len(says) == 1 and "the next one" not in says[0] and trainer.share_prefix is False
        else:
            assert not says
    assert len(calls) == 3


def test_a_check_that_fails_once_shares_from_the_next_step(monkeypatch):
    import agentrl.train.trainer as trainer_module

    real, calls = trainer_module.prefix_sharing_error, []

    def fails_once(model):
        calls.append(1)
        if len(calls) == 1:
            raise TypeError("'NoneType' object is not a mapping")
        return real(model)

    monkeypatch.setattr(trainer_module, "prefix_sharing_error", fails_once)
    model = _model("sdpa")
    trainer = _trainer(model, True)
    with pytest.warns(UserWarning, match="the next one checks again"):
        first = trainer.step(_groups(model.config.vocab_size), policy_version=3)
    second = trainer.step(_groups(model.config.vocab_size), policy_version=3)
    trainer.step(_groups(model.config.vocab_size), policy_version=3)
    assert first["prefix_shared_tokens"] == 0 and second["prefix_shared_tokens"] > 0 and len(calls) == 2


def _steps_unshared_with_a_warning(model, says: str) -> None:
    """A sharing trainer's first step on `model`: it warns (`says` in the message) and packs unshared."""
    trainer = _trainer(model, True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = trainer.step(_groups(model.config.vocab_size), policy_version=3)
    assert any(says in str(w.message) for w in caught)
    assert trainer.share_prefix is False and metrics["prefix_shared_tokens"] == 0


# ----------------------------------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cuda_model(impl, dtype=torch.float32):
    model, _ = load_model("tiny-qwen3", dtype=dtype, device="cuda")
    model.set_attn_implementation(impl)
    return model


def _cuda_step(model, batch, pad_multiple=16):
    cfg = LossConfig()
    forward = _shared_forward(pad_multiple) if hasattr(batch, "units") else (
        lambda m, micro: packed_token_logprobs(m, micro, chunk_size=16, pad_multiple=pad_multiple))
    loss, grads, lp = _step_gradients(model, batch.to("cuda"), cfg, forward)
    return loss, torch.cat([g.float().reshape(-1) for g in grads.values()]), lp.float()


def _by_key(batch, samples, lp):
    if hasattr(batch, "units"):
        keys = zip(batch.tokens.sample_index.tolist(), batch.entry_token.tolist())
    else:
        keys = _unshared_keys(batch, samples)
    got = dict(zip(keys, lp.tolist()))
    return torch.tensor([got[k] for k in sorted(got)])


@pytest.mark.gpu
@cuda
def test_cuda_tree_mask_paths_equal_unshared_packing():
    """fp32: sdpa's 4D mask and flex_attention's BlockMask (forward and backward) against unshared rows. bf16: flex
    and flash varlen (gathered prefix keys) no further from the fp32 reference than unshared bf16 packing is."""
    samples = _groups()
    shared, unshared = pack_shared(samples, 64, pad_to_multiple=16), pack_samples(samples, 64, pad_to_multiple=16)
    ref_loss, ref_grad, ref_lp = _cuda_step(_cuda_model("sdpa"), unshared)
    ref = _by_key(unshared, samples, ref_lp)
    for impl in ("sdpa", "flex_attention"):
        loss, grad, lp = _cuda_step(_cuda_model(impl), shared)
        torch.testing.assert_close(_by_key(shared, samples, lp), ref, atol=1e-4, rtol=1e-5, msg=impl)
        assert abs(loss - ref_loss) < 1e-4 and float((grad - ref_grad).norm() / ref_grad.norm()) < 1e-4, impl
    # bf16 flex_attention at this tiny head size fails to compile in inductor (NoValidChoicesError); the trainer's
    # check catches that and trains unshared (test_a_forward_that_fails_turns_sharing_off).
    for impl in (va.register(),):
        model = _cuda_model(impl, torch.bfloat16)
        assert prefix_sharing_error(model) < 0.05, impl
        errors = []
        for batch in (unshared, shared):
            _, grad, lp = _cuda_step(model, batch)
            errors.append((float((_by_key(batch, samples, lp) - ref).abs().max()),
                           float((grad - ref_grad).norm() / ref_grad.norm())))
        for i in range(2):
            assert errors[1][i] <= 2 * errors[0][i] + 1e-3, (impl, errors)
