"""The Chunked Hash Tree (CHT): prefix-aware request selection without tree walks.

A request is the chain of its chunk digests (:mod:`traces.chunk_hash`): equal digests mean equal
prefixes, so a digest names a prefix and its depth (the chunks it covers). The CHT holds the
waiting requests and the running ones (the *working set*); a waiting request's ``shared`` chunks
are its leading chunks that some running request also has.

Queries (``n`` chunks of a request; keys compare left to right):

* **Selection key** of a waiting request: ``(n - shared, -shared, arrival)``.
  :meth:`ChunkedHashTree.find_best` returns the waiting request with the smallest.
* **Prefix group** of a waiting request: its deepest prefix shared with another waiting request
  (one with none is a group of its own). :meth:`ChunkedHashTree.top_candidates` returns the best
  request (by selection key) of each of the ``k`` best groups, best first, so
  ``top_candidates(1) == [find_best()]``.
* :meth:`ChunkedHashTree.candidate_stats` (:class:`CandidateStats`), ``running_common_prefix``,
  :meth:`ChunkedHashTree.largest_groups` (:class:`PrefixGroup`).

Representation: a path-compressed trie of the chains of every request, compiled
(``cache_core/cht/native/cht.cpp``, which states its invariants). A node is a run of depths
along which the same requests pass, found by its first digest, and a chain is matched against a
run by binary search: because digests are chained, one comparison at a depth answers for the
whole prefix above it. Per node the trie keeps the waiting and running counts, the best member
of each prefix group in its subtree, and, for the nodes in the working set, one ordered entry
for their best waiting request.

Costs (``L`` nodes on a request's path, the branch points along it, ``W`` waiting requests):
``add``, ``remove``, ``activate`` and ``finish`` O(L log W), plus O(L log n) comparisons for
``add`` and a copy of the chunks nobody else has; ``find_best`` O(1); ``top_candidates(k)``
O(k L log W) (a group is passed over at most once per working-set node above it);
``candidate_stats`` O(L). No operation is proportional to ``n`` beyond copying new chunks.

The pure-Python :class:`cache_core.cht.python_tree.PythonChunkedHashTree` answers identically
and is the oracle of the property tests (``tests/test_cht_native.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cache_core.cht._native import NativeTree
from traces.chunk_hash import DEFAULT_CHUNK_SIZE, chained_chunk_hashes, request_chunk_hashes


@dataclass(frozen=True, slots=True)
class CandidateStats:
    """What the scheduler's observation needs about one waiting request (all in chunks)."""

    shared_chunks: int        #: leading chunks already in the running working set
    missing_chunks: int       #: num_chunks - shared_chunks: chunks to prefill
    chunk_loss: int           #: shrink of running_common_prefix if it joined (0 when none run)
    same_prefix_waiting: int  #: other waiting requests sharing its deepest shared-with-anyone prefix
    num_chunks: int           #: full chunks of the request


#: Columns of :meth:`ChunkedHashTree.candidate_rows`, in order (the fields of :class:`CandidateStats`).
CANDIDATE_COLUMNS: tuple[str, ...] = CandidateStats.__slots__


@dataclass(frozen=True, slots=True)
class PrefixGroup:
    """A set of >= 2 waiting requests that share ``depth`` chunks (and not one more, all)."""

    depth: int
    size: int


class ChunkHashing:
    """What a CHT offers beyond digests: hashing tokens and requests at its ``chunk_size``."""

    chunk_size: int

    def digests_of(self, tokens: np.ndarray) -> np.ndarray:
        """Chained digests of ``tokens`` at this tree's chunk size."""
        return chained_chunk_hashes(tokens, self.chunk_size)

    def add_request(self, request) -> np.ndarray:
        """Add a :class:`traces.Request` (hashed at this chunk size); returns its digests."""
        digests = request_chunk_hashes(request, self.chunk_size)
        self.add(request.request_id, digests)
        return digests


class ChunkedHashTree(ChunkHashing, NativeTree):
    """Waiting queue indexed by chained chunk digests, with a running working set.

    ``chunk_size`` is the tokens per chunk that callers hash with (``digests_of``,
    ``add_request``); the tree itself only sees digests. Request ids are any hashable; an id may
    be reused once its request has finished or been removed.

    Misuse raises ``ValueError`` and changes nothing: adding an id that is waiting or running,
    removing, activating or asking stats of one that is not waiting, finishing one that is not
    running, digests that are not a 1-D integer array, or visibly not a chain (a digest met at
    another depth than where the trie holds it; not every malformed chain is caught).

    Compiled methods: ``add(id, digests)``, ``remove(id)``, ``activate(id)``, ``finish(id)``,
    ``find_best()``, ``top_candidates(k)``, ``shared_chunks(id)``, ``candidate_rows(ids)``
    (int64 ``[len(ids), 5]`` in :data:`CANDIDATE_COLUMNS` order), ``waiting_ids()`` (arrival
    order), ``running_ids()`` (activation order), ``is_waiting(id)``, ``is_running(id)``,
    ``snapshot()`` (the canonical content: equal for equal waiting/running histories) and
    ``memory_entries()`` (all zeros once every request has left); properties ``num_waiting``,
    ``num_running``, ``num_prefixes`` (digests of the waiting requests) and
    ``running_common_prefix`` (chunks common to every running request, 0 when none run).
    """

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        super().__init__()
        self.chunk_size = chunk_size

    def __deepcopy__(self, memo) -> ChunkedHashTree:
        """An independent tree in the same state (request ids are shared, as immutable keys)."""
        copy = type(self)(self.chunk_size)
        copy._assign(self)
        memo[id(self)] = copy
        return copy

    def candidate_stats(self, request_id) -> CandidateStats:
        """Observation features of a waiting request (see :class:`CandidateStats`). O(L)."""
        return CandidateStats(*self._candidate_stats(request_id))

    def largest_groups(self, k: int) -> list[PrefixGroup]:
        """The ``k`` largest prefix groups of waiting requests, largest first, deeper first.

        A group is a prefix contained in >= 2 waiting requests that no single child prefix
        covers entirely (its deepest representative). O(S log S), S = trie nodes held by >= 2
        waiting requests.
        """
        return [PrefixGroup(depth, size) for depth, size in self._largest_groups(k)]
