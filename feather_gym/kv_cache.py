"""The simulator's KV-cache block pool with prefix caching (vLLM v1 KVCacheManager semantics).

A block holds ``block_size`` tokens. Full prompt blocks are *hashed*: identified by their
chained chunk digest, so equal digests are one physical block shared by every request that
references it (it counts once against capacity). Every other block (a prompt's partial tail,
generated tokens) is *anonymous*: private to its request and never reused.

A hashed block whose reference count drops to 0 stays resident as a *cached* block until its
space is needed; cached blocks are evicted least recently freed first. A request frees its
blocks tail first, so a prefix outlives its extensions (as vLLM's free-block queue does).

Invariants: ``used_blocks <= capacity_blocks`` and ``used_blocks + cached_blocks <= capacity_blocks``.
Digests are Python ints (from ``ndarray.tolist()``): dict lookups on them are the hot path.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixKVCache:
    """Reference-counted hashed blocks, anonymous blocks and an LRU of cached free blocks."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"KV capacity must be at least one block, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._refs: dict[int, int] = {}                   # digest -> reference count (>= 1)
        self._cached: OrderedDict[int, None] = OrderedDict()  # digest of unreferenced resident block, LRU first
        self.anonymous_blocks = 0

    @property
    def used_blocks(self) -> int:
        """Blocks referenced by running requests (shared blocks once)."""
        return len(self._refs) + self.anonymous_blocks

    @property
    def cached_blocks(self) -> int:
        """Resident, unreferenced hashed blocks (evictable)."""
        return len(self._cached)

    @property
    def free_blocks(self) -> int:
        """Blocks a new reference can claim (evictable cached blocks included)."""
        return self.capacity_blocks - self.used_blocks

    def cached_prefix(self, digests: list[int]) -> int:
        """Number of leading ``digests`` resident (referenced or cached). O(matched)."""
        refs, cached = self._refs, self._cached
        n = 0
        for d in digests:
            if d not in refs and d not in cached:
                break
            n += 1
        return n

    def referenced_prefix(self, digests: list[int]) -> int:
        """Number of leading ``digests`` referenced by running requests. O(matched)."""
        refs = self._refs
        n = 0
        for d in digests:
            if d not in refs:
                break
            n += 1
        return n

    def blocks_to_claim(self, digests: list[int], total_blocks: int) -> tuple[int, int]:
        """``(hits, claim)`` for a request needing ``total_blocks`` whose full blocks are ``digests``.

        ``hits`` leading digests are resident; ``claim`` is how many blocks would turn from free
        to used (cached hits included, referenced hits excluded). Admission fits iff
        ``claim <= free_blocks``. O(matched).
        """
        hits = self.cached_prefix(digests)
        return hits, total_blocks - self.referenced_prefix(digests[:hits])

    def acquire(self, digests: list[int], hits: int, anonymous: int) -> None:
        """Reference all ``digests`` (the first ``hits`` are resident) plus ``anonymous`` new blocks.

        The caller has checked the claim fits; cached blocks are evicted LRU as needed.
        """
        refs, cached = self._refs, self._cached
        for d in digests[:hits]:
            if d in refs:
                refs[d] += 1
            else:
                del cached[d]
                refs[d] = 1
        new = digests[hits:]
        for d in new:
            cached.pop(d, None)   # a stale extension whose prefix was evicted: recomputed in place
        self.anonymous_blocks += anonymous
        self._make_room()
        for d in new:
            refs[d] = 1
        self._make_room()
        if self.used_blocks > self.capacity_blocks:
            raise RuntimeError("KV cache over capacity: admission claimed more blocks than were free")

    def grow(self, blocks: int = 1) -> None:
        """Add ``blocks`` anonymous blocks (decode growth); the caller has checked they fit."""
        self.anonymous_blocks += blocks
        self._make_room()
        if self.used_blocks > self.capacity_blocks:
            raise RuntimeError("KV cache over capacity: grew past the free blocks")

    def release(self, digests: list[int], anonymous: int) -> None:
        """Drop one reference to each of ``digests`` (tail first) and free ``anonymous`` blocks."""
        refs, cached = self._refs, self._cached
        self.anonymous_blocks -= anonymous
        for d in reversed(digests):
            count = refs[d] - 1
            if count:
                refs[d] = count
            else:
                del refs[d]
                cached[d] = None

    def _make_room(self) -> None:
        """Evict least recently freed cached blocks until resident blocks fit capacity."""
        excess = len(self._refs) + self.anonymous_blocks + len(self._cached) - self.capacity_blocks
        for _ in range(max(0, min(excess, len(self._cached)))):
            self._cached.popitem(last=False)
