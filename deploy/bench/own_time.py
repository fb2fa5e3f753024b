"""The time a scheduler spends in its own code beside vLLM's: its waiting queue and, for the Feather
scheduler, its step log and metrics.

:class:`OwnTime` attaches to a built scheduler (vLLM's or Feather's) and adds up the wall time of
every call into the parts that differ between the two:

* the waiting queue's ``RequestQueue`` methods and ``bool(queue)`` (where the Feather queue runs its
  admission decision: the CHT's candidates, the observation, the policy), and the Feather queue's
  ``finish_running``;
* the Feather scheduler's per-step bookkeeping: ``_step_record`` (the step log's record, the batch
  composition included), ``_report_metrics``, the step log's ``end`` and the composition's
  ``leave``.

vLLM's deque-based FCFS queue is metered the same way, so a Feather figure minus vLLM's is the time
Feather adds; everything else in the step (KV allocation, prefix-cache lookups, outputs) is vLLM's
own code on both sides. The clock is the thread's CPU time, as the step timings', so time the
thread spends descheduled on a busy machine is not counted; the clock's own cost inside a metered
call (measured when the meter is built) is subtracted. A metered call still costs two clock reads
and a Python call more than it would unmetered, on both sides alike.

Invariant: :meth:`take` returns the nanoseconds metered since the previous ``take`` (or attachment)
and nothing is counted twice (a metered method calling another metered one counts once).
"""

from __future__ import annotations

import time

#: The waiting queue's methods that are metered (those a scheduler calls).
QUEUE_METHODS = ("__bool__", "peek_request", "pop_request", "add_request", "prepend_request", "prepend_requests",
                 "remove_request", "remove_requests", "finish_running")
#: Metered calls of nothing whose median time is the clock's own cost, subtracted from every call.
CALIBRATION_CALLS = 501
#: The Feather scheduler's per-step bookkeeping that is metered (instance attributes).
FEATHER_STEP_METHODS = ("_step_record", "_report_metrics")


class OwnTime:
    """Meters ``scheduler``'s own code (see the module docstring); :meth:`take` reads the counter."""

    def __init__(self, scheduler) -> None:
        self._ns = 0
        self._depth = 0
        self._clock_ns = 0
        nothing, samples = self._wrap(lambda: None), []
        for _ in range(CALIBRATION_CALLS):
            nothing()
            samples.append(self.take())
        self._clock_ns = sorted(samples)[CALIBRATION_CALLS // 2]     # the clock's own cost in a metered call
        queue = scheduler.waiting
        queue.__class__ = type(f"Metered{type(queue).__name__}", (type(queue),),
                               {name: self._wrap(getattr(type(queue), name))
                                for name in QUEUE_METHODS if hasattr(type(queue), name)})
        for name in FEATHER_STEP_METHODS:
            if hasattr(scheduler, name):
                setattr(scheduler, name, self._wrap(getattr(scheduler, name)))
        for owner, name in (("step_log", "end"), ("decode_composition", "leave")):
            target = getattr(scheduler, owner, None)
            if target is not None:
                setattr(scheduler, owner, _Proxy(target, name, self._wrap(getattr(target, name))))

    def take(self) -> int:
        """Nanoseconds metered since the previous call."""
        ns, self._ns = self._ns, 0
        return ns

    def _wrap(self, method):
        clock = time.thread_time_ns

        def metered(*args, **kwargs):
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                self._ns += clock() - start - self._clock_ns
                self._depth -= 1
        return metered


class _Proxy:
    """``target`` with one method replaced (for objects whose attributes cannot be set, compiled ones)."""

    def __init__(self, target, name: str, replacement) -> None:
        self._target, self._name, self._replacement = target, name, replacement

    def __getattr__(self, attribute):
        return self._replacement if attribute == self._name else getattr(self._target, attribute)
