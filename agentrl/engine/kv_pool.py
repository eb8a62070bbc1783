"""Host-side bookkeeping of the paged KV pool: which page holds what, who refers to it, what can be reused.

A page is `page_size` token slots in every attention layer. Pages are reference counted: a page is live
while some sequence's block table lists it. A page whose tokens are all computed can be *registered* under
the chained key of its content (a 128-bit BLAKE2b digest of the key of the page before it and its own token
ids), so a later sequence with the same prefix maps the same page instead of computing it again. Registered
pages that nobody refers to stay cached and are evicted least recently released first, only when no free page
is left.

Why a cryptographic digest rather than Python's `hash` plus a stored copy of the content to rule out
collisions: the copies were tuples, one per page, and the garbage collector walked all of them, pausing
resubmitted turns for a full collection (benchmarks/engine_host_cpu.py). A digest is a `bytes` object, which
the collector never tracks, and at 128 bits a collision needs ~2^64 pages.

Only full pages are ever shared, and a full page is never written again, so sharing needs no copy-on-write.

KV is a function of the weights as well as of the tokens. The weights change under the cache (the engine decodes
from the parameters the trainer updates), so with `max_age` a registered page carries the policy `version` current
when it was registered, and a match stops at a page more than `max_age` versions older than the current one: that
page is no longer advertised (freed if nobody holds it) and the prefix is computed again under today's weights.
Without the bound, a prompt every rollout shares (a system prompt, worked examples) is computed once, at version 0,
and every later rollout is sampled on that KV however far the weights have moved.

`on_forget(page)`, if set, is called whenever the pool stops vouching for a page's content: an unregistered
page freed, a registered one evicted or unregistered, or a page left private because its key is taken. Whatever
is attached to a page's content (hybrid models' state snapshots) goes with it.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from hashlib import blake2b
from typing import Sequence


def chain_keys(token_ids: Sequence[int], page_size: int, start_key: bytes | None = None, start_page: int = 0,
               num_pages: int | None = None) -> list[bytes]:
    """Chained keys of the full pages of `token_ids`, from page `start_page` whose parent key is `start_key`."""
    full = len(token_ids) // page_size if num_pages is None else num_pages
    data = array("q", token_ids[start_page * page_size:full * page_size]).tobytes()
    step = 8 * page_size
    keys, parent = [], start_key or b""
    for offset in range(0, len(data), step):
        parent = blake2b(data[offset:offset + step], digest_size=16, key=parent).digest()
        keys.append(parent)
    return keys


class PagePool:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool = True, max_age: int | None = None):
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self.refs = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, unreferenced; oldest first
        self._key_of: dict[int, bytes] = {}  # page -> key
        self._page_of: dict[bytes, int] = {}  # key -> page
        self._version_of: dict[int, int] = {}  # registered page -> the policy version it was registered at
        self.version = 0  # the policy version now (the engine's `bump_version` sets it)
        self.max_age = max_age  # versions a registered page stays reusable; None: for ever
        self.evictions = 0
        self.stale_pages = 0  # registered pages retired by `max_age`
        self.on_forget = None

    # -- capacity -------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages an allocation can take now: never used, or cached but unreferenced."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- allocation -----------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh pages with one reference each, or None (and nothing taken) if fewer are available."""
        if n > self.num_free:
            return None
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                self._unregister(page)
                self.evictions += 1
            self.refs[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        # Released tail first, so under pressure a sequence's last pages are evicted before its prefix,
        # which is the part other sequences are likely to share.
        for page in reversed(pages):
            self.refs[page] -= 1
            if self.refs[page] > 0:
                continue
            if page in self._key_of:
                self._evictable[page] = None
            else:
                self._free.append(page)
                self._forget(page)

    # -- prefix cache ---------------------------------------------------------------------------------
    def match(self, keys: Sequence[bytes]) -> list[int]:
        """Reference the cached pages for the longest prefix of `keys`."""
        if not self.enable_prefix_cache:
            return []
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            if self.max_age is not None and self._version_of[page] < self.version - self.max_age:
                self._retire(page)
                break
            if self.refs[page] == 0:
                del self._evictable[page]
            self.refs[page] += 1
            pages.append(page)
        return pages

    def register(self, page: int, key: bytes) -> bool:
        """Advertise a live, fully computed page under `key`. False if the key is taken by another page
        (two sequences computed the same prefix concurrently): this one then stays private."""
        if not self.enable_prefix_cache or key in self._page_of or page in self._key_of:
            if page not in self._key_of:
                self._forget(page)
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        self._version_of[page] = self.version
        return True

    def clear_cache(self) -> None:
        """Forget every registered page; unreferenced ones become free, live ones stay with their owners."""
        for page in list(self._key_of):
            self._unregister(page)
        while self._evictable:
            page, _ = self._evictable.popitem(last=False)
            self._free.append(page)

    def drop_unreferenced(self) -> None:
        """Forget cached pages nobody refers to; used when the pool's memory is handed back and only live
        pages are saved, so the cache must not advertise the others."""
        while self._evictable:
            page, _ = self._evictable.popitem(last=False)
            self._unregister(page)
            self._free.append(page)

    def _retire(self, page: int) -> None:
        """A registered page too old to reuse: no longer advertised; free now unless a sequence holds it (its
        holder keeps using it, and frees it at release as a private page)."""
        if self.refs[page] == 0:
            del self._evictable[page]
            self._free.append(page)
        self._unregister(page)
        self.stale_pages += 1

    def _unregister(self, page: int) -> None:
        del self._page_of[self._key_of.pop(page)]
        del self._version_of[page]
        self._forget(page)

    def _forget(self, page: int) -> None:
        if self.on_forget is not None:
            self.on_forget(page)

    def live_pages(self) -> list[int]:
        return [p for p, r in enumerate(self.refs) if r > 0]

    def check(self) -> None:
        """Invariants, for tests: every page is exactly one of free, evictable or referenced."""
        free, evict = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not (free & evict)
        for p, r in enumerate(self.refs):
            assert r >= 0
            assert (p in free) + (p in evict) + (r > 0) == 1, (p, r)
        assert all(self._page_of[k] == p for p, k in self._key_of.items())
        assert self._version_of.keys() == self._key_of.keys()
        assert evict <= set(self._key_of)
