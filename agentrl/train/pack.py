"""First-fit-decreasing packing of samples into fixed-capacity rows, with every per-token tensor the loss needs.

Padding a batch to its longest sample wastes the forward on pad tokens (up to a third of it on mixed lengths),
and padded batches of long rollouts do not fit at all; packing several samples into one row removes that.
Position ids restart at 0 at every sample, which is what lets the model tell the samples apart without an
attention mask (see `logprobs.packed_hidden_states`).

Shift convention: every "target-side" tensor is indexed by the position whose output predicts it, so
`target_ids[r, t]` is the token at `t + 1`, and `loss_mask[r, t]` says whether that token is trained on. The
last position of each sample predicts nothing (mask 0, target 0), so the shifted loss never reads across a
seam: a sample's first token is never the target of the previous sample's last position.

Rollout groups whose members share a prompt are packed by `prefix_pack` instead where the model allows it (the
trainer's default for dense models): each group's common prefix once, its members' suffixes after it.

A sample longer than `row_tokens` raises: giving it a row of its own would make the widest row, and with it the
step's memory peak, depend on which rollouts happened to finish, which is exactly the run-to-run OOM that a fixed
capacity is there to prevent. The config checks `row_tokens >= max_sample_tokens` up front.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from agentrl.sample import TrainingSample


@dataclass
class TrainableTokens:
    """The loss's view of a batch: one entry per trained target token, in row-major order of the packed rows.

    `sample_index[i]` is the index (into the packed samples) of the sample token `i` belongs to; the GRPO
    per-sequence mean groups by it.
    """

    target_ids: torch.Tensor  # [M] long
    behaviour_logprobs: torch.Tensor  # [M] float32
    advantages: torch.Tensor  # [M] float32
    versions: torch.Tensor  # [M] long
    sample_index: torch.Tensor  # [M] long
    num_samples: int

    def __len__(self) -> int:
        return int(self.target_ids.shape[0])

    def to(self, device) -> "TrainableTokens":
        return TrainableTokens(**{k: (_to(v, device) if isinstance(v, torch.Tensor) else v)
                                  for k, v in self.__dict__.items()})


def _to(t: torch.Tensor, device) -> torch.Tensor:
    """Host to GPU through pinned memory, without blocking: a pageable copy makes the host wait until the device
    has finished everything queued before it (the previous micro-batch's backward, the engine's decode steps)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class PackedBatch:
    """`R` rows of width `T`. Per-token tensors are `[R, T]`; target-side ones follow the module's shift convention.

    `cu_seqlens[r]` (int32) holds the cumulative boundaries of row `r`'s segments: every sample, then the padding
    tail as one more segment when the row is not full, so `cu_seqlens[r][-1] == T` as varlen kernels expect.
    `rows[r]` lists the indices (into the packed samples) of the samples in row `r`, left to right, and
    `segments[r]` their `(sample_index, start, length)`.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    target_ids: torch.Tensor
    loss_mask: torch.Tensor  # bool
    behaviour_logprobs: torch.Tensor  # float32
    advantages: torch.Tensor  # float32
    versions: torch.Tensor  # long, -1 where not trained
    sample_index: torch.Tensor  # long, sample owning the target; -1 on padding / untrained positions
    cu_seqlens: list[torch.Tensor]
    rows: list[list[int]]
    segments: list[list[tuple[int, int, int]]]
    num_samples: int
    num_tokens: int  # real (non-pad) tokens
    host_loss_mask: torch.Tensor | None = None  # the CPU loss mask, kept by `to()`: indices from it need no sync

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    @property
    def num_trainable(self) -> int:
        return int(self.loss_mask.sum())

    def trainable_tokens(self) -> TrainableTokens:
        m = self.loss_mask
        return TrainableTokens(
            target_ids=self.target_ids[m], behaviour_logprobs=self.behaviour_logprobs[m],
            advantages=self.advantages[m], versions=self.versions[m], sample_index=self.sample_index[m],
            num_samples=self.num_samples,
        )

    def flat_cu_seqlens(self) -> torch.Tensor:
        """Boundaries of every segment once the rows are laid end to end as one `[1, R*T]` row (varlen kernels)."""
        width = self.input_ids.shape[1]
        parts = [self.cu_seqlens[0]]
        for r in range(1, len(self.cu_seqlens)):
            parts.append(self.cu_seqlens[r][1:] + r * width)
        return torch.cat(parts)

    def select_rows(self, start: int, stop: int) -> "PackedBatch":
        """Rows `[start, stop)` as a batch of their own (a micro-batch). Samples never straddle rows, so every
        sample's tokens stay together and `sample_index` keeps pointing into the whole batch's samples."""
        fields = {k: (v[start:stop] if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        fields.update(cu_seqlens=self.cu_seqlens[start:stop], rows=self.rows[start:stop],
                      segments=self.segments[start:stop],
                      num_tokens=sum(length for row in self.segments[start:stop] for _, _, length in row))
        return PackedBatch(**fields)

    def to(self, device) -> "PackedBatch":
        moved = {k: (_to(v, device) if isinstance(v, torch.Tensor) and k != "host_loss_mask" else v)
                 for k, v in self.__dict__.items()}
        moved["cu_seqlens"] = [_to(c, device) for c in self.cu_seqlens]
        moved["host_loss_mask"] = self.loss_mask if self.loss_mask.device.type == "cpu" else self.host_loss_mask
        return PackedBatch(**moved)


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Assign items to bins of `capacity`: longest first, each into the first bin with room.

    Ties are broken by index so the layout is a pure function of the lengths (every rank of a replica group
    packing the same samples gets the same rows). Within a bin, items keep the order they were placed in.
    """
    if capacity < 1:
        raise ValueError(f"row capacity must be >= 1 token, got {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(
                f"sample {i} has {n} tokens, more than a row holds (row_tokens={capacity}); raise row_tokens or "
                f"cap the rollout length (rollout.max_sample_tokens) below it"
            )
        for b, free in enumerate(room):
            if free >= n:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def pack_samples(samples: Sequence[TrainingSample], row_tokens: int, *, pad_token_id: int = 0,
                 pad_to_multiple: int = 1) -> PackedBatch:
    """Pack `samples` into rows of at most `row_tokens` real tokens (first-fit decreasing).

    The width `T` is the fullest row's length rounded up to `pad_to_multiple` (so it can exceed `row_tokens` by
    at most `pad_to_multiple - 1` pad tokens); fixed multiples keep compiled kernels from re-specialising on every
    batch. Padding takes positions 0, 1, ... of its own, so it forms one more segment that attends only to itself.
    """
    if not samples:
        raise ValueError("pack_samples needs at least one sample")
    for sample in samples:  # a rollout's Trajectory is built token by token and checked here
        sample.validate()
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    rows = first_fit_decreasing([len(s) for s in samples], row_tokens)
    fill = [sum(len(samples[i]) for i in row) for row in rows]
    width = -(-max(fill) // pad_to_multiple) * pad_to_multiple

    # Laid out in numpy and turned into tensors once: a torch call on a small slice lets go of the GIL and must win
    # it back, which beside the engine's thread (a training run) costs far more than the copy.
    n_rows = len(rows)
    input_ids = np.full((n_rows, width), pad_token_id, dtype=np.int64)
    position_ids = np.zeros((n_rows, width), dtype=np.int64)
    target_ids = np.zeros((n_rows, width), dtype=np.int64)
    loss_mask = np.zeros((n_rows, width), dtype=bool)
    behaviour = np.zeros((n_rows, width), dtype=np.float32)
    advantages = np.zeros((n_rows, width), dtype=np.float32)
    versions = np.full((n_rows, width), -1, dtype=np.int64)
    sample_index = np.full((n_rows, width), -1, dtype=np.int64)
    cu_seqlens, segments = [], []

    for r, row in enumerate(rows):
        start, bounds, segs = 0, [0], []
        for i in row:
            s = samples[i]
            n = len(s)
            end = start + n
            input_ids[r, start:end] = s.input_ids
            position_ids[r, start:end] = np.arange(n)
            # Target side: position t predicts token t + 1 of the same sample; the sample's last position is
            # left at mask 0 so nothing is predicted across the seam into the next sample.
            if n > 1:
                t0, t1 = start, end - 1
                target_ids[r, t0:t1] = s.input_ids[1:]
                mask = np.asarray(s.trainable[1:], dtype=bool)
                loss_mask[r, t0:t1] = mask
                behaviour[r, t0:t1] = np.asarray(s.behaviour_logprobs[1:], dtype=np.float32) * mask
                advantages[r, t0:t1] = np.float32(s.advantage) * mask
                versions[r, t0:t1] = np.where(mask, np.asarray(s.versions[1:], dtype=np.int64), -1)
                sample_index[r, t0:t1] = np.where(mask, i, -1)
            segs.append((i, start, n))
            bounds.append(end)
            start = end
        if start < width:
            position_ids[r, start:] = np.arange(width - start)
            bounds.append(width)
        cu_seqlens.append(torch.tensor(bounds, dtype=torch.int32))
        segments.append(segs)

    t = torch.from_numpy
    return PackedBatch(
        input_ids=t(input_ids), position_ids=t(position_ids), target_ids=t(target_ids), loss_mask=t(loss_mask),
        behaviour_logprobs=t(behaviour), advantages=t(advantages), versions=t(versions),
        sample_index=t(sample_index), cu_seqlens=cu_seqlens, rows=rows, segments=segments,
        num_samples=len(samples), num_tokens=sum(fill),
    )
