"""Resume points of the prefix cache for hybrid models: linear-attention state snapshots attached to pages.

A cached page restores the KV of the full-attention layers, but a linear-attention layer's state after a prefix
is a recurrence over all of it, which no page holds. So while a sequence is computed, the state at the deepest
page boundary each step reaches (a prefill chunk's end or the boundary inside it, and every page a decode
fills) is copied into a snapshot slot attached to the page that ends at that boundary (`LinearStates.plan`).
A later sequence whose prefix hits the cache resumes from the deepest hit page that has a snapshot: its
state is copied from the snapshot and only the tokens after that page are prefilled. The scheduler truncates
every hit to such a page (`Scheduler.resumable`).

Why a separate pool rather than one snapshot per page: a snapshot is the whole state of every linear layer,
which for Qwen3.5 shapes weighs as much as many pages of KV (`LinearStates.bytes_per_state` against
`KVStorage.bytes_per_page`). So snapshots are few (`EngineConfig.state_snapshots`) and kept where they pay:
a sequence's newest one is what its next turn resumes from, so taking a new one moves the sequence's previous
one to the front of the eviction order; otherwise the least recently taken or used goes first. A snapshot
lives at most as long as its page's content: the page pool calls `drop` when it forgets a page (freed
unregistered, evicted, unregistered on a cache clear or a release of the pool, or left private because
another page holds its key).

Snapshots are written by device work queued in step order (a restore copies out before the forward, a
snapshot is written in or after it), so a snapshot evicted and taken again by a later step is overwritten
only after every earlier read of it. Within one step no snapshot is taken twice (`begin_step`).
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class StateSnapshots:
    def __init__(self, states, capacity: int):
        self.states = states
        self.capacity = capacity
        self.conv, self.recurrent = states.allocate(capacity)
        self._index_of: OrderedDict[int, int] = OrderedDict()  # page -> snapshot index; first evicted first
        self._free = list(range(capacity - 1, -1, -1))
        self._taken_now: set[int] = set()  # pages whose snapshot the step being planned writes
        self._taker: dict[int, int] = {}  # page -> request id of the sequence that took its snapshot
        self._saved = None
        self.taken = 0
        self.evicted = 0

    @property
    def nbytes(self) -> int:
        return self.capacity * self.states.bytes_per_state

    def __len__(self) -> int:
        return len(self._index_of)

    def has(self, page: int) -> bool:
        return page in self._index_of

    def index(self, page: int) -> int:
        """The snapshot of `page`, which a sequence is about to resume from: it moves to the back of the
        eviction order."""
        self._index_of.move_to_end(page)
        return self._index_of[page]

    def begin_step(self) -> None:
        self._taken_now.clear()

    def take(self, page: int, seq) -> int:
        """A snapshot index for the state at the end of `page` (computed by `seq` in the step being planned),
        or -1 when every snapshot is written by this step. The sequence's previous snapshot is evicted first
        from now on: its next turn resumes from the newest."""
        if page in self._index_of:
            self.drop(page)
        if not self._free:
            victim = next((p for p in self._index_of if p not in self._taken_now), None)
            if victim is None:
                return -1
            self.drop(victim)
            self.evicted += 1
        index = self._free.pop()
        self._index_of[page] = index
        self._taken_now.add(page)
        previous = seq.snapshot_page
        if previous is not None and self._taker.get(previous) == seq.request_id and previous in self._index_of:
            self._index_of.move_to_end(previous, last=False)
        seq.snapshot_page = page
        self._taker[page] = seq.request_id
        self.taken += 1
        return index

    def drop(self, page: int) -> None:
        self._taker.pop(page, None)
        index = self._index_of.pop(page, None)
        if index is not None:
            self._free.append(index)

    def clear(self) -> None:
        for page in list(self._index_of):
            self.drop(page)

    def check(self, pool) -> None:
        """Invariants, for tests: every snapshot index is used once or free, and every snapshot belongs to a page
        whose content `pool` still vouches for (registered, or held by a sequence)."""
        used = list(self._index_of.values())
        assert len(set(used)) == len(used) and not set(used) & set(self._free)
        assert len(used) + len(self._free) == self.capacity
        live = {p for p, r in enumerate(pool.refs) if r > 0}
        assert set(self._index_of) <= set(pool._key_of) | live, set(self._index_of) - set(pool._key_of) - live

    # -- memory --------------------------------------------------------------------------------------
    def release(self) -> int:
        """Copy the snapshots still attached to pages to host memory and free the device tensors (the pool
        has already dropped those of pages it does not keep). Returns the bytes saved."""
        if self.conv is None:
            return 0
        index = torch.tensor(sorted(self._index_of.values()), dtype=torch.long, device=self.conv.device)
        saved = (self.conv.index_select(1, index).cpu(), self.recurrent.index_select(1, index).cpu())
        self._saved = (index.cpu(), *saved)
        self.conv = self.recurrent = None
        return sum(t.numel() * t.element_size() for t in saved)

    def restore(self) -> None:
        if self.conv is not None:
            return
        self.conv, self.recurrent = self.states.allocate(self.capacity)
        if self._saved is not None:
            index, conv, recurrent = self._saved
            index = index.to(self.conv.device)
            self.conv.index_copy_(1, index, conv.to(self.conv.device))
            self.recurrent.index_copy_(1, index, recurrent.to(self.recurrent.device))
            self._saved = None
