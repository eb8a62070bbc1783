"""The fused decode kernels of the gated delta net (`triton_delta_rule`) against transformers' torch rule and conv.

As in test_triton_attention.py, the interpreter needs TRITON_INTERPRET set before triton is first imported, so
`test_kernels_in_interpreter` runs this file again in a child process with TRITON_INTERPRET=1, where the kernel and
engine tests marked `in_interpreter` run. `TRITON_INTERPRET=1 pytest tests/engine/test_triton_delta_rule.py` runs
them directly. The GPU test compiles the kernel for real (CUDA only).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tests.children import INTERPRETING, interpreter_child, patch_triton_interpreter, run_in_interpreter
from tests.helpers import random_prompts

pytest.importorskip("triton")

in_interpreter = pytest.mark.skipif(not INTERPRETING, reason="runs in the child of test_kernels_in_interpreter")


INTERPRETER_RUN = interpreter_child(__file__, "-m", "not gpu")


@pytest.mark.child(INTERPRETER_RUN)
def test_kernels_in_interpreter():
    if INTERPRETING:
        pytest.skip("this process is the interpreter run")
    run_in_interpreter(INTERPRETER_RUN)


if INTERPRETING:
    patch_triton_interpreter()


def reference_rule():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule
    return torch_recurrent_gated_delta_rule


def random_step(rows, hk, hv, dk, dv, num_slots, dtype=torch.float32, device="cpu", seed=0):
    """Inputs of one decode step as the engine has them: q, k, v strided views of one conv output row per
    sequence, g fp32 (log-decay, negative), beta in (0, 1), a state per slot plus the scratch one; the rows' slots
    distinct and shuffled, the last row on the scratch slot (a captured step's padding)."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(rows, 2 * hk * dk + hv * dv, generator=gen).to(device, dtype)
    q = y[:, :hk * dk].unflatten(1, (hk, dk))
    k = y[:, hk * dk:2 * hk * dk].unflatten(1, (hk, dk))
    v = y[:, 2 * hk * dk:].unflatten(1, (hv, dv))
    g = (-torch.rand(rows, hv, generator=gen) * 2).to(device)
    beta = torch.rand(rows, hv, generator=gen).to(device, dtype)
    state = (torch.randn(num_slots + 1, hv, dk, dv, generator=gen) * 0.5).to(device)
    slots = torch.cat([torch.randperm(num_slots, generator=gen)[:rows - 1], torch.tensor([num_slots])]).to(device)
    return q, k, v, g, beta, state, slots


def reference_step(q, k, v, g, beta, state, slots):
    """transformers' rule over the rows' gathered states, in fp32 from the same input values (heads repeated
    here: its 5.17 version expects that)."""
    rep = v.shape[1] // q.shape[1]
    q, k, v, beta = (t.float() for t in (q, k, v, beta))
    out, final = reference_rule()(
        q.repeat_interleave(rep, 1)[:, None], k.repeat_interleave(rep, 1)[:, None], v[:, None], g=g[:, None],
        beta=beta[:, None], initial_state=state[slots], output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[:, 0], final


def check_step(rows, hk, hv, dk, dv, config=None, dtype=torch.float32, device="cpu", tol=1e-5):
    """Output within `tol` of the fp32 reference, plus half a unit in the last place of the output dtype (the
    rounding of the output: 0 for fp32, 2^-8 relative for bf16); written states within `tol`, the others
    untouched bit for bit."""
    from agentrl.engine.triton_delta_rule import delta_rule_step

    q, k, v, g, beta, state, slots = random_step(rows, hk, hv, dk, dv, num_slots=rows + 3, dtype=dtype, device=device)
    ref_out, ref_final = reference_step(q, k, v, g, beta, state, slots)
    before = state.clone()
    out = delta_rule_step(q, k, v, g, beta, state, slots, config=config)
    assert out.dtype == q.dtype and out.shape == (rows, hv, dv)
    half_ulp = 0.0 if dtype == torch.float32 else 2.0 ** -8
    excess = ((out.float() - ref_out).abs() - half_ulp * ref_out.abs()).max().item()
    state_err = (state[slots] - ref_final).abs().max().item()
    assert excess < tol and state_err < tol, (excess, state_err)
    untouched = torch.ones(state.shape[0], dtype=torch.bool, device=state.device)
    untouched[slots] = False
    assert untouched.any() and torch.equal(state[untouched], before[untouched])


@in_interpreter
@pytest.mark.parametrize("hk,hv", [(2, 4), (2, 2)])
@pytest.mark.parametrize("dk,dv", [(16, 16), (32, 16), (16, 32), (24, 40)])  # 24, 40: masked blocks
@pytest.mark.parametrize("config", [None, {"block_v": 8, "num_warps": 1}, {"block_v": 64, "num_warps": 2}],
                         ids=["default", "blocks-of-8", "full-batch-blocks"])
def test_delta_rule_step_matches_transformers_rule(hk, hv, dk, dv, config):
    check_step(5, hk, hv, dk, dv, config)


def reference_conv(x, conv, slots, weight, bias):
    window = torch.cat([conv[slots], x[:, :, None]], dim=-1)
    return F.silu(F.conv1d(window, weight, bias, groups=x.shape[1]))[:, :, 0], window[:, :, 1:]


@in_interpreter
@pytest.mark.parametrize("channels,width,bias", [(96, 3, True), (40, 3, False), (300, 1, True)])
def test_conv_step_matches_conv1d_and_shifts_the_window_in_place(channels, width, bias):
    from agentrl.engine.triton_delta_rule import conv_step

    g_ = torch.Generator().manual_seed(1)
    rows, num_slots = 4, 7
    x = torch.randn(rows, channels, generator=g_)
    conv = torch.randn(num_slots + 1, channels, width, generator=g_)
    weight = torch.randn(channels, 1, width + 1, generator=g_)
    b = torch.randn(channels, generator=g_) if bias else None
    slots = torch.tensor([5, 0, 3, num_slots])
    ref_y, ref_window = reference_conv(x, conv, slots, weight, b)
    before = conv.clone()
    y = conv_step(x, conv, slots, weight, b, block_c=64)  # several channel blocks, the last one masked
    assert (y - ref_y).abs().max() < 1e-5
    assert torch.equal(conv[slots], ref_window)
    untouched = [s for s in range(num_slots + 1) if s not in slots.tolist()]
    assert torch.equal(conv[untouched], before[untouched])


@in_interpreter
def test_rows_with_a_snapshot_index_also_write_their_new_state_and_window_there():
    """`snaps[i] >= 0`: row i's new state and shifted window are written to that snapshot as well as to its slot;
    rows at -1 (and the padding row on the scratch slot) write none, and other snapshots stay untouched."""
    from agentrl.engine.triton_delta_rule import conv_step, delta_rule_step

    q, k, v, g, beta, state, slots = random_step(4, 2, 4, 16, 16, num_slots=7)
    snapshot = torch.randn(5, *state.shape[1:])
    snaps = torch.tensor([3, -1, 0, -1])
    before = snapshot.clone()
    delta_rule_step(q, k, v, g, beta, state, slots, snapshot=snapshot, snaps=snaps)
    assert torch.equal(snapshot[3], state[slots[0]]) and torch.equal(snapshot[0], state[slots[2]])
    assert torch.equal(snapshot[[1, 2, 4]], before[[1, 2, 4]])
    gen = torch.Generator().manual_seed(2)
    x, conv = torch.randn(4, 40, generator=gen), torch.randn(8, 40, 3, generator=gen)
    windows = torch.randn(5, 40, 3, generator=gen)
    before = windows.clone()
    conv_step(x, conv, slots, torch.randn(40, 1, 4, generator=gen), snapshot=windows, snaps=snaps, block_c=16)
    assert torch.equal(windows[3], conv[slots[0]]) and torch.equal(windows[0], conv[slots[2]])
    assert torch.equal(windows[[1, 2, 4]], before[[1, 2, 4]])


@in_interpreter
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "stand-in-graphs"])
def test_engine_decode_with_the_fused_kernels_matches_the_reference_path(graphs):
    """The tiny Qwen3.5 engine with `LinearStates.fused_decode` set (as on CUDA) against the same engine on the
    per-row rule, over two turns: prompts prefilled on the chunk path, decode steps through the kernels, which write
    the state at each page boundary a decode fills into its snapshot (the reference copies it after the step); the
    second turn resumes from those snapshots. With stand-in graphs, steps replayed from the static slot and snapshot
    buffers, padding rows on the scratch slot."""
    from agentrl.engine import Engine, EngineConfig, SamplingParams
    from agentrl.engine import triton_delta_rule
    from agentrl.models import load_model
    from tests.helpers import graph_engine, two_turns

    torch.set_num_threads(1)
    model = load_model("tiny-qwen3.5")[0]
    prompts = random_prompts(3, 3, 20, seed=4)
    tools = random_prompts(3, 1, 4, seed=5)
    params = [SamplingParams(max_new_tokens=11, temperature=0, ignore_eos=True),
              SamplingParams(max_new_tokens=10, temperature=1.0, seed=2, ignore_eos=True)]
    params = [params[i % 2] for i in range(len(prompts))]
    config = dict(page_size=8, max_num_seqs=4, state_snapshots=16)  # room for every snapshot: turn 2 resumes from
    # the deepest, one the kernel wrote
    make = (lambda: graph_engine(model, **config)) if graphs else (
        lambda: Engine(model, EngineConfig(num_pages=32, **config)))
    reference = make()
    assert reference.linear.fused_decode is None  # CPU: the per-row rule
    refs = two_turns(reference, prompts, params, tools)
    engine = make()
    calls, written = [], []

    def fused(module, *args, snapshot=None):
        calls.append(args[-1].tolist())
        if snapshot is not None:
            written.extend(s for s in snapshot[2].tolist() if s >= 0)
        return triton_delta_rule.decode_rows(module, *args, snapshot=snapshot)

    engine.linear.fused_decode = fused
    outs = two_turns(engine, prompts, params, tools)
    assert max(map(len, calls)) >= len(prompts)  # decode steps of every sequence together
    if graphs:
        scratch = engine.linear.scratch
        assert engine.stats.graph_steps > 0 and any(slots.count(scratch) > 1 for slots in calls)
    # Snapshots written by the kernel, and turn 2 resumed from as many as the reference's
    assert written and engine.stats.snapshot_resumes == reference.stats.snapshot_resumes > 0
    assert [o.cached_tokens for o in outs] == [r.cached_tokens for r in refs]
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    # 1e-4: the kernel sums in another order than the per-row rule, over 20 tokens of a tiny model whose own fp32
    # logprobs miss fp64 by up to 4.0e-3 (tests/train/test_linear_conv.py); a wrong state is O(1)
    err = max(abs(a - b) for o, r in zip(outs, refs) for a, b in zip(o.logprobs, r.logprobs))
    assert err < 1e-4, err
    # The same snapshots held, each the reference's state up to that rounding (a snapshot one token off is O(1)):
    # the inputs of every layer after the first differ by it, so the windows too.
    index = dict(engine.snapshots._index_of)
    assert index == reference.snapshots._index_of
    for i in index.values():
        for ours, theirs in ((engine.snapshots.conv, reference.snapshots.conv),
                             (engine.snapshots.recurrent, reference.snapshots.recurrent)):
            torch.testing.assert_close(ours[:, i], theirs[:, i], atol=1e-4, rtol=1e-4)


@in_interpreter
def test_the_startup_check_passes_the_kernels_and_catches_a_wrong_one(monkeypatch):
    """`check_decode_rows`, which an engine runs once before trusting the fused decode on its GPU: silent on the
    real kernels, a one-line reason for a kernel that computes differently (here a 1% error in the decay)."""

    from agentrl.engine import triton_delta_rule
    from agentrl.engine.linear_state import _decode_rows
    from agentrl.models import load_model

    torch.set_num_threads(1)
    rule = reference_rule()

    def reference(module, *args):
        return _decode_rows(module, rule, *args)

    model = load_model("tiny-qwen3.5")[0]
    module = next(m for m in model.modules() if hasattr(m, "in_proj_b"))
    assert triton_delta_rule.check_decode_rows(module, reference) is None
    step = triton_delta_rule.delta_rule_step
    monkeypatch.setattr(triton_delta_rule, "delta_rule_step",
                        lambda q, k, v, g, *rest, **kw: step(q, k, v, g * 0.99, *rest, **kw))
    failure = triton_delta_rule.check_decode_rows(module, reference)
    assert failure is not None and failure.startswith("differs from the reference here"), failure
    # A bf16 layer: the same wrong decay is caught by the fp32 check, which runs first on a copy of the layer.
    bf16 = copy.deepcopy(module).to(torch.bfloat16)
    failure = triton_delta_rule.check_decode_rows(bf16, reference)
    assert failure is not None and failure.endswith("in fp32"), failure
    monkeypatch.setattr(triton_delta_rule, "delta_rule_step", lambda *a, **kw: 1 / 0)
    assert triton_delta_rule.check_decode_rows(module, reference).startswith("failed here (ZeroDivisionError")


@in_interpreter
def test_the_startup_check_passes_a_bf16_layer_whose_reference_rounds_twice():
    """A bf16 layer: the reference rounds the conv output and its SiLU to bf16 separately, the kernel once, so their
    states differ by about a bf16 unit relative to an update (7e-3 of the state's scale here, 1.0e-3 on an H200: the
    former 1e-4 bound refused the kernel there). The kernels pass both checks."""
    from agentrl.engine import triton_delta_rule
    from agentrl.engine.linear_state import _decode_rows
    from agentrl.models import load_model

    torch.set_num_threads(1)
    rule = reference_rule()
    module = next(m for m in load_model("tiny-qwen3.5", dtype=torch.bfloat16)[0].modules() if hasattr(m, "in_proj_b"))
    assert triton_delta_rule.check_decode_rows(module, lambda m, *a: _decode_rows(m, rule, *a)) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_rule_step_on_cuda(dtype):
    """The compiled kernel at the Qwen3.5-0.8B shape (16 key and value heads of 128), with 2 value heads per key
    head and with a small batch (narrow blocks), against transformers' rule in fp32 on the same input values. bf16
    inputs with the fp32 state: both sides compute in fp32 from the same bf16 values, so states agree within 1e-5
    and outputs within 1e-5 plus the bf16 rounding of the output, half a unit in its last place (2^-8 relative;
    `check_step`)."""
    for rows, hk, hv, config in [(64, 16, 16, None), (3, 16, 16, None), (64, 8, 16, None),
                                 (5, 2, 4, {"block_v": 16, "num_warps": 2})]:
        check_step(rows, hk, hv, 128, 128, config, dtype=dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_with_the_fused_decode_matches_the_gathered_rule_on_cuda():
    """fp32 on CUDA, decode graphs on: the engine decoding through `triton_delta_rule` against the same engine with
    `fused_decode` off (fla's fused recurrent kernel, or transformers' rule, between a gather and a scatter).
    Tokens equal, logprobs within 1e-4, the bound of the other fp32 engine comparisons on CUDA (different kernels
    summing in different orders, over a few hundred steps)."""
    from agentrl.engine import Engine, EngineConfig, SamplingParams
    from agentrl.models import load_model

    model = load_model("tiny-qwen3.5", device="cuda")[0]
    prompts = random_prompts(20, 3, 60, seed=9)
    params = [SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True),
              SamplingParams(max_new_tokens=40, temperature=1.0, seed=2, ignore_eos=True)]
    params = [params[i % 2] for i in range(len(prompts))]
    config = EngineConfig(num_pages=256, max_num_seqs=32)
    engine = Engine(model, config)
    assert engine.linear.fused_decode is not None and engine.graphs is not None
    outs = engine.generate(prompts, params)
    reference = Engine(model, config)
    reference.linear.fused_decode = None
    refs = reference.generate(prompts, params)
    assert engine.stats.graph_steps > 0
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)
