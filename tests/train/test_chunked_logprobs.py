"""The chunked lm_head against full logits, and packed logprobs against per-sample ones on the tiny models."""

import pytest
import torch

from agentrl.models import load_model
from agentrl.train.lm_head import chunked_logprobs
from agentrl.train.logprobs import packed_hidden_states, packed_token_logprobs, packing_error
from agentrl.train.pack import pack_samples
from tests.helpers import in_packed_order, per_sample_logprobs, train_samples


def _full(hidden, weight, targets, temperature=1.0):
    logits = (hidden.float() @ weight.float().t()) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def _inputs(n=37, h=24, v=101, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("temperature,chunk", [(1.0, 8), (0.7, 5), (1.3, 64)])
def test_values_and_gradients_match_full_logits_fp32(temperature, chunk):
    hidden, weight, targets = _inputs()
    g = torch.Generator().manual_seed(1)
    up_lp, up_ent = torch.randn(hidden.shape[0], generator=g), torch.randn(hidden.shape[0], generator=g)

    lp, ent = chunked_logprobs(hidden, weight, targets, temperature=temperature, chunk_size=chunk)
    grads = torch.autograd.grad((lp * up_lp).sum() + (ent * up_ent).sum(), (hidden, weight))
    ref_lp, ref_ent = _full(hidden, weight, targets, temperature)
    ref_grads = torch.autograd.grad((ref_lp * up_lp).sum() + (ref_ent * up_ent).sum(), (hidden, weight))

    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_unused_entropy_costs_no_gradient_and_logprob_grads_still_match():
    hidden, weight, targets = _inputs(seed=3)
    lp, _ = chunked_logprobs(hidden, weight, targets, chunk_size=7)
    grads = torch.autograd.grad(lp.sum(), (hidden, weight))
    ref_lp, _ = _full(hidden, weight, targets)
    ref_grads = torch.autograd.grad(ref_lp.sum(), (hidden, weight))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _rel(got, want):
    return float((got.detach().float() - want.detach()).norm() / want.detach().norm())


def _check_bf16_against_fp32(hidden, weight, targets):
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref_lp, ref_ent = _full(h32, w32, targets)
    lp, ent = chunked_logprobs(hidden, weight, targets, chunk_size=16)
    assert lp.dtype == ent.dtype == torch.float32
    assert _rel(lp, ref_lp) < 1e-2 and _rel(ent, ref_ent) < 1e-2
    for with_entropy in (False, True):  # the two backward branches
        got = torch.autograd.grad(lp.sum() + (0.1 * ent.sum() if with_entropy else 0), (hidden, weight),
                                  retain_graph=True)
        want = torch.autograd.grad(ref_lp.sum() + (0.1 * ref_ent.sum() if with_entropy else 0), (h32, w32),
                                   retain_graph=True)
        for g, r in zip(got, want):
            assert g.dtype == torch.bfloat16
            assert _rel(g, r) < 2e-2  # bf16 keeps ~3 significant digits


def test_the_compiled_chunk_steps_compile_once_whatever_the_chunk_sizes(monkeypatch):
    """Compiled chunk steps meet every micro-batch's ragged last chunk, and a micro-batch of fewer trained tokens
    than a chunk has only that one: only the first call may compile (its row dimension dynamic from the start), a
    one-row chunk included (it joins the one before: dynamo specializes size 1 even in a dynamic graph, one more
    compile, mid-run). Values and gradients still match full logits."""
    from agentrl.train import lm_head as logprobs

    assert logprobs.chunk_bounds(17, 8) == [(0, 8), (8, 17)] and logprobs.chunk_bounds(16, 8) == [(0, 8), (8, 16)]
    assert logprobs.chunk_bounds(1, 8) == [(0, 1)] and logprobs.chunk_bounds(0, 8) == []
    torch._dynamo.reset()
    monkeypatch.setitem(logprobs._COMPILED, "steps", logprobs.compile_chunk_steps(backend="eager"))
    frames = torch._dynamo.utils.counters["frames"]
    compiled_per_call = []
    try:
        for n in (5, 7, 8 + 5, 16 + 3, 16 + 1, 24 + 1, 8 + 7):
            hidden, weight, targets = _inputs(n=n)
            before = frames["total"]
            lp, ent = chunked_logprobs(hidden, weight, targets, chunk_size=8, compile=True)
            (lp.sum() + ent.sum()).backward()
            compiled_per_call.append(frames["total"] - before)
            want_lp, want_ent = _full(hidden.detach(), weight.detach(), targets)
            torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=1e-5)
    finally:
        torch._dynamo.reset()
    assert compiled_per_call[0] > 0 and compiled_per_call[1:] == [0] * 6, compiled_per_call


def test_bf16_gemms_stay_close_to_fp32_reference():
    _check_bf16_against_fp32(*_inputs(n=64, h=32, v=257, dtype=torch.bfloat16, seed=5))


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3.5"])
def test_packed_logprobs_equal_per_sample(name):
    model, _ = load_model(name)
    samples = train_samples(model.config.vocab_size, [13, 9, 21, 4, 17, 11, 2, 30])
    batch = pack_samples(samples, row_tokens=40)
    assert len(batch.rows) > 1 and any(len(r) > 1 for r in batch.rows)
    with torch.no_grad():
        lp, _ = packed_token_logprobs(model, batch, chunk_size=16)
        ref = per_sample_logprobs(model, samples)
    # The random tiny models give logprobs down to -40, where one fp32 ulp is ~4e-6 and batched GEMMs differ by a
    # few: so 1e-5 absolute plus 1e-6 relative (the hidden states themselves agree to 1e-5, test below).
    torch.testing.assert_close(lp, in_packed_order(ref, samples, batch), atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_dense_packed_forward_builds_block_diagonal_mask_without_a_cache(impl):
    """Guards the `use_cache=False` detail: with a cache transformers skips packed-sequence detection."""
    model, _ = load_model("tiny-qwen3")
    model.set_attn_implementation(impl)
    assert model.config.use_cache  # the default that would otherwise leak across samples
    assert packing_error(model) < 1e-5
    samples = train_samples(model.config.vocab_size, [6, 5])
    batch = pack_samples(samples, row_tokens=16)
    with torch.no_grad():
        packed = packed_hidden_states(model, batch)
        # Controls: the same call leaving use_cache at the config's True, and positions that do not restart.
        with_cache = model.get_decoder()(input_ids=batch.input_ids, position_ids=batch.position_ids).last_hidden_state
        unrestarted = model.get_decoder()(input_ids=batch.input_ids, use_cache=False).last_hidden_state
    assert (packed[0, 6:11] - with_cache[0, 6:11]).abs().max() > 1e-3
    assert (packed[0, 6:11] - unrestarted[0, 6:11]).abs().max() > 1e-3


def test_hybrid_packing_never_leaks_and_varlen_needs_its_kernels():
    model, _ = load_model("tiny-qwen3.5")
    assert packing_error(model) < 1e-5
    # Control: the plain packed forward (what a dense model gets) does leak through the linear-attention layers'
    # torch fallbacks, which is why the hybrid path runs each sample on its own.
    batch = pack_samples(train_samples(model.config.vocab_size, [6, 5]), row_tokens=16)
    with torch.no_grad():
        exact = packed_hidden_states(model, batch)
        naive = model.get_decoder()(input_ids=batch.input_ids, position_ids=batch.position_ids,
                                    use_cache=False).last_hidden_state
    assert (exact[0, 6:11] - naive[0, 6:11]).abs().max() > 1e-3
    try:
        import fla  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="flash-linear-attention"):
            packing_error(model, hybrid_varlen=True)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_cuda_compiled_head_matches_full_logits():
    """The GPU path runs the per-chunk steps through torch.compile; same checks as the eager CPU tests."""
    hidden, weight, targets = _inputs(n=300, h=128, v=5000, dtype=torch.bfloat16, seed=2)
    _check_bf16_against_fp32(hidden.detach().cuda().requires_grad_(), weight.detach().cuda().requires_grad_(),
                             targets.cuda())
    for n, temperature in ((37, 1.0), (53, 0.7)):  # ragged last chunks: the compiled steps must not misbehave
        hidden, weight, targets = (x.detach().cuda() for x in _inputs(n=n, seed=n))
        hidden.requires_grad_(), weight.requires_grad_()
        lp, ent = chunked_logprobs(hidden, weight, targets, temperature=temperature, chunk_size=16, compile=True)
        grads = torch.autograd.grad(lp.sum() + ent.sum(), (hidden, weight))
        ref_lp, ref_ent = _full(hidden, weight, targets, temperature)
        ref_grads = torch.autograd.grad(ref_lp.sum() + ref_ent.sum(), (hidden, weight))
        # fused reductions sum in another order than the reference: 1e-5 plus 1e-5 relative
        torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("impl", ["sdpa", "flex_attention"])
def test_cuda_packed_forward_matches_per_sample(impl):
    model, _ = load_model("tiny-qwen3", device="cuda")
    model.set_attn_implementation(impl)
    assert packing_error(model, lengths=(70, 33, 129, 5)) < 1e-4
    samples = train_samples(model.config.vocab_size, [13, 9, 21, 4, 17, 11, 2, 30])
    batch = pack_samples(samples, row_tokens=40, pad_to_multiple=16).to("cuda")
    with torch.no_grad():
        lp, _ = packed_token_logprobs(model, batch, chunk_size=16)
        ref = per_sample_logprobs(model, samples)
    torch.testing.assert_close(lp, in_packed_order(ref, samples, batch), atol=1e-4, rtol=1e-5)
