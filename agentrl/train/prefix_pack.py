"""Prefix-shared packing: a group's common prefix is laid out (and computed) once, its members' suffixes after it.

A rollout group's members start from the same prompt, and multi-turn members that diverge late share more than
that. `pack_shared` turns each group into one *unit*: one copy of the members' longest common prefix P (of token
ids), then every member's suffix S1..Sk. Position ids restart at 0 for P and continue from len(P) in every suffix,
so a suffix sees exactly the positions it had in its own sample; the forward (`prefix_forward`) lets each suffix
attend to P and to itself causally, never to another suffix (a tree mask). Units are then packed into rows by
first-fit decreasing as `pack.pack_samples` packs samples. A sample without a group (or alone in it) is a unit with
an empty prefix and one suffix, which is exactly what unshared packing makes of it.

Targets. One computed position can predict a different token for each member (the last position of P predicts
each member's first suffix token), and a trained token inside P (a multi-turn prefix can hold assistant turns
identical across members) belongs to several members with different advantages, behaviour logprobs and policy
versions. So targets are not per position here: the lm_head runs on *head rows* (position, target token), each
computed once, and the loss reads *entries* (one per member and trained token) that point at a head row, carrying
that member's advantage, behaviour logprob, version and sample index. Every member therefore contributes every
token it trains on exactly once, as in unshared packing: the GRPO per-sequence mean (grouped by `sample_index`),
the DAPO token count and Dr.GRPO's sample count are the same numbers, and the gradient is the sum of the same
terms (a shared prefix position collects its members' terms through the gather, where unshared packing would
collect them from k copies of the position). This was chosen over ending P before the first trained or
disagreeing token: that rule is simpler but loses the sharing of exactly the long multi-turn histories that gain
most from it.

Only the longest common prefix of a whole group is shared, not a prefix tree over its members: sampled members
diverge within a few tokens of the prompt, so subgroups sharing deeper prefixes are rare; `prefix_tree_tokens`
counts what a tree would add, and the trainer reports it so a run can tell whether a tree is worth building.

A group whose unit would not fit a row is split into consecutive runs of members that do, each sharing its own
(at least as long) common prefix, so a row never exceeds `row_tokens` (the fixed capacity `pack.py` explains).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from agentrl.sample import TrainingSample
from agentrl.train.pack import TrainableTokens, _to, first_fit_decreasing


@dataclass(frozen=True)
class Unit:
    """One segment of a row: the common prefix of `members` (sample indices), then each member's suffix."""

    members: tuple[int, ...]
    prefix_len: int
    suffix_lens: tuple[int, ...]
    start: int = 0  # where the unit begins in its row

    @property
    def length(self) -> int:
        return self.prefix_len + sum(self.suffix_lens)

    def suffixes(self):
        """(start in the row, length) of each member's suffix, in member order."""
        offset = self.start + self.prefix_len
        for n in self.suffix_lens:
            yield offset, n
            offset += n


@dataclass
class SharedBatch:
    """`R` rows of width `T` holding units; the lm_head rows and the loss entries that point at them.

    Per-token tensors are `[R, T]`: `segment_ids` number the units of a row (the padding tail is one more segment),
    `branch_ids` are 0 on a unit's prefix and j >= 1 on its j-th suffix. A query attends to a key of the same
    segment at or before it whose branch is 0 or its own.

    `head_index[h]` is the position in the flattened `[R * T]` batch whose hidden state predicts `head_targets[h]`
    (ascending; one row per distinct position and target). `tokens` are the loss entries and `entry_head[m]` the
    head row of entry `m`; `entry_token[m]` is the index, in its own sample, of the token entry `m` trains on.
    Head rows and entries come row by row: row `r`'s begin at `head_offsets[r]` / `entry_offsets[r]`.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    branch_ids: torch.Tensor
    head_index: torch.Tensor  # [H] long
    head_targets: torch.Tensor  # [H] long
    tokens: TrainableTokens  # [M] entries
    entry_head: torch.Tensor  # [M] long
    entry_token: torch.Tensor  # [M] long
    head_offsets: list[int]  # R + 1
    entry_offsets: list[int]  # R + 1
    rows: list[list[int]]  # samples of each row, unit by unit
    units: list[list[Unit]]
    row_tokens: list[int]  # real tokens laid out (and computed) in each row
    row_unshared_tokens: list[int]  # what unshared packing would lay out for the same samples
    num_samples: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    @property
    def num_tokens(self) -> int:
        return sum(self.row_tokens)

    @property
    def unshared_tokens(self) -> int:
        return sum(self.row_unshared_tokens)

    @property
    def num_trainable(self) -> int:
        return len(self.tokens)

    def trainable_tokens(self) -> TrainableTokens:
        return self.tokens

    def select_rows(self, start: int, stop: int) -> "SharedBatch":
        """Rows `[start, stop)` as a batch of their own (a micro-batch). Units never straddle rows, and
        `sample_index` keeps pointing into the whole batch's samples."""
        width = self.input_ids.shape[1]
        h0, h1 = self.head_offsets[start], self.head_offsets[stop]
        e0, e1 = self.entry_offsets[start], self.entry_offsets[stop]
        tokens = TrainableTokens(**{k: (v[e0:e1] if isinstance(v, torch.Tensor) else v)
                                    for k, v in self.tokens.__dict__.items()})
        return SharedBatch(
            input_ids=self.input_ids[start:stop], position_ids=self.position_ids[start:stop],
            segment_ids=self.segment_ids[start:stop], branch_ids=self.branch_ids[start:stop],
            head_index=self.head_index[h0:h1] - start * width, head_targets=self.head_targets[h0:h1],
            tokens=tokens, entry_head=self.entry_head[e0:e1] - h0, entry_token=self.entry_token[e0:e1],
            head_offsets=[h - h0 for h in self.head_offsets[start:stop + 1]],
            entry_offsets=[e - e0 for e in self.entry_offsets[start:stop + 1]],
            rows=self.rows[start:stop], units=self.units[start:stop], row_tokens=self.row_tokens[start:stop],
            row_unshared_tokens=self.row_unshared_tokens[start:stop], num_samples=self.num_samples,
        )

    def to(self, device) -> "SharedBatch":
        moved = {k: (_to(v, device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        moved["tokens"] = self.tokens.to(device)
        return SharedBatch(**moved)


# ------------------------------------------------------------------------------------------------- planning


def longest_common_prefix(sequences: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix every sequence starts with."""
    if not sequences:
        return 0
    first, n = sequences[0], min(len(s) for s in sequences)
    for other in sequences[1:]:
        n = _common(first, other, n)
    return n


def _common(a: Sequence[int], b: Sequence[int], n: int) -> int:
    """Longest common prefix of `a` and `b`, at most `n`: a bisection over slice comparisons, which run in C
    (a token-by-token loop in Python costs more than the packing itself on long prompts)."""
    a, b = list(a), list(b)
    n = min(n, len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def prefix_tree_tokens(sequences: Sequence[Sequence[int]]) -> int:
    """Tokens a prefix tree (trie) over `sequences` holds: each distinct prefix once. Sorted, every sequence shares
    with the tree built so far exactly its longest common prefix with its predecessor."""
    ordered = sorted(tuple(s) for s in sequences)
    shared = sum(longest_common_prefix([a, b]) for a, b in zip(ordered, ordered[1:]))
    return sum(len(s) for s in ordered) - shared


def groups_of(samples: Sequence[TrainingSample]) -> list[list[int]]:
    """Sample indices by `group_id`, groups and members in order of first appearance; no group id: alone."""
    by_key: dict = {}
    out: list[list[int]] = []
    for i, s in enumerate(samples):
        if s.group_id is None:
            out.append([i])
            continue
        if s.group_id not in by_key:
            by_key[s.group_id] = len(out)
            out.append([])
        out[by_key[s.group_id]].append(i)
    return out


def _unit(samples: Sequence[TrainingSample], members: list[int], shared: int) -> Unit:
    shared = shared if len(members) > 1 else 0
    return Unit(tuple(members), shared, tuple(len(samples[i]) - shared for i in members))


def plan_units(samples: Sequence[TrainingSample], row_tokens: int) -> list[Unit]:
    """Each group as one unit sharing its members' common prefix, split into consecutive runs of members where
    the whole would not fit a row; members that share nothing stay samples of their own (packing them apart
    leaves first-fit decreasing more freedom at no cost)."""
    units: list[Unit] = []
    for members in groups_of(samples):
        run: list[int] = []
        shared = 0  # the run's common prefix: adding a member can only shorten it
        for i in members:
            if len(samples[i]) > row_tokens:  # refused with the same message as unshared packing
                first_fit_decreasing([len(samples[i])], row_tokens)
            if run:
                bound = shared if len(run) > 1 else len(samples[run[0]])
                joined = _common(samples[run[0]].input_ids, samples[i].input_ids, bound)
                if _unit(samples, run + [i], joined).length <= row_tokens:
                    run.append(i)
                    shared = joined
                    continue
                units.extend(_split_if_unshared(samples, _unit(samples, run, shared)))
            run, shared = [i], 0
        if run:
            units.extend(_split_if_unshared(samples, _unit(samples, run, shared)))
    return units


def _split_if_unshared(samples, unit: Unit) -> list[Unit]:
    if unit.prefix_len == 0 and len(unit.members) > 1:
        return [Unit((i,), 0, (n,)) for i, n in zip(unit.members, unit.suffix_lens)]
    return [unit]


# -------------------------------------------------------------------------------------------------- packing


def pack_shared(samples: Sequence[TrainingSample], row_tokens: int, *, pad_token_id: int = 0,
                pad_to_multiple: int = 1, units: list[Unit] | None = None) -> SharedBatch:
    """Pack `samples` with each group's common prefix laid out once (see the module docstring); rows hold at most
    `row_tokens` real tokens, the width is the fullest row rounded up to `pad_to_multiple` as in `pack_samples`.
    `units`: `plan_units(samples, row_tokens)` if the caller has it already."""
    if not samples:
        raise ValueError("pack_shared needs at least one sample")
    for sample in samples:
        sample.validate()
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    units = units if units is not None else plan_units(samples, row_tokens)
    placement = first_fit_decreasing([u.length for u in units], row_tokens)
    fill = [sum(units[u].length for u in row) for row in placement]
    width = -(-max(fill) // pad_to_multiple) * pad_to_multiple
    n_rows = len(placement)

    # Laid out in numpy and turned into tensors once, as in `pack.pack_samples` (why: there).
    input_ids = np.full((n_rows, width), pad_token_id, dtype=np.int64)
    position_ids = np.zeros((n_rows, width), dtype=np.int64)
    segment_ids = np.zeros((n_rows, width), dtype=np.int64)
    branch_ids = np.zeros((n_rows, width), dtype=np.int64)
    heads = _Collector()
    head_offsets, entry_offsets, rows, row_units, unshared = [0], [0], [], [], []

    for r, row in enumerate(placement):
        start, placed = 0, []
        for seg, u in enumerate(row):
            unit = dataclasses.replace(units[u], start=start)
            end = _lay_out(samples, unit, r, seg, input_ids, position_ids, segment_ids, branch_ids,
                           heads, flat_start=r * width + start)
            placed.append(unit)
            start = end
        if start < width:  # the padding tail: a segment of its own, positions 0, 1, ...
            position_ids[r, start:] = np.arange(width - start)
            segment_ids[r, start:] = len(row)
        head_offsets.append(heads.num_heads)
        entry_offsets.append(heads.num_entries)
        rows.append([i for unit in placed for i in unit.members])
        row_units.append(placed)
        unshared.append(sum(len(samples[i]) for i in rows[-1]))

    head_index, head_targets, tokens, entry_head, entry_token = heads.tensors(len(samples))
    t = torch.from_numpy
    return SharedBatch(
        input_ids=t(input_ids), position_ids=t(position_ids), segment_ids=t(segment_ids), branch_ids=t(branch_ids),
        head_index=head_index, head_targets=head_targets, tokens=tokens, entry_head=entry_head,
        entry_token=entry_token, head_offsets=head_offsets, entry_offsets=entry_offsets, rows=rows,
        units=row_units, row_tokens=fill, row_unshared_tokens=unshared, num_samples=len(samples),
    )


def _lay_out(samples, unit: Unit, r: int, seg: int, input_ids, position_ids, segment_ids, branch_ids,
             heads: "_Collector", flat_start: int) -> int:
    """Write `unit` into row `r` from `unit.start`, and its head rows and entries; returns where it ends."""
    members = [samples[i] for i in unit.members]
    n_prefix, s = unit.prefix_len, unit.start
    end = s + unit.length
    segment_ids[r, s:end] = seg
    if n_prefix:
        input_ids[r, s:s + n_prefix] = members[0].input_ids[:n_prefix]
        position_ids[r, s:s + n_prefix] = np.arange(n_prefix)
        # Prefix positions 0..L-2 predict prefix tokens 1..L-1: the same target for every member, trained for
        # those whose loss mask says so; one head row per position any member trains on, one entry per member.
        trained = np.array([m.trainable[1:n_prefix] for m in members], dtype=bool).reshape(
            len(members), n_prefix - 1)
        positions = np.flatnonzero(trained.any(0))
        entries = np.argwhere(trained.T)  # (position, member), position-major as the head rows come
        targets = np.asarray(members[0].input_ids[1:n_prefix], dtype=np.int64)
        heads.add(flat_start + positions, targets[positions])
        heads.add_entries(samples, unit.members, entries[:, 1], entries[:, 0] + 1,
                          np.searchsorted(positions, entries[:, 0]))
        # The seam: the last prefix position predicts each member's first suffix token; one head row per
        # distinct token, in the order members first need it.
        seam = [(j, m.input_ids[n_prefix]) for j, m in enumerate(members)
                if len(m) > n_prefix and m.trainable[n_prefix]]
        distinct = list(dict.fromkeys(t for _, t in seam))
        heads.add(np.full(len(distinct), flat_start + n_prefix - 1, dtype=np.int64),
                  np.array(distinct, dtype=np.int64))
        heads.add_entries(samples, unit.members, np.array([j for j, _ in seam], dtype=np.int64),
                          np.full(len(seam), n_prefix, dtype=np.int64),
                          np.array([distinct.index(t) for _, t in seam], dtype=np.int64))
    offset = s + n_prefix
    for j, m in enumerate(members):
        n = len(m) - n_prefix
        if n == 0:
            continue
        input_ids[r, offset:offset + n] = m.input_ids[n_prefix:]
        position_ids[r, offset:offset + n] = np.arange(n_prefix, len(m))
        branch_ids[r, offset:offset + n] = j + 1
        # Suffix position q predicts the member's token n_prefix + q + 1; its last position predicts nothing.
        positions = np.flatnonzero(np.asarray(m.trainable[n_prefix + 1:], dtype=bool))
        targets = np.asarray(m.input_ids[n_prefix + 1:], dtype=np.int64)
        heads.add(flat_start + (offset - s) + positions, targets[positions])
        heads.add_entries(samples, unit.members, np.full(positions.size, j, dtype=np.int64),
                          positions + n_prefix + 1, np.arange(positions.size))
        offset += n
    return end


class _Collector:
    """Head rows and loss entries as they are laid out; `add_entries` refers to the head rows of the last `add`."""

    def __init__(self):
        self.head_index, self.head_targets, self.num_heads = [], [], 0
        self.sample_index, self.token_index, self.behaviour, self.versions, self.advantages = [], [], [], [], []
        self.entry_head, self.num_entries = [], 0
        self._last = 0

    def add(self, flat_positions: np.ndarray, targets: np.ndarray) -> None:
        self._last = self.num_heads
        self.head_index.append(flat_positions.astype(np.int64, copy=False))
        self.head_targets.append(targets.astype(np.int64, copy=False))
        self.num_heads += targets.size

    def add_entries(self, samples, members, member: np.ndarray, token: np.ndarray, head: np.ndarray):
        """Entries for `members[member[e]]`'s token `token[e]`, predicted by head row `head[e]` of the last add."""
        if member.size == 0:
            return
        owners = [members[j] for j in member.tolist()]
        tokens = token.tolist()
        self.sample_index.extend(owners)
        self.token_index.extend(tokens)
        self.behaviour.extend(samples[i].behaviour_logprobs[t] for i, t in zip(owners, tokens))
        self.versions.extend(samples[i].versions[t] for i, t in zip(owners, tokens))
        self.advantages.extend(float(samples[i].advantage) for i in owners)
        self.entry_head.append(head.astype(np.int64, copy=False) + self._last)
        self.num_entries += member.size

    def tensors(self, num_samples: int):
        """(head_index, head_targets, TrainableTokens, entry_head, entry_token)."""
        def cat(parts):
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

        head_targets, entry_head = cat(self.head_targets), cat(self.entry_head)
        t = torch.from_numpy
        tokens = TrainableTokens(
            target_ids=t(head_targets[entry_head]),
            behaviour_logprobs=t(np.array(self.behaviour, dtype=np.float32)),
            advantages=t(np.array(self.advantages, dtype=np.float32)),
            versions=t(np.array(self.versions, dtype=np.int64)),
            sample_index=t(np.array(self.sample_index, dtype=np.int64)), num_samples=num_samples)
        return t(cat(self.head_index)), t(head_targets), tokens, t(entry_head), t(np.array(self.token_index,
                                                                                           dtype=np.int64))
