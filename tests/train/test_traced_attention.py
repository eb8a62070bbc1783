"""The varlen attention traced into the trainer's compiled layers, and cuDNN's varlen kernel.

On CPU a per-segment reference wrapped as an op (what flash's aten op and `cudnn_attention`'s ops are on the GPU:
fake kernels, symbolic max lengths) stands in for the GPU kernels; the GPU tests run the kernels themselves."""

import concurrent.futures

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from agentrl.engine.model_view import compile_decoder_layers
from agentrl.models import load_model
from agentrl.run import build
from agentrl.run.build import TRAINER_COMPILE, attention_implementation
from agentrl.train import cudnn_attention as ca
from agentrl.train import varlen_attention as va
from agentrl.train.config import ModelConfig
from agentrl.train.logprobs import packed_token_logprobs
from agentrl.train.pack import pack_samples
from tests.helpers import train_samples


@torch.library.custom_op("agentrl_test::reference_attention", mutates_args=())
def _reference_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                  max_q: int, max_k: int, scale: float, causal: bool) -> torch.Tensor:
    return va.reference_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, 0.0).contiguous()


@_reference_op.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    return torch.empty_like(q)


@torch.library.custom_op("agentrl_test::reference_attention_backward", mutates_args=())
def _reference_backward_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, scale: float,
                           causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    def vjp():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = va.reference_kernel(*leaves, cu_q, cu_k, max_q, max_k, scale, causal, 0.0)
        return [g.contiguous() for g in torch.autograd.grad(out, leaves, grad)]

    # An op's kernel runs below autograd; a fresh thread starts with its own dispatch state, where autograd runs.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return tuple(pool.submit(vjp).result())


@_reference_backward_op.register_fake
def _(grad, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *ctx.rest = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k)


def _backward(ctx, grad):
    return (*_reference_backward_op(grad, *ctx.saved_tensors, *ctx.rest), None, None, None, None, None, None)


_reference_op.register_autograd(_backward, setup_context=_setup)


def op_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, dropout):
    return _reference_op(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)


TRACED = va.register("agentrl_varlen_reference_traced", op_kernel, traced=True)
UNTRACED = va.register("agentrl_varlen_reference_op", op_kernel)


class Copies(TorchDispatchMode):
    """The shapes of every tensor cloned or copied below the autograd engine."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) in ("aten.clone", "aten.copy_", "aten.contiguous"):
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and its process-wide counters (graph breaks) as a fresh process has them."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _model(impl):
    model, _ = load_model("tiny-qwen3")
    model.set_attn_implementation(impl)
    return model


def _batches(vocab):
    lengths = [[13, 9, 21, 4, 17], [11, 2, 30, 25], [7, 33, 19, 8, 3, 6]]
    return [pack_samples(train_samples(vocab, n, seed=i), row_tokens=40) for i, n in enumerate(lengths)]


def _backward_copies(model, batch) -> list[tuple]:
    model.zero_grad(set_to_none=True)
    lp, ent = packed_token_logprobs(model, batch, chunk_size=16, pad_multiple=16)
    copies = Copies()
    with copies:
        (lp.sum() + 0.1 * ent.sum()).backward()
    return copies.shapes


@pytest.mark.parametrize("impl", [TRACED, UNTRACED])
def test_traced_attention_leaves_the_dynamic_layers_whole_and_their_gradients_uncopied(impl, fresh_dynamo):
    """The trainer's layers are compiled dynamic, and a dynamic layer's backward plans each incoming gradient
    contiguous. Broken around the attention, a layer hands q, k and v over as transposed views and copies each of
    their gradients into that plan (three strided copies a layer and micro-batch: 8 ms of the Qwen3-0.6B step on
    the H200). Traced through, the layer is one graph: no graph break, no 4-d copy in the backward, no new graph for
    a new flat length, and eager's logprobs and gradients. The untraced registration is the control."""
    eager, compiled = _model(impl), _model(impl)
    compile_decoder_layers(compiled, **TRAINER_COMPILE)
    counters = torch._dynamo.utils.counters
    batches = _batches(eager.config.vocab_size)
    for i, batch in enumerate(batches):
        if i == len(batches) - 1:
            graphs = counters["stats"]["unique_graphs"]
        _backward_copies(eager, batch)
        copies = _backward_copies(compiled, batch)
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
            assert float((q.grad - p.grad).norm() / p.grad.norm()) < 1e-5, name
    four_d = [s for s in copies if len(s) == 4]
    if impl == TRACED:
        assert not four_d, four_d
        assert not sum(counters["graph_break"].values()), dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] == graphs  # the third length compiled nothing new
    else:
        assert len(four_d) == 3 * compiled.config.num_hidden_layers, four_d


def test_traced_attention_takes_prefix_shared_rows(fresh_dynamo):
    """A prefix-shared row through traced attention in compiled layers: each suffix's keys gathered (the prefix's,
    then its own), the gathered entries no segment reads dropped from the gradient; logprobs and gradients equal
    the eager layers' on the same rows, with no graph break."""
    from agentrl.train.prefix_pack import pack_shared
    from agentrl.train.prefix_forward import shared_token_logprobs
    from tests.train.test_prefix_sharing import _groups

    eager, compiled = _model(TRACED), _model(TRACED)
    compile_decoder_layers(compiled, **TRAINER_COMPILE)
    batch = pack_shared(_groups(eager.config.vocab_size), row_tokens=64)
    outs = []
    for model in (eager, compiled):
        lp, _ = shared_token_logprobs(model, batch, chunk_size=16, pad_multiple=16)
        lp.sum().backward()
        outs.append((lp.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-5)
    for got, want in zip(outs[1][1], outs[0][1]):
        assert float((got - want).norm() / want.norm()) < 1e-5
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert not sum(breaks.values()), dict(breaks)


def test_cudnn_ops_trace_forward_and_backward_on_fake_tensors():
    """`cudnn_attention`'s ops through their fake kernels and autograd registration, no GPU: the traced forward
    and backward call the pair once each, the max length reaches both as a symbol (the package's own ops take an
    `int`, which a trace would bake in as the literal), and each gradient has its input's shape."""
    from torch.fx.experimental.proxy_tensor import make_fx

    t, hq, hkv, d = 40, 4, 2, 16

    def step(q, k, v, cu, max_len):
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out = ca.cudnn_kernel(q, k, v, cu, cu, max_len, max_len, d ** -0.5, True, 0.0)
        return (q, k, v, out, *torch.autograd.grad(out.float().sum(), (q, k, v)))

    args = [torch.randn(t, h, d, dtype=torch.bfloat16) for h in (hq, hkv, hkv)]
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    graph = make_fx(step, tracing_mode="symbolic")(*args, cu, 25)
    calls = [n for n in graph.graph.nodes if n.op == "call_function"
             and str(n.target) in ("agentrl.cudnn_varlen_fwd.default", "agentrl.cudnn_varlen_bwd.default")]
    assert [str(n.target).split(".")[1] for n in calls] == ["cudnn_varlen_fwd", "cudnn_varlen_bwd"], calls
    for call, at in zip(calls, (5, 8)):  # max_q's position in each op's arguments
        assert isinstance(call.args[at], torch.fx.Node), call.args  # a symbol, not the literal 25
    q, k, v, out, dq, dk, dv = (str(o.meta["val"].shape) for o in graph.graph.output_node().args[0])
    assert (dq, dk, dv, out) == (q, k, v, q)
    with pytest.raises(NotImplementedError, match="dropout"):
        ca.cudnn_kernel(*args, cu, cu, 25, 25, 0.25, True, 0.1)


def test_default_attention_is_cudnn_on_hopper_with_the_package_else_flash(monkeypatch):
    """The choice `agentrl train` makes on a GPU, its devices and packages stood in: for a dense model cuDNN's
    kernel on Hopper with cudnn-frontend installed, flash's elsewhere, traced into the layers; for a hybrid one
    flash's, untraced (the path its GPU figures were measured on)."""
    import transformers

    model, _ = load_model("tiny-qwen3", dtype=torch.bfloat16)
    monkeypatch.setattr(build, "varlen_attention_available", lambda: True)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability[0])
    for installed, cap, want in ((True, (9, 0), va.CUDNN_IMPLEMENTATION), (False, (9, 0), va.ATTN_IMPLEMENTATION),
                                 (True, (8, 0), va.ATTN_IMPLEMENTATION)):
        monkeypatch.setattr(build, "cudnn_varlen_available", lambda installed=installed: installed)
        capability[0] = cap
        assert attention_implementation(ModelConfig(), model, "cuda") == want
        registered = transformers.AttentionInterface._global_mapping[want]
        assert not getattr(registered, "_torchdynamo_disable", False)  # traced: a dense model
    hybrid, _ = load_model("tiny-qwen3.5", dtype=torch.bfloat16)
    monkeypatch.setattr(build, "cudnn_varlen_available", lambda: True)
    capability[0] = (9, 0)
    chosen = attention_implementation(ModelConfig(hybrid_varlen=True), hybrid, "cuda")
    assert chosen == va.ATTN_IMPLEMENTATION
    assert transformers.AttentionInterface._global_mapping[chosen]._torchdynamo_disable  # a hybrid's: untraced


# ------------------------------------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_cudnn = pytest.mark.skipif(not ca.cudnn_varlen_available(), reason="needs CUDA and nvidia-cudnn-frontend")


def _layouts():
    """A bucket's boundaries (segments of 300, 0, 700 tokens, a padding tail, empty segments up to a capacity) and
    a prefix-shared row (queries: two suffixes after a 500-token prefix; keys: the prefix, then each suffix's own)."""
    bucket = [0, 300, 300, 1000, 1024, 1024, 1024, 1024, 1024]
    return [(bucket, bucket, 700, 700), ([0, 500, 700, 820], [0, 500, 1200, 1820], 500, 700)]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kernel", ["flash", pytest.param("cudnn", marks=needs_cudnn)])
@pytest.mark.parametrize("layout", [0, 1], ids=["bucket", "prefix_shared"])
def test_cuda_kernel_matches_the_fp32_reference_on_the_trainers_layouts(kernel, layout):
    fn = {"flash": va.flash_kernel, "cudnn": ca.cudnn_kernel}[kernel]
    cu_q, cu_k, max_q, max_k = _layouts()[layout]
    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d = 16, 8, 128
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cu_q, cu_k))
    q = torch.randn(int(cu_q[-1]), hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(int(cu_k[-1]), hkv, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in "kv")
    up = torch.randn(q.shape, device="cuda", generator=g)
    results = []
    for f, dtype in ((fn, torch.bfloat16), (va.reference_kernel, torch.float32)):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        out = f(*leaves, cu_q, cu_k, max_q, max_k, d ** -0.5, True, 0.0)
        results.append([out, *torch.autograd.grad((out.float() * up).sum(), leaves)])
    for got, want in zip(*results):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert float((got.float() - want).norm() / want.norm()) < 2e-2  # bf16 rounding is ~3e-3 relative


@pytest.mark.gpu
@needs_cudnn
def test_cuda_compiled_layers_with_traced_cudnn_attention_match_eager(fresh_dynamo):
    """The default on Hopper: inductor-compiled dynamic layers with cuDNN's attention traced in, micro-batches of
    changing flat length, no graph break; in bf16 each is as close to the fp32 model (sdpa) as the eager layers
    with the same kernel are (bf16 gradients of the tiny model are several % from fp32 on every path)."""
    batches = [b.to("cuda") for b in _batches(320)]
    name = va.register(va.CUDNN_IMPLEMENTATION, ca.cudnn_kernel, traced=True)

    def run(model):
        model.zero_grad(set_to_none=True)
        lps = [packed_token_logprobs(model, b, chunk_size=64, pad_multiple=16)[0] for b in batches]
        torch.cat(lps).float().sum().backward()
        return torch.cat(lps).detach().float(), torch.cat([p.grad.float().reshape(-1) for p in model.parameters()])

    def rel(got, want):
        return float((got - want).norm() / want.norm())

    reference, _ = load_model("tiny-qwen3", dtype=torch.float32, device="cuda")
    reference.set_attn_implementation("sdpa")
    want = run(reference)
    models = []
    for compiled in (False, True):
        model, _ = load_model("tiny-qwen3", dtype=torch.bfloat16, device="cuda")
        model.set_attn_implementation(name)
        if compiled:
            compile_decoder_layers(model, **TRAINER_COMPILE)
        models.append(model)
    eager = run(models[0])
    for _ in range(2):  # the second pass runs the compiled graphs
        got = run(models[1])
        for g, e, w in zip(got, eager, want):
            assert rel(g, w) <= 2 * rel(e, w) + 1e-3, (rel(g, w), rel(e, w))
    assert not sum(torch._dynamo.utils.counters["graph_break"].values())
