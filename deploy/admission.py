"""Who is admitted next, and whether at all: FCFS, or a Feather policy with its safety rules.

An :class:`Admission` answers ``next_admission(queue)`` at each decision point of vLLM's
admission loop (see :mod:`deploy.waiting_queue`): the request to admit next, or ``None`` to
STOP admitting for this engine step.

==================  ===========================================================================
implementation      behaviour
==================  ===========================================================================
FCFSAdmission       the queue's FCFS head, always ADD: the order of vLLM's default scheduler
PolicyAdmission     the CHT's top ``k`` candidates (``k = policy.num_candidates``, 1: its best);
                    a deployable :class:`feather_gym.policies.Policy` (the Feather rule, or a
                    trained ONNX policy) admits one of them or STOPs
==================  ===========================================================================

:class:`PolicyAdmission` is the scheduler's :class:`~feather_gym.observation.AdmissionView`,
so the policy reads the observation the simulator builds, from the same function. Its rules, in
order, are the simulator's (:mod:`feather_gym.simulator`, step 3):

1. A resumed request (preempted/skipped by vLLM, admitted before) is taken first, without a
   decision, as vLLM does.
2. No starvation: when the FCFS head has waited ``max_wait_steps`` engine steps or more
   (:meth:`~deploy.waiting_queue.CHTWaitingQueue.wait_steps`), it is admitted (this overrides
   both the CHT order and a STOP). Steps, not seconds: nothing here reads a clock.
3. A full batch (``max_num_seqs`` running) ends admission without a decision, as vLLM's next
   check would.
4. No idling: with nothing running, the best candidate is admitted (a STOP would leave the
   engine with no work).
5. The policy's action on the candidates (0 STOP, ``i`` admits slot ``i - 1``; an empty slot is
   STOP, :func:`~feather_gym.observation.chosen_slot`). Only the policy call is guarded: when it raises (a
   non-finite output, a broken runtime), the rest of this engine step is FCFS; the engine keeps
   serving, and the fallback is counted in :class:`AdmissionStats` and logged (the first time
   and at every power of two). A failure while building the observation is a bug and raises.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass

from feather_gym.observation import DEFAULT_NUM_CANDIDATES, DecisionPoint
from feather_gym.policies import DEFAULT_MAX_WAIT_STEPS, check_max_wait_steps

logger = logging.getLogger(__name__)


@dataclass
class AdmissionStats:
    """Counters of one :class:`PolicyAdmission` (all cumulative)."""

    decisions: int = 0          # policy answered (ADD or STOP)
    adds: int = 0               # ... and answered ADD
    stops: int = 0              # ... and answered STOP
    forced_resumed: int = 0     # rule 1
    forced_wait: int = 0        # rule 2: the bound chose (one failing vLLM's KV check counts again next step)
    forced_idle: int = 0        # rule 4
    fallbacks: int = 0          # rule 5: the policy call raised
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
    """The CHT candidate, admitted when ``policy.decide(point)`` says ADD (rules in module doc).

    ``policy`` is a deployable :class:`feather_gym.policies.Policy`. ``num_running`` and
    ``kv_usage`` read the scheduler live (requests running including those admitted this step;
    fraction of KV blocks in use); ``max_num_seqs`` is the scheduler's running limit.
    ``resident_tokens(request)`` is the prefix-cache hit, in tokens, a waiting request would
    take if admitted now (:class:`deploy.resident_prefix.ResidentPrefix`; side-effect free).
    ``resumable(request, shared_blocks)`` says how many of a waiting request's first
    ``shared_blocks`` blocks a hit can resume (a hybrid engine's deepest kept state); ``None``,
    a dense engine: all of them.
    """

    def __init__(self, policy, *, num_running: Callable[[], int], kv_usage: Callable[[], float],
                 max_num_seqs: int, resident_tokens: Callable[[object], int],
                 max_wait_steps: int = DEFAULT_MAX_WAIT_STEPS,
                 resumable: Callable[[object, int], int] | None = None) -> None:
        self.policy = policy
        self.max_wait_steps = check_max_wait_steps(max_wait_steps)
        self.max_num_seqs = max_num_seqs
        self.stats = AdmissionStats()
        self._num_running = num_running
        self._kv_usage = kv_usage
        self._resident_tokens = resident_tokens
        self._resumable = resumable
        self._fcfs_this_step = False
        self._queue = None
        self._running_now = self._oldest_now = 0     # the view's figures, read once per decision
        #: When a list (the scheduler's step log is on): ``[observation, action]`` of each policy answer
        #: (the observation as the float32 array the policy read).
        self.decision_log: list | None = None
        #: When a list (the scheduler's metrics): the wall time of each policy decision, in ns.
        self.decision_latencies_ns: list[int] | None = None

    def begin_step(self) -> None:
        self._fcfs_this_step = False

    def describe(self) -> dict:
        return {**super().describe(), "policy": getattr(self.policy, "name", type(self.policy).__name__),
                **self.stats.as_dict()}

    # --- AdmissionView (valid during next_admission) -----------------------------------------
    @property
    def tree(self):
        return self._queue.tree

    @property
    def num_running(self) -> int:
        return self._running_now

    @property
    def kv_utilisation(self) -> float:
        return self._kv_usage()

    @property
    def oldest_wait_steps(self) -> int:
        # After rule 1 the FCFS head is the earliest-arrived waiting request (resumed ones lead).
        return self._oldest_now

    @property
    def policy(self):
        return self._policy

    @policy.setter
    def policy(self, policy) -> None:
        """The policy (a hot swap sets it between steps); its ``k`` is read once here."""
        self._policy = policy
        self._num_candidates = getattr(policy, "num_candidates", DEFAULT_NUM_CANDIDATES)

    def context_tokens(self, request_id) -> int:
        return self._queue.waiting_request(request_id).num_tokens

    def resident_blocks(self, request_id) -> int:
        return self._resident_tokens(self._queue.waiting_request(request_id)) // self.tree.chunk_size

    def resumable_blocks(self, request_id, shared_blocks: int) -> int:
        if self._resumable is None:
            return shared_blocks
        return self._resumable(self._queue.waiting_request(request_id), shared_blocks)

    # --- decisions ----------------------------------------------------------------------------
    def next_admission(self, queue):
        self._queue = queue
        head = queue.front()
        if queue.is_resumed(head):
            self.stats.forced_resumed += 1
            return head
        self._oldest_now = queue.wait_steps(head)
        if self._oldest_now >= self.max_wait_steps:
            self.stats.forced_wait += 1
            return head
        if self._fcfs_this_step:
            self.stats.fcfs_admissions += 1
            return head
        num_running = self._running_now = self._num_running()
        if num_running >= self.max_num_seqs:
            return None
        k = self._num_candidates
        candidates = queue.candidate_ids(k)
        if num_running == 0:
            self.stats.forced_idle += 1
            return queue.waiting_request(candidates[0])
        start = time.perf_counter_ns()
        point = DecisionPoint(self, candidates, queue.step, k)
        point.read_view()   # outside the guard below: a bug here raises rather than falling back
        try:
            action = self.policy.decide(point)
            slot = point.slot(action)
        except Exception as exc:  # any policy failure degrades to FCFS, never stops serving
            self._fall_back(exc)
            self.stats.fcfs_admissions += 1
            return head
        finally:
            elapsed = time.perf_counter_ns() - start
            self.stats.policy_ns += elapsed
            if self.decision_latencies_ns is not None:
                self.decision_latencies_ns.append(elapsed)
        self.stats.decisions += 1
        if self.decision_log is not None:
            self.decision_log.append([point.observation, action])
        if slot is not None:
            self.stats.adds += 1
            return queue.waiting_request(candidates[slot])
        self.stats.stops += 1
        return None

    def _fall_back(self, exc: Exception) -> None:
        self._fcfs_this_step = True
        self.stats.fallbacks += 1
        count = self.stats.fallbacks
        if count & (count - 1) == 0:  # 1, 2, 4, 8, ...
            logger.warning("Feather policy failed (%s: %s); this step admits FCFS (%d fallback%s so far)",
                           type(exc).__name__, exc, count, "" if count == 1 else "s")
