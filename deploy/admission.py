"""Who is admitted next, and whether at all: FCFS, or the Feather policy with its safety rules.

An :class:`Admission` answers ``next_admission(queue)`` at each decision point of vLLM's
admission loop (see :mod:`deploy.waiting_queue`): the request to admit next, or ``None`` to
STOP admitting for this engine step.

==================  ===========================================================================
implementation      behaviour
==================  ===========================================================================
FCFSAdmission       the queue's FCFS head, always ADD: the order of vLLM's default scheduler
PolicyAdmission     the CHT's best candidate; the ONNX policy decides ADD/STOP on its observation
==================  ===========================================================================

:class:`PolicyAdmission` rules, in order (each documented as an invariant):

1. A resumed request (preempted/skipped by vLLM, admitted before) is taken first, without a
   decision, as vLLM does.
2. No starvation: when the FCFS head has waited ``max_wait_s`` or more, it is admitted
   (this overrides both the CHT order and a STOP).
3. No idling: with nothing running, the best candidate is admitted (a STOP would leave the
   engine with no work).
4. A policy that raises or returns NaN makes the rest of this engine step FCFS; the engine
   keeps serving, and the fallback is counted in :class:`AdmissionStats` and logged (the first
   time and at every power of two).
5. Otherwise the policy's greedy action on the candidate's observation is the answer.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass

from feather_gym.observation import build_observation

logger = logging.getLogger(__name__)

#: Default waiting-time bound (seconds) after which the oldest request is admitted regardless.
DEFAULT_MAX_WAIT_S = 10.0


@dataclass
class AdmissionStats:
    """Counters of one :class:`PolicyAdmission` (all cumulative)."""

    decisions: int = 0          # policy answered (ADD or STOP)
    adds: int = 0               # ... and answered ADD
    stops: int = 0              # ... and answered STOP
    forced_resumed: int = 0     # rule 1
    forced_wait: int = 0        # rule 2 (waiting-time bound overrode the policy)
    forced_idle: int = 0        # rule 3
    fallbacks: int = 0          # rule 4: policy raised or returned NaN
    fcfs_admissions: int = 0    # admissions decided FCFS after a fallback in the same step
    policy_ns: int = 0          # wall time spent building observations and running the policy

    def as_dict(self) -> dict:
        return asdict(self)


class Admission(ABC):
    """One admission strategy; called only between ``begin_step`` calls of one scheduler."""

    def begin_step(self) -> None:
        """A new engine step's admission scan starts."""

    def describe(self) -> dict:
        """The admission's name and counters, for reports."""
        return {"admission": type(self).__name__}

    @abstractmethod
    def next_admission(self, queue) -> object | None:
        """The request of the non-empty ``queue`` to admit next, or None for STOP."""


class FCFSAdmission(Admission):
    """vLLM's default order: the FCFS head, always ADD."""

    def next_admission(self, queue):
        return queue.front()


class PolicyAdmission(Admission):
    """The CHT candidate, admitted when ``policy.decide(observation)`` says ADD (rules in module doc).

    ``num_running`` and ``kv_usage`` read the scheduler live (requests running including those
    admitted this step; fraction of KV blocks in use). ``clock`` is the clock of vLLM's
    ``request.arrival_time`` (wall time).
    """

    def __init__(self, policy, *, num_running: Callable[[], int], kv_usage: Callable[[], float],
                 max_wait_s: float = DEFAULT_MAX_WAIT_S, clock: Callable[[], float] = time.time) -> None:
        if not max_wait_s >= 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.policy = policy
        self.max_wait_s = float(max_wait_s)
        self.stats = AdmissionStats()
        self._num_running = num_running
        self._kv_usage = kv_usage
        self._clock = clock
        self._fcfs_this_step = False

    def begin_step(self) -> None:
        self._fcfs_this_step = False

    def describe(self) -> dict:
        return {**super().describe(), **self.stats.as_dict()}

    def next_admission(self, queue):
        head = queue.front()
        if queue.is_resumed(head):
            self.stats.forced_resumed += 1
            return head
        oldest_wait_s = self._clock() - head.arrival_time
        if oldest_wait_s >= self.max_wait_s:
            self.stats.forced_wait += 1
            return head
        if self._fcfs_this_step:
            self.stats.fcfs_admissions += 1
            return head
        candidate = queue.best()
        num_running = self._num_running()
        if num_running == 0:
            self.stats.forced_idle += 1
            return candidate
        start = time.perf_counter_ns()
        try:
            add = self.policy.decide(self._observation(queue, candidate, num_running, oldest_wait_s))
        except Exception as exc:  # any policy failure degrades to FCFS, never stops serving
            self._fall_back(exc)
            self.stats.fcfs_admissions += 1
            return head
        finally:
            self.stats.policy_ns += time.perf_counter_ns() - start
        self.stats.decisions += 1
        if add:
            self.stats.adds += 1
            return candidate
        self.stats.stops += 1
        return None

    def _observation(self, queue, candidate, num_running: int, oldest_wait_s: float):
        tree = queue.tree
        stats = tree.candidate_stats(candidate.request_id)
        cached = (stats.num_chunks - stats.missing_chunks) / stats.num_chunks if stats.num_chunks else 0.0
        return build_observation(
            batch_size=num_running,
            chunk_loss=stats.chunk_loss,
            same_prefix_waiting=stats.same_prefix_waiting,
            running_common_prefix=tree.running_common_prefix,
            candidate_context_tokens=candidate.num_tokens,
            candidate_cached_fraction=cached,
            kv_utilisation=self._kv_usage(),
            num_waiting=len(queue),
            oldest_wait_s=oldest_wait_s,
        )

    def _fall_back(self, exc: Exception) -> None:
        self._fcfs_this_step = True
        self.stats.fallbacks += 1
        count = self.stats.fallbacks
        if count & (count - 1) == 0:  # 1, 2, 4, 8, ...
            logger.warning("Feather policy failed (%s: %s); this step admits FCFS (%d fallback%s so far)",
                           type(exc).__name__, exc, count, "" if count == 1 else "s")
