"""agentrl's PyTorch `chunk_bwd_dqkwg` (the gated delta rule's chunk backward, in place of the flash-linear-attention
kernel that package refuses on Hopper under Triton < 3.7.1) against autograd through the chunk's own forward.

The reference is written from the chunked rule, not from the kernel: per chunk of one sequence, with the chunk's
incoming state h (keys × values) and the gradients the other kernels hand in (do for the output, dh for the state
the chunk passes on, dv for its corrected values v = u - w h),

    o      = scale · ((q ⊙ 2^g) h + tril(q kᵀ ⊙ 2^(gᵢ - gⱼ)) v)
    h_next = 2^g_last · h + (k ⊙ 2^(g_last - g))ᵀ v

so the loss Σ o⊙do + Σ h_next⊙dh - Σ (w h)⊙dv has autograd gradients dq, dk, dw and dg · ln 2 (the gate is in
base 2). fp32 on the CPU, within 1e-5. Where flash-linear-attention is installed, in Triton's interpreter (a child
process): its own kernel on the same inputs agrees within fp32 rounding, and its whole chunked rule with the stand-in
in its backward gives the gradients of transformers' PyTorch rule run on each sequence alone."""

import importlib.util
import math

import pytest
import torch

from agentrl.train.delta_rule_backward import chunk_bwd_dqkwg
from tests.children import INTERPRETING, interpret_fla, interpreter_child, run_in_interpreter

CHUNK = 16  # fla's chunks are 64 tokens; the rule is the same at any size, and 16 keeps sequences short


def inputs(lengths, H, HV, K, V, *, batch_rows=None, state_v_first=False, seed=0, chunk=CHUNK):
    """Random tensors laid out as fla lays them: tokens `[B, T, heads, D]`, a chunk-local cumulative gate (base 2,
    decreasing within each chunk), and one state and state gradient per chunk in fla's chunk order."""
    gen = torch.Generator().manual_seed(seed)
    if batch_rows is None:
        B, T = 1, sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long)
        seqs = [(int(cu[i]), int(cu[i + 1])) for i in range(len(lengths))]
    else:
        B, T, cu = batch_rows, lengths[0], None
        seqs = [(b * T, (b + 1) * T) for b in range(B)]

    def rand(*shape, s=1.0):
        return torch.randn(*shape, generator=gen) * s

    q, k = rand(B, T, H, K, s=0.5), rand(B, T, H, K, s=0.5)
    v, do, dv = rand(B, T, HV, V), rand(B, T, HV, V), rand(B, T, HV, V)
    w = rand(B, T, HV, K, s=0.5)
    step = -torch.rand(B * T, HV, generator=gen) * 0.3
    g = torch.empty(B * T, HV)
    chunks = []
    for s, e in seqs:
        for c in range(s, e, chunk):
            end = min(c + chunk, e)
            g[c:end] = step[c:end].cumsum(0)
            chunks.append((c, end))
    states = (len(chunks), HV, V, K) if state_v_first else (len(chunks), HV, K, V)
    h, dh = rand(*states, s=0.5), rand(*states, s=0.5)
    return dict(q=q, k=k, v=v, do=do, h=h.reshape(B, -1, *states[1:]), dh=dh.reshape(B, -1, *states[1:]), w=w,
                g=g.reshape(B, T, HV), dv=dv, cu_seqlens=cu, state_v_first=state_v_first), chunks


def reference(t, chunks, scale):
    """dq, dk, dw and dg by autograd through each chunk's forward (module docstring), summed over the value heads of
    each query head as fla sums them."""
    B, T, H, K = t["k"].shape
    HV = t["v"].shape[2]
    leaves = {n: t[n].detach().clone().requires_grad_() for n in ("q", "k", "w", "g")}
    flat = {n: x.reshape(B * T, x.shape[2], -1) for n, x in leaves.items() if n != "g"}
    g = leaves["g"].reshape(B * T, HV)
    v, do, dv = (t[n].reshape(B * T, HV, -1) for n in ("v", "do", "dv"))
    h, dh = (t[n].reshape(len(chunks), HV, *t[n].shape[-2:]) for n in ("h", "dh"))
    if t["state_v_first"]:
        h, dh = h.transpose(-1, -2), dh.transpose(-1, -2)
    loss = 0.0
    for c, (s, e) in enumerate(chunks):
        for head in range(HV):
            qh, kh = flat["q"][s:e, head * H // HV], flat["k"][s:e, head * H // HV]
            gh, vh, hh = g[s:e, head], v[s:e, head], h[c, head]
            decay = torch.exp2(gh[:, None] - gh[None, :]).tril()
            o = scale * ((qh * torch.exp2(gh)[:, None]) @ hh + ((qh @ kh.T) * decay) @ vh)
            h_next = torch.exp2(gh[-1]) * hh + (kh * torch.exp2(gh[-1] - gh)[:, None]).T @ vh
            loss = loss + (o * do[s:e, head]).sum() + (h_next * dh[c, head]).sum()
            loss = loss - ((flat["w"][s:e, head] @ hh) * dv[s:e, head]).sum()
    loss.backward()
    return leaves["q"].grad, leaves["k"].grad, leaves["w"].grad, leaves["g"].grad / math.log(2)


@pytest.mark.parametrize("case", [
    dict(lengths=(37, 5, 16, 50), H=2, HV=4, K=8, V=12),  # varlen, chunks cut short, value heads sharing a query head
    dict(lengths=(16, 1, 31), H=3, HV=3, K=16, V=8, state_v_first=True),
    dict(lengths=(41,), H=2, HV=2, K=8, V=8, batch_rows=3),  # fixed-length rows, no cu_seqlens
])
def test_the_torch_chunk_backward_equals_autograd_through_the_chunked_rule(case):
    t, chunks = inputs(**case)
    scale = 0.3
    got = chunk_bwd_dqkwg(**t, scale=scale, chunk_size=CHUNK)
    want = reference(t, chunks, scale)
    for name, a, b in zip(("dq", "dk", "dw", "dg"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_fla_chunk_indices_give_the_same_result_as_the_ones_built_from_cu_seqlens():
    """fla hands in `chunk_indices` (sequence, chunk) pairs; without them they are built from cu_seqlens."""
    t, _ = inputs((37, 5, 16, 50), 2, 4, 8, 12)
    lens = t["cu_seqlens"].diff().tolist()
    indices = torch.tensor([(n, c) for n, n_tok in enumerate(lens) for c in range(-(-n_tok // CHUNK))])
    a = chunk_bwd_dqkwg(**t, chunk_size=CHUNK)
    b = chunk_bwd_dqkwg(**t, chunk_size=CHUNK, chunk_indices=indices)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_padding_chunk_entries_past_a_sequences_end_change_nothing():
    """A fixed grid of chunks for CUDA graphs (`linear_conv.chunk_indices` with a capacity): the entries past the
    real chunks point one chunk past the last non-empty sequence's end, with states of their own (garbage here).
    The real chunks' gradients are exactly those without them, and nothing is written for the padding."""
    from agentrl.train.linear_conv import chunk_indices

    t, _ = inputs((37, 5, 16, 50), 2, 4, 8, 12)
    lens = t["cu_seqlens"].diff().tolist()
    exact = torch.tensor(chunk_indices(lens, size=CHUNK))
    padded = torch.tensor(chunk_indices(lens, len(exact) + 5, size=CHUNK))
    assert padded[len(exact):].tolist() == [[3, 4]] * 5  # 50 tokens: chunks 0-3, then one past the end
    gen = torch.Generator().manual_seed(1)
    extra = {n: torch.cat([t[n], torch.randn(1, 5, *t[n].shape[2:], generator=gen) * 1e3], dim=1) for n in ("h", "dh")}
    a = chunk_bwd_dqkwg(**t, chunk_size=CHUNK, chunk_indices=exact)
    b = chunk_bwd_dqkwg(**{**t, **extra}, chunk_size=CHUNK, chunk_indices=padded)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_bf16_inputs_give_bf16_gradients_near_the_fp32_ones():
    """Stored as fla stores them (dq, dk, dw in the inputs' dtype, dg in fp32), within bf16 rounding of fp32."""
    t, _ = inputs((37, 5, 50), 2, 2, 8, 8)
    low = {n: (x.bfloat16() if torch.is_tensor(x) and x.is_floating_point() and n != "g" else x)
           for n, x in t.items()}
    got, want = chunk_bwd_dqkwg(**low, chunk_size=CHUNK), chunk_bwd_dqkwg(**t, chunk_size=CHUNK)
    assert [x.dtype for x in got] == [torch.bfloat16] * 3 + [torch.float32]
    for a, b in zip(got, want):
        scale = b.abs().max()
        assert (a.float() - b).abs().max() <= 0.03 * scale  # inputs rounded to 8 bits of mantissa, then products


def test_only_the_gated_case_is_covered():
    t, _ = inputs((20,), 1, 1, 8, 8)
    with pytest.raises(NotImplementedError, match="gated case"):
        chunk_bwd_dqkwg(**{**t, "g": None}, chunk_size=CHUNK)


FLA = importlib.util.find_spec("fla") is not None


@pytest.mark.skipif(not FLA or INTERPRETING, reason="needs flash-linear-attention (the gpu extra); the child runs it")
def test_flas_own_kernel_in_the_interpreter_gives_the_same_gradients():
    child = interpreter_child(__file__, "-k", "interpreted_fla")
    # no GPU in the child: on Hopper under Triton < 3.7.1 fla would refuse the very kernel compared here
    run_in_interpreter(child._replace(env=(*child.env, ("CUDA_VISIBLE_DEVICES", ""))))


@pytest.mark.skipif(not FLA or not INTERPRETING, reason="runs in the child of the test above")
@pytest.mark.parametrize("case", [dict(lengths=(130, 5, 64, 70), H=2, HV=4, K=16, V=32),
                                  dict(lengths=(100,), H=2, HV=2, K=32, V=16, batch_rows=2),
                                  dict(lengths=(70, 3), H=1, HV=2, K=16, V=16, state_v_first=True),
                                  dict(lengths=(90, 40), H=2, HV=2, K=64, V=16)])  # K in two blocks of 32
def test_interpreted_fla_kernel_equals_the_torch_one(case, monkeypatch):
    """fp32 only: the interpreter holds bf16 as raw integers in elementwise ops (tests.helpers widens only dots).
    fla's kernel through its own launcher, and through agentrl's at the width that spares Hopper's miscompile (a
    head dimension of 64 in two blocks of 32, whose dg partial sums are added), equal the PyTorch version."""
    from agentrl.train.delta_rule_backward import fla_kernel as spared

    interpret_fla(monkeypatch)
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg as fla_kernel
    from fla.ops.utils import prepare_chunk_indices

    t, _ = inputs(**case, chunk=64)
    indices = None if t["cu_seqlens"] is None else prepare_chunk_indices(t["cu_seqlens"], 64)
    want = fla_kernel(**t, scale=0.3, chunk_size=64, chunk_indices=indices)
    got = chunk_bwd_dqkwg(**t, scale=0.3, chunk_size=64, chunk_indices=indices)
    launched = spared(**t, scale=0.3, chunk_size=64, chunk_indices=indices)
    for name, a, b, c in zip(("dq", "dk", "dw", "dg"), got, want, launched):
        assert a.shape == b.shape == c.shape and a.dtype == b.dtype == c.dtype, name
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(c, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}, spared width: {m}")


@pytest.mark.skipif(not FLA or INTERPRETING, reason="needs flash-linear-attention (the gpu extra)")
def test_the_registered_backend_takes_exactly_the_calls_fla_refuses(monkeypatch):
    """Through fla's own dispatch (`fla.ops.common.chunk_o.chunk_bwd_dqkwg`): where fla refuses the gated kernel the
    call lands here; where it does not, the backend declines and fla's kernel runs (not called here: CPU tensors)."""
    from fla.backends import _operation_registries
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg as dispatched

    from agentrl.train import delta_rule_backward

    assert delta_rule_backward.install() and delta_rule_backward.install()  # idempotent
    backend = _operation_registries["common"]._backends[delta_rule_backward.BACKEND_TYPE]
    t, _ = inputs((37, 5, 50), 2, 4, 8, 8)
    monkeypatch.setattr(delta_rule_backward, "refused_by_fla", lambda g: False)
    assert backend.verify("chunk_bwd_dqkwg", **t)[0] is False
    monkeypatch.setattr(delta_rule_backward, "refused_by_fla", lambda g: g is not None)
    assert backend.verify("chunk_bwd_dqkwg", **t) == (True, None)
    assert backend.verify("chunk_bwd_dqkwg", **{**t, "g": None})[0] is False
    for a, b in zip(dispatched(**t, chunk_size=CHUNK), chunk_bwd_dqkwg(**t, chunk_size=CHUNK)):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_16bit_products_on_tensor_cores_equal_the_fp32_copies(monkeypatch):
    """On CUDA, bf16 operands multiply on tensor cores writing fp32 (`torch.bmm(out_dtype=)`), the way the kernel's
    dot products do; the fp32-copy path the CPU takes gives the same results but for the order of the sums."""
    from agentrl.train import delta_rule_backward

    t, _ = inputs((130, 5, 64, 70), 2, 4, 32, 64, chunk=64)
    t = {n: (x.cuda().bfloat16() if torch.is_tensor(x) and x.is_floating_point() and n != "g" else
             x.cuda() if torch.is_tensor(x) else x) for n, x in t.items()}
    assert delta_rule_backward._bmm_fp32_out(torch.device("cuda"))
    fast = chunk_bwd_dqkwg(**t, chunk_size=64)
    monkeypatch.setitem(delta_rule_backward._BMM_FP32_OUT, "cuda", False)
    slow = chunk_bwd_dqkwg(**t, chunk_size=64)
    for name, a, b in zip(("dq", "dk", "dw", "dg"), fast, slow):
        assert a.dtype == b.dtype, name
        # bf16 results (dq, dk, dw) may round to a neighbouring value when the fp32 sums differ in their last bits
        tol = 1e-5 if a.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(a.float(), b.float(), atol=tol * b.float().abs().max().item(), rtol=tol,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.skipif(not FLA or not INTERPRETING, reason="runs in the child of the fla test above")
def test_interpreted_fla_rule_with_the_stand_in_equals_the_reference_rule_per_sample(monkeypatch):
    """fla's whole chunked rule over four packed sequences (one of 5 tokens, one of exactly a chunk), forward and
    backward in the interpreter with the stand-in taking the gated dq/dk/dw/dg kernel as on a refusing host, against
    transformers' PyTorch rule run on each sequence alone: outputs and the gradients of q, k, v, g and beta within
    1e-5 of their scale (fp32)."""
    import inspect

    from agentrl.train import delta_rule_backward

    interpret_fla(monkeypatch)
    monkeypatch.setattr(delta_rule_backward, "refused_by_fla", lambda g: g is not None)
    calls = []
    own = delta_rule_backward.chunk_bwd_dqkwg
    monkeypatch.setattr(delta_rule_backward, "chunk_bwd_dqkwg", lambda *a, **k: (calls.append(1), own(*a, **k))[1])
    assert delta_rule_backward.install()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    reference = inspect.unwrap(torch_chunk_gated_delta_rule)  # transformers' wrapper would dispatch to fla
    gen = torch.Generator().manual_seed(0)
    lengths, H, K = (70, 5, 64, 30), 2, 16
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v = (torch.randn(1, T, H, K, generator=gen).requires_grad_() for _ in range(3))
    g = (-torch.rand(1, T, H, generator=gen) * 0.5).requires_grad_()
    beta = torch.rand(1, T, H, generator=gen).requires_grad_()
    grad_out = torch.randn(1, T, H, K, generator=gen)
    out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    got = torch.autograd.grad((out * grad_out).sum(), (q, k, v, g, beta))
    assert calls == [1]
    alone = torch.cat([reference(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                                 use_qk_l2norm_in_kernel=True)[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())],
                      dim=1)
    want = torch.autograd.grad((alone * grad_out).sum(), (q, k, v, g, beta))
    torch.testing.assert_close(out, alone, atol=1e-5, rtol=1e-5)
    for name, a, b in zip(("q", "k", "v", "g", "beta"), got, want):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), name


@pytest.mark.skipif(not FLA or not INTERPRETING, reason="runs in the child of the fla test above")
def test_interpreted_fla_rule_and_conv_on_a_fixed_chunk_grid_equal_the_exact_grid(monkeypatch):
    """A hybrid row in CUDA graphs launches fla's kernels over a fixed grid of chunks (`linear_conv.chunk_indices`
    with a capacity): the entries past the real chunks point one chunk past the last non-empty sequence's end, and
    an empty sequence closes the boundaries as the graph buckets' layouts do. fla's chunked rule (its own kernels,
    forward and backward) and its varlen convolution give exactly what the exact grid gives: outputs and every
    gradient (fp32, the interpreter)."""
    interpret_fla(monkeypatch)
    _fixed_grid_equals_exact("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not FLA or not torch.cuda.is_available(), reason="needs CUDA and flash-linear-attention")
def test_fla_rule_and_conv_on_a_fixed_chunk_grid_equal_the_exact_grid_on_cuda(monkeypatch):
    """The same on the GPU's compiled kernels (the interpreter masks what a compiled kernel might still read)."""
    from agentrl.engine.linear_varlen import ieee_fp32_kernels
    from agentrl.train import delta_rule_backward

    ieee_fp32_kernels()
    delta_rule_backward.install()  # where fla refuses its gated backward here, the stand-in's padding runs too
    _fixed_grid_equals_exact("cuda")


def _fixed_grid_equals_exact(device: str) -> None:
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from agentrl.train.linear_conv import chunk_indices

    gen = torch.Generator().manual_seed(0)
    lengths, H, K = (70, 5, 64, 30, 0), 2, 16
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    exact = torch.tensor(chunk_indices(list(lengths)), dtype=torch.int32, device=device)
    grid = torch.tensor(chunk_indices(list(lengths), len(exact) + 6), dtype=torch.int32, device=device)
    leaves = [torch.randn(1, T, H, K, generator=gen) for _ in range(3)]
    leaves += [-torch.rand(1, T, H, generator=gen) * 0.5, torch.rand(1, T, H, generator=gen)]
    leaves = [t.to(device) for t in leaves]
    x, weight = torch.randn(1, T, 3 * K, generator=gen).to(device), torch.randn(3 * K, 4, generator=gen).to(device)
    grad_rule = torch.randn(1, T, H, K, generator=gen).to(device)
    grad_conv = torch.randn(1, T, 3 * K, generator=gen).to(device)

    def rule(indices):
        q, k, v, g, beta = (t.clone().requires_grad_() for t in leaves)
        out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=cu, chunk_indices=indices,
                                        use_qk_l2norm_in_kernel=True)
        return [out, *torch.autograd.grad((out * grad_rule).sum(), (q, k, v, g, beta))]

    def conv(indices):
        xs, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out, _ = causal_conv1d(xs, w, activation="silu", cu_seqlens=cu, chunk_indices=indices)
        return [out, *torch.autograd.grad((out * grad_conv).sum(), (xs, w))]

    for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), rule(grid), rule(exact)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=lambda m, n=name: f"rule {n}: {m}")
    for name, a, b in zip(("y", "dx", "dweight"), conv(grid), conv(exact)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=lambda m, n=name: f"conv {n}: {m}")


def test_the_compiled_stand_in_is_one_graph_that_gives_the_eager_gradients(monkeypatch):
    """`compile_stand_in` (a run that compiles its layers): the backend's calls run one whole graph (fullgraph, no
    breaks), compiled once for every packed row's chunk count (dynamic shapes) and whether or not an input is a view
    (a row's chunk indices are a slice of its layout's one copy, a graph bucket's static copy of them is not), with
    the eager results. A backend here that needs no C++ toolchain: the graph is what is checked, not inductor's."""
    from agentrl.train import delta_rule_backward
    from agentrl.train.linear_conv import chunk_indices

    monkeypatch.setattr(delta_rule_backward, "_COMPILE", None)
    delta_rule_backward.compile_stand_in(backend="aot_eager")
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]
    try:
        for n, lengths in enumerate([(37, 5, 16, 50), (70, 9, 33, 64, 2), (16, 1, 31)]):
            t, _ = inputs(lengths, 2, 4, 8, 12, seed=n)
            t["cu_seqlens"] = t["cu_seqlens"].int()
            indices = torch.tensor(chunk_indices(t["cu_seqlens"].diff().tolist(), size=CHUNK), dtype=torch.int32)
            if n != 1:  # a slice of a larger tensor, as the layout's; the second call's are a tensor of their own
                indices = torch.cat([torch.zeros(3, 2, dtype=torch.int32), indices])[3:]
            before = graphs["unique_graphs"]
            got = delta_rule_backward._run(**t, scale=0.3, chunk_size=CHUNK, chunk_indices=indices)
            assert graphs["unique_graphs"] - before == (1 if n == 0 else 0)  # one graph, kept across chunk counts
            want = chunk_bwd_dqkwg(**t, scale=0.3, chunk_size=CHUNK, chunk_indices=indices)
            for name, a, b in zip(("dq", "dk", "dw", "dg"), got, want):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=lambda m, x=name: f"{x}: {m}")
        # Fixed-length rows (no boundaries) compile too; a packed row without chunk indices stays eager.
        t, _ = inputs((41,), 2, 2, 8, 8, batch_rows=3)
        for a, b in zip(delta_rule_backward._run(**t, chunk_size=CHUNK), chunk_bwd_dqkwg(**t, chunk_size=CHUNK)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        before = graphs["unique_graphs"]
        t, _ = inputs((37, 5, 50), 2, 4, 8, 8)
        delta_rule_backward._run(**t, chunk_size=CHUNK)
        assert graphs["unique_graphs"] == before and delta_rule_backward._COMPILE is not None
    finally:
        torch._dynamo.reset()
        delta_rule_backward.compile_stand_in(False)
    assert delta_rule_backward._COMPILE is None


def test_a_stand_in_that_fails_to_compile_warns_once_and_runs_eagerly(monkeypatch):
    from agentrl.train import delta_rule_backward

    def broken(fn, **options):
        def call(*args, **kwargs):
            raise RuntimeError("no lowering for aten.bmm.dtype\nmore")
        return call

    monkeypatch.setattr(delta_rule_backward, "_COMPILE", None)
    monkeypatch.setattr(torch, "compile", broken)
    delta_rule_backward.compile_stand_in()
    t, _ = inputs((41,), 2, 2, 8, 8, batch_rows=3)
    with pytest.warns(UserWarning, match="compiling agentrl's gated delta-rule backward failed \\(no lowering"):
        got = delta_rule_backward._run(**t, chunk_size=CHUNK)
    assert delta_rule_backward._COMPILE is None  # eager from now on, without another warning
    for a, b in zip(got, chunk_bwd_dqkwg(**t, chunk_size=CHUNK)):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_stand_in_compiled_by_inductor_on_cuda_gives_the_eager_gradients(monkeypatch):
    """The compiled stand-in as a run with compiled layers gets it (inductor, bf16 products on tensor cores): the
    eager results within the rounding of its fused fp32 work (bf16 outputs may land on a neighbouring value)."""
    from agentrl.train import delta_rule_backward
    from agentrl.train.linear_conv import chunk_indices

    monkeypatch.setattr(delta_rule_backward, "_COMPILE", None)
    monkeypatch.setattr(delta_rule_backward, "KERNEL", False)  # the PyTorch version for every call
    delta_rule_backward.compile_stand_in()
    try:
        for lengths in [(130, 5, 64, 70), (300, 17, 90)]:
            t, _ = inputs(lengths, 2, 4, 32, 64, chunk=64)
            t = {n: (x.cuda().bfloat16() if torch.is_tensor(x) and x.is_floating_point() and n != "g" else
                     x.cuda().int() if torch.is_tensor(x) else x) for n, x in t.items()}
            indices = torch.tensor(chunk_indices(t["cu_seqlens"].diff().tolist(), size=64), dtype=torch.int32,
                                   device="cuda")
            got = delta_rule_backward._run(**t, chunk_size=64, chunk_indices=indices)
            assert delta_rule_backward._COMPILE is not None  # it compiled, and ran compiled
            want = chunk_bwd_dqkwg(**t, chunk_size=64, chunk_indices=indices)
            for name, a, b in zip(("dq", "dk", "dw", "dg"), got, want):
                tol = 1e-5 if a.dtype == torch.float32 else 1e-2
                torch.testing.assert_close(a.float(), b.float(), atol=tol * b.float().abs().max().item(), rtol=tol,
                                           msg=lambda m, n=name: f"{n}: {m}")
    finally:
        delta_rule_backward.compile_stand_in(False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("K", [128, 64])
def test_flas_kernel_at_a_spared_width_equals_the_pytorch_version_on_cuda(K, monkeypatch):
    """fla's kernel as the backend launches it for the calls fla refuses (Hopper under Triton 3.4-3.7.0: K blocks of
    128 for Qwen3.5's head dimension, two of 32 for 64), bf16 at Qwen3.5's value dimension, against the PyTorch
    version: each result within 1e-2 of its norm (their 16-bit roundings differ by ~2^-8 an element; the miscompile
    the width avoids got dk wrong by half its norm). The backend then keeps the kernel for that shape."""
    from agentrl.train import delta_rule_backward
    from agentrl.train.linear_conv import chunk_indices

    t, _ = inputs((300, 17, 640, 90), 4, 8, K, 128, chunk=64)
    t = {n: (x.cuda().bfloat16() if torch.is_tensor(x) and x.is_floating_point() and n != "g" else
             x.cuda().int() if torch.is_tensor(x) else x) for n, x in t.items()}
    indices = torch.tensor(chunk_indices(t["cu_seqlens"].diff().tolist(), size=64), dtype=torch.int32, device="cuda")
    got = delta_rule_backward.fla_kernel(**t, chunk_size=64, chunk_indices=indices)
    want = chunk_bwd_dqkwg(**t, chunk_size=64, chunk_indices=indices)
    for name, a, b in zip(("dq", "dk", "dw", "dg"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        error = float((a.float() - b.float()).norm() / b.float().norm())
        assert error < 1e-2, f"{name}: relative {error:.3g} at K {K}"
    monkeypatch.setattr(delta_rule_backward, "_VERDICTS", {})
    monkeypatch.setattr(delta_rule_backward, "KERNEL", True)
    delta_rule_backward._run(**t, chunk_size=64, chunk_indices=indices)
    assert list(delta_rule_backward._VERDICTS.values()) == [True]


def test_a_kernel_that_differs_from_the_pytorch_version_is_not_kept(monkeypatch):
    """`_kernel_agrees`, the check on each shape's first call: a kernel within rounding of the PyTorch version is
    kept; one whose dk is off by a half (what fla's issue #640 reports at its miscompiled width) is refused with a
    warning that names the difference."""
    from agentrl.train import delta_rule_backward

    t, _ = inputs((37, 5, 50), 2, 4, 8, 8)
    call = {**t, "chunk_size": CHUNK}
    rounded = lambda **k: tuple(None if x is None else x * (1 + 1e-4) for x in chunk_bwd_dqkwg(**k))  # noqa: E731
    monkeypatch.setattr(delta_rule_backward, "fla_kernel", rounded)
    assert delta_rule_backward._kernel_agrees(call) is True

    def miscompiled(**k):
        dq, dk, dw, dg = chunk_bwd_dqkwg(**k)
        return dq, dk * 0.5, dw, dg
    monkeypatch.setattr(delta_rule_backward, "fla_kernel", miscompiled)
    with pytest.warns(UserWarning, match=r"differs from agentrl's PyTorch version here \(relative 0\.5"):
        assert delta_rule_backward._kernel_agrees(call) is False
