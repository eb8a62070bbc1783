"""Which tokens of which sequences run in the next forward step, and what happens to them after.

Each step, in order:
1. decode: every running sequence with one pending token (the last one sampled) gets it fed. A decode that
   needs a new page and finds none preempts the most recently admitted sequence (recompute: its pages go
   back to the pool, registered ones stay cached, and it rejoins the front of the queue with its generated
   tokens as prompt), until the page is found or the sequence itself was the one preempted;
2. prefill: running sequences part way through their prompt continue in chunks, then waiting sequences
   are admitted in arrival order while `max_num_seqs`, the step's token budget and the pool allow. A
   sequence is admitted only if the pool can take its whole remaining prompt now, so admissions do not
   stall half way and thrash; its longest cached prefix of full pages is mapped, never its last token,
   which must run to yield logits. For a hybrid model (`resumable` set) the prefix is cut back to the deepest
   page with a linear-attention state snapshot, which the sequence resumes from (`Sequence.resume_page`).
   A waiting sequence whose next uncached page is a prompt page that a running sequence is computing (the members
   of a group sharing their prompt, submitted together) waits, letting others behind it in, until that page is
   cached: the shared prompt is computed once, not once per member admitted in the same step.
Prefill chunks share the step with decodes, so a long prompt never stalls the sequences already decoding.

The engine schedules step n+1 while step n still runs on the device, so a sequence's last token may be a
placeholder whose value arrives with step n's results (`Sequence.unresolved` counts such trailing tokens). The
scheduler needs only lengths for its decisions; it feeds a placeholder only as a decode (the device takes the
value from step n's output), never admits a sequence that still has one, and leaves alone a sequence whose
pending token already reached a length limit (`final`: it finishes when that token resolves).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from agentrl.engine.kv_pool import PagePool, chain_keys
from agentrl.engine.types import SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Sequence:
    request_id: int
    prompt_len: int
    tokens: list[int]  # prompt, then generated tokens
    params: SamplingParams
    stop_ids: frozenset[int]
    callback: object = None
    seed: int = 0  # of the request's counter-based draws (see sampler.py)
    status: str = WAITING
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in `pages`
    num_registered: int = 0  # leading pages already advertised in (or mapped from) the prefix cache
    page_keys: list[bytes] = field(default_factory=list)  # chained keys of the full pages of `tokens`
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache at first admission
    finish_reason: str = ""
    unresolved: int = 0  # trailing tokens sampled by a step still in flight (placeholders in `tokens`)
    source_row: int = -1  # row of the in-flight step's output that holds the value of the last placeholder
    final: bool = False  # the pending token reaches a length limit: no more steps, it finishes on resolving
    resume_page: int | None = None  # hybrid models: the cached page whose state snapshot the next step restores
    snapshot_page: int | None = None  # hybrid models: the page of the newest state snapshot this sequence took

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.num_computed

    def keys(self, num_pages: int, page_size: int) -> list[bytes]:
        if len(self.page_keys) < num_pages:
            parent = self.page_keys[-1] if self.page_keys else None
            self.page_keys += chain_keys(self.tokens, page_size, parent, len(self.page_keys), num_pages)
        return self.page_keys[:num_pages]


@dataclass
class Scheduled:
    seq: Sequence
    start: int  # position of the first token fed
    length: int  # tokens fed
    decode: bool = False  # the one token a decoding sequence feeds (else a prefill chunk)

    @property
    def samples(self) -> bool:
        return self.start + self.length == len(self.seq.tokens)


class Scheduler:
    def __init__(self, pool: PagePool, max_num_seqs: int, max_tokens_per_step: int, resumable=None):
        self.pool = pool
        self.resumable = resumable  # page -> whether a sequence can resume after it (None: any cached page)
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_tokens_per_step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: preemption takes from the back
        self.preemptions = 0
        self.prefix_hit_tokens = 0

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------------------
    def schedule(self) -> list[Scheduled]:
        while True:
            batch = self._schedule_once()
            if batch or all(seq.final for seq in self.running):
                return batch
            # Nothing fits although sequences are running (all part way through prefill with the pool
            # full): give the newest one's pages to the others. One sequence alone always fits, since
            # max_model_len never exceeds the pool.
            self._preempt(self.running[-1])

    def _schedule_once(self) -> list[Scheduled]:
        batch: list[Scheduled] = []
        ps = self.page_size
        for seq in list(self.running):
            n = seq.num_computed
            if seq.status != RUNNING or len(seq.tokens) - n != 1 or seq.final:
                continue
            if n < len(seq.pages) * ps:  # the common case, checked inline: its page has room (this loop is hot)
                batch.append(Scheduled(seq, n, 1, True))
                continue
            while not self._grow(seq, seq.num_computed + 1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                batch.append(Scheduled(seq, seq.num_computed, 1, decode=True))
        budget = max(self.max_tokens - len(batch), 0)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.pending > 1:
                n = self._grow_chunk(seq, min(seq.pending, budget))
                if n == 0:
                    break
                batch.append(Scheduled(seq, seq.num_computed, n))
                budget -= n
        computing = self._prompt_pages_computing() if self.waiting else set()
        deferred = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.unresolved:  # a placeholder can be fed only as a decode
                break
            admitted = self._admit(seq, computing)
            if admitted is False:
                break
            self.waiting.popleft()
            if admitted is None:
                deferred.append(seq)
                continue
            n = self._grow_chunk(seq, min(seq.pending, budget))
            batch.append(Scheduled(seq, seq.num_computed, n))
            budget -= n
            computing.update(self._uncached_prompt_keys(seq))
        self.waiting.extendleft(reversed(deferred))
        return batch

    def advance(self, batch: list[Scheduled]) -> None:
        """The step is launched: its tokens count as computed (their KV is written before any later step runs)."""
        for item in batch:
            item.seq.num_computed = item.start + item.length

    def register(self, batch: list[Scheduled]) -> None:
        """The step's sampled values are known: advertise the pages that became full of computed, known tokens."""
        ps = self.page_size
        for item in batch:
            seq = item.seq
            if seq.status != RUNNING:  # finished or preempted since: its pages went back to the pool
                continue
            full = min(seq.num_computed, len(seq.tokens) - seq.unresolved) // ps
            if full > seq.num_registered:
                keys = seq.keys(full, ps)
                for i in range(seq.num_registered, full):
                    self.pool.register(seq.pages[i], keys[i])
                seq.num_registered = full

    # -- membership -----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == RUNNING:
            self.running.remove(seq)
        elif seq.status == WAITING:
            self.waiting.remove(seq)
        self.pool.release(seq.pages)
        seq.pages = []
        seq.status, seq.finish_reason = FINISHED, reason

    def preempt_all(self) -> None:
        for seq in reversed(list(self.running)):
            self._preempt(seq)

    # -- internals ------------------------------------------------------------------------------------
    def _uncached_prompt_keys(self, seq: Sequence) -> list[bytes]:
        """Keys of `seq`'s full prompt pages not advertised in the prefix cache yet (computed or to be)."""
        full = seq.prompt_len // self.page_size
        return seq.keys(full, self.page_size)[seq.num_registered:full] if seq.num_registered < full else []

    def _prompt_pages_computing(self) -> set[bytes]:
        """Prompt pages running sequences compute (or computed without advertising them yet, their step's results
        still on the way): a waiting sequence that needs one next is better off waiting for it than computing it
        again (`_admit`). Only the prefix cache advertises pages."""
        if not self.pool.enable_prefix_cache:
            return set()
        return {key for seq in self.running for key in self._uncached_prompt_keys(seq)}

    def _admit(self, seq: Sequence, computing: set[bytes] = frozenset()) -> bool | None:
        """Admit `seq` onto its longest usable cached prefix: True; False when the pool cannot take the rest of it;
        None (nothing taken) when its next page is among `computing`, which a running sequence will advertise."""
        ps = self.page_size
        usable = (len(seq.tokens) - 1) // ps  # the last token always runs, to give the next token's logits
        keys = seq.keys(usable, ps)
        matched = self.pool.match(keys)
        if self.resumable is not None and matched:
            keep = next((i + 1 for i in range(len(matched) - 1, -1, -1) if self.resumable(matched[i])), 0)
            self.pool.release(matched[keep:])
            matched = matched[:keep]
        if len(matched) < usable and keys[len(matched)] in computing:
            self.pool.release(matched)
            return None
        if self.pool.pages_for(len(seq.tokens)) - len(matched) > self.pool.num_free:
            self.pool.release(matched)
            return False
        seq.pages = matched
        seq.resume_page = matched[-1] if matched and self.resumable is not None else None
        seq.num_computed = seq.num_registered = len(matched)
        seq.num_computed *= ps
        if seq.cached_tokens is None:
            seq.cached_tokens = seq.num_computed
        self.prefix_hit_tokens += seq.num_computed
        seq.status = RUNNING
        self.running.append(seq)
        return True

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` pages for its first `num_tokens` tokens; False (nothing taken) if the pool is short."""
        need = self.pool.pages_for(num_tokens) - len(seq.pages)
        if need <= 0:
            return True
        pages = self.pool.allocate(need)
        if pages is None:
            return False
        seq.pages += pages
        return True

    def _grow_chunk(self, seq: Sequence, n: int) -> int:
        """Largest chunk of at most `n` tokens the pool can take for `seq` now."""
        ps = self.page_size
        room = len(seq.pages) * ps - seq.num_computed + self.pool.num_free * ps
        n = min(n, room)
        if n > 0 and not self._grow(seq, seq.num_computed + n):
            raise AssertionError("page accounting out of step")
        return max(n, 0)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.release(seq.pages)
        seq.pages, seq.num_computed, seq.num_registered = [], 0, 0
        seq.resume_page = None
        seq.status = WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1
