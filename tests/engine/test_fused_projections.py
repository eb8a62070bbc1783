"""The engine's fused projections (`agentrl.engine.fused_projections`): the model's parameters re-pointed at one
buffer per group, unchanged in value and identity, the engine's output equal to the unfused engine's before and
after an in-place update, training on them bit for bit what it was, and a moved parameter never read stale."""

import copy

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

from agentrl.engine import Engine, EngineConfig, SamplingParams
from agentrl.engine.fused_projections import ATTR, spanning_view
from agentrl.models import load_model
from tests.helpers import perturb_, random_prompts

GREEDY = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
CONFIG = dict(num_pages=64, max_tokens_per_step=48)  # prompts of 20-40 tokens: some prefill in two chunks


def _generate(engine, prompts):
    return [(c.token_ids, c.logprobs) for c in engine.generate(prompts, GREEDY)]


def _assert_same_outputs(got, want):
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3.5"])
def test_fusing_keeps_every_parameter_and_its_values(name):
    model = load_model(name)[0]
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    engine = Engine(model, EngineConfig(**CONFIG))
    layers = model.config.num_hidden_layers
    linear = len(engine.linear.layers) if engine.linear is not None else 0
    assert engine.fused.fused == layers + linear  # every MLP and every gated delta net
    for n, p in model.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1]), n
    for module, linears in engine.fused.groups:
        weights = [lin.weight for lin in linears]
        fused = getattr(module, ATTR)
        assert fused.data_ptr() == weights[0].data_ptr()
        assert torch.equal(fused, torch.cat([w.detach() for w in weights]))
    perturb_(model, seed=3)  # an optimizer's in-place step writes into the buffer the engine reads
    for module, linears in engine.fused.groups:
        assert torch.equal(getattr(module, ATTR), torch.cat([lin.weight.detach() for lin in linears]))


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3.5"])
def test_engine_output_equals_the_unfused_engines_across_an_update(name):
    prompts = random_prompts(6, 20, 40, seed=4)
    outputs = []
    for fuse in (False, True):
        model = load_model(name)[0]
        engine = Engine(model, EngineConfig(**CONFIG, fuse_projections=fuse))
        assert (engine.fused is not None) == fuse
        first = _generate(engine, prompts)
        perturb_(model, seed=5)
        engine.bump_version()
        outputs.append((first, _generate(engine, prompts)))
    (first_off, second_off), (first_on, second_on) = outputs
    _assert_same_outputs(first_on, first_off)
    _assert_same_outputs(second_on, second_off)
    assert [t for t, _ in second_on] != [t for t, _ in first_on]  # the update changed what is decoded


def test_training_fused_parameters_gives_bit_identical_weights():
    models = [load_model("tiny-qwen3.5")[0] for _ in range(2)]
    Engine(models[1], EngineConfig(**CONFIG))  # re-points models[1]'s parameters
    ids = torch.tensor(random_prompts(2, 24, 25, seed=6))
    for model in models:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(3):
            logits = model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
    for (n, a), (_, b) in zip(*(m.named_parameters() for m in models)):
        assert torch.equal(a, b), n


def test_a_fused_model_saves_and_loads_as_before(tmp_path):
    model = load_model("tiny-qwen3.5")[0]
    Engine(model, EngineConfig(**CONFIG))
    model.save_pretrained(tmp_path / "final")
    loaded = type(model).from_pretrained(tmp_path / "final")
    torch.save(model.state_dict(), tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    for n, p in model.named_parameters():
        assert torch.equal(loaded.get_parameter(n), p) and torch.equal(state[n], p), n


def test_a_moved_parameter_is_never_read_from_the_old_buffer():
    prompts = random_prompts(4, 20, 40, seed=7)
    model = load_model("tiny-qwen3.5")[0]
    engine = Engine(model, EngineConfig(**CONFIG))
    _generate(engine, prompts)
    with torch.no_grad():  # what `.to()` does: each parameter's data replaced by a new tensor
        for p in model.parameters():
            p.data = p.data * 1.05
    engine.bump_version()
    reference = copy.deepcopy(model)
    others = random_prompts(4, 20, 40, seed=17)  # none of the cached KV of the old weights is reused
    expected = _generate(Engine(reference, EngineConfig(**CONFIG, fuse_projections=False)), others)
    _assert_same_outputs(_generate(engine, others), expected)
    assert engine.fused.fused == 0  # the groups no longer lie in one buffer: each module's own projections


class SwappedMLP(Qwen3MLP):
    """Not the gated form the engine fuses: gate and up trade places."""

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


def test_an_mlp_of_other_arithmetic_is_left_unfused():
    prompts = random_prompts(4, 20, 40, seed=8)
    outputs = []
    for fuse in (False, True):
        model = load_model("tiny-qwen3")[0]
        for layer in model.model.layers:
            layer.mlp.__class__ = SwappedMLP
        if fuse:
            with pytest.warns(UserWarning, match="SwappedMLP is not the gated MLP"):
                engine = Engine(model, EngineConfig(**CONFIG))
            assert engine.fused.fused == 0
        else:
            engine = Engine(model, EngineConfig(**CONFIG, fuse_projections=False))
        outputs.append(_generate(engine, prompts))
    _assert_same_outputs(outputs[1], outputs[0])


def test_spanning_view_needs_rows_back_to_back():
    buffer = torch.arange(24.0).reshape(6, 4)
    a, b, c = buffer[:2], buffer[2:5], buffer[5:]
    assert torch.equal(spanning_view([a, b, c]), buffer)
    assert spanning_view([a, c]) is None  # a gap
    assert spanning_view([b, a]) is None  # out of order
    assert spanning_view([a, b.clone()]) is None  # another storage


def test_a_parameter_two_groups_share_leaves_the_first_unfused():
    """Layer 1's gate is layer 0's (tied): fusing layer 1 moves it out of layer 0's buffer, so layer 0 runs its own
    projections and both layers read the one tied weight."""
    prompts = random_prompts(4, 20, 40, seed=9)
    outputs = []
    for fuse in (False, True):
        model = load_model("tiny-qwen3")[0]
        layers = model.model.layers
        layers[1].mlp.gate_proj.weight = layers[0].mlp.gate_proj.weight
        engine = Engine(model, EngineConfig(**CONFIG, fuse_projections=fuse))
        if fuse:
            assert [getattr(m, ATTR) is not None for m, _ in engine.fused.groups] == [False, True]
        outputs.append(_generate(engine, prompts))
    _assert_same_outputs(outputs[1], outputs[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3.5"])
def test_fused_projections_on_cuda_with_graphs_and_compiled_layers(name):
    """fp32 on CUDA with the engine's defaults there (compiled layers, decode graphs; the hybrid's fused decode
    kernel): the fused engine against the unfused one on the same model, across an in-place update. Tokens equal,
    logprobs within 1e-4, the bound of the other fp32 engine comparisons on CUDA (other GEMM kernels summing in
    another order)."""
    prompts = random_prompts(16, 3, 60, seed=12)
    others = random_prompts(16, 3, 60, seed=13)
    params = [SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True),
              SamplingParams(max_new_tokens=32, temperature=1.0, seed=2, ignore_eos=True)]
    params = [params[i % 2] for i in range(len(prompts))]
    outputs = []
    for fuse in (False, True):
        model = load_model(name, device="cuda")[0]
        engine = Engine(model, EngineConfig(num_pages=256, max_num_seqs=16, fuse_projections=fuse))
        assert engine.graphs is not None and (engine.fused is not None) == fuse
        first = engine.generate(prompts, params)
        perturb_(model, seed=5)
        engine.bump_version()
        outputs.append(first + engine.generate(others, params))
        assert engine.stats.graph_steps > 0
    for got, want in zip(outputs[1], outputs[0]):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0)
