"""The simulator's KV-cache block pool with prefix caching: vLLM 0.32's ``BlockPool`` semantics.

The pool has ``capacity_blocks`` physical blocks. Each running request owns a *block table*
(its blocks in token order). A block is *registered* under a digest (the chained hash of the
tokens it holds) once its tokens are full and scheduled; a registered block can be shared by
any request whose chain has that digest. Blocks with no reference sit in one **free queue**,
as in vLLM's ``FreeKVCacheBlockQueue``:

* allocating takes blocks from the head of the free queue; a registered block taken there is
  evicted (its digest forgotten);
* a request frees its table tail first (vLLM's ``free``). Of the blocks left unreferenced, the
  registered ones join the queue's tail, so cached blocks are evicted least recently freed
  first, a request's prefix after its own extensions; the unregistered ones (a partly filled
  last block, never hittable) join its head and are reused first (``BlockPool.free_blocks``:
  LIFO for blocks without a hash);
* a prefix hit on a registered free block takes it out of the free queue (it is "touched");
* a block computed again holds its digest too (vLLM does not de-duplicate): a hit takes the
  earliest-registered resident block of a digest, and evicting it leaves the next.

Invariants (tested): ``free_blocks + referenced blocks == capacity_blocks``; every resident
digest maps to the earliest-registered block holding it, and every block holding a digest is
that block or one of its twins; a block is in the free queue iff its reference count is 0.
Digests are Python ints (``ndarray.tolist()``); dict lookups on them are the hot path.
"""

from __future__ import annotations

from collections import OrderedDict

#: Blocks of an engine's KV cache that no request can hold: vLLM's ``BlockPool`` takes one as its
#: null block (its free count and ``get_usage`` leave it out). A pool for an engine of ``n``
#: blocks has ``n - NULL_BLOCKS``.
NULL_BLOCKS = 1


class PrefixKVCache:
    """Reference-counted blocks, per-request block tables, one free queue (see module doc)."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"KV capacity must be at least one block, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(capacity_blocks))
        self._refs = [0] * capacity_blocks
        self._digest: list[int | None] = [None] * capacity_blocks   # block -> registered digest
        self._block_of: dict[int, int] = {}                         # digest -> earliest block holding it
        self._twins: dict[int, list[int]] = {}                      # digest -> later blocks holding it
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
        """Resident prefix-cache entries: distinct registered digests, referenced or not (twins once)."""
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
        free, refs, digest_of = self._free, self._refs, self._digest
        for _ in range(need):
            block, _ = free.popitem(last=False)
            if digest_of[block] is not None:
                self._evict(block)
            refs[block] = 1
            table.append(block)
        return True

    def _evict(self, block: int) -> None:
        """Forget the digest ``block`` holds; a twin holding it too becomes the one hits take."""
        digest = self._digest[block]
        self._digest[block] = None
        twins = self._twins.get(digest)
        if self._block_of[digest] == block:
            if twins:
                self._block_of[digest] = twins.pop(0)
            else:
                del self._block_of[digest]
        else:
            twins.remove(block)
        if twins == []:
            del self._twins[digest]

    def register(self, request, digests: list[int], full_blocks: int) -> None:
        """Register ``request``'s first ``full_blocks`` blocks under ``digests`` (as vLLM caches the
        full blocks of scheduled tokens). A digest another block already holds is held by both
        (a twin); hits keep taking the earlier one. A block hit, not computed, is left as it is."""
        done = self._registered[request]
        if full_blocks <= done:
            return
        table, digest_of, block_of = self._tables[request], self._digest, self._block_of
        for k in range(done, full_blocks):
            block, d = table[k], digests[k]
            if digest_of[block] is not None:      # a shared hit block: registered already
                continue
            digest_of[block] = d
            if d in block_of:
                self._twins.setdefault(d, []).append(block)
            else:
                block_of[d] = block
        self._registered[request] = full_blocks

    def release(self, request) -> None:
        """Drop ``request``'s references, tail first; of the unreferenced blocks the registered ones
        join the free queue's tail and the others its head, the tail block first (module doc)."""
        refs, free, digest_of = self._refs, self._free, self._digest
        reuse_first = []
        for block in reversed(self._tables.pop(request)):
            refs[block] -= 1
            if not refs[block]:
                if digest_of[block] is None:
                    reuse_first.append(block)
                else:
                    free[block] = None
        for block in reversed(reuse_first):
            free[block] = None
            free.move_to_end(block, last=False)
        del self._registered[request]
