"""What a hybrid (linear-attention) model trains with when nothing is set: varlen kernels on GPU, the exact
per-sample path on CPU, and a one-line error naming the extra when the GPU's kernels are not installed."""

import pytest
import torch

from agentrl.models import load_model
from agentrl.run.build import attention_implementation, check_hybrid_kernels, hybrid_varlen
from agentrl.train.config import ModelConfig
from agentrl.train.logprobs import varlen_kernels_installed


@pytest.fixture(scope="module")
def hybrid():
    return load_model("tiny-qwen3.5")[0]


def test_varlen_kernels_are_the_default_on_gpu_only():
    assert hybrid_varlen(ModelConfig(), "cuda") is True
    assert hybrid_varlen(ModelConfig(), "cpu") is False
    assert hybrid_varlen(ModelConfig(hybrid_varlen=False), "cuda") is False
    assert hybrid_varlen(ModelConfig(hybrid_varlen=True), "cpu") is True


@pytest.mark.skipif(varlen_kernels_installed(), reason="flash-linear-attention is installed here")
def test_missing_kernels_name_the_extra_before_training(hybrid):
    with pytest.raises(ValueError, match=r"flash-linear-attention: pip install 'agentrl\[gpu\]'.*hybrid_varlen=false"):
        check_hybrid_kernels(ModelConfig(name="tiny-qwen3.5"), hybrid, "cuda")
    check_hybrid_kernels(ModelConfig(name="tiny-qwen3.5"), hybrid, "cpu")  # the exact per-sample path
    check_hybrid_kernels(ModelConfig(name="tiny-qwen3.5", hybrid_varlen=False), hybrid, "cuda")
    dense = load_model("tiny-qwen3")[0]
    check_hybrid_kernels(ModelConfig(name="tiny-qwen3"), dense, "cuda")  # nothing to ask of a dense model


def test_a_hybrid_model_is_never_given_flex_attention(hybrid):
    # transformers refuses flex_attention for Qwen3.5; without the flat varlen layout (here: fp32, no flash) the
    # per-sample path runs under sdpa. A dense model keeps flex_attention's block-sparse packed mask.
    assert attention_implementation(ModelConfig(), hybrid, "cuda") == "sdpa"
    assert attention_implementation(ModelConfig(hybrid_varlen=False), hybrid.to(torch.bfloat16), "cuda") == "sdpa"
    assert attention_implementation(ModelConfig(), load_model("tiny-qwen3")[0], "cuda") == "flex_attention"


def test_kernels_that_leak_across_samples_are_refused_or_left_for_the_exact_path(monkeypatch, capsys):
    import agentrl.run.build as build

    monkeypatch.setattr(build, "varlen_kernels_installed", lambda: True)
    monkeypatch.setattr(build, "packing_error", lambda model, hybrid_varlen, relative: 0.94)  # a leaking kernel: 3.76 at a scale of ~4
    model, tok = load_model("tiny-qwen3.5")
    # The default on GPU: a warning, then the per-sample path (sdpa), never rows whose samples share state.
    _, _, varlen = build._trainable(ModelConfig(name="tiny-qwen3.5"), model, tok, "cuda")
    assert varlen is False and model.config._attn_implementation == "sdpa"
    assert "leak state across packed samples (relative error 0.94)" in capsys.readouterr().err
    # Asked for explicitly: an error.
    with pytest.raises(RuntimeError, match="leak across packed samples"):
        build._trainable(ModelConfig(name="tiny-qwen3.5", hybrid_varlen=True), model, tok, "cuda")
    # Kernels that honour the boundaries keep the packed varlen path.
    monkeypatch.setattr(build, "packing_error", lambda model, hybrid_varlen, relative: 1e-6)
    monkeypatch.setattr(build, "packed_backward_failure", lambda model: None)
    assert build._trainable(ModelConfig(name="tiny-qwen3.5"), model, tok, "cuda")[2] is True


def test_kernels_whose_backward_fails_keep_packed_rows_with_the_reference_delta_rule(monkeypatch, capsys):
    import agentrl.run.build as build
    from agentrl.train import logprobs

    monkeypatch.setattr(build, "varlen_kernels_installed", lambda: True)
    monkeypatch.setattr(logprobs, "varlen_kernels_installed", lambda: True)
    monkeypatch.setattr(build, "packing_error", lambda model, hybrid_varlen, relative: 1e-6)  # the forward is fine
    model, tok = load_model("tiny-qwen3.5")
    # A delta rule that refuses the boundaries, as fla's backward refuses Hopper under Triton < 3.7.1 (transformers'
    # own torch rule refuses them in 5.24 and ignores them in 5.17, so the test states the refusal itself): the run
    # keeps packed rows and runs the PyTorch reference sample by sample.
    import functools
    import sys

    module = sys.modules[type(next(m for m in model.modules() if hasattr(m, "conv1d"))).__module__]
    rule = module.torch_chunk_gated_delta_rule

    @functools.wraps(rule)
    def refusing(*args, cu_seqlens=None, **kwargs):
        if cu_seqlens is not None:
            raise RuntimeError("this kernel cannot train across sample boundaries here")
        return rule(*args, **kwargs)

    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", refusing)
    assert logprobs.packed_backward_failure(model) is not None
    _, _, varlen = build._trainable(ModelConfig(name="tiny-qwen3.5"), model, tok, "cuda")
    assert varlen is True
    assert "cannot train here" in capsys.readouterr().err
    assert logprobs.packed_backward_failure(model) is None
    assert all(p.grad is None for p in model.parameters())  # the checks leave no gradients behind
    # And a refusal that the reference rule does not cure stops the run with the way out named.
    monkeypatch.setattr(build, "packed_backward_failure", lambda model: "no backward")
    with pytest.raises(RuntimeError, match="hybrid_varlen=false"):
        build._trainable(ModelConfig(name="tiny-qwen3.5"), model, tok, "cuda")
