"""The varlen path of hybrid models' linear-attention layers (`linear_varlen.VarlenLayout`): all the chunks of a step
in one call of fla's chunked delta rule (two where a chunk is split at a page boundary), one conv over the chunks
laid end to end, and fla's fused recurrent kernel for decode rows.

On CPU the fla functions are replaced by stand-ins of the same signature that run transformers' torch rules per
segment of `cu_seqlens` and check what fla itself checks (one flat row, one initial state per segment) and that
the chunk indices handed over are the ones fla would compute: the engine on the varlen path then equals the
per-sequence path bit for bit, which verifies the bookkeeping (rows, conv windows, split pieces, snapshots,
fresh slots). On CUDA with flash-linear-attention the real kernels are compared with the per-sequence path.
"""

import importlib.util
import sys

import numpy as np
import pytest
import torch

import agentrl.engine.linear_state as linear_state
from agentrl.engine import Engine, EngineConfig, SamplingParams
from agentrl.engine.linear_varlen import FLA_CHUNK_SIZE, VarlenKernels, VarlenLayout
from agentrl.models import load_model
from tests.helpers import random_prompts

PARAMS = [SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
          SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True),
          SamplingParams(max_new_tokens=9, temperature=0.8, top_k=30, seed=4, ignore_eos=True)]


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-qwen3.5")[0]


def fla_chunk_indices(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """fla's `prepare_chunk_indices`: a `(segment, chunk within it)` row for every 64-token chunk of every segment."""
    rows = [(i, j) for i, n in enumerate(cu_seqlens.diff().tolist()) for j in range(-(-n // FLA_CHUNK_SIZE))]
    return torch.tensor(rows, dtype=cu_seqlens.dtype, device=cu_seqlens.device).view(-1, 2)


def standin_kernels(impl) -> tuple[VarlenKernels, list[int]]:
    """fla's two kernels as transformers' torch rules per segment; the list records each chunked call's segments."""
    chunked, recurrent = impl.torch_chunk_gated_delta_rule, impl.torch_recurrent_gated_delta_rule
    calls = []

    def chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_indices=None, **kwargs):
        assert not kwargs and scale is None and output_final_state and use_qk_l2norm_in_kernel
        assert q.shape[0] == 1 and q.shape[2] == k.shape[2] and v.shape[2] % q.shape[2] == 0
        assert cu_seqlens.dtype == torch.long and int(cu_seqlens[0]) == 0 and int(cu_seqlens[-1]) == q.shape[1]
        assert initial_state.shape[0] == cu_seqlens.numel() - 1 and initial_state.dtype == torch.float32
        assert torch.equal(chunk_indices, fla_chunk_indices(cu_seqlens))
        calls.append(cu_seqlens.numel() - 1)
        outs, finals = [], []
        bounds = cu_seqlens.tolist()
        for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            state = initial_state[i:i + 1]
            # The per-sequence path runs a one-token piece that continues a state in the recurrent form (and a
            # fresh one, from no state, in the chunked form): the same choice keeps the comparison bit for bit.
            rule = recurrent if e - s == 1 and bool(state.any()) else chunked
            out, final = rule(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e], initial_state=state,
                              output_final_state=True, use_qk_l2norm_in_kernel=True)
            outs.append(out)
            finals.append(final)
        return torch.cat(outs, dim=1), torch.cat(finals)

    def conv(x, weight, bias, initial_state=None, output_final_state=False, activation=None, cu_seqlens=None,
             chunk_indices=None):
        # fla's varlen conv per segment: transformers' conv and SiLU over the segment after its window
        channels, kernel = weight.shape
        assert x.shape[0] == 1 and x.shape[2] == channels and output_final_state and activation == "silu"
        assert initial_state.shape == (cu_seqlens.numel() - 1, channels, kernel)
        assert torch.equal(chunk_indices, fla_chunk_indices(cu_seqlens))
        outs, tails = [], []
        bounds = cu_seqlens.tolist()
        for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            window = torch.cat([initial_state[i, :, 1:], x[0, s:e].t()], dim=-1)  # [C, kernel - 1 + n]
            y = torch.nn.functional.conv1d(window[None], weight[:, None], bias, groups=channels)[0]
            outs.append(torch.nn.functional.silu(y).t())
            tails.append(torch.cat([initial_state[i, :, :1], window], dim=-1)[:, -kernel:])
        return torch.cat(outs)[None], torch.stack(tails)

    return VarlenKernels(chunk=chunk, recurrent=recurrent, conv=conv), calls


def conversations(engine, contexts, turns, tools):
    """`turns` turns of several conversations advancing together (their chunks share steps), each resubmitting
    its history with its completion and a tool result. Returns every completion, in order."""
    outs = []
    for turn in range(turns):
        params = [PARAMS[(turn + i) % len(PARAMS)] for i in range(len(contexts))]
        done = engine.generate(contexts, params)
        outs += done
        contexts = [c + o.token_ids + tools[(turn + i) % len(tools)] for i, (c, o) in enumerate(zip(contexts, done))]
    return outs


def gathered(layout: VarlenLayout) -> VarlenLayout:
    """`layout` with its chunks' rows gathered by index rather than sliced (the layout of chunks that are not the
    packed row's tail, which the scheduler's order rarely gives)."""
    start, stop = layout.rows
    return VarlenLayout({**layout.parts, "lin_chunk_rows": np.arange(start, stop)}, layout.tokens, None)


@pytest.mark.parametrize("page_size,budget,rows", [(8, 40, "sliced"), (16, 256, "sliced"), (8, 40, "gathered"),
                                                   (8, 24, "sliced")],
                         ids=["small-pages-chunked", "ample", "rows-gathered", "tiny-budget"])
def test_varlen_path_equals_the_per_sequence_path_bit_for_bit(model, monkeypatch, page_size, budget, rows):
    impl = sys.modules[type(next(m for m in model.modules() if hasattr(m, "in_proj_b"))).__module__]
    layouts = []
    adapt = gathered if rows == "gathered" else (lambda layout: layout)
    monkeypatch.setattr(linear_state, "varlen_layout",
                        lambda *a, _f=linear_state.varlen_layout: layouts.append(adapt(_f(*a))) or layouts[-1])
    system = random_prompts(1, 70, 71, seed=5)[0]  # a shared prefix longer than fla's 64-token chunk
    contexts = [system + p for p in random_prompts(5, 1, 30, seed=6)] + random_prompts(2, 1, 4, seed=7)
    tools = random_prompts(4, 2, 9, seed=8)
    config = dict(num_pages=160, page_size=page_size, max_num_seqs=8, max_tokens_per_step=budget)
    reference = Engine(model, EngineConfig(**config))
    assert reference.linear.kernels is None  # CPU: the per-sequence path
    refs = conversations(reference, contexts, 3, tools)
    engine = Engine(model, EngineConfig(**config))
    engine.linear.kernels, calls = standin_kernels(impl)
    outs = conversations(engine, contexts, 3, tools)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert [o.logprobs for o in outs] == [r.logprobs for r in refs]
    assert [o.cached_tokens for o in outs] == [r.cached_tokens for r in refs]
    # What the comparison went through: several chunks in one call, chunks split at page boundaries writing
    # snapshots, fresh and continued chunks, and turns resumed from snapshots.
    parts = [layout.parts for layout in layouts]
    assert max(calls) > 1 and any(p["lin_chunk_slots"].size > 1 for p in parts)
    assert any("lin_p2" in p for p in parts) and any("lin_snap_ids" in p for p in parts)
    if budget == 24:  # a snapshot window reaching back into the slot's window (a boundary < 3 tokens in)
        assert any("lin_snap_in_x" in p and not p["lin_snap_in_x"].all() for p in parts)
    fresh = [(p["lin_fresh"].size if "lin_fresh" in p else 0, p["lin_chunk_slots"].size) for p in parts]
    assert any(n for n, _ in fresh) and any(n < chunks for n, chunks in fresh)
    stats, ref_stats = engine.stats, reference.stats
    assert stats.snapshot_resumes == ref_stats.snapshot_resumes > 0
    assert stats.prefilled_tokens == ref_stats.prefilled_tokens
    engine.pool.check()
    engine.snapshots.check(engine.pool)


def test_varlen_layout_of_split_and_fresh_chunks():
    chunks = [linear_state.Chunk(row=2, length=5, slot=3, fresh=True, split=0, snap=-1),
              linear_state.Chunk(row=7, length=70, slot=0, fresh=False, split=2, snap=4),
              linear_state.Chunk(row=77, length=3, slot=6, fresh=False, split=1, snap=-1),
              linear_state.Chunk(row=80, length=20, slot=5, fresh=False, split=16, snap=7)]
    layout = linear_state.varlen_layout(chunks, width=3)
    p = layout.parts
    assert layout.tokens == 98 and layout.rows == (2, 100) and "lin_chunk_rows" not in p  # the row's tail: a slice
    assert p["lin_chunk_slots"].tolist() == [3, 0, 6, 5] and p["lin_fresh"].tolist() == [3]
    assert p["lin_cuc"].tolist() == [0, 5, 75, 78, 98]  # the conv runs each chunk whole
    assert p["lin_cic"].reshape(-1, 2).tolist() == [[0, 0], [1, 0], [1, 1], [2, 0], [3, 0]]
    # First call: chunk 0 whole, the first 2 tokens of chunk 1, the first of chunk 2, the first 16 of chunk 3;
    # second: the rest of 1, 2 and 3.
    assert p["lin_cu1"].tolist() == [0, 5, 7, 8, 24]
    assert p["lin_p1"].tolist() == [0, 1, 2, 3, 4, 5, 6, 75, *range(78, 94)]
    assert p["lin_cu2"].tolist() == [0, 68, 70, 74] and p["lin_p2"].tolist() == [*range(7, 75), 76, 77, *range(94, 98)]
    assert p["lin_ci1"].reshape(-1, 2).tolist() == [[0, 0], [1, 0], [2, 0], [3, 0]]
    assert p["lin_ci2"].reshape(-1, 2).tolist() == [[0, 0], [0, 1], [1, 0], [2, 0]]  # 68 tokens: two chunks
    assert p["lin_split"].tolist() == [1, 2, 3]
    # Chunks 1 and 3 write snapshots: the window of the 3 inputs before the boundary. Chunk 1's boundary is 2 tokens
    # in, so its window's first column is its slot window's last (window column 3 * 1 + 2 of the chunks' windows laid
    # end to end); chunk 3's are its rows 13..15 (chunk-major rows 91..93).
    assert p["lin_snap_chunks"].tolist() == [1, 3] and p["lin_snap_ids"].tolist() == [4, 7]
    assert p["lin_snap_in_x"].tolist() == [0, 1, 1, 1, 1, 1]
    assert p["lin_snap_rows"].tolist()[1:] == [5, 6, 91, 92, 93] and p["lin_snap_win"].tolist()[0] == 5
    # Chunks that are not the row's tail in order are gathered.
    gathered = linear_state.varlen_layout([chunks[1], chunks[0]], width=3)
    assert gathered.rows is None and gathered.parts["lin_chunk_rows"].tolist() == [*range(7, 77), *range(2, 7)]


def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not fla_installed(),
                    reason="needs CUDA and flash-linear-attention")
def test_fla_varlen_path_matches_the_per_sequence_path_on_cuda():
    """fp32 on CUDA: the engine with fla's varlen and fused recurrent kernels against the per-sequence path,
    three turns of conversations advancing together, prefix cache and decode graphs on. Tokens equal, logprobs
    within 1e-4 (both paths run fla's kernels, where transformers resolves its rules to fla's, over different
    segmentations; in IEEE fp32, TRITON_F32_DEFAULT, tests/conftest.py). Not 1e-5: the tiny default's own fp32
    logprobs (every vocabulary entry) miss fp64 by up to 4.0e-3 on the CPU (`tests/train/test_linear_conv.py::
    test_the_fp32_bound_is_above_fp32_rounding`), so two correct segmentations may differ by more than 1e-5, and the
    well-conditioned model that would allow it decodes greedily onto one token; a boundary fault is O(1)."""
    model, _ = load_model("tiny-qwen3.5", device="cuda")
    system = random_prompts(1, 150, 151, seed=5)[0]
    contexts = [system + p for p in random_prompts(12, 1, 60, seed=6)] + random_prompts(4, 1, 4, seed=7)
    tools = random_prompts(4, 2, 20, seed=8)
    config = dict(num_pages=512, page_size=16, max_num_seqs=32, max_tokens_per_step=512)
    engine = Engine(model, EngineConfig(**config))
    assert engine.linear.kernels is not None and engine.graphs is not None
    calls = []
    chunk = engine.linear.kernels.chunk
    engine.linear.kernels = VarlenKernels(
        chunk=lambda *a, **k: calls.append(k["cu_seqlens"].numel() - 1) or chunk(*a, **k),
        recurrent=engine.linear.kernels.recurrent, conv=engine.linear.kernels.conv)
    outs = conversations(engine, contexts, 3, tools)
    reference = Engine(model, EngineConfig(**config))
    reference.linear.kernels = None
    reference.linear.fused_decode = None  # the reference decodes through the model's own rule (fla's on CUDA)
    refs = conversations(reference, contexts, 3, tools)
    assert max(calls) > 1 and engine.stats.graph_steps > 0 and engine.stats.snapshot_resumes > 0
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)
