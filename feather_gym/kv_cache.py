"""The simulator's KV-cache block pool with prefix caching: vLLM v1's ``BlockPool`` semantics.

The pool has ``capacity_blocks`` physical blocks. Each running request owns a *block table*
(its blocks in token order). A block is *registered* under a digest (the chained hash of the
tokens it holds) once its tokens are full and scheduled; a registered block can be shared by
any request whose chain has that digest. Blocks with no reference sit in one **free queue**,
least recently freed first, whether they are registered or not, exactly as vLLM's
``FreeKVCacheBlockQueue``:

* allocating takes blocks from the head of the free queue; a registered block taken there is
  evicted (its digest forgotten), even while blocks freed later, registered or not, wait
  behind it;
* a request frees its table tail first, so its prefix blocks sit behind its own extensions
  and are evicted after them;
* a prefix hit on a registered free block takes it out of the free queue (it is "touched").

Invariants (tested): ``free_blocks + referenced blocks == capacity_blocks``; every registered
digest maps to one block holding it; a block is in the free queue iff its reference count is 0.
Digests are Python ints (``ndarray.tolist()``); dict lookups on them are the hot path.
"""

from __future__ import annotations

from collections import OrderedDict

#: Blocks of an engine's KV cache that no request can hold: vLLM's ``BlockPool`` takes one as its
#: null block (its free count and ``get_usage`` leave it out). A pool for an engine of ``n``
#: blocks has ``n - NULL_BLOCKS``.
NULL_BLOCKS = 1


class PrefixKVCache:
    """Reference-counted blocks, per-request block tables, one LRU free queue (see module doc)."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"KV capacity must be at least one block, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(capacity_blocks))
        self._refs = [0] * capacity_blocks
        self._digest: list[int | None] = [None] * capacity_blocks   # block -> registered digest
        self._block_of: dict[int, int] = {}                         # digest -> block
        self._tables: dict[object, list[int]] = {}                  # request -> its blocks, in order
        self._registered: dict[object, int] = {}                    # request -> leading blocks registered

    @property
    def free_blocks(self) -> int:
        """Blocks in the free queue (registered-but-unreferenced blocks included)."""
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        """Blocks referenced by running requests (shared blocks once)."""
        return self.capacity_blocks - len(self._free)

    @property
    def cached_blocks(self) -> int:
        """Registered blocks (resident prefix-cache entries, referenced or not)."""
        return len(self._block_of)

    def blocks_held(self, request) -> int:
        return len(self._tables.get(request, ()))

    def hit_blocks(self, digests: list[int], max_blocks: int) -> list[int]:
        """The blocks of the leading ``digests`` that are registered, at most ``max_blocks``."""
        block_of, hits = self._block_of, []
        for d in digests[:max_blocks]:
            block = block_of.get(d)
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_prefix(self, digests: list[int]) -> int:
        """Number of leading ``digests`` registered (resident, referenced or not). O(matched)."""
        return len(self.hit_blocks(digests, len(digests)))

    def blocks_to_claim(self, hits: list[int], total_blocks: int) -> int:
        """Free blocks an admission of ``total_blocks`` with prefix ``hits`` takes (vLLM's count:
        new blocks plus hit blocks that are free now). Admission fits iff ``<= free_blocks``."""
        refs = self._refs
        return total_blocks - len(hits) + sum(1 for b in hits if not refs[b])

    def admit(self, request, hits: list[int]) -> None:
        """Start ``request``'s table with the prefix ``hits`` (each gains a reference)."""
        if request in self._tables:
            raise RuntimeError(f"request {request!r} already holds blocks")
        refs, free = self._refs, self._free
        for block in hits:
            if not refs[block]:
                del free[block]
            refs[block] += 1
        self._tables[request] = list(hits)
        self._registered[request] = len(hits)

    def allocate(self, request, total_blocks: int) -> bool:
        """Grow ``request``'s table to ``total_blocks`` from the free queue's head.

        Returns False, changing nothing, when the free queue is too short.
        """
        table = self._tables[request]
        need = total_blocks - len(table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        free, refs, digest_of, block_of = self._free, self._refs, self._digest, self._block_of
        for _ in range(need):
            block, _ = free.popitem(last=False)
            digest = digest_of[block]
            if digest is not None:            # evict the cached content
                digest_of[block] = None
                if block_of.get(digest) == block:
                    del block_of[digest]
            refs[block] = 1
            table.append(block)
        return True

    def register(self, request, digests: list[int], full_blocks: int) -> None:
        """Register ``request``'s first ``full_blocks`` blocks under ``digests`` (as vLLM caches the
        full blocks of scheduled tokens). A digest already held by another block stays with it."""
        done = self._registered[request]
        if full_blocks <= done:
            return
        table, digest_of, block_of = self._tables[request], self._digest, self._block_of
        for k in range(done, full_blocks):
            d = digests[k]
            if d not in block_of:
                block = table[k]
                block_of[d] = block
                digest_of[block] = d
        self._registered[request] = full_blocks

    def release(self, request) -> None:
        """Drop ``request``'s references, tail first; unreferenced blocks join the free queue's tail."""
        refs, free = self._refs, self._free
        for block in reversed(self._tables.pop(request)):
            refs[block] -= 1
            if not refs[block]:
                free[block] = None
        del self._registered[request]
