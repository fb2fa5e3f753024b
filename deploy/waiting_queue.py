"""vLLM's waiting queue, indexed by the Chunked Hash Tree, with an admission gate.

:class:`CHTWaitingQueue` implements vLLM's ``RequestQueue`` (the interface the v1 scheduler
uses for ``self.waiting``). It keeps every request the scheduler hands it in a
:class:`cache_core.cht.tree.ChunkedHashTree`, fed with vLLM's own ``request.block_hashes`` (one
digest per full KV block, already chained by vLLM; ``add_block_hashes`` reads the first 8 bytes of
each, as :func:`traces.chunk_hash.block_hash_digests` does, so nothing is hashed twice). The
tree's chunk size is vLLM's hash block size, so one block is one chunk.

vLLM's admission loop asks, per iteration: ``if not waiting: break``; ``waiting.peek_request()``;
... ``waiting.pop_request()``. While the scheduler holds the queue open for a step
(:meth:`CHTWaitingQueue.admitting`), ``bool(queue)`` is that decision point: it asks the
:class:`~deploy.admission.Admission` for the next request, remembers it for ``peek``/``pop``,
and is False on STOP, which ends admission for the step. Outside that window the queue
behaves as vLLM's FCFS queue. Everything else (budgets, KV allocation, preemption) stays
vLLM's.

Invariants:

* every waiting request is in ``_fcfs`` (arrival order; requests vLLM prepends, i.e.
  preempted or skipped ones, at the front) and waits in the tree;
* every request popped (admitted) and not yet finished or prepended again is in
  ``_running`` and active in the tree;
* ``step`` counts the admission windows opened, one per ``schedule()`` call, i.e. the engine
  steps (from 1, as the simulator's ``step``); every request in the engine has its arrival
  step in ``_arrival_step``: the step it first waited in (``step + 1`` when vLLM adds it
  between steps), kept across preemption, dropped when it leaves the engine.

Costs: add/remove/pop O(tree update); FCFS front O(1); best candidate O(tree ``find_best``);
``k`` candidates O(tree ``top_candidates``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.request import Request


class CHTWaitingQueue(RequestQueue):
    """A ``RequestQueue`` over a CHT; see the module docstring for the protocol and invariants."""

    def __init__(self, tree) -> None:
        self.tree = tree
        self._fcfs: OrderedDict[str, Request] = OrderedDict()
        self._resumed: set[str] = set()
        self._running: set[str] = set()
        self._admission = None
        self._chosen: Request | None = None
        self._arrival_step: dict[str, int] = {}
        self.step = 0

    # --- the admission window -------------------------------------------------------------
    @contextmanager
    def admitting(self, admission):
        """Within this block ``bool(self)`` asks ``admission.next_admission(self)`` (None = STOP)."""
        self._admission, self._chosen = admission, None
        self.step += 1
        admission.begin_step()
        try:
            yield
        finally:
            self._admission, self._chosen = None, None

    def __bool__(self) -> bool:
        if not self._fcfs:
            return False
        if self._admission is None:
            return True
        self._chosen = self._admission.next_admission(self)
        return self._chosen is not None

    # --- what an Admission reads ----------------------------------------------------------
    def front(self) -> Request:
        """The FCFS head: the earliest-queued request (resumed requests first). O(1)."""
        return next(iter(self._fcfs.values()))

    def best(self) -> Request:
        """The CHT's best candidate: fewest chunks missing from the running set. O(log W)."""
        return self._fcfs[self.tree.find_best()]

    def candidate_ids(self, k: int) -> list[str]:
        """The ids of the CHT's ``k`` candidates (``tree.top_candidates``): the best request of each
        of its ``k`` best prefix groups, ``best()`` first; fewer when fewer groups wait."""
        return self.tree.top_candidates(k)

    def waiting_request(self, request_id) -> Request:
        """The waiting request with ``request_id`` (KeyError if it is not waiting). O(1)."""
        return self._fcfs[request_id]

    def wait_steps(self, request: Request) -> int:
        """Engine steps the waiting ``request`` has waited before the current one (0 in its
        arrival step). O(1)."""
        return self.step - self._arrival_step[request.request_id]

    def is_resumed(self, request: Request) -> bool:
        """True for a request vLLM put back (preempted or skipped): it was admitted before."""
        return request.request_id in self._resumed

    @property
    def num_running(self) -> int:
        """Requests admitted through this queue and still running."""
        return len(self._running)

    # --- lifecycle hooks --------------------------------------------------------------------
    def finish_running(self, request: Request) -> None:
        """A running request left the engine (finished or aborted): drop it from the tree."""
        self._arrival_step.pop(request.request_id, None)
        self._leave_running(request)

    # --- RequestQueue -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._arrival_step.setdefault(request.request_id, self.step + 1)
        self._enqueue(request)

    def pop_request(self) -> Request:
        request = self.peek_request()
        self._chosen = None
        del self._fcfs[request.request_id]
        self._resumed.discard(request.request_id)
        self.tree.activate(request.request_id)
        self._running.add(request.request_id)
        return request

    def peek_request(self) -> Request:
        if not self._fcfs:
            raise IndexError("peek from an empty queue")
        return self._chosen if self._chosen is not None else self.front()

    def prepend_request(self, request: Request) -> None:
        self._enqueue(request)
        self._fcfs.move_to_end(request.request_id, last=False)
        self._resumed.add(request.request_id)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        # Same order as vLLM's deque.extendleft: the last one given ends up in front.
        for request in requests:
            self.prepend_request(request)

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        # vLLM also passes requests that sit in its other queue: those are ignored.
        for request in requests:
            if self._fcfs.pop(request.request_id, None) is not None:
                self._resumed.discard(request.request_id)
                self._arrival_step.pop(request.request_id, None)
                self.tree.remove(request.request_id)
                if self._chosen is request:
                    self._chosen = None

    def __len__(self) -> int:
        return len(self._fcfs)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._fcfs.values()))

    def __getitem__(self, index: int) -> Request:
        """The ``index``-th waiting request in FCFS order, as vLLM's deque-based FCFS queue indexes
        (its tests read ``scheduler.waiting[i]``). O(W)."""
        return list(self._fcfs.values())[index]

    def _leave_running(self, request: Request) -> None:
        if request.request_id in self._running:
            self._running.discard(request.request_id)
            self.tree.finish(request.request_id)

    def _enqueue(self, request: Request) -> None:
        self._leave_running(request)  # a preempted or resumable request leaves the running set
        self._fcfs[request.request_id] = request
        self.tree.add_block_hashes(request.request_id, request.block_hashes)
