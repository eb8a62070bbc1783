"""Hybrid (linear-attention) training on CUDA with flash-linear-attention: packed rows through fla's varlen kernels
and agentrl's within-sample conv (`linear_conv`) give the logprobs each sample gives alone, and `agentrl train` on
tiny Qwen3.5 with default options trains on that packed path, not the per-sample fallback.

Both need CUDA and the `gpu` extra (package `fla`); they skip elsewhere. The CPU versions stand a torch delta rule
in for fla's (tests/train/test_linear_conv.py, tests/run/test_hybrid_defaults.py).
"""

import importlib.util
import json

import pytest
import torch

import agentrl.train.logprobs as logprobs
from agentrl.models import load_model
from agentrl.run import build
from agentrl.sample import TrainingSample
from agentrl.train.config import ModelConfig, TrainerConfig
from agentrl.train.pack import pack_samples
from tests.helpers import WELL_CONDITIONED_INIT, tiny_qwen35

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
    reason="needs CUDA and flash-linear-attention (the gpu extra)")]

# Samples across fla's 64-token chunks (150, 70), exactly one (64), and short ones: their seams fall inside chunks.
LENGTHS = (150, 70, 9, 33, 64, 2)


def packed_batch():
    gen = torch.Generator().manual_seed(0)
    samples = []
    for n in LENGTHS:
        ids = torch.randint(0, 320, (n,), generator=gen).tolist()
        samples.append(TrainingSample(ids, [0] + [1] * (n - 1), [0.0] * n, [-1] + [0] * (n - 1)))
    batch = pack_samples(samples, sum(LENGTHS) + 5, pad_to_multiple=TrainerConfig().row_pad_multiple)
    assert batch.input_ids.shape[0] == 1  # every sample in one row
    return samples, batch


def alone(model, samples, batch) -> torch.Tensor:
    """Each sample through the model's own forward on its own (no packing code at all), its trained logprobs in the
    packed batch's order."""
    out = []
    for r, segs in enumerate(batch.segments):
        for i, _, _ in segs:
            ids = torch.tensor([samples[i].input_ids], device="cuda")
            with torch.no_grad():
                logits = model(input_ids=ids, use_cache=False).logits[0].float()
            out.append(logits.log_softmax(-1)[:-1].gather(1, ids[0, 1:, None])[:, 0])
    return torch.cat(out)


def packed(model, batch) -> torch.Tensor:
    """The trainer's forward: the whole row at once through the varlen kernels, as `Trainer.step` runs it."""
    with torch.no_grad():
        return logprobs.packed_token_logprobs(model, batch.to("cuda"), hybrid_varlen=True,
                                             pad_multiple=TrainerConfig().row_pad_multiple)[0]


def trainable(dtype):
    """Tiny Qwen3.5 on CUDA with the training forward's attention as a run picks it by default (the run's own
    packed-vs-per-sample check is the third test's subject, not a gate here)."""
    model, _ = load_model("tiny-qwen3.5", dtype=dtype, device="cuda")
    model.set_attn_implementation(build.attention_implementation(ModelConfig(name="tiny-qwen3.5"), model, "cuda"))
    return model


def well_conditioned(dtype):
    """Tiny Qwen3.5 at transformers' own initializer range (0.02) instead of the tiny models' 1.0. At 1.0 the model's
    fp32 arithmetic is itself off from fp64 by 2.7e-4 in its last hidden states and 6.6e-3 in the first linear
    layer's output (scale 260; CPU), so two correct fp32 paths with different reduction orders differ by that much:
    the H200 measured 3.3e-4 between packed and per-sample rows. At 0.02 fp32's own error is 1.4e-6
    (`tests/train/test_linear_conv.py::test_the_fp32_bound_is_above_fp32_rounding`), so a 1e-5 bound tells a packing
    fault from rounding (a leak across samples is O(1))."""
    model = tiny_qwen35(WELL_CONDITIONED_INIT, dtype, "cuda")
    model.set_attn_implementation(build.attention_implementation(ModelConfig(name="tiny-qwen3.5"), model, "cuda"))
    return model


def test_packed_logprobs_equal_per_sample_in_fp32(monkeypatch):
    """fp32: hidden states within 1e-5 (their scale is a few units), logprobs within 1e-5, on the well-conditioned
    tiny model (above). fla's kernels run IEEE fp32 products here (tests/conftest.py); cuDNN's tf32 is turned off so
    that the convolutions are fp32 too."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = well_conditioned(torch.float32)
    assert model.config._attn_implementation == "sdpa"  # fp32: the row route (`_varlen_hidden_states`)
    assert logprobs.packing_error(model, lengths=LENGTHS, hybrid_varlen=True) < 1e-5
    samples, batch = packed_batch()
    got, want = packed(model, batch), alone(model, samples, batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_packed_logprobs_in_bf16_are_as_close_to_fp32_as_per_sample_ones():
    """bf16 against the fp32 per-sample reference: the packed row's error may not exceed the error of each sample run
    alone in bf16 by more than rounding noise (mean over ~330 tokens within 1.5x, worst token within 3x). Both bf16
    paths round the same operations in the same dtype and differ only in kernels (flash varlen and fla varlen
    against sdpa and fla per sample), so their errors are draws from one distribution; a leak across samples adds
    a whole-unit error on the first tokens of every sample after the first (the conv leak: 17.7 worst, 0.59 mean,
    on CPU, against a bf16 rounding error of 2.0 worst, 0.16 mean)."""
    samples, batch = packed_batch()
    reference = alone(load_model("tiny-qwen3.5", dtype=torch.float32, device="cuda")[0], samples, batch)
    per_sample = alone(load_model("tiny-qwen3.5", dtype=torch.bfloat16, device="cuda")[0], samples, batch)
    model = trainable(torch.bfloat16)
    assert logprobs.takes_flat_layout(model)  # bf16: flash's varlen attention, the flat route
    packed_error, alone_error = (packed(model, batch) - reference).abs(), (per_sample - reference).abs()
    means, worst = (float(packed_error.mean()), float(alone_error.mean())), (float(packed_error.max()),
                                                                             float(alone_error.max()))
    assert means[0] <= 1.5 * means[1], f"mean error packed {means[0]:.4g}, alone {means[1]:.4g}"
    assert worst[0] <= 3 * worst[1], f"worst error packed {worst[0]:.4g}, alone {worst[1]:.4g}"


def test_train_tiny_qwen35_three_default_steps_on_the_packed_varlen_path(tmp_path, monkeypatch, capfd):
    """`agentrl train gsm8k_math --model tiny-qwen3.5 --max-steps 3` with default options: three steps, the run's
    varlen check passed (the trainer's flag, and no fallback warning), every training forward went through the
    packed varlen route and none through the per-sample one, the trainer's CUDA graphs on (no failed capture; the
    grouped rollouts' prefix-shared rows run eagerly), and the engine prefilled through fla's varlen kernels."""
    from agentrl.cli import main
    from agentrl.engine import linear_state
    from agentrl.train.trainer import Trainer

    trainers, engines, routes, in_step = [], [], [], [False]
    init, step = Trainer.__init__, Trainer.step

    def record_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        trainers.append(self)

    def record_step(self, *args, **kwargs):
        in_step[0] = True
        try:
            return step(self, *args, **kwargs)
        finally:
            in_step[0] = False

    monkeypatch.setattr(Trainer, "__init__", record_init)
    monkeypatch.setattr(Trainer, "step", record_step)
    for name in ("_flat_hidden_states", "_varlen_hidden_states", "_per_sample_hidden_states"):
        def spy(*args, _name=name, _f=getattr(logprobs, name), **kwargs):
            if in_step[0]:
                routes.append(_name)
            return _f(*args, **kwargs)
        monkeypatch.setattr(logprobs, name, spy)
    states = linear_state.LinearStates.__init__

    def record_states(self, *args, **kwargs):
        states(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(linear_state.LinearStates, "__init__", record_states)
    layouts = []
    monkeypatch.setattr(linear_state, "varlen_layout",
                        lambda *a, _f=linear_state.varlen_layout: layouts.append(_f(*a)) or layouts[-1])

    run = tmp_path / "run"
    assert main(["train", "gsm8k_math", "--model", "tiny-qwen3.5", "--max-steps", "3", "--run-dir", str(run)]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["trained_tokens"] > 0 for r in records)
    err = capfd.readouterr().err
    fallback = [line for line in err.splitlines() if "packed samples" in line]
    assert not fallback, fallback  # the run's check found the packed rows differing from per-sample
    assert len(trainers) == 1 and trainers[0].hybrid_varlen is True
    assert trainers[0].graphs is not None  # the flat forward and backward from CUDA graphs, a hybrid's default too
    assert "CUDA graphs failed" not in err, err
    assert routes and set(routes) <= {"_flat_hidden_states", "_varlen_hidden_states"}, routes
    assert len(engines) == 1 and engines[0].kernels is not None and layouts


def test_the_packed_convolution_is_flas_varlen_kernel_and_equals_each_sample_alone(monkeypatch):
    """On CUDA the packed rows' causal convolution is flash-linear-attention's varlen kernel (no spreading), and it
    gives each sample's own convolution and gradients (fp32, cuDNN without tf32)."""
    import sys

    from agentrl.train import linear_conv

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = trainable(torch.float32)
    layer = next(m for m in model.modules() if hasattr(m, "conv1d") and hasattr(m, "in_proj_qkv"))
    modeling = sys.modules[type(layer).__module__]
    calls = []
    kernel = linear_conv.varlen_conv()
    monkeypatch.setattr(linear_conv, "varlen_conv", lambda: lambda *a, **k: (calls.append(1), kernel(*a, **k))[1])
    weight, bias = layer.conv1d.weight.squeeze(1), layer.conv1d.bias
    lengths = [70, 1, 33, 150, 3]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    x = torch.randn(1, sum(lengths), weight.shape[0], device="cuda").transpose(1, 2).requires_grad_()
    grad = torch.randn(1, weight.shape[0], sum(lengths), device="cuda")
    with linear_conv.packed_conv_boundaries(model, cu, sum(lengths)):
        got = modeling.causal_conv1d_fn(x, weight, bias, activation=layer.activation)
    assert calls == [1]
    want = torch.cat([modeling.causal_conv1d_fn(part, weight, bias, activation=layer.activation)
                      for part in x.split(lengths, dim=-1)], dim=-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    inputs = tuple(t for t in (x, weight, bias) if t is not None)  # Qwen3.5's conv has no bias
    got_grads = torch.autograd.grad(got, inputs, grad)
    want_grads = torch.autograd.grad(want, inputs, grad)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_prefix_shared_rows_resume_each_prefix_state_through_fla():
    """bf16 on the flat layout: a group's suffixes start from their prefix's state in fla's kernels (per-sequence
    initial states) and the trainer's check finds the shared forward within bf16 rounding of unshared packing (its
    limit is 0.05; a suffix started from zero state is off by O(1)), so a run shares the prefixes."""
    from agentrl.train import delta_rule_backward
    from agentrl.train.prefix_forward import prefix_sharing_error, prefix_sharing_unsupported

    delta_rule_backward.install()  # as a run installs it: the check runs a backward, which fla refuses on some hosts
    model = trainable(torch.bfloat16)
    assert prefix_sharing_unsupported(model) is None
    assert prefix_sharing_error(model) < 0.02


def test_packed_gradients_through_the_torch_gated_backward_equal_the_reference_rules(monkeypatch):
    """Where fla refuses its gated chunk backward (Hopper, Triton < 3.7.1), agentrl's PyTorch one stands in for that
    one kernel (`agentrl.train.delta_rule_backward`); forced here on any GPU. fp32, the well-conditioned model, one
    packed row: the parameter gradients equal those of the same row with the delta rule through transformers'
    PyTorch reference sample by sample (`use_reference_delta_rule`, no fla kernel in its backward) within 1e-4 of
    each gradient's scale, and the stand-in ran."""
    import copy

    from agentrl.train import delta_rule_backward
    from agentrl.train.linear_conv import use_reference_delta_rule

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(delta_rule_backward, "refused_by_fla", lambda g: g is not None)
    monkeypatch.setattr(delta_rule_backward, "KERNEL", False)  # the PyTorch version, not fla's kernel, answers
    calls = []
    own = delta_rule_backward.chunk_bwd_dqkwg
    monkeypatch.setattr(delta_rule_backward, "chunk_bwd_dqkwg", lambda *a, **k: (calls.append(1), own(*a, **k))[1])
    assert delta_rule_backward.install()
    model = well_conditioned(torch.float32)
    reference = copy.deepcopy(model)
    use_reference_delta_rule(reference)
    _, batch = packed_batch()
    batch = batch.to("cuda")

    def grads(m):
        lp = logprobs.packed_token_logprobs(m, batch, hybrid_varlen=True,
                                            pad_multiple=TrainerConfig().row_pad_multiple)[0]
        names, params = zip(*m.named_parameters())
        return lp, dict(zip(names, torch.autograd.grad(lp.sum(), params, allow_unused=True)))

    got_lp, got = grads(model)
    assert calls, "the packed backward did not go through agentrl's gated chunk backward"
    n_calls = len(calls)
    want_lp, want = grads(reference)
    assert len(calls) == n_calls  # the reference row's backward never reached it
    torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=1e-5)
    for name, b in want.items():
        a = got[name]
        if b is None:
            assert a is None or not a.any(), name
            continue
        assert (a - b).abs().max() <= 1e-4 * b.abs().max().clamp(min=1e-6), name


def test_hybrid_replays_train_to_the_eager_weights_of_the_same_buckets():
    """CUDA graphs on tiny Qwen3.5 (`trainer.cuda_graphs`, the default): its flat forward and backward, fla's
    kernels on the bucket's fixed grid of chunks, replayed from CUDA graphs, train to exactly the weights the same
    padded micro-batches give eagerly (bf16, eager layers); prefix-shared rows stay eager."""
    from agentrl.train import delta_rule_backward
    from agentrl.train.config import LossConfig, OptimConfig
    from agentrl.train.flat_graphs import FlatGraphs, cuda_capture
    from agentrl.train.logprobs import _decoder
    from agentrl.train.trainer import Trainer
    from tests.helpers import train_samples

    delta_rule_backward.install()  # as a run installs it: where fla refuses its gated backward, the stand-in

    def train(capture):
        torch.manual_seed(0)
        model = trainable(torch.bfloat16)
        model.train()
        trainer = Trainer(model, TrainerConfig(row_tokens=512, rows_per_micro_batch=1, share_prefix=False),
                          LossConfig(), OptimConfig(lr=1e-4), total_steps=4, hybrid_varlen=True)
        trainer.graphs = FlatGraphs(_decoder(model), pad_multiple=trainer.pad_multiple, row_tokens=512,
                                    capture=capture)
        batch = train_samples(model.config.vocab_size, [130, 90, 210, 40, 170, 110, 20, 300, 250, 80])
        losses = [trainer.step(batch, policy_version=0)["loss"] for _ in range(4)]
        return model, trainer, losses

    eager, _, eager_losses = train(None)
    graphed, trainer, losses = train(cuda_capture)
    counts = trainer.graphs.counts
    assert counts["captured"] >= 1 and counts["replayed"] >= 2, counts
    assert losses == eager_losses
    for a, b in zip(graphed.parameters(), eager.parameters()):
        assert torch.equal(a, b)
