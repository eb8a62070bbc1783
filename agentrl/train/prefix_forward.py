"""The forward of a prefix-shared batch (`prefix_pack.SharedBatch`): a tree mask, then the lm_head on head rows.

A unit's prefix attends causally to itself; each suffix attends to the whole prefix and causally to itself, never
to a sibling suffix. How that mask reaches the attention depends on the implementation:
- sdpa / eager (the CPU path): an explicit 4D mask `[R, 1, T, T]`, boolean for sdpa, additive for eager, which
  transformers' masking hands to every layer unchanged (a 4D mask is taken as already prepared);
- flex_attention (GPU): a `BlockMask` from a `mask_mod` over (segment id, branch id, position in the row), also
  passed through as is; blocks of sibling suffixes and of other units are skipped, not masked;
- a flat varlen implementation (`varlen_attention`, flash attention on GPU): varlen kernels take contiguous
  key ranges, so a tree is not one sequence to them. The prefix runs as a sequence of its own and every suffix
  as a query sequence whose keys are the prefix's followed by its own: the attention gathers those keys and
  values (`kv_index`), and the kernel's causal mask, aligned to the end of the keys when there are more keys than
  queries (flash attention's convention), lets suffix token j see the prefix and suffix tokens 0..j. The prefix's
  keys are read once per suffix (the attention work of unshared packing for those queries); its projections and
  MLPs, most of a layer, run once.
Hybrid (linear-attention) models share on the flat layout: their recurrent layers run the prefixes first, and
each suffix starts from its prefix's final state and convolution window (`linear_conv.packed_conv_boundaries` with
`tree`), which is what the suffix sees unshared after its own copy of the prefix. On the row layout (sdpa, CPU) they
are packed unshared. Models with sliding-window layers are not shared: transformers would build their second mask
from positions alone.

The lm_head then runs on the head rows (each distinct (position, target) once) and the loss entries gather their
logprob and entropy from them, so a shared prefix position trained for several members gets each member's
gradient through that gather, summed, exactly as unshared packing sums it over the members' copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from agentrl.train.flat_graphs import FlatGraphs, FlatInputs, Plan, RoundUp, boundaries, flat_forward
from agentrl.train.linear_conv import packed_conv_boundaries, tree_supported
from agentrl.train.lm_head import chunked_logprobs, lm_head_weight
from agentrl.train.logprobs import _check_attention, _decoder, is_hybrid, padded_row
from agentrl.train.prefix_pack import SharedBatch
from agentrl.train.varlen_attention import takes_flat_layout

TREE_MASK_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention")


def prefix_sharing_unsupported(model) -> str | None:
    """Why `model` must be trained on unshared packing, or None when the prefix-shared forward applies."""
    layer_types = getattr(model.config, "layer_types", None) or ()
    if is_hybrid(model):
        if not takes_flat_layout(model):
            return ("hybrid (linear-attention) layers share a prefix on the flat layout only (the varlen kernels), "
                    "where each suffix starts from its prefix's recurrent state")
        if not tree_supported(model):
            return "these linear-attention layers' convolution and delta rule cannot be given a prefix's state"
    if any(t not in ("full_attention", "linear_attention") for t in layer_types):
        return f"layer types {sorted(set(layer_types))}: only full-attention layers take the tree mask"
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if impl not in TREE_MASK_IMPLEMENTATIONS and not takes_flat_layout(model):
        return f"attention implementation {impl!r} takes no tree mask"
    return None


def tree_mask(batch: SharedBatch) -> torch.Tensor:
    """`[R, 1, T, T]` boolean: query t attends to key s of its segment at or before it, on the prefix or its own
    branch."""
    seg, branch = batch.segment_ids, batch.branch_ids
    width = seg.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=seg.device).tril()
    same = seg[:, :, None] == seg[:, None, :]
    visible = (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])
    return (same & visible & causal)[:, None]


def tree_block_mask(batch: SharedBatch):
    """The tree mask as flex_attention's block-sparse `BlockMask`."""
    from torch.nn.attention.flex_attention import create_block_mask

    seg, branch = batch.segment_ids, batch.branch_ids

    def mask_mod(b, h, q, k):
        visible = (branch[b, k] == 0) | (branch[b, k] == branch[b, q])
        return (seg[b, q] == seg[b, k]) & visible & (k <= q)

    n_rows, width = seg.shape
    return create_block_mask(mask_mod, B=n_rows, H=None, Q_LEN=width, KV_LEN=width, device=seg.device,
                             _compile=seg.device.type == "cuda")


@dataclass
class TreeFlatLayout:
    """A shared batch's real tokens laid end to end as one row `[1, length]`, as query and key sequences."""

    index: torch.Tensor  # [N] positions in the flattened [R * T] batch, ascending
    cu_q: torch.Tensor  # int32: query sequences (each prefix, each suffix, the tail) in the flat row
    cu_k: torch.Tensor  # int32: their key sequences in the gathered keys
    kv_index: torch.Tensor  # [K] flat-row position of every gathered key
    head_rows: torch.Tensor  # [H] flat-row position of every head row
    max_q: int
    max_k: int
    length: int  # N rounded up to the pad multiple
    q_lens: list[int] | None = None  # host: each query sequence's length ...
    parents: list[int] | None = None  # ... and the sequence it continues (a suffix: its prefix), or -1


def tree_flat_layout(batch: SharedBatch, pad_multiple: int = 1, padding: Plan | None = None) -> TreeFlatLayout:
    """Built on the host from the batch's units and head rows; crosses to the device in one copy. `padding`: how the
    row is padded (`flat_graphs`; default: the length rounded up to `pad_multiple`, the padding one segment)."""
    padding = padding or RoundUp(pad_multiple)
    width = batch.input_ids.shape[1]
    q_lens, kv_spans, parents = [], [], []  # per query sequence: its length, key spans (flat start, length), parent
    base = 0
    for units, fill in zip(batch.units, batch.row_tokens):
        for unit in units:
            prefix = (base + unit.start, unit.prefix_len)
            parent = len(q_lens) if unit.prefix_len else -1
            if unit.prefix_len:
                q_lens.append(unit.prefix_len)
                kv_spans.append([prefix])
                parents.append(-1)
            for offset, n in unit.suffixes():
                if n:
                    q_lens.append(n)
                    kv_spans.append([prefix, (base + offset, n)] if unit.prefix_len else [(base + offset, n)])
                    parents.append(parent)
        base += fill
    real = base
    k_lens = [sum(n for _, n in spans) for spans in kv_spans]
    plan = padding(real, len(q_lens), sum(k_lens), max(q_lens), max(k_lens))
    start = real
    for n in plan.tails:  # the padding: sequences of their own, so no real token attends to them
        q_lens.append(n)
        k_lens.append(n)
        kv_spans.append([(start, n)])
        parents.append(-1)
        start += n
    index = torch.cat([r * width + torch.arange(fill) for r, fill in enumerate(batch.row_tokens)])
    kv_index = torch.cat([torch.arange(s, s + n) for spans in kv_spans for s, n in spans])
    kv_index = torch.cat([kv_index, kv_index.new_zeros(plan.keys - kv_index.numel())])  # unused: never attended
    flat_of = torch.full((batch.input_ids.numel(),), -1, dtype=torch.long)
    flat_of[index] = torch.arange(real)
    head_rows = flat_of[batch.head_index.cpu()]
    parts = [index, torch.tensor(boundaries(q_lens, plan.segments)), torch.tensor(boundaries(k_lens, plan.segments)),
             kv_index, head_rows]
    host = torch.cat(parts)
    device = batch.input_ids.device
    if device.type == "cuda":
        host = host.pin_memory()
    moved = host.to(device, non_blocking=True).split([p.numel() for p in parts])
    return TreeFlatLayout(index=moved[0], cu_q=moved[1].int(), cu_k=moved[2].int(), kv_index=moved[3],
                          head_rows=moved[4], max_q=plan.max_q, max_k=plan.max_k, length=plan.length,
                          q_lens=q_lens + [0] * (plan.segments - len(q_lens)),
                          parents=parents + [-1] * (plan.segments - len(parents)))


def shared_head_hidden(model, batch: SharedBatch, pad_multiple: int = 1,
                       graphs: FlatGraphs | None = None) -> torch.Tensor:
    """Final hidden states `[H, hidden]` of the batch's head rows, in `head_index` order (the flat forward replayed
    from `graphs` where given)."""
    _check_attention(model)
    reason = prefix_sharing_unsupported(model)
    if reason is not None:
        raise ValueError(f"this model cannot run a prefix-shared batch: {reason}; pack it with pack_samples")
    decoder = _decoder(model)
    if takes_flat_layout(model):
        layout = tree_flat_layout(batch, pad_multiple, graphs.padding if graphs is not None else None)
        ids = batch.input_ids.reshape(-1)[layout.index]
        pos = batch.position_ids.reshape(-1)[layout.index]
        inputs = FlatInputs(*padded_row(ids, pos, layout.length), layout.cu_q, layout.cu_k, layout.max_q,
                            layout.max_k, layout.kv_index)
        if is_hybrid(model):  # the tree's layout is built per forward, outside any graph: these rows run eagerly
            with packed_conv_boundaries(decoder, layout.cu_q, layout.length, tree=(layout.q_lens, layout.parents)):
                return flat_forward(decoder, inputs, None)[layout.head_rows]
        return flat_forward(decoder, inputs, graphs)[layout.head_rows]
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if impl == "flex_attention":
        mask = tree_block_mask(batch)
    else:
        mask = tree_mask(batch)
        if impl == "eager":  # eager adds its mask to the scores
            dtype = next(model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    out = decoder(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=mask, use_cache=False)
    hidden = out.last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])[batch.head_index.to(hidden.device)]


def shared_token_logprobs(model, batch: SharedBatch, *, temperature: float = 1.0, chunk_size: int = 1024,
                          compile: bool | None = None, pad_multiple: int = 1, graphs: FlatGraphs | None = None,
                          token_loss: Callable | None = None) -> tuple[torch.Tensor, ...]:
    """Logprob and entropy `[M]` of every loss entry of `batch`, in `batch.trainable_tokens()` order: the lm_head
    runs once per head row, and the entries gather from it. With `token_loss` (over the `M` entries), the loss as
    well, its gradient taken in the lm_head's forward (`lm_head.chunked_logprobs`)."""
    hidden = shared_head_hidden(model, batch, pad_multiple, graphs)
    targets = batch.head_targets.to(hidden.device)
    entries = batch.entry_head.to(hidden.device)
    rows_loss = None if token_loss is None else HeadRowsLoss(token_loss, entries)
    out = chunked_logprobs(hidden, lm_head_weight(model), targets, temperature=temperature, chunk_size=chunk_size,
                           compile=compile, token_loss=rows_loss)
    logprobs, entropy = out[0][entries], out[1][entries]
    return (logprobs, entropy) if token_loss is None else (logprobs, entropy, out[2])


class HeadRowsLoss:
    """A loss over the entries, as terms of the head rows: a row's term is the sum of its entries' (a trained token
    of a shared history is one row for every member that trains on it, each with its own advantage). Each chunk
    evaluates every entry and keeps those of its rows: no host copy of the mapping, no device sync."""

    def __init__(self, token_loss: Callable, entry_head: torch.Tensor):
        self.token_loss, self.entry_head = token_loss, entry_head

    def __call__(self, logprobs: torch.Tensor, start: int, end: int) -> torch.Tensor:
        local = self.entry_head - start
        inside = (local >= 0) & (local < end - start)
        local = local.clamp(0, end - start - 1)
        terms = torch.where(inside, self.token_loss(logprobs[local]), 0.0)
        return logprobs.new_zeros(end - start, dtype=torch.float32).index_add(0, local, terms)


def prefix_sharing_error(model, *, seed: int = 0) -> float:
    """Largest relative difference, per sample, between a synthetic group's hidden states computed prefix-shared
    and packed unshared, on the real model and attention implementation.

    A kernel that reads the tree wrongly (a causal mask aligned to the start of the keys rather than their end)
    shows up as an O(1) difference; rounding in bf16 stays two orders below that. Members diverge at different
    depths, one equals the prefix, and a sample of another group shares the row. A hybrid's shared forward is also
    run backward once (the suffixes' gradients reach the prefix through its recurrent state, a kernel path the
    forward does not exercise): a kernel that cannot raises here, before a step relies on it."""
    from agentrl.sample import TrainingSample
    from agentrl.train.logprobs import packed_hidden_states
    from agentrl.train.pack import pack_samples
    from agentrl.train.prefix_pack import pack_shared

    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size

    def ids(n):
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    prompt = ids(23)
    histories = [prompt + ids(9), prompt + ids(4), prompt[:], prompt + ids(1), ids(6)]
    samples = [TrainingSample(h, [0] * len(h), [0.0] * len(h), [-1] * len(h), group_id=0 if k < 4 else 1)
               for k, h in enumerate(histories)]
    capacity = sum(len(h) for h in histories)
    shared = pack_shared(samples, capacity).to(model.device)
    unshared = pack_samples(samples, capacity).to(model.device)
    shared_loc, unshared_loc = token_locations(shared, samples), token_locations(unshared, samples)
    training = model.training
    model.eval()  # dropout, were there any, would differ between the two forwards
    try:
        with torch.no_grad():
            reference = packed_hidden_states(model, unshared, hybrid_varlen=is_hybrid(model)).reshape(
                -1, model.config.hidden_size)
            got = _all_hidden(model, shared)
        if is_hybrid(model):
            try:
                _all_hidden(model, shared).float().square().mean().backward()
            finally:
                for p in model.parameters():
                    p.grad = None
    finally:
        model.train(training)
    worst = 0.0
    for i in range(len(samples)):
        want, have = reference[unshared_loc[i]].float(), got[shared_loc[i]].float()
        worst = max(worst, float((have - want).abs().mean() / want.abs().mean().clamp(min=1e-12)))
    return worst


def _all_hidden(model, batch: SharedBatch) -> torch.Tensor:
    """Hidden states `[R * T, hidden]` of every position of a shared batch (for checks: every real position made a
    head row)."""
    everything = torch.arange(batch.input_ids.numel(), device=batch.input_ids.device)
    probe = SharedBatch(**{**batch.__dict__, "head_index": everything,
                           "head_targets": torch.zeros_like(everything)})
    return shared_head_hidden(model, probe)


def token_locations(batch, samples) -> list[torch.Tensor]:
    """For each sample, the position in the flattened `[R * T]` batch where each of its tokens is computed, for a
    `SharedBatch` or an unshared `PackedBatch` alike."""
    width = batch.input_ids.shape[1]
    out: list[torch.Tensor | None] = [None] * len(samples)
    if isinstance(batch, SharedBatch):
        for r, units in enumerate(batch.units):
            for unit in units:
                prefix = r * width + unit.start + torch.arange(unit.prefix_len)
                for i, (offset, n) in zip(unit.members, unit.suffixes()):
                    out[i] = torch.cat([prefix, r * width + offset + torch.arange(n)])
    else:
        for r, segs in enumerate(batch.segments):
            for i, start, n in segs:
                out[i] = r * width + start + torch.arange(n)
    return out
