"""From a packed batch to per-token logprobs: the packed forward and the chunked lm_head.

Packed forward. Dense models get the whole `[R, T]` batch with `position_ids` and no attention mask; transformers
sees positions restart and builds the block-diagonal causal mask itself (a dense boolean mask under sdpa/eager,
which is what the CPU tests run; a block-sparse `BlockMask` under flex_attention on GPU, where the attention
between samples is skipped rather than masked). `use_cache=False` is not optional: transformers only looks for
packed sequences when there is no cache, and a model whose config says `use_cache=True` would otherwise build
one and silently attend across samples.

Flat layout. Under a varlen attention implementation (`varlen_attention.takes_flat_layout`, flash attention on
GPU) the micro-batch's real tokens are laid end to end as one row `[1, N]` instead: rows' padding is not computed,
sample boundaries go to the kernel as `cu_seq_lens`, and the trained positions are gathered from that row in the
same row-major order as from `[R, T]`. N is rounded up to `pad_multiple` by a tail that is a segment of its own,
so compiled layers see few distinct lengths and no real token attends to the tail.

Hybrid models (linear-attention layers) carry a recurrent state and a short convolution along the sequence, and
the torch fallbacks of those layers know nothing of sample seams. Unless the caller vouches for varlen kernels
(`hybrid_varlen=True`, e.g. flash-linear-attention, checked once with `packing_error`), each row's samples are run
as a right-padded batch of their own and scattered back into the packed layout: right padding sits after every
real token, so a causal model computes the real positions exactly, and no state crosses a sample.

A prefix-shared batch (`prefix_pack.SharedBatch`) runs through `prefix_forward` instead, with a tree mask.

The trained positions' hidden states then go through the chunked lm_head (`lm_head`).
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from agentrl.models import is_hybrid
from agentrl.train.flat_graphs import FlatGraphs, FlatInputs, Plan, RoundUp, boundaries, flat_forward
from agentrl.train.linear_conv import chunk_indices, packed_conv_boundaries
from agentrl.train.lm_head import chunked_logprobs, lm_head_weight
from agentrl.train.pack import PackedBatch
from agentrl.train.varlen_attention import takes_flat_layout


def varlen_kernels_installed() -> bool:
    """flash-linear-attention is the one package whose delta-rule kernels take sample boundaries (cu_seqlens)."""
    return importlib.util.find_spec("fla") is not None


def _decoder(model):
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    return decoder if decoder is not None else model.model


def _check_attention(model):
    impl = getattr(model.config, "_attn_implementation", None) or ""
    if "paged" in impl:
        # The engine's paged implementation reads a cache object and ignores position-based packing.
        raise ValueError(f"the training forward cannot run through the attention implementation {impl!r}; "
                         f"give the engine its own view of the model")


def packed_hidden_states(model, batch: PackedBatch, *, hybrid_varlen: bool = False,
                         pad_multiple: int = 1) -> torch.Tensor:
    """Final hidden states `[R, T, H]` of `batch` (after the decoder's final norm, before the lm_head).

    Positions on padding hold whatever the model computes there (zeros on the flat and hybrid reference paths);
    they are masked out of every loss term. `pad_multiple` rounds the flat layout's length (flat layout only).
    """
    decoder = _decoder(model)
    if _route(model, hybrid_varlen) == "flat":
        hidden, layout = _flat_hidden_states(decoder, batch, pad_multiple)
        n_rows, width = batch.input_ids.shape
        return hidden.new_zeros(n_rows * width, hidden.shape[-1]).index_copy(0, layout.index, hidden).view(
            n_rows, width, -1)
    return _row_hidden_states(model, decoder, batch, hybrid_varlen)


def _route(model, hybrid_varlen: bool) -> str:
    _check_attention(model)
    hybrid = is_hybrid(model)
    if hybrid and hybrid_varlen and not varlen_kernels_installed():
        raise RuntimeError("hybrid_varlen=True needs flash-linear-attention (package `fla`), whose kernels take "
                           "sample boundaries; without it use the per-sample reference path (hybrid_varlen=False)")
    if takes_flat_layout(model):
        if hybrid and not hybrid_varlen:
            # The per-sample path would hand the boundaries the flat attention needs to the linear-attention
            # layers too, whose torch fallbacks refuse them.
            raise ValueError(f"a hybrid model under attention implementation {model.config._attn_implementation!r} "
                             "needs hybrid_varlen=True (flash-linear-attention); otherwise use flex_attention or sdpa")
        return "flat"
    return "rows"


def _row_hidden_states(model, decoder, batch: PackedBatch, hybrid_varlen: bool) -> torch.Tensor:
    if not is_hybrid(model):
        out = decoder(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
        return out.last_hidden_state
    if hybrid_varlen:
        return _varlen_hidden_states(decoder, batch)
    return _per_sample_hidden_states(decoder, batch)


@dataclass
class FlatLayout:
    """Where a packed batch's real tokens go when laid end to end as one row `[1, length]`."""

    index: torch.Tensor  # [N] long: each real token's position in the flattened [R * T] batch, ascending
    cu_seqlens: torch.Tensor  # int32: every sample's boundaries in the flat row, then the padding tail if any
    max_len: int  # longest segment, the tail included
    length: int  # N rounded up to the pad multiple
    trained: torch.Tensor | None = None  # [M] positions in the flat row of the trained targets (host-built)
    chunks: torch.Tensor | None = None  # int32 [C, 2]: fla's chunk indices of the segments (hybrid models)


def flat_layout(batch: PackedBatch, pad_multiple: int = 1, padding: Plan | None = None,
                chunks: bool = False) -> FlatLayout:
    """Built on the host from `batch.segments`. Index and boundaries cross to the device in one copy, from pinned
    memory on CUDA: a pageable copy would wait for the previous micro-batch's backward to finish. `padding`: how the
    row is padded (`flat_graphs`; default: the length rounded up to `pad_multiple`, the padding one segment).
    `chunks`: also flash-linear-attention's chunk indices of the segments (`linear_conv.chunk_indices`), as many as
    the plan's fixed shapes hold where it has them (`Padding.chunks`)."""
    padding = padding or RoundUp(pad_multiple)
    width = batch.input_ids.shape[1]
    spans = [(r * width + start, n) for r, segs in enumerate(batch.segments) for _, start, n in segs]
    lengths = [n for _, n in spans]
    real = sum(lengths)
    plan = padding(real, len(lengths), real, max(lengths), max(lengths))
    bounds = boundaries(lengths + list(plan.tails), plan.segments)
    device = batch.input_ids.device
    index = torch.cat([torch.arange(s, s + n) for s, n in spans])
    parts = [index, torch.tensor(bounds)]
    if chunks:
        segment_lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        parts.append(torch.tensor(chunk_indices(segment_lengths, plan.chunks)).reshape(-1))
    if batch.host_loss_mask is not None:  # the trained rows, found on the host rather than by a device nonzero
        parts.append(batch.host_loss_mask.reshape(-1)[index].nonzero().squeeze(1))
    host = torch.cat(parts)
    if device.type == "cuda":
        host = host.pin_memory()
    moved = list(host.to(device, non_blocking=True).split([p.numel() for p in parts]))
    index, cu = moved.pop(0), moved.pop(0).int()
    chunk_tensor = moved.pop(0).int().view(-1, 2) if chunks else None
    return FlatLayout(index=index, cu_seqlens=cu, max_len=plan.max_q, length=plan.length,
                      trained=moved[0] if moved else None, chunks=chunk_tensor)


def _flat_hidden_states(decoder, batch: PackedBatch, pad_multiple: int,
                        graphs: FlatGraphs | None = None) -> tuple[torch.Tensor, FlatLayout]:
    """Hidden states `[N, H]` of the real tokens, in `layout.index` order, from one flat forward (replayed from
    `graphs` where given)."""
    hybrid = is_hybrid(decoder)
    layout = flat_layout(batch, pad_multiple, graphs.padding if graphs is not None else None, chunks=hybrid)
    ids = batch.input_ids.reshape(-1)[layout.index]
    pos = batch.position_ids.reshape(-1)[layout.index]
    # A hybrid's inputs carry the chunk indices: `FlatInputs.run` keeps the linear-attention layers within the
    # samples, on the tensors a captured graph reads.
    inputs = FlatInputs(*padded_row(ids, pos, layout.length), layout.cu_seqlens, layout.cu_seqlens, layout.max_len,
                        layout.max_len, chunks=layout.chunks)
    hidden = flat_forward(decoder, inputs, graphs)
    return hidden[:layout.index.shape[0]], layout


def padded_row(ids: torch.Tensor, pos: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The real tokens' ids and positions, then the padding's: ids 0 and positions 0.. (valid for any model; the
    padding's segments are never read back)."""
    pad = length - ids.shape[0]
    if not pad:
        return ids, pos
    return torch.cat([ids, ids.new_zeros(pad)]), torch.cat([pos, torch.arange(pad, device=pos.device)])


def _varlen_hidden_states(decoder, batch: PackedBatch) -> torch.Tensor:
    # Varlen kernels take one flat row with cumulative boundaries, so the rows are laid end to end.
    n_rows, width = batch.input_ids.shape
    cu = batch.flat_cu_seqlens().to(batch.input_ids.device)
    max_len = int((cu[1:] - cu[:-1]).max())
    inputs = FlatInputs(batch.input_ids.reshape(-1), batch.position_ids.reshape(-1), cu, cu, max_len, max_len)
    with _linear_boundaries(decoder, cu, n_rows * width):
        return inputs.run(decoder).reshape(n_rows, width, -1)


def _linear_boundaries(decoder, cu_seqlens: torch.Tensor, length: int):
    """Hybrid models: their linear-attention convolutions kept within the samples (`linear_conv`)."""
    return packed_conv_boundaries(decoder, cu_seqlens, length) if is_hybrid(decoder) else contextlib.nullcontext()


def _per_sample_hidden_states(decoder, batch: PackedBatch) -> torch.Tensor:
    device = batch.input_ids.device
    width = batch.input_ids.shape[1]
    if takes_flat_layout(decoder):  # dense models only (see _route): each sample alone, as one flat segment
        hidden = []
        for r, segs in enumerate(batch.segments):
            pieces = []
            for _, start, n in segs:
                cu = torch.tensor([0, n], dtype=torch.int32, device=device)
                pieces.append(FlatInputs(batch.input_ids[r, start:start + n], torch.arange(n, device=device), cu, cu,
                                         n, n).run(decoder))
            used = sum(n for _, _, n in segs)
            if used < width:
                pieces.append(pieces[0].new_zeros(width - used, pieces[0].shape[-1]))
            hidden.append(torch.cat(pieces))
        return torch.stack(hidden)
    rows = []
    for r, segs in enumerate(batch.segments):
        longest = max(n for _, _, n in segs)
        ids = torch.zeros((len(segs), longest), dtype=torch.long, device=device)
        for j, (_, start, n) in enumerate(segs):
            ids[j, :n] = batch.input_ids[r, start:start + n]
        # Plain causal positions and no mask: every row of this small batch is one sample, right-padded.
        pos = torch.arange(longest, device=device).expand(len(segs), -1)
        hidden = decoder(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        pieces = [hidden[j, :n] for j, (_, _, n) in enumerate(segs)]
        used = sum(n for _, _, n in segs)
        if used < width:
            pieces.append(hidden.new_zeros(width - used, hidden.shape[-1]))
        rows.append(torch.cat(pieces))
    return torch.stack(rows)


def packing_error(model, *, lengths: tuple[int, ...] = (7, 5, 3), hybrid_varlen: bool = False, seed: int = 0,
                  relative: bool = False) -> float:
    """Largest |packed - per-sample| hidden-state difference on a synthetic packed row (`relative`: over the
    largest |hidden state| of the per-sample reference, which makes one threshold fit every model scale and dtype).

    A training loop calls this once before its first step, on the real model and attention implementation: a
    kernel that ignores sample boundaries shows up here as an O(1) difference rather than as a quietly worse run.
    (On the hybrid per-sample path it is 0 by construction; there it is the varlen kernels that need checking.)
    """
    batch = _synthetic_row(model, lengths, seed)
    with torch.no_grad():
        packed = packed_hidden_states(model, batch, hybrid_varlen=hybrid_varlen)
        reference = _per_sample_hidden_states(_decoder(model), batch)
    real = batch.position_ids.new_zeros(batch.position_ids.shape, dtype=torch.bool)
    real[:, :batch.num_tokens] = True
    error = (packed[real].float() - reference[real].float()).abs().max()
    if relative:
        error = error / reference[real].float().abs().max().clamp_min(torch.finfo(torch.float32).tiny)
    return float(error)


def packed_backward_failure(model, *, lengths: tuple[int, ...] = (7, 5, 3), seed: int = 0) -> str | None:
    """Why a backward through the hybrid varlen path fails here (the error's first line), None if it runs.

    Some kernels run their forward but refuse their backward on some Triton and GPU pairs (flash-linear-attention
    0.6 on Hopper under Triton < 3.7.1); a run finds out here, before its first step, rather than mid-step.
    Gradients it leaves are cleared."""
    batch = _synthetic_row(model, lengths, seed)
    try:
        packed_hidden_states(model, batch, hybrid_varlen=True).float().square().mean().backward()
    except Exception as e:  # whatever the kernel raises; the caller decides what runs instead
        return (str(e).strip().splitlines() or [type(e).__name__])[0]
    finally:
        for p in model.parameters():
            p.grad = None
    return None


def _synthetic_row(model, lengths: tuple[int, ...], seed: int) -> PackedBatch:
    """Samples of random tokens with `lengths`, packed into one row with a padding tail."""
    from agentrl.train.pack import pack_samples
    from agentrl.sample import TrainingSample

    gen = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
        samples.append(TrainingSample(ids, [0] + [1] * (n - 1), [0.0] * n, [-1] + [0] * (n - 1)))
    return pack_samples(samples, sum(lengths) + 1).to(model.device)


def packed_token_logprobs(model, batch: PackedBatch, *, temperature: float = 1.0, chunk_size: int = 1024,
                          hybrid_varlen: bool = False, compile: bool | None = None,
                          pad_multiple: int = 1, graphs: FlatGraphs | None = None,
                          token_loss: Callable | None = None) -> tuple[torch.Tensor, ...]:
    """Logprob and entropy `[M]` of every trained target of `batch`, in `batch.trainable_tokens()` order; with
    `token_loss` (over those `M` tokens), the loss as well (`chunked_logprobs`).

    `pad_multiple` rounds the length of the flat layout, and `graphs` replays its forward and backward from CUDA
    graphs, padding it to their buckets (both used under a varlen attention implementation only)."""
    if _route(model, hybrid_varlen) == "flat":
        hidden, layout = _flat_hidden_states(_decoder(model), batch, pad_multiple, graphs)
        # layout.index is ascending and every trained position is a real token, so these rows come in the
        # row-major order of `hidden[loss_mask]` on the [R, T] layout. Found on the host when the batch kept its
        # host mask (no sync); else one device nonzero, which waits for the forward.
        rows = layout.trained
        if rows is None:
            rows = batch.loss_mask.to(hidden.device).reshape(-1)[layout.index].nonzero().squeeze(1)
        hidden, targets = hidden[rows], batch.target_ids.to(hidden.device).reshape(-1)[layout.index[rows]]
    else:
        hidden = packed_hidden_states(model, batch, hybrid_varlen=hybrid_varlen)
        mask = batch.loss_mask.to(hidden.device)
        hidden, targets = hidden[mask], batch.target_ids.to(hidden.device)[mask]
    return chunked_logprobs(hidden, lm_head_weight(model), targets, temperature=temperature, chunk_size=chunk_size,
                            compile=compile, token_loss=token_loss)
