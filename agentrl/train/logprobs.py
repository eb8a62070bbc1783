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

Chunked lm_head. Full logits for 25k packed tokens at a 152k vocabulary are 15 GiB in fp32; only trainable
positions need them, and only a chunk at a time. GEMMs run in the model dtype (tensor cores), softmax statistics
and gradient accumulation in fp32. Given the loss (`token_loss`, the trainer's way), the head takes the loss's
gradient in its forward while each chunk's logits exist (`ChunkedHeadLoss`); without it, the backward recomputes
each chunk's logits instead of storing them (`ChunkedLMHead`).
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


class ChunkedLMHead(torch.autograd.Function):
    """`(hidden [N, H], weight [V, H], targets [N]) -> (logprobs [N], entropy [N])`, both fp32, chunk by chunk.

    Only `[chunk, V]` logits exist at any time. The forward keeps each row's logsumexp and entropy; the backward
    recomputes the chunk's logits and accumulates the weight gradient into one fp32 buffer. Past the GEMMs the
    work is memory-bound passes over `[chunk, V]` fp32, which is why those two steps are plain functions that
    torch.compile fuses into one or two passes on GPU (time and memory against full fp32 logits: BENCHMARKS.md).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_size: int, compiled: bool):
        n = hidden.shape[0]
        stats, _ = _steps(compiled, hidden.device)
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        for s, e in chunk_bounds(n, chunk_size):
            logprobs[s:e], entropy[s:e], lse[s:e] = stats(_logits(hidden[s:e], weight), targets[s:e], 1.0 / temperature)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk_size, ctx.compiled = temperature, chunk_size, compiled
        # An unused output (entropy is usually only logged) then arrives as None and costs nothing in backward.
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        none = (None,) * 6
        if (grad_logprobs is None and grad_entropy is None) or not (need_hidden or need_weight):
            return none
        _, grad_step = _steps(ctx.compiled)
        chunk, inv_temp = ctx.chunk_size, 1.0 / ctx.temperature
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        for s, e in chunk_bounds(hidden.shape[0], chunk):
            g_lp = grad_logprobs[s:e] if grad_logprobs is not None else None
            g_ent = grad_entropy[s:e] if grad_entropy is not None else None
            gz = grad_step(_logits(hidden[s:e], weight), targets[s:e], lse[s:e], entropy[s:e], g_lp, g_ent, inv_temp,
                           weight.dtype)
            # The GEMMs run in the model dtype; .float() copies here would fall onto fp32 SIMT kernels, several
            # times slower than the tensor cores. fp32 survives where it matters: in
            # the softmax and in the buffer the weight gradient is summed into across chunks.
            if need_hidden:
                grad_hidden[s:e] = gz @ weight
            if need_weight:
                _accumulate(grad_weight, gz.t(), hidden[s:e])
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


class ChunkedHeadLoss(torch.autograd.Function):
    """`(hidden, weight, targets, ..., token_loss) -> (loss, logprobs, entropy)`: the chunked lm_head with the loss's
    gradient taken in the forward, while each chunk's logits exist.

    `token_loss(logprobs, start, end)` gives the terms of rows `start:end` from their logprobs, each a function of its
    own row only (`loss.TokenLoss`); the loss is their sum. Per chunk the forward computes the logits, their
    statistics, the terms' gradient with respect to the logprobs (autograd over the `[chunk]` terms), then the
    logits' gradient and from it the hidden states' and the weight's. The backward only scales those by the
    incoming gradient: the logits are computed once a step instead of twice (`ChunkedLMHead` recomputes them).
    Logprobs and entropy come out detached; the entropy carries no gradient on this path.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_size: int, compiled: bool, token_loss):
        n = hidden.shape[0]
        stats, grad_step = _steps(compiled, hidden.device)
        inv_temp = 1.0 / temperature
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        loss = hidden.new_zeros((), dtype=torch.float32)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        for s, e in chunk_bounds(n, chunk_size):
            logits = _logits(hidden[s:e], weight)
            lp, ent, lse = stats(logits, targets[s:e], inv_temp)
            logprobs[s:e], entropy[s:e] = lp, ent
            with torch.enable_grad():
                x = lp.detach().requires_grad_()
                terms = token_loss(x, s, e).sum()
                (g_lp,) = torch.autograd.grad(terms, x)
            loss += terms.detach()
            if need_hidden or need_weight:
                gz = grad_step(logits, targets[s:e], lse, ent, g_lp, None, inv_temp, weight.dtype)
                if need_hidden:
                    grad_hidden[s:e] = gz @ weight
                if need_weight:
                    _accumulate(grad_weight, gz.t(), hidden[s:e])
        ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype))
        ctx.mark_non_differentiable(logprobs, entropy)
        return loss, logprobs, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logprobs, _grad_entropy):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_loss.to(torch.float32)
        return (None if grad_hidden is None else grad_hidden * scale.to(grad_hidden.dtype),
                None if grad_weight is None else grad_weight * scale.to(grad_weight.dtype),
                None, None, None, None, None)


def chunk_bounds(n: int, size: int) -> list[tuple[int, int]]:
    """`[start, end)` of the chunks of `n` rows, `size` rows each; a last chunk of one row joins the one before.
    Compiled, a chunk of one row is a size dynamo specializes even in a dynamic graph (0/1 specialization): one more
    compile of both steps, in whichever training step first ends a micro-batch on one row."""
    bounds = [(s, min(s + size, n)) for s in range(0, n, size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor, inv_temp: float):
    """Per row: logprob of the target, entropy, logsumexp, of softmax(logits * inv_temp); all fp32."""
    z = logits * inv_temp
    lse = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - lse[:, None])
    return z.gather(1, targets[:, None]).squeeze(1) - lse, lse - (p * z).sum(-1), lse


def _chunk_grad(logits, targets, lse, entropy, grad_logprobs, grad_entropy, inv_temp: float, dtype: torch.dtype):
    """Gradient w.r.t. the raw logits, in `dtype`, from the saved logsumexp and entropy.

    d logprob / dz = onehot(target) - p;  d entropy / dz = -p * (z - (lse - entropy));  dz / dlogits = inv_temp.
    `p - onehot` is formed in fp32 before the cast: p_target near 1 would round the difference to 0 in bf16.
    """
    z = logits * inv_temp
    p = torch.exp(z - lse[:, None])
    grad = torch.zeros_like(z)
    if grad_logprobs is not None:
        onehot = torch.arange(z.shape[1], device=z.device)[None, :] == targets[:, None]
        grad = (p - onehot.to(z.dtype)) * (-grad_logprobs)[:, None]
    if grad_entropy is not None:
        grad = grad - p * (z - (lse - entropy)[:, None]) * grad_entropy[:, None]
    return (grad * inv_temp).to(dtype)


_COMPILED = {}


def compile_chunk_steps(**options) -> tuple[Callable, Callable]:
    """`_chunk_stats` and `_chunk_grad` compiled (`options` go to torch.compile), their row dimension dynamic from
    the first call: one compile serves every chunk of two rows or more. Left to dynamo's default, the first size
    seen compiled static and the next one compiled again, in whichever training step first met a second size (a
    first micro-batch of fewer trained tokens than a chunk made that a later step)."""

    def dynamic_rows(fn):
        compiled = torch.compile(fn, **options)

        def call(*args):
            for a in args:
                if isinstance(a, torch.Tensor):
                    torch._dynamo.maybe_mark_dynamic(a, 0)
            return compiled(*args)

        return call

    return dynamic_rows(_chunk_stats), dynamic_rows(_chunk_grad)


def _steps(compiled: bool, device: torch.device | None = None):
    """The chunk steps: eager, or compiled; on CUDA the statistics from one read of the logits (`head_kernels`)."""
    if not compiled:
        return _chunk_stats, _chunk_grad
    if not _COMPILED:
        _COMPILED["steps"] = compile_chunk_steps()
    stats, grad = _COMPILED["steps"]
    if device is not None and device.type == "cuda":
        from agentrl.train.head_kernels import online_stats_triton

        stats = online_stats_triton
    return stats, grad


_FP32_OUT = {}  # device type -> whether torch.mm / addmm take out_dtype there (CUDA in recent torch)


def _fp32_out(device: torch.device) -> bool:
    if device.type not in _FP32_OUT:
        try:
            a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
            c = torch.zeros(2, 2, dtype=torch.float32, device=device)
            torch.mm(a, a, out_dtype=torch.float32)
            torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
            _FP32_OUT[device.type] = bool(c[0, 0] == 2)
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUT[device.type] = False
    return _FP32_OUT[device.type]


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if hidden.dtype != torch.float32 and _fp32_out(hidden.device):
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)  # low-precision GEMM writing fp32 directly
    return (hidden @ weight.t()).float()


def _accumulate(buffer: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    """buffer (fp32) += a @ b, the product computed in a's dtype."""
    if a.dtype == torch.float32:
        buffer.addmm_(a, b)
    elif _fp32_out(a.device):
        torch.addmm(buffer, a, b, out_dtype=torch.float32, out=buffer)
    else:
        buffer.add_(a @ b)


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                     temperature: float = 1.0, chunk_size: int = 1024, compile: bool | None = None,
                     token_loss: Callable | None = None) -> tuple[torch.Tensor, ...]:
    """Per-row logprob of `targets` and entropy under `softmax(hidden @ weight.T / temperature)`, in fp32.

    `compile` (default: on CUDA) fuses the per-chunk softmax work with torch.compile; the CPU path runs the same
    functions eagerly. With `token_loss` (`loss.TokenLoss`, or any `(logprobs, start, end) -> terms` whose terms
    each depend on their own row), returns `(logprobs, entropy, loss)` instead: the loss (the terms' sum) carries
    the gradient, taken chunk by chunk in the forward (`ChunkedHeadLoss`), and the two others are detached.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match hidden rows {hidden.shape[0]}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but the lm_head weight is {weight.dtype}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    compiled = hidden.is_cuda if compile is None else compile
    if token_loss is None:
        return ChunkedLMHead.apply(hidden, weight, targets.long(), float(temperature), int(chunk_size), compiled)
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        logprobs, entropy = ChunkedLMHead.apply(hidden, weight, targets.long(), float(temperature),
                                                int(chunk_size), compiled)
        return logprobs, entropy, token_loss(logprobs, 0, hidden.shape[0]).sum()
    loss, logprobs, entropy = ChunkedHeadLoss.apply(hidden, weight, targets.long(), float(temperature),
                                                    int(chunk_size), compiled, token_loss)
    return logprobs, entropy, loss


def lm_head_weight(model) -> torch.Tensor:
    """The vocabulary projection, refusing heads the chunked path would compute wrongly (bias, logit scaling)."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("the chunked lm_head assumes a bias-free vocabulary projection")
    for name in ("final_logit_softcapping", "logit_scale"):
        if getattr(model.config, name, None) not in (None, 1.0):
            raise ValueError(f"the model's logits are post-processed ({name}); the chunked lm_head does not do that")
    weight = head.weight
    if _is_dtensor(weight):
        # Tensor parallelism keeps the vocabulary projection replicated: the local tensor is the whole matrix,
        # and to_local() carries the gradient back to the DTensor parameter.
        weight = weight.to_local()
    return weight


def _is_dtensor(t: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


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
