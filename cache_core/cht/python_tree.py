"""The pure-Python Chunked Hash Tree: the oracle the compiled one is tested against.

:class:`PythonChunkedHashTree` answers exactly as :class:`cache_core.cht.tree.ChunkedHashTree`
(same queries, same tie-breaks, same ``snapshot()``) with another representation: one index entry
per digest and lazy heaps. Only the property tests use it.

A request is the chain of its chunk digests (:mod:`traces.chunk_hash`): equal digests
mean equal prefixes, so a digest names a trie node and its depth (the chunks it covers).
The CHT keeps two maps keyed by digest:

* the **waiting index**: digest -> :class:`_Prefix` (its depth, its parent digest, how
  many waiting requests contain it, and a lazy min-heap of those requests' queue keys);
* the **working set**: digest -> reference count over the running requests. It is
  prefix-closed, so a request's shared run with the running set (``shared_chunks``) is the
  number of its leading digests in the working set, found by binary search.

Selection. A waiting request ``w`` with ``n`` chunks of which ``s`` are in the working set
has the selection key ``(missing, -shared, arrival) = (n - s, -s, seq)``; :meth:`find_best`
returns the minimum. Activations and finishes change ``s`` for whole groups of waiting
requests at once, so keys are not stored per request. Instead, for every prefix ``f`` in
the working set (and the empty root prefix) the pair ``(f, w)`` with ``w`` waiting below
``f`` has the value ``(n_w - depth(f), -depth(f), seq_w)``; it is never below ``w``'s key
and equals it when ``f`` is ``w``'s deepest working-set prefix, so the minimum over pairs is
the answer. Each prefix's heap yields its best request (smallest ``(n_w, seq_w)``) below it,
and a global heap holds, for every working-set prefix, an entry pairing its best request
with it or with a deeper working-set prefix on that request's chain (which is never
worse). Prefixes holding the same waiting requests (a prefix group's shared part) form a
chain that one entry, at its deepest prefix, serves. So an activation that puts a group's
prefix in the working set moves the whole group with one push, whatever its size.
:meth:`top_candidates` reads the same heaps for the best request of each of the ``k`` best
prefix groups (a policy's choices beyond the single best).

Invariants (checked by ``tests/test_cht*.py``):

1. The index, the working set and the set of shared prefixes equal those of a CHT rebuilt
   from scratch from the current waiting requests (in arrival order) and running requests
   (:meth:`snapshot` is the canonical view).
2. Every prefix heap holds the keys of all waiting requests containing the prefix, plus
   stale keys of requests that left; it is compacted when stale keys outnumber live ones,
   so it has at most ``2 * waiting + _COMPACT_SLACK`` entries. The top of every
   working-set prefix's heap is live.
3. For the root and every working-set prefix ``f`` with waiting requests, the global heap
   holds a valid entry (request waiting, prefix in the working set) for ``f``'s best
   request at ``f`` or deeper on that request's chain. Other entries are redundant or
   stale (discarded lazily). It is rebuilt when longer than
   ``2 * (len(working set) + 1) + _COMPACT_SLACK``.
4. ``shared_children`` of the root and of every indexed prefix counts its child prefixes
   contained in >= 2 waiting requests (so a prefix with none holds one prefix group only).
5. Memory returns to empty: once every request has finished or been removed, every
   container is empty (:meth:`memory_entries` is all zeros).

Costs below: ``n`` chunks of the request, ``W`` waiting requests, ``R`` digests in the
working set, ``H <= 2 * (R + 1) + _COMPACT_SLACK`` global-heap entries. A prefix-heap push
is O(log W) worst case and O(1) in practice (keys grow with arrival). Dictionary
operations are O(1) expected. Per-chunk work is a few dictionary and heap operations in
Python; everything that does not depend on the chunk count is O(log n) or O(log H).
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush

import numpy as np

from cache_core.cht.tree import CandidateStats, ChunkHashing, PrefixGroup
from traces.chunk_hash import DEFAULT_CHUNK_SIZE

#: Queue key of a request = ``num_chunks << _SEQ_BITS | seq``: ordered by length, then arrival
#: (``seq`` counts adds: 2**40 per tree, 35 years at 1,000 requests/s).
_SEQ_BITS = 40
_SEQ_MASK = (1 << _SEQ_BITS) - 1
_MAX_CHUNKS = 1 << 22
#: Heaps tolerate this many stale entries beyond twice their live ones before compaction.
_COMPACT_SLACK = 16
#: Stands for the empty (root) prefix in global-heap entries; digests are >= 0.
_ROOT = -1


class _Prefix:
    """One digest of the waiting index."""

    __slots__ = ("depth", "parent", "waiting", "heap", "shared_children")

    def __init__(self, depth: int, parent: int | None, key: int) -> None:
        self.depth = depth
        self.parent = parent
        self.waiting = 1      # waiting requests containing this prefix
        self.heap = [key]     # lazy min-heap of their queue keys
        self.shared_children = 0   # child prefixes contained in >= 2 waiting requests


class _Request:
    __slots__ = ("request_id", "digests", "seq", "key")

    def __init__(self, request_id, digests: np.ndarray, seq: int) -> None:
        self.request_id = request_id
        self.digests = digests
        self.seq = seq
        self.key = len(digests) << _SEQ_BITS | seq


def _leading(chain: list[int], holds, stop: int | None = None) -> int:
    """Length of the longest prefix of ``chain[:stop]`` whose items satisfy ``holds``.

    ``holds`` must be monotone along a chain (true, then false): O(log n) calls.
    Callers convert a request's digests with ``tolist()`` first (O(n) in C), cheaper than
    boxing numpy scalars at every probe.
    """
    lo, hi = 0, len(chain) if stop is None else stop
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if holds(chain[mid - 1]):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PythonChunkedHashTree(ChunkHashing):
    """Waiting queue indexed by chained chunk digests, with a running working set.

    ``chunk_size`` is the tokens per chunk that callers hash with (``digests_of``,
    ``add_request``); the tree itself only sees digests. Request ids are any hashable;
    an id may be reused once its request has finished or been removed.

    Misuse raises ``ValueError`` and changes nothing: adding an id that is waiting or
    running, removing, activating or asking stats of one that is not waiting, finishing
    one that is not running, digests that are not a 1-D integer array, or visibly not a
    chain (its already-indexed digests are not its leading ones at their depths; checked
    in O(n) C-level work, so not every malformed chain is caught).
    """

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = chunk_size
        self._index: dict[int, _Prefix] = {}
        self._root = _Prefix(0, None, 0)             # the empty prefix: every waiting request
        self._root.waiting, self._root.heap = 0, []
        self._shared_prefixes: set[int] = set()      # digests contained in >= 2 waiting requests
        self._working_set: dict[int, int] = {}       # digest -> running requests containing it
        self._global: list[tuple[int, int, int, int]] = []  # (missing, -depth, seq, digest)
        self._waiting: dict[object, _Request] = {}   # insertion order = arrival order
        self._waiting_by_seq: dict[int, _Request] = {}
        self._running: dict[object, _Request] = {}
        self._common_prefix: int | None = 0          # running_common_prefix; None: recompute
        self._next_seq = 0

    # ------------------------------------------------------------------ sizes
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_prefixes(self) -> int:
        """Prefixes (chunk digests) in the waiting index. O(1)."""
        return len(self._index)

    def is_waiting(self, request_id) -> bool:
        return request_id in self._waiting

    def is_running(self, request_id) -> bool:
        return request_id in self._running

    def waiting_ids(self) -> list:
        """Waiting request ids in arrival order. O(W)."""
        return list(self._waiting)

    def running_ids(self) -> list:
        """Running request ids in activation order. O(running)."""
        return list(self._running)

    # ------------------------------------------------------------------ mutations
    def add(self, request_id, digests: np.ndarray) -> None:
        """A request arrives in the waiting queue (arrival order = call order).

        O(n log W): one index lookup and one prefix-heap push (or a new index entry) per
        chunk; O(log n) for its shared run; a global-heap push (O(log H)) at the deepest
        prefix of each chain of working-set prefixes it became the best of.
        """
        if request_id in self._waiting or request_id in self._running:
            state = "waiting" if request_id in self._waiting else "running"
            raise ValueError(f"request {request_id!r} is already {state}")
        digests = np.asarray(digests)
        if digests.ndim != 1 or digests.dtype.kind not in "ui":
            raise ValueError(f"request {request_id!r}: digests must be a 1-D integer array")
        if len(digests) >= _MAX_CHUNKS:
            raise ValueError(f"request {request_id!r}: {len(digests)} chunks, at most {_MAX_CHUNKS - 1}")
        digests = digests.astype(np.uint64, copy=False)     # digests are >= 0 (vs _ROOT)
        chain = digests.tolist()
        n, index = len(chain), self._index
        known = [index.get(digest) for digest in chain]
        indexed = n - known.count(None)       # the indexed digests of a chain are a prefix of it
        if indexed and (known[indexed - 1] is None or known[indexed - 1].depth != indexed):
            raise ValueError(f"request {request_id!r}: its indexed digests are not its first {indexed} "
                             f"chunks at their depths; digests must be chained")
        request = _Request(request_id, digests, self._next_seq)
        self._next_seq += 1
        self._waiting[request_id] = request
        self._waiting_by_seq[request.seq] = request
        key, seq = request.key, request.seq

        root = self._root
        root.waiting += 1
        heappush(root.heap, key)
        shared_prefixes = self._shared_prefixes
        for digest, prefix in zip(chain, known[:indexed]):
            prefix.waiting += 1
            heappush(prefix.heap, key)
            if prefix.waiting == 2:
                shared_prefixes.add(digest)
                self._parent_of(prefix).shared_children += 1
        parent = chain[indexed - 1] if indexed else None
        for depth in range(indexed + 1, n + 1):
            digest = chain[depth - 1]
            index[digest] = _Prefix(depth, parent, key)
            parent = digest
        # Working-set prefixes it became the best of need its entry (their tops were live,
        # invariant 2); one per chain of equal prefixes, at the deepest (see _leave_waiting).
        shared = _leading(chain, self._working_set.__contains__)
        below = 0
        for depth in range(shared, 0, -1):
            prefix = index[chain[depth - 1]]
            if prefix.heap[0] == key and below != prefix.waiting:
                heappush(self._global, (n - depth, -depth, seq, chain[depth - 1]))
            below = prefix.waiting
        if root.heap[0] == key and below != root.waiting:
            heappush(self._global, (n, 0, seq, _ROOT))
        self._maybe_compact_global()

    def remove(self, request_id) -> None:
        """A waiting request is cancelled. O(n log W), like :meth:`activate` without the
        working set; stale heap keys are compacted in amortised O(1) each."""
        request = self._take_waiting(request_id, "remove")
        chain = request.digests.tolist()
        shared = _leading(chain, self._working_set.__contains__)
        self._leave_waiting(request, chain, running_depth=shared, new_from=shared)

    def activate(self, request_id) -> None:
        """A waiting request joins the running batch: its chunks join the working set.

        O(n log W): per chunk, one reference count and one waiting-count update; a
        global-heap push (O(log H)) at the deepest prefix of each chain of working-set
        prefixes that just entered or just lost their best request. The waiting requests
        below a newly running prefix move as a group through that one push.
        """
        request = self._take_waiting(request_id, "activate")
        chain = request.digests.tolist()
        working_set = self._working_set
        was_shared = _leading(chain, working_set.__contains__)
        for digest in chain:
            working_set[digest] = working_set.get(digest, 0) + 1
        self._running[request_id] = request
        self._common_prefix = None
        self._leave_waiting(request, chain, running_depth=len(chain), new_from=was_shared)

    def finish(self, request_id) -> None:
        """A running request leaves: its chunks' reference counts drop. O(n + log R).

        Global-heap entries of prefixes that leave the working set go stale and are
        discarded lazily by :meth:`find_best`. Prefixes above them that relied on them
        (a chain of equal prefixes, see :meth:`_leave_waiting`) share the deepest prefix
        still in the working set; one push for it restores invariant 3.
        """
        request = self._running.pop(request_id, None)
        if request is None:
            raise ValueError(f"cannot finish request {request_id!r}: {self._state(request_id)}")
        self._common_prefix = None
        working_set = self._working_set
        chain = request.digests.tolist()
        for digest in chain:
            refs = working_set[digest] - 1
            if refs:
                working_set[digest] = refs
            else:
                del working_set[digest]
        still_running = _leading(chain, working_set.__contains__)
        if still_running < len(chain):
            if not still_running:
                self._push_best(self._root, _ROOT)
            elif chain[still_running - 1] in self._index:
                self._push_best(self._index[chain[still_running - 1]], chain[still_running - 1])
        self._maybe_compact_global()

    # ------------------------------------------------------------------ queries
    def find_best(self):
        """The waiting request with the fewest chunks missing from the working set.

        Ties: longest shared run, then earliest arrival. ``None`` when nothing waits.
        O(1) when the global heap's top is valid; each invalid entry is popped once
        (O(log H)), so amortised O(log H) = O(log R), independent of W.
        """
        heap, by_seq, working_set = self._global, self._waiting_by_seq, self._working_set
        while heap:
            _, _, seq, digest = heap[0]
            request = by_seq.get(seq)
            if request is not None and (digest == _ROOT or digest in working_set):
                return request.request_id
            heappop(heap)
        return None

    def top_candidates(self, k: int) -> list:
        """The best waiting request of each of the ``k`` best prefix groups, best first.

        A waiting request's *prefix group* is its deepest prefix shared with another waiting
        request (the group :class:`CandidateStats` ``same_prefix_waiting`` counts); a request
        that shares no chunk with another waiting one is a group of its own. Groups rank by
        their best request's selection key (:meth:`find_best`), so the first id is
        ``find_best()`` and ``top_candidates(1) == [find_best()]``. Fewer than ``k`` ids when
        fewer groups wait; ``[]`` when nothing waits.

        How: a lazy k-way merge of prefix heaps. The global heap is walked in key order (a heap
        of its positions). A valid entry for request ``b`` opens, as a stream of its waiting
        requests at their keys through it, every working-set prefix on ``b``'s chain at or above
        the entry whose best request is ``b`` (a contiguous run; one per run of prefixes with the
        same waiting requests). Every working-set prefix's best has such an entry (invariant 3)
        that surfaces before any of its other requests' keys, so each request first appears at
        its own key, through its deepest working-set prefix. Only stale prefix-heap tops are
        popped, before the walk. A stream whose prefix is a group's own prefix with no shared
        child prefix holds that group only, so it is dropped once one of its requests has been
        read. O((k + d + e + o) (log W + log n)): ``d`` requests passed over (group already
        taken, or seen through a deeper prefix), ``e`` global entries walked, ``o`` prefixes
        opened. ``d`` is not bounded by ``k``: members of a taken group that rank before the next
        group's best in a stream that also holds other groups (the root's, a prefix with shared
        children) are passed over one by one.
        """
        if k < 1:
            raise ValueError(f"top_candidates needs k >= 1, got {k}")
        best = self.find_best()                 # drops invalid global-heap tops
        if best is None or k == 1:
            return [] if best is None else [best]
        self._drop_invalid_global()             # the walk below then passes over valid entries only
        glob, by_seq, working_set, index = self._global, self._waiting_by_seq, self._working_set, self._index
        self._live_top(self._root)              # now every top compared below is live (invariant 2)
        merge: list[tuple] = []                 # (missing, -depth, seq, tiebreak, heap, position, prefix)
        tiebreak = 0

        def push(heap: list, position: int, prefix: _Prefix | None) -> None:
            nonlocal tiebreak
            if position < len(heap):
                tiebreak += 1
                if prefix is None:              # a global-heap entry
                    missing, negdepth, seq, _ = heap[position]
                else:                           # a queue key through ``prefix``
                    key = heap[position]
                    missing, negdepth, seq = (key >> _SEQ_BITS) - prefix.depth, -prefix.depth, key & _SEQ_MASK
                heappush(merge, (missing, negdepth, seq, tiebreak, heap, position, prefix))

        def open_sources(request: _Request, digest: int) -> None:
            # Up the chain from the entry's prefix, one source per run of prefixes with the same
            # waiting requests (waiting counts only grow upwards: a binary search finds the run's top).
            chain = request.digests.tolist()
            depth = 0 if digest == _ROOT else index[digest].depth
            source = index[chain[depth - 1]] if depth else self._root
            while source.heap[0] == request.key:
                if source not in opened:
                    opened.add(source)
                    push(source.heap, 0, source)
                if not depth:
                    return
                waiting = source.waiting
                depth = _leading(chain, lambda d: index[d].waiting > waiting, depth - 1)
                source = index[chain[depth - 1]] if depth else self._root
                if source.waiting == waiting:       # the root, holding no other waiting request
                    return

        push(glob, 0, None)
        opened, exhausted, seen, groups, out = set(), set(), set(), set(), []
        while merge and len(out) < k:
            _, _, seq, _, heap, position, prefix = heappop(merge)
            if prefix in exhausted:
                continue
            push(heap, 2 * position + 1, prefix)
            push(heap, 2 * position + 2, prefix)
            request = by_seq.get(seq)
            if request is None:
                continue
            if prefix is None:
                digest = heap[position][3]
                if digest == _ROOT or digest in working_set:
                    open_sources(request, digest)
                continue
            if seq in seen:
                continue
            seen.add(seq)
            chain = request.digests.tolist()
            depth = _leading(chain, lambda digest: index[digest].waiting >= 2)
            group = chain[depth - 1] if depth else _ROOT - 1 - seq
            if depth and depth == prefix.depth and not prefix.shared_children:
                exhausted.add(prefix)           # all its requests are this group's (invariant 4)
            if group not in groups:
                groups.add(group)
                out.append(request.request_id)
        return out

    @property
    def running_common_prefix(self) -> int:
        """Chunks common to every running request (0 when none run).

        O(1) between activations and finishes; O(log n) lookups after one.
        """
        if self._common_prefix is None:
            anyone = next(iter(self._running.values()), None)
            self._common_prefix = _leading(anyone.digests.tolist(), self._in_every_running) if anyone else 0
        return self._common_prefix

    def shared_chunks(self, request_id) -> int:
        """Leading chunks of a waiting or running request in the working set. O(log n)."""
        request = self._waiting.get(request_id) or self._running.get(request_id)
        if request is None:
            raise ValueError(f"unknown request {request_id!r}")
        return _leading(request.digests.tolist(), self._working_set.__contains__)

    def candidate_stats(self, request_id) -> CandidateStats:
        """Observation features of a waiting request (see :class:`CandidateStats`). O(log n)."""
        request = self._waiting.get(request_id)
        if request is None:
            raise ValueError(f"no stats for request {request_id!r}: {self._state(request_id)}")
        digests = request.digests.tolist()
        n = len(digests)
        shared = _leading(digests, self._working_set.__contains__)
        common = self.running_common_prefix
        chunk_loss = common - _leading(digests[:common], self._in_every_running)
        index = self._index
        group_depth = _leading(digests, lambda digest: index[digest].waiting >= 2)
        same_prefix = index[digests[group_depth - 1]].waiting - 1 if group_depth else 0
        return CandidateStats(shared_chunks=shared, missing_chunks=n - shared, chunk_loss=chunk_loss,
                              same_prefix_waiting=same_prefix, num_chunks=n)

    def largest_groups(self, k: int) -> list[PrefixGroup]:
        """The ``k`` largest prefix groups of waiting requests, largest first, deeper first.

        A group is a prefix contained in >= 2 waiting requests that no single child prefix
        covers entirely (its deepest representative). O(S log S), S = number of prefixes
        shared by >= 2 waiting requests (branch chains, not requests).
        """
        if k < 0:
            raise ValueError(f"largest_groups needs k >= 0, got {k}")
        index = self._index
        ranked = sorted(((index[d].waiting, index[d].depth, d) for d in self._shared_prefixes), reverse=True)
        covered, groups = set(), []
        for size, depth, digest in ranked:
            if len(groups) == k:
                break
            parent = index[digest].parent
            if parent is not None and index[parent].waiting == size:
                covered.add(parent)     # ranked deeper first: its one child holds all of it
            if digest not in covered:
                groups.append(PrefixGroup(depth, size))
        return groups

    # ------------------------------------------------------------------ introspection
    def snapshot(self) -> dict:
        """Canonical content (invariant 1): equal for equal waiting/running histories.

        O(total index size); for tests and debugging.
        """
        by_seq = self._waiting_by_seq

        def live(prefix: _Prefix) -> frozenset:
            return frozenset(by_seq[k & _SEQ_MASK].request_id for k in prefix.heap if k & _SEQ_MASK in by_seq)

        return {
            "waiting": list(self._waiting),
            "running": set(self._running),
            "root": (self._root.waiting, live(self._root)),
            "index": {d: (p.depth, p.parent, p.waiting, live(p)) for d, p in self._index.items()},
            "working_set": dict(self._working_set),
            "shared_prefixes": set(self._shared_prefixes),
        }

    def memory_entries(self) -> dict[str, int]:
        """Entries held by every internal container (invariant 5: all 0 when idle). O(index)."""
        return {
            "requests": len(self._waiting) + len(self._waiting_by_seq) + len(self._running),
            "index_prefixes": len(self._index),
            "heap_entries": len(self._root.heap) + sum(len(p.heap) for p in self._index.values()),
            "working_set": len(self._working_set),
            "global_heap": len(self._global),
            "shared_prefixes": len(self._shared_prefixes),
        }

    # ------------------------------------------------------------------ internals
    def _state(self, request_id) -> str:
        if request_id in self._waiting:
            return "it is waiting"
        if request_id in self._running:
            return "it is running"
        return "unknown request id"

    def _take_waiting(self, request_id, action: str) -> _Request:
        request = self._waiting.pop(request_id, None)
        if request is None:
            raise ValueError(f"cannot {action} request {request_id!r}: {self._state(request_id)}")
        del self._waiting_by_seq[request.seq]
        return request

    def _in_every_running(self, digest: int) -> bool:
        return self._working_set.get(digest, 0) == len(self._running)

    def _parent_of(self, prefix: _Prefix) -> _Prefix:
        return self._root if prefix.parent is None else self._index[prefix.parent]

    def _live_top(self, prefix: _Prefix) -> int | None:
        """Pop stale keys off ``prefix``'s heap; its top key, or None when empty."""
        heap, by_seq = prefix.heap, self._waiting_by_seq
        while heap and heap[0] & _SEQ_MASK not in by_seq:
            heappop(heap)
        return heap[0] if heap else None

    def _push_best(self, prefix: _Prefix, digest: int) -> None:
        """Global-heap entry for ``prefix``'s best waiting request (a working-set prefix)."""
        self._push_entry(self._live_top(prefix), prefix.depth, digest)

    def _push_entry(self, top: int | None, depth: int, digest: int) -> None:
        """Global-heap entry pairing the prefix ``digest`` at ``depth`` with queue key ``top``."""
        if top is not None:
            heappush(self._global, ((top >> _SEQ_BITS) - depth, -depth, top & _SEQ_MASK, digest))

    def _leave_waiting(self, request: _Request, chain: list[int], running_depth: int, new_from: int) -> None:
        """Drop a request that left the waiting queue from its prefixes and the root.

        Its prefixes up to ``running_depth`` are in the working set, those deeper than
        ``new_from`` just entered it. A working-set prefix whose best was this request, or
        that just entered, needs an entry for its current best (invariant 3), unless the
        next prefix on the chain is in the working set with the same waiting requests: that
        one has the same best and a better entry. Walking deepest first, one push serves a
        whole chain of equal prefixes (a prefix group's shared part).
        """
        key, index, shared_prefixes = request.key, self._index, self._shared_prefixes
        below = 0       # waiting count of the prefix one chunk deeper on this chain
        for depth in range(len(chain), 0, -1):
            digest = chain[depth - 1]
            prefix = index[digest]
            waiting = prefix.waiting = prefix.waiting - 1
            if not waiting:
                del index[digest]
                continue
            if waiting == 1:
                shared_prefixes.discard(digest)
                self._parent_of(prefix).shared_children -= 1
            needs_best = depth <= running_depth and (depth > new_from or prefix.heap[0] == key)
            if len(prefix.heap) > 2 * waiting + _COMPACT_SLACK:
                self._compact(prefix)
            if needs_best:
                top = self._live_top(prefix)            # restores invariant 2
                if not (depth < running_depth and below == waiting):
                    self._push_entry(top, depth, digest)
            below = waiting
        root = self._root
        root.waiting -= 1
        if root.waiting:
            needs_best = root.heap[0] == key
            if len(root.heap) > 2 * root.waiting + _COMPACT_SLACK:
                self._compact(root)
            if needs_best:
                top = self._live_top(root)
                if not (running_depth and below == root.waiting):
                    self._push_entry(top, 0, _ROOT)
        else:
            root.heap.clear()
        if self._waiting:
            self._maybe_compact_global()
        else:
            self._global.clear()

    def _compact(self, prefix: _Prefix) -> None:
        """Drop stale keys (called once they outnumber live ones: invariant 2). Amortised O(1)."""
        by_seq = self._waiting_by_seq
        prefix.heap = [k for k in prefix.heap if k & _SEQ_MASK in by_seq]
        heapify(prefix.heap)

    def _drop_invalid_global(self) -> None:
        """Drop the global-heap entries whose request left or whose prefix left the working set. O(H)."""
        by_seq, working_set = self._waiting_by_seq, self._working_set
        valid = [entry for entry in self._global
                 if entry[2] in by_seq and (entry[3] == _ROOT or entry[3] in working_set)]
        if len(valid) < len(self._global):
            heapify(valid)
            self._global = valid

    def _maybe_compact_global(self) -> None:
        """Rebuild the global heap from the working set once stale entries dominate (inv. 3)."""
        working_set = self._working_set
        if len(self._global) <= 2 * (len(working_set) + 1) + _COMPACT_SLACK:
            return
        self._global = []
        self._push_best(self._root, _ROOT)
        index = self._index
        for digest in working_set:
            prefix = index.get(digest)
            if prefix is not None:
                self._push_best(prefix, digest)
