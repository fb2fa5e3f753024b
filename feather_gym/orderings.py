"""Waiting-queue orderings: which waiting request an admission point proposes.

An ordering is the "queue" half of a scheduling policy (the policy's decision rule is the
other half, see :mod:`feather_gym.policies`), shaped like vLLM v1's ``request_queue.py``:
the simulator calls :meth:`WaitingOrder.add` when a request starts waiting (arrival, or
re-queue after a preemption), :meth:`WaitingOrder.remove` when it is admitted, and
:meth:`WaitingOrder.peek` for the next candidate (:meth:`WaitingOrder.candidates` for up to
``k`` of them, when the policy chooses among several). Orderings read the simulator's state
(the CHT, the prefix cache, the running set) through ``self.sim`` after :meth:`attach`.

=================  ================================================================  =====================
ordering           candidate                                                         peek cost
=================  ================================================================  =====================
FCFSOrder          earliest arrival; preempted requests first (vLLM v1 FCFS)         O(log W) amortised
CHTOrder           ``ChunkedHashTree.find_best()``: fewest chunks missing from the   the CHT's (O(log W))
                   running working set; ``candidates(k)``: the best of each of the
                   k best prefix groups (``top_candidates``)
LPMOrder           longest prefix resident in the KV cache (SGLang LPM); FCFS when   O(W x depth) per step
                   more than ``fcfs_beyond`` requests wait
DFSWeightOrder     SGLang DFS-weight: depth-first over the cached-prefix tree,       O(W x depth) per step
                   heavier subtrees first
GroupOrder         group labels: the earliest waiting request of the group with the most   O(B + groups) per step
                   running requests, else FCFS (knows ``Request.group``)
HRRNOrder          SGLang HRRN: highest ``(waiting + service) / service``, both in   O(W x depth) per step
                   engine steps (service: the uncached prompt over the token budget)
=================  ================================================================  =====================

The per-step orderings (LPM, DFS-weight, group, HRRN) compute one order per engine step, as
SGLang does once per scheduling round, and hand out its entries in turn.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import defaultdict


class WaitingOrder(ABC):
    """Proposes admission candidates among the waiting requests (indices into the trace)."""

    sim = None

    def attach(self, sim) -> None:
        """Bind to the simulator whose waiting requests this orders (called once, before any add)."""
        self.sim = sim

    @abstractmethod
    def add(self, idx: int, *, preempted: bool) -> None:
        """Request ``idx`` starts waiting; ``preempted`` requests go to the front (vLLM prepends them)."""

    @abstractmethod
    def remove(self, idx: int) -> None:
        """Request ``idx`` is admitted (it was waiting)."""

    @abstractmethod
    def peek(self) -> int | None:
        """The next candidate, or None when nothing waits. Does not remove it."""

    def candidates(self, k: int) -> list[int]:
        """Up to ``k`` candidates to choose among, ``peek()`` first (``[]`` when nothing waits).

        By default only ``peek()``: an ordering offers more only where its choices are natural
        (the CHT's distinct prefix groups); the others stay ADD/STOP orderings at any ``k``.
        """
        best = self.peek()
        return [] if best is None else [best]


class FCFSOrder(WaitingOrder):
    """Arrival order with preempted requests in front, most recently preempted first.

    A heap of ``(key, idx)`` with lazy deletion: an entry is live iff ``self._key[idx] == key``.
    """

    def __init__(self) -> None:
        self._key: dict[int, int] = {}
        self._heap: list[tuple[int, int]] = []
        self._counter = 0

    def add(self, idx: int, *, preempted: bool) -> None:
        self._counter += 1
        key = -self._counter if preempted else self._counter
        self._key[idx] = key
        heapq.heappush(self._heap, (key, idx))

    def remove(self, idx: int) -> None:
        del self._key[idx]

    def peek(self) -> int | None:
        heap, keys = self._heap, self._key
        while heap and keys.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][1] if heap else None

    def fcfs_waiting(self) -> list[int]:
        """All waiting requests in FCFS order. O(W log W)."""
        return sorted(self._key, key=self._key.__getitem__)


class CHTOrder(WaitingOrder):
    """The CHT's best candidate; the simulator's CHT is the queue, so add/remove are no-ops."""

    def add(self, idx: int, *, preempted: bool) -> None:
        pass

    def remove(self, idx: int) -> None:
        pass

    def peek(self) -> int | None:
        return self.sim.cht.find_best()

    def candidates(self, k: int) -> list[int]:
        return self.sim.cht.top_candidates(k)


class _PerStepOrder(FCFSOrder):
    """An FCFS queue whose candidates come from an order recomputed once per engine step."""

    def __init__(self) -> None:
        super().__init__()
        self._step = -1
        self._order: list[int] = []
        self._pos = 0

    def peek(self) -> int | None:
        if self._step != self.sim.step:
            self._step, self._order, self._pos = self.sim.step, self._step_order(), 0
        order, keys = self._order, self._key
        while self._pos < len(order) and order[self._pos] not in keys:
            self._pos += 1
        return order[self._pos] if self._pos < len(order) else None

    @abstractmethod
    def _step_order(self) -> list[int]:
        """This step's candidate order over all waiting requests."""


class LPMOrder(_PerStepOrder):
    """SGLang's longest-prefix-match: most resident prefix blocks first, ties FCFS.

    ``fcfs_beyond``: with more waiting requests than this, plain FCFS (SGLang's 128).
    """

    def __init__(self, fcfs_beyond: int = 128) -> None:
        super().__init__()
        self.fcfs_beyond = fcfs_beyond

    def _step_order(self) -> list[int]:
        waiting = self.fcfs_waiting()
        if len(waiting) > self.fcfs_beyond:
            return waiting
        matched = self.sim.kv.cached_prefix
        digests = self.sim.digest_lists
        depth = {idx: matched(digests[idx]) for idx in waiting}
        return sorted(waiting, key=lambda idx: -depth[idx])   # stable: FCFS among equals


class DFSWeightOrder(_PerStepOrder):
    """SGLang's DFS-weight order over the tree of cached prefixes.

    Each waiting request hangs at the deepest resident block of its prefix (the root if none).
    A node's weight is the number of requests in its subtree. The order is a post-order
    traversal visiting children by descending weight (ties: first seen in FCFS order), each
    node's own requests after its children, exactly as SGLang's ``get_dfs_priority``.
    """

    _ROOT = None

    def _step_order(self) -> list[int]:
        matched = self.sim.kv.cached_prefix
        digests = self.sim.digest_lists
        children: dict = defaultdict(dict)      # node -> {child: None} in first-seen order
        weight: dict = defaultdict(int)
        hanging: dict = defaultdict(list)       # node -> its own requests, FCFS
        for idx in self.fcfs_waiting():
            path = digests[idx][: matched(digests[idx])]
            parent = self._ROOT
            weight[parent] += 1
            for node in path:
                children[parent][node] = None
                weight[node] += 1
                parent = node
            hanging[parent].append(idx)
        order: list[int] = []
        stack = [(self._ROOT, False)]
        while stack:                             # iterative post-order (paths can be deep)
            node, expanded = stack.pop()
            if expanded:
                order.extend(hanging[node])
                continue
            stack.append((node, True))
            kids = sorted(children[node], key=lambda child: -weight[child])
            stack.extend((child, False) for child in reversed(kids))
        return order


class GroupOrder(_PerStepOrder):
    """Ordering from the generators' group labels: keep serving the group that dominates the running set.

    Candidates are the waiting requests of the running groups, most running requests first,
    then everyone else in FCFS order. A request without a label is a group of its own.
    """

    def _step_order(self) -> list[int]:
        group_of = self.sim.group_of
        running = defaultdict(int)
        for idx in self.sim.running:
            running[group_of[idx]] += 1
        waiting = self.fcfs_waiting()
        rank = {group: -count for group, count in running.items()}
        return sorted(waiting, key=lambda idx: rank.get(group_of[idx], 0))


class HRRNOrder(_PerStepOrder):
    """SGLang's highest-response-ratio-next: the highest ``(waiting + service) / service`` first,
    ties FCFS.

    Both terms are in engine steps, never seconds (as every waiting figure of the project, see
    :mod:`feather_gym.observation`): ``waiting`` is the steps the request has waited
    (``sim.wait_steps``), ``service`` its expected prefill, the prompt tokens not resident in
    the KV cache (at least one: vLLM always computes the last) over the engine's token budget
    per step. As in SGLang the service is the prefill work alone, since a scheduler does not know
    output lengths. So the ratio is ``1 + waiting x budget / uncached tokens``: shortest uncached
    prefill first, aged by waiting, and a request passed over grows in ratio every step until
    it comes first, however many shorter requests keep arriving (LPM's and DFS-weight's
    starvation; the waiting-time bound of the admission is the other answer to it).
    """

    def _step_order(self) -> list[int]:
        sim = self.sim
        budget, block, digests = sim.config.token_budget, sim.block_size, sim.digest_lists

        def ratio(idx: int) -> float:
            uncached = max(1, sim.context_tokens(idx) - block * sim.kv.cached_prefix(digests[idx]))
            return 1.0 + sim.wait_steps(idx) * budget / uncached

        waiting = self.fcfs_waiting()
        ratios = {idx: ratio(idx) for idx in waiting}
        return sorted(waiting, key=lambda idx: -ratios[idx])   # stable: FCFS among equals
