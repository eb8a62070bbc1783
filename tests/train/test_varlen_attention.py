"""The flat (varlen) training layout against the padded rows, on CPU through a per-sample SDPA stand-in for flash;
flash itself, and compiled layers around it, on CUDA."""

import pytest
import torch

from agentrl.models import load_model
from agentrl.train import varlen_attention as va
from agentrl.train.config import ModelConfig
from agentrl.engine.model_view import compile_decoder_layers
from agentrl.train.logprobs import flat_layout, packed_hidden_states, packed_token_logprobs, packing_error
from agentrl.run.build import attention_implementation
from agentrl.train.pack import pack_samples
from tests.helpers import in_packed_order, per_sample_logprobs, train_samples

REFERENCE = va.register("agentrl_varlen_reference", va.reference_kernel)
LENGTHS = [13, 9, 21, 4, 17, 11, 2, 30]


def _model(impl, name="tiny-qwen3", **kwargs):
    model, _ = load_model(name, **kwargs)
    model.set_attn_implementation(impl)
    return model


def _batch(vocab, lengths=LENGTHS, row_tokens=40, **kwargs):
    batch = pack_samples(train_samples(vocab, lengths), row_tokens=row_tokens, **kwargs)
    assert len(batch.rows) > 1 and any(len(r) > 1 for r in batch.rows)  # several rows, several samples a row
    assert batch.num_tokens < batch.input_ids.numel()  # and padding
    return batch


def test_flat_layout_lists_real_tokens_in_row_major_order_and_pads_with_one_segment():
    batch = _batch(320)
    lengths = [n for segs in batch.segments for _, _, n in segs]
    real = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
    for r, segs in enumerate(batch.segments):
        for _, start, n in segs:
            real[r, start:start + n] = True
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    exact = flat_layout(batch)
    assert torch.equal(exact.index, real.reshape(-1).nonzero().squeeze(1))
    assert torch.equal(exact.cu_seqlens, bounds) and exact.length == sum(lengths) == 107
    assert exact.max_len == max(lengths)

    padded = flat_layout(batch, pad_multiple=64)  # 107 -> 128: a 21-token tail, its own segment
    assert torch.equal(padded.index, exact.index) and padded.length == 128
    assert padded.cu_seqlens.tolist() == bounds.tolist() + [128] and padded.cu_seqlens.dtype == torch.int32
    assert flat_layout(batch, pad_multiple=100).max_len == 93  # the tail can be the longest segment


@pytest.mark.parametrize("pad_multiple", [1, 16, 64])
def test_flat_logprobs_equal_padded_rows_and_per_sample(pad_multiple):
    rows_model, flat_model = _model("sdpa"), _model(REFERENCE)
    batch = _batch(rows_model.config.vocab_size)
    with torch.no_grad():
        lp, ent = packed_token_logprobs(flat_model, batch, chunk_size=16, pad_multiple=pad_multiple)
        ref_lp, ref_ent = packed_token_logprobs(rows_model, batch, chunk_size=16)
        alone = per_sample_logprobs(rows_model, train_samples(rows_model.config.vocab_size, LENGTHS))
    assert lp.shape == (batch.num_trainable,)
    # Same tolerance as the packed-vs-per-sample test: logprobs reach -40 on the random tiny model.
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-6)
    # Entropy is lse - E[z], two terms near 40 that cancel: sdpa and eager rows differ by 4e-5 there as well.
    torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(lp, in_packed_order(alone, train_samples(320, LENGTHS), batch), atol=1e-5, rtol=1e-6)


def test_flat_hidden_states_scatter_back_to_rows():
    rows_model, flat_model = _model("sdpa"), _model(REFERENCE)
    batch = _batch(rows_model.config.vocab_size)
    with torch.no_grad():
        flat = packed_hidden_states(flat_model, batch, pad_multiple=16)
        rows = packed_hidden_states(rows_model, batch)
    real = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
    real.reshape(-1)[flat_layout(batch).index] = True
    assert flat.shape == rows.shape
    torch.testing.assert_close(flat[real], rows[real], atol=1e-5, rtol=1e-5)
    assert not flat[~real].any()  # padding is never computed on the flat path


def test_flat_gradients_equal_padded_rows():
    rows_model, flat_model = _model("sdpa"), _model(REFERENCE)
    batch = _batch(rows_model.config.vocab_size)
    weights = torch.randn(batch.num_trainable, generator=torch.Generator().manual_seed(0))
    grads = []
    for model, kwargs in ((rows_model, {}), (flat_model, {"pad_multiple": 16})):
        lp, ent = packed_token_logprobs(model, batch, chunk_size=16, **kwargs)
        ((lp * weights).sum() + 0.1 * ent.sum()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, want in grads[0].items():
        got = grads[1][name]
        assert float((got - want).norm() / want.norm()) < 1e-5, name


def test_attention_receives_the_flat_row_and_its_boundaries():
    calls = []

    def recording(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, dropout):
        calls.append((q.shape, k.shape, cu_q.tolist(), cu_k.tolist(), max_q, max_k, scale, causal))
        return va.reference_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, dropout)

    model = _model(va.register("agentrl_varlen_recording", recording))
    batch = _batch(model.config.vocab_size)
    layout = flat_layout(batch, pad_multiple=16)
    with torch.no_grad():
        packed_token_logprobs(model, batch, pad_multiple=16)
    c = model.config
    assert len(calls) == c.num_hidden_layers
    for call in calls:
        assert call == ((112, c.num_attention_heads, c.head_dim), (112, c.num_key_value_heads, c.head_dim),
                        layout.cu_seqlens.tolist(), layout.cu_seqlens.tolist(), 30, 30, c.head_dim ** -0.5, True)
    assert layout.cu_seqlens.tolist()[-2:] == [107, 112]


def test_a_kernel_that_ignores_boundaries_is_caught():
    """Control for the tests above: a kernel attending across the whole flat row changes the logprobs."""

    def leaky(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, dropout):
        whole = torch.tensor([0, q.shape[0]], dtype=torch.int32)
        return va.reference_kernel(q, k, v, whole, whole, q.shape[0], q.shape[0], scale, causal, dropout)

    rows_model, leaky_model = _model("sdpa"), _model(va.register("agentrl_varlen_leaky", leaky))
    batch = _batch(rows_model.config.vocab_size)
    with torch.no_grad():
        lp, _ = packed_token_logprobs(leaky_model, batch)
        ref, _ = packed_token_logprobs(rows_model, batch)
        assert (lp - ref).abs().max() > 1e-2
        assert packing_error(leaky_model) > 1e-2


def test_per_sample_reference_runs_under_flat_implementations():
    assert packing_error(_model(REFERENCE)) < 1e-5


def test_hybrid_model_under_flat_attention_needs_varlen_linear_kernels():
    model = _model(REFERENCE, "tiny-qwen3.5")
    batch = _batch(model.config.vocab_size)
    with pytest.raises(ValueError, match="hybrid_varlen"):
        packed_token_logprobs(model, batch)


def test_missing_boundaries_raise_a_clear_error():
    model = _model(REFERENCE)
    with pytest.raises(RuntimeError, match="cu_seq_lens_q"):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


def test_flash_call_is_well_formed_on_meta_tensors():
    """The aten op's meta kernel checks the call (argument order, layouts, GQA) and autograd builds its backward,
    without a GPU."""
    t, hq, hkv, d = 96, 4, 2, 16
    query = torch.randn(1, hq, t, d, dtype=torch.bfloat16, device="meta", requires_grad=True)
    key, value = (torch.randn(1, hkv, t, d, dtype=torch.bfloat16, device="meta", requires_grad=True) for _ in "kv")
    cu = torch.tensor([0, 40, 90, 96], dtype=torch.int32, device="meta")
    module = torch.nn.Module()
    module.is_causal = True
    out, weights = va.make_attention(va.flash_kernel, "flash")(
        module, query, key, value, None, scaling=0.25, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=50,
        max_length_k=50)
    assert out.shape == (1, t, hq, d) and weights is None
    names = []
    fn = out.grad_fn
    while fn is not None:
        names.append(fn.name())
        fn = fn.next_functions[0][0] if fn.next_functions else None
    assert any("FlashAttentionBackward" in n for n in names), names
    out.sum().backward()
    assert query.grad.shape == query.shape and key.grad.shape == key.shape


def test_the_attention_backward_makes_no_zeroed_copies_of_its_inputs():
    """The flat row's q, k and v reach the kernel as views whose backward is a view too: indexing the batch dimension
    (`t[0]`) made the backward fill a zeroed tensor and copy each gradient into it, a fill and a strided copy per
    tensor and layer (≈ 12 ms of the Qwen3-0.6B step on the H200). Recorded below the autograd engine, so whatever
    the kernel's own backward does is counted too; the reference kernel's SDPA makes no zeros or select_backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    t, hq, hkv, d = 24, 4, 2, 8
    query = torch.randn(1, hq, t, d, requires_grad=True)
    key, value = (torch.randn(1, hkv, t, d, requires_grad=True) for _ in "kv")
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = va.make_attention(va.reference_kernel, "reference")(
        module, query, key, value, None, scaling=0.25, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=14,
        max_length_k=14)
    ops = Ops()
    with ops:
        out.sum().backward()
    assert query.grad is not None and key.grad is not None
    assert not [n for n in ops.names if n in ("aten.select_backward", "aten.zeros", "aten.new_zeros")], ops.names


def test_registration_and_default_choice_on_cpu():
    assert va.register() == va.ATTN_IMPLEMENTATION
    model = _model(va.ATTN_IMPLEMENTATION)  # registering and selecting need no CUDA
    assert va.takes_flat_layout(model) and not va.takes_flat_layout(_model("sdpa"))
    if torch.cuda.is_available():
        return
    assert not va.varlen_attention_available()
    assert attention_implementation(ModelConfig(), model, "cpu") is None  # transformers' sdpa, as before
    chosen = ModelConfig(attn_implementation=va.ATTN_IMPLEMENTATION)
    with pytest.raises(RuntimeError, match="flash"):
        attention_implementation(chosen, model, "cpu")


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _micro_batches(vocab, seed=0):
    """Three micro-batches of different flat lengths, as the trainer's rows give them."""
    lengths = [[13, 9, 21, 4, 17], [11, 2, 30, 25], [7, 33, 19, 8, 3, 6]]
    return [pack_samples(train_samples(vocab, n, seed=seed + i), row_tokens=40) for i, n in enumerate(lengths)]


def test_compiled_layers_break_around_the_attention_and_match_eager(fresh_dynamo):
    """Dynamo and AOTAutograd as the GPU run uses them (aot_eager: no C++ toolchain): the compiled layers break
    their graph at the attention, go dynamic after one recompile, and give eager's values and gradients."""
    eager, compiled = _model(REFERENCE), _model(REFERENCE)
    compile_decoder_layers(compiled, backend="aot_eager")
    counters = torch._dynamo.utils.counters
    batches = _micro_batches(eager.config.vocab_size)
    extra = pack_samples(train_samples(eager.config.vocab_size, [5, 29, 12], seed=9), row_tokens=40)
    for i, batch in enumerate(batches + [extra]):
        if i == len(batches):
            graphs = counters["stats"]["unique_graphs"]
        outs = []
        for model in (eager, compiled):
            lp, ent = packed_token_logprobs(model, batch, chunk_size=16, pad_multiple=16)
            (lp.sum() + 0.1 * ent.sum()).backward()
            outs.append(lp)
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-6)
    # A fourth flat length compiles nothing new: the lengths went dynamic.
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["graph_break"].values()) > 0
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert float((q.grad - p.grad).norm() / p.grad.norm()) < 1e-5, name


# ------------------------------------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rel(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.gpu
@cuda
def test_cuda_flash_kernel_matches_per_segment_reference():
    assert va.varlen_attention_available()
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths, hq, hkv, d = [37, 1, 200, 64, 5, 27], 8, 2, 64
    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(t, hq, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(t, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_() for _ in "kv")
    up = torch.randn(t, hq, d, device="cuda", generator=g)
    out = va.flash_kernel(q, k, v, cu, cu, max(lengths), max(lengths), d ** -0.5, True, 0.0)
    grads = torch.autograd.grad((out.float() * up).sum(), (q, k, v))
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = va.reference_kernel(q32, k32, v32, cu, cu, max(lengths), max(lengths), d ** -0.5, True, 0.0)
    ref_grads = torch.autograd.grad((ref * up).sum(), (q32, k32, v32))
    assert out.shape == (t, hq, d) and out.dtype == torch.bfloat16
    assert _rel(out, ref) < 1e-2  # bf16 output rounding is ~3e-3
    for got, want in zip(grads, ref_grads):
        assert _rel(got, want) < 2e-2
    # Control: the same call without boundaries (one segment) is far from the reference.
    whole = torch.tensor([0, t], dtype=torch.int32, device="cuda")
    assert _rel(va.flash_kernel(q, k, v, whole, whole, t, t, d ** -0.5, True, 0.0), ref) > 0.1


def _logprobs_and_grads(model, batches, weights, **kwargs):
    model.zero_grad(set_to_none=True)
    out = []
    for batch, w in zip(batches, weights):
        lp, _ = packed_token_logprobs(model, batch, chunk_size=64, **kwargs)
        (lp * w).sum().backward()
        out.append(lp.detach().float())
    return torch.cat(out), torch.cat([p.grad.float().reshape(-1) for p in model.parameters()])


@pytest.mark.gpu
@cuda
def test_cuda_varlen_model_is_as_close_to_fp32_as_flex_and_sdpa():
    """bf16 flat varlen vs bf16 padded rows (flex_attention, sdpa), each against the fp32 model on sdpa: the
    flat path must be no further from fp32 than the padded ones are (a leak or wrong scale is far further)."""
    batches = [b.to("cuda") for b in _micro_batches(320)]
    weights = [torch.randn(b.num_trainable, device="cuda") for b in batches]
    ref_lp, ref_grad = _logprobs_and_grads(_model("sdpa", device="cuda"), batches, weights)
    errors = {}
    for impl in ("sdpa", "flex_attention", va.register()):
        model = _model(impl, dtype=torch.bfloat16, device="cuda")
        lp, grad = _logprobs_and_grads(model, batches, weights, pad_multiple=16)
        errors[impl] = (_rel(lp, ref_lp), _rel(grad, ref_grad))
    print(errors)
    flat = errors.pop(va.ATTN_IMPLEMENTATION)
    for i in range(2):
        assert flat[i] <= 2 * max(e[i] for e in errors.values()) + 1e-3, errors


@pytest.mark.gpu
@cuda
def test_cuda_compiled_varlen_layers_match_eager(fresh_dynamo):
    """What the trainer runs on GPU: inductor-compiled layers with a graph break at flash, micro-batches of
    changing flat length, against the eager varlen model and the fp32 reference."""
    batches = [b.to("cuda") for b in _micro_batches(320)]
    weights = [torch.randn(b.num_trainable, device="cuda") for b in batches]
    ref_lp, ref_grad = _logprobs_and_grads(_model("sdpa", device="cuda"), batches, weights)
    eager = _model(va.register(), dtype=torch.bfloat16, device="cuda")
    compiled = _model(va.register(), dtype=torch.bfloat16, device="cuda")
    compile_decoder_layers(compiled)
    eager_lp, eager_grad = _logprobs_and_grads(eager, batches, weights, pad_multiple=16)
    for _ in range(2):  # the second pass runs the already-compiled (dynamic) graphs
        lp, grad = _logprobs_and_grads(compiled, batches, weights, pad_multiple=16)
        assert _rel(lp, ref_lp) <= 2 * _rel(eager_lp, ref_lp) + 1e-3
        assert _rel(grad, ref_grad) <= 2 * _rel(eager_grad, ref_grad) + 1e-3


def test_trained_rows_found_on_the_host_equal_the_device_search():
    """A batch moved with `to()` keeps its host loss mask; the flat layout then lists the trained rows itself
    (no device nonzero, which would wait for the forward), and they are the rows the device search finds."""
    model = _model(REFERENCE)
    batch = _batch(model.config.vocab_size)
    moved = batch.to("cpu")
    assert batch.host_loss_mask is None and moved.host_loss_mask is batch.loss_mask
    layout = flat_layout(moved, pad_multiple=16)
    assert torch.equal(layout.trained, batch.loss_mask.reshape(-1)[layout.index].nonzero().squeeze(1))
    assert flat_layout(batch).trained is None
    with torch.no_grad():
        a = packed_token_logprobs(model, moved, chunk_size=16, pad_multiple=16)
        b = packed_token_logprobs(model, batch, chunk_size=16, pad_multiple=16)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    micro = moved.select_rows(1, 2)
    assert torch.equal(micro.host_loss_mask, batch.loss_mask[1:2])
