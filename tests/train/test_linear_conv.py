"""Packed hybrid rows: the linear-attention convolution stays within each sample (agentrl.train.linear_conv), so
a packed varlen forward equals running every sample alone once the delta rule takes the boundaries too."""

import contextlib
import sys

import pytest
import torch

import agentrl.train.logprobs as logprobs
from agentrl.models import load_model
from agentrl.train.linear_conv import packed_conv_boundaries, spread_index


@pytest.fixture(scope="module")
def hybrid():
    return load_model("tiny-qwen3.5")[0]


def _gdn(model):
    return next(m for m in model.modules() if hasattr(m, "conv1d") and hasattr(m, "in_proj_qkv"))


def test_spread_index_leaves_a_gap_before_every_sample():
    cu = torch.tensor([0, 3, 5, 6])
    assert spread_index(cu, 6, 2).tolist() == [2, 3, 4, 7, 8, 11]


def _conv_case(hybrid):
    """A layer's convolution as its modeling module calls it, four samples' inputs laid end to end, their boundaries,
    and each sample convolved alone."""
    layer = _gdn(hybrid)
    modeling = sys.modules[type(layer).__module__]
    weight, bias = layer.conv1d.weight.squeeze(1), layer.conv1d.bias
    lengths = [7, 5, 1, 3]
    cu = torch.tensor([0, 7, 12, 13, 16], dtype=torch.int32)
    x = torch.randn(1, weight.shape[0], sum(lengths), generator=torch.Generator().manual_seed(0))

    def conv(t):
        return modeling.causal_conv1d_fn(t, weight, bias, activation=layer.activation)

    return conv, x, cu, lambda: torch.cat([conv(part) for part in x.split(lengths, dim=-1)], dim=-1)


def test_the_packed_convolution_equals_each_sample_alone(hybrid):
    conv, x, cu, each_alone = _conv_case(hybrid)
    alone = each_alone()
    with packed_conv_boundaries(hybrid, cu):
        packed = conv(x)
    assert torch.equal(packed, alone)
    # Outside the context the installed wrapper is the model's own convolution again, reading across the seams.
    leaky = conv(x)
    assert (leaky - alone).abs().max() > 1e-3


def test_the_packed_convolution_waits_for_nothing_on_the_host(hybrid):
    """Each linear-attention layer's convolution runs with the row's length given on the host: no read of the
    boundaries from the device per layer (on a GPU, a read waits for every kernel queued before it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Reads.count += func.overloadpacket.__name__ == "_local_scalar_dense"
            return func(*args, **(kwargs or {}))

    conv, x, cu, _ = _conv_case(hybrid)
    with packed_conv_boundaries(hybrid, cu, 16):
        with Reads():
            for _ in range(3):  # as three layers would
                conv(x)
    assert Reads.count == 0


def _delta_rule_within_samples(rule):
    # Stands in for flash-linear-attention's kernel, which honours cu_seqlens (the torch fallback does not).
    def within(query, key, value, g, beta, cu_seqlens=None, **kwargs):
        if cu_seqlens is None:
            return rule(query, key, value, g=g, beta=beta, **kwargs)
        outs = []
        for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            outs.append(rule(query[:, s:e], key[:, s:e], value[:, s:e], g=g[:, s:e], beta=beta[:, s:e], **kwargs)[0])
        return torch.cat(outs, dim=1), None
    return within


@pytest.mark.parametrize("boundaries", [True, False], ids=["conv within samples", "conv across samples"])
def test_packed_varlen_forward_equals_per_sample_with_the_boundary_conv(hybrid, monkeypatch, boundaries):
    modeling = sys.modules[type(_gdn(hybrid)).__module__]
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule",
                        _delta_rule_within_samples(modeling.torch_chunk_gated_delta_rule))
    monkeypatch.setattr(logprobs, "varlen_kernels_installed", lambda: True)
    if not boundaries:
        monkeypatch.setattr(logprobs, "packed_conv_boundaries", lambda model, cu, length: contextlib.nullcontext())
    error = logprobs.packing_error(hybrid, hybrid_varlen=True)
    relative = logprobs.packing_error(hybrid, hybrid_varlen=True, relative=True)
    if boundaries:
        assert error < 1e-5
        assert relative < 1e-5
    else:  # what the run's check saw on the GPU: a delta rule with boundaries is not enough
        assert error > 1e-2
        assert relative > 0.1  # the run's threshold (agentrl.run.build._trainable): a leak is caught at any scale


def test_the_reference_delta_rule_keeps_packed_rows_exact_forward_and_backward(monkeypatch):
    # What a run falls back to when the varlen kernels cannot train: packed rows, the delta rule sample by sample.
    from agentrl.train.linear_conv import use_reference_delta_rule
    from agentrl.train.logprobs import _per_sample_hidden_states, _decoder, _synthetic_row, packed_hidden_states

    model = load_model("tiny-qwen3.5")[0]
    monkeypatch.setattr(logprobs, "varlen_kernels_installed", lambda: True)
    use_reference_delta_rule(model)
    batch = _synthetic_row(model, (9, 70, 3, 33), seed=1)
    real = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
    real[:, :batch.num_tokens] = True

    def grads(forward):
        model.zero_grad()
        hidden = forward()
        hidden[real].square().mean().backward()
        return hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    packed, packed_grads = grads(lambda: packed_hidden_states(model, batch, hybrid_varlen=True))
    alone, alone_grads = grads(lambda: _per_sample_hidden_states(_decoder(model), batch))
    assert (packed[real] - alone[real]).abs().max() < 1e-5
    assert packed_grads.keys() == alone_grads.keys() and len(packed_grads) > 10
    for name, g in packed_grads.items():
        assert torch.allclose(g, alone_grads[name], atol=1e-5, rtol=1e-4), name


def test_compiled_hybrid_layers_keep_their_graphs_across_packed_forwards(monkeypatch):
    """The convolution and delta-rule wrappers are installed once and run as graph breaks, so a hybrid's compiled
    layers (a cheap backend here) compile in the first packed forward and not again for rows of other lengths, and
    give the eager model's hidden states."""
    import copy

    from agentrl.engine.model_view import compile_decoder_layers
    from agentrl.train import varlen_attention as va
    from agentrl.train.linear_conv import use_reference_delta_rule
    from agentrl.train.logprobs import _synthetic_row, packed_hidden_states

    monkeypatch.setattr(logprobs, "varlen_kernels_installed", lambda: True)
    eager = load_model("tiny-qwen3.5")[0]
    eager.set_attn_implementation(va.register("agentrl_varlen_reference", va.reference_kernel))
    use_reference_delta_rule(eager)
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["frames"]
    compile_decoder_layers(compiled, backend="aot_eager", dynamic=True)
    per_forward = []
    try:
        for k, lengths in enumerate([(9, 70, 3, 33), (12, 5), (40, 41, 7), (66, 2, 2, 9, 20)]):
            batch = _synthetic_row(eager, lengths, seed=k)
            before = frames["total"]
            got = packed_hidden_states(compiled, batch, hybrid_varlen=True)
            per_forward.append(frames["total"] - before)
            want = packed_hidden_states(eager, batch, hybrid_varlen=True)
            real = slice(0, sum(lengths))
            torch.testing.assert_close(got[0, real], want[0, real], atol=1e-5, rtol=1e-5)
    finally:
        torch._dynamo.reset()
    assert per_forward[0] > 0 and per_forward[2:] == [0, 0], per_forward


def test_a_varlen_convolution_that_fails_warns_once_and_the_spread_path_takes_over(hybrid, monkeypatch):
    """Where flash-linear-attention's convolution fails (another version's signature, a kernel that cannot run),
    packed rows keep their boundaries through the spread path. The CUDA check is stood in for: the tensor is CPU."""
    from agentrl.train import linear_conv

    def broken(*args, **kwargs):
        raise TypeError("causal_conv1d() got an unexpected keyword argument 'cu_seqlens'")

    monkeypatch.setattr(linear_conv, "_VARLEN_CONV_FAILED", [])
    monkeypatch.setattr(linear_conv, "varlen_conv", lambda: None if linear_conv._VARLEN_CONV_FAILED else broken)
    conv, x, cu, each_alone = _conv_case(hybrid)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    with pytest.warns(UserWarning, match="unexpected keyword argument 'cu_seqlens'"), \
            packed_conv_boundaries(hybrid, cu, 16):
        first = conv(x)
    with packed_conv_boundaries(hybrid, cu, 16):
        second = conv(x)
    monkeypatch.undo()
    alone = each_alone()
    assert torch.equal(first, alone) and torch.equal(second, alone)


def test_compiled_hybrid_layers_break_around_the_rule_on_the_per_sample_path_too(monkeypatch):
    """`model.compile_layers=true` on a hybrid off the varlen path (the CPU's per-sample forward): the trainer's
    compile installs the convolution and delta-rule wrappers first, so both run as graph breaks there as well
    (traced by inductor, the PyTorch reference rule's padding to whole chunks failed to lower with dynamic shapes),
    and the compiled model's per-sample logprobs equal the eager model's."""
    import copy
    import dataclasses
    import inspect

    from agentrl.run.build import compile_trainer_layers
    from agentrl.run.config import TrainConfig
    from agentrl.train import linear_conv
    from agentrl.train.logprobs import _synthetic_row, packed_token_logprobs

    eager = load_model("tiny-qwen3.5")[0]
    modeling = sys.modules[type(_gdn(eager)).__module__]
    for name in ("causal_conv1d_fn", linear_conv._RULE):  # as a fresh process has them: unwrapped
        monkeypatch.setattr(modeling, name, inspect.unwrap(getattr(modeling, name)))
        monkeypatch.delitem(linear_conv._INSTALLED, (modeling.__name__, name), raising=False)
    compiled = copy.deepcopy(eager)
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compile_layers=True))
    from agentrl.train import delta_rule_backward

    monkeypatch.setattr(delta_rule_backward, "_COMPILE", None)
    torch._dynamo.reset()
    try:
        assert compile_trainer_layers(cfg, compiled, "cpu", backend="aot_eager")
        for name in ("causal_conv1d_fn", linear_conv._RULE):
            assert getattr(modeling, name) is linear_conv._INSTALLED[(modeling.__name__, name)]
        # The backward's stand-in for the kernel fla refuses is compiled with the layers, by the same backend.
        assert delta_rule_backward._COMPILE == {"dynamic": True, "fullgraph": True, "backend": "aot_eager"}
        batch = _synthetic_row(eager, (9, 70, 3), seed=0)
        got = packed_token_logprobs(compiled, batch, hybrid_varlen=False)[0]
        want = packed_token_logprobs(eager, batch, hybrid_varlen=False)[0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    finally:
        torch._dynamo.reset()


def test_the_fp32_bound_is_above_fp32_rounding():
    """The GPU test of packed fp32 hybrid rows asks for 1e-5 (`test_hybrid_gpu.py`). That bound can tell a packing
    fault from rounding only where fp32's own error, against fp64, is well below it: on the well-conditioned tiny
    model, not on the tiny default, whose initializer range of 1.0 makes fp32 miss fp64 by more than the bound (so
    two correct fp32 paths with different reduction orders differ by more than it, as packed and per-sample rows do
    on the H200). Each sample alone through transformers' own forward (its torch delta rule here), fp32 against fp64."""
    from agentrl.models import tiny_config
    from tests.helpers import WELL_CONDITIONED_INIT, tiny_qwen35

    lengths = (150, 70, 9, 33, 64, 2)  # test_hybrid_gpu.LENGTHS

    def fp32_error(initializer_range):
        hidden = {}
        for dtype in (torch.float64, torch.float32):
            model = tiny_qwen35(initializer_range, dtype)
            batch = logprobs._synthetic_row(model, lengths, 0)
            with torch.no_grad():
                states = logprobs._per_sample_hidden_states(logprobs._decoder(model), batch)
            hidden[dtype] = states[0, :batch.num_tokens]
        return float((hidden[torch.float32].double() - hidden[torch.float64]).abs().max())

    assert fp32_error(WELL_CONDITIONED_INIT) < 5e-6  # half the GPU bound; 1.4e-6 measured, 2.9e-6 on an AMD EPYC
    assert fp32_error(tiny_config("tiny-qwen3.5").initializer_range) > 1e-4  # 2.7e-4 measured: the tiny default's
