"""A hybrid engine with compiled decoder layers (`engine.compile=true`): dynamo compiles each layer around the
linear-attention core (`linear_state._core`, kept out of the graph), and the engine's tokens and logprobs are those
of the eager engine. aot_eager stands in for inductor here (no C++ toolchain needed); what it checks is dynamo's
side: the graph breaks at the core, the step plan passed through the layers' kwargs, the graphs around it."""

import functools

import pytest
import torch

import agentrl.engine.engine as engine_module
from agentrl.engine import Engine, EngineConfig, SamplingParams
from agentrl.engine.model_view import compile_decoder_layers
from agentrl.models import load_model
from tests.helpers import random_prompts, two_turns


def test_compiled_hybrid_layers_give_the_eager_engines_tokens_and_logprobs(monkeypatch):
    torch._dynamo.reset()
    model = load_model("tiny-qwen3.5")[0]
    prompts = random_prompts(6, 3, 40, seed=21)
    params = [SamplingParams(max_new_tokens=12, temperature=0),
              SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)]
    params = [params[i % 2] for i in range(len(prompts))]
    config = EngineConfig(num_pages=64, max_num_seqs=8, max_tokens_per_step=32)
    tools = random_prompts(6, 5, 40, seed=22)
    eager = Engine(model, config)
    reference = two_turns(eager, prompts, params, tools)
    monkeypatch.setattr(engine_module, "compile_decoder_layers",
                        functools.partial(compile_decoder_layers, backend="aot_eager"))
    compiled = Engine(model, EngineConfig(**{**vars(config), "compile": True}))
    layers = [m for m in compiled.view.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert len(layers) == model.config.num_hidden_layers
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = two_turns(compiled, prompts, params, tools)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames  # the layers did compile
    assert compiled.stats.snapshot_resumes > 0  # turn 2 resumed from state snapshots through the compiled layers
    for out, ref in zip(got, reference):
        assert out.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)


def test_hybrid_layers_stay_eager_unless_asked():
    model = load_model("tiny-qwen3.5")[0]
    engine = Engine(model, EngineConfig(num_pages=16))
    assert not any(getattr(m, "_compiled_call_impl", None) is not None for m in engine.view.modules())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_hybrid_layers_on_cuda_with_graphs():
    """fp32 on CUDA with inductor and decode graphs: the compiled engine's tokens equal the eager engine's, logprobs
    within 1e-4 (the bound of the other fp32 engine comparisons on CUDA: fused kernels sum in other orders)."""
    model = load_model("tiny-qwen3.5", device="cuda")[0]
    prompts = random_prompts(12, 3, 40, seed=23)
    tools = random_prompts(12, 5, 40, seed=24)
    params = [SamplingParams(max_new_tokens=24, temperature=0),
              SamplingParams(max_new_tokens=24, temperature=1.0, seed=4)]
    params = [params[i % 2] for i in range(len(prompts))]
    config = EngineConfig(num_pages=256, max_num_seqs=16)
    reference = two_turns(Engine(model, config), prompts, params, tools)
    compiled = Engine(model, EngineConfig(**{**vars(config), "compile": True}))
    got = two_turns(compiled, prompts, params, tools)
    assert compiled.stats.graph_steps > 0
    for out, ref in zip(got, reference):
        assert out.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)
