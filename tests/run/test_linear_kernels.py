"""transformers' delta-rule names routed by the tensors' device (agentrl.linear_kernels): with flash-linear-attention
installed on a machine without a GPU, transformers still sends every hybrid forward to fla's Triton kernels, which
fail there; the router sends CPU tensors to transformers' PyTorch reference instead, and a packed call sequence by
sequence. Checked against the reference itself, with a stand-in for fla's kernel that refuses CPU tensors as fla's
do (the real package is not in CI)."""

import functools
import inspect
import sys

import pytest
import torch

from agentrl import linear_kernels
from agentrl.models import load_model


@pytest.fixture(scope="module")
def reference():
    model = load_model("tiny-qwen3.5")[0]
    layer = next(m for m in model.modules() if hasattr(m, "conv1d"))
    return inspect.unwrap(sys.modules[type(layer).__module__].torch_chunk_gated_delta_rule)


def _fla_like(reference):
    calls = []

    @functools.wraps(reference)  # as transformers wraps its reference around fla's kernel
    def kernel(query, key, value, **kwargs):
        calls.append(query.device.type)
        if not query.is_cuda:
            raise RuntimeError("0 active drivers ([]). There should only be one.")
        return reference(query, key, value, **kwargs)
    return kernel, calls


def _inputs(T, heads=2, K=8, V=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, T, heads, K, generator=gen) for _ in range(2))
    v = torch.randn(1, T, heads, V, generator=gen)
    g = -torch.rand(1, T, heads, generator=gen)
    beta = torch.rand(1, T, heads, generator=gen)
    return q, k, v, g, beta


def test_cpu_tensors_take_the_reference_and_a_packed_call_runs_sequence_by_sequence(reference, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernel, calls = _fla_like(reference)
    routed = linear_kernels._routed(kernel)
    q, k, v, g, beta = _inputs(30)
    out, final = routed(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True,
                        use_qk_l2norm_in_kernel=True, chunk_indices=None)  # fla-only arguments are dropped
    want, want_final = reference(q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert calls == [] and torch.equal(out, want) and torch.equal(final, want_final)

    cu = torch.tensor([0, 7, 7, 30])  # an empty sequence among them
    init = torch.randn(3, 2, 8, 8)
    out, finals = routed(q, k, v, g=g, beta=beta, cu_seqlens=cu, initial_state=init, output_final_state=True)
    for j, (a, b) in enumerate([(0, 7), (7, 7), (7, 30)]):
        part, fin = reference(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                              initial_state=init[j:j + 1], output_final_state=True)
        assert torch.equal(out[:, a:b], part) and torch.equal(finals[j:j + 1], fin)
    assert calls == [] and out.shape[1] == 30


def test_under_tritons_interpreter_cpu_tensors_go_to_the_kernel(reference, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel, calls = _fla_like(reference)
    with pytest.raises(RuntimeError, match="active drivers"):  # the stand-in refuses; fla's would run interpreted
        q, k, v, g, beta = _inputs(5)
        linear_kernels._routed(kernel)(q, k, v, g=g, beta=beta, output_final_state=False)
    assert calls == ["cpu"]


def test_routing_is_installed_once_beneath_agentrls_own_wrappers(monkeypatch):
    """`route_by_device` is a no-op without fla; with it, it routes each name once, and leaves a name alone that
    agentrl's trainer wrapper (installed over a routed one) now holds."""
    from agentrl.train import linear_conv

    model = load_model("tiny-qwen3.5")[0]
    layer = next(m for m in model.modules() if hasattr(m, "conv1d"))
    modeling = sys.modules[type(layer).__module__]
    for name in (*linear_kernels.NAMES, "causal_conv1d_fn"):  # as a fresh process has them, restored afterwards
        monkeypatch.setattr(modeling, name, inspect.unwrap(getattr(modeling, name)))
    monkeypatch.setattr(linear_conv, "_INSTALLED", {})
    monkeypatch.setattr(linear_kernels.importlib.util, "find_spec", lambda name: None)
    before = [getattr(modeling, n) for n in linear_kernels.NAMES]
    linear_kernels.route_by_device(model)
    assert [getattr(modeling, n) for n in linear_kernels.NAMES] == before  # no fla: nothing to route
    monkeypatch.setattr(linear_kernels.importlib.util, "find_spec", lambda name: object())
    linear_kernels.route_by_device(model)
    routed = [getattr(modeling, n) for n in linear_kernels.NAMES]
    assert all(linear_kernels._is_routed(f) for f in routed) and routed != before
    linear_kernels.route_by_device(layer)
    assert [getattr(modeling, n) for n in linear_kernels.NAMES] == routed  # idempotent
    monkeypatch.setattr(linear_conv, "serialize_autotuners", lambda: None)
    linear_conv.install_wrappers(model)
    ours = getattr(modeling, linear_conv._RULE)
    assert ours is linear_conv._INSTALLED[(modeling.__name__, linear_conv._RULE)]
    linear_kernels.route_by_device(model)
    assert getattr(modeling, linear_conv._RULE) is ours  # not routed again on top of agentrl's wrapper
