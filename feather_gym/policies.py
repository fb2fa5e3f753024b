"""Scheduling policies for the Feather MDP: an ordering proposes, the policy says ADD or STOP.

At every admission point the simulator shows a policy the candidate its ordering proposes
(:mod:`feather_gym.orderings`) as an :class:`~feather_gym.simulator.AdmissionPoint`:
``batch_size``, ``request``, the CHT ``stats`` and the normalised ``observation``.

==============  ================  ============================================================
name            ordering          decision
==============  ================  ============================================================
fcfs            FCFSOrder         always ADD: vLLM's default (the batch is bounded by
                                  ``max_num_seqs``, the token budget and the KV cache)
lpm             LPMOrder          always ADD: SGLang's longest-prefix-match (FCFS beyond 128)
dfs             DFSWeightOrder    always ADD: SGLang's DFS-weight
feather-rule    CHTOrder          the threshold rule of the Feather vLLM pull request
oracle          GroupOrder        ADD within the running groups (true labels), else STOP once
                                  the batch reaches ``min_batch``
PATH.onnx       CHTOrder          a trained policy's greedy action on the observation
==============  ================  ============================================================

:func:`make_policy` builds any of them by name. Policies are stateful only where documented
and :meth:`Policy.reset` clears that state before each run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from feather_gym.observation import ADD, STOP
from feather_gym.orderings import CHTOrder, DFSWeightOrder, FCFSOrder, GroupOrder, LPMOrder, WaitingOrder


class Policy(ABC):
    """An admission policy: :meth:`make_order` gives its ordering, :meth:`decide` ADD (1) or STOP (0)."""

    name: str = ""

    def make_order(self) -> WaitingOrder:
        """A fresh ordering for one simulation run (the CHT's best candidate by default)."""
        return CHTOrder()

    def reset(self) -> None:
        """Forget per-run state (called before each run)."""

    @abstractmethod
    def decide(self, point) -> int:
        """ADD or STOP for ``point`` (an :class:`~feather_gym.simulator.AdmissionPoint`)."""


class AlwaysAdd(Policy):
    """Admit whatever the ordering proposes while the engine's limits allow."""

    def __init__(self, name: str, order_factory) -> None:
        self.name = name
        self._order_factory = order_factory

    def make_order(self) -> WaitingOrder:
        return self._order_factory()

    def decide(self, point) -> int:
        return ADD


class FeatherRule(Policy):
    """The Feather threshold rule (Feather vLLM pull request), on the CHT's best candidate.

    1. The first request (empty batch) is always admitted.
    2. ADD while the candidate's chunk loss is at most ``loss_limit`` chunks, or at most
       ``crowded_loss_limit`` when ``crowded_waiting`` or more waiting requests (the candidate
       included) share its prefix.
    3. Otherwise ADD only while the batch is smaller than a floor: ``floor_start`` plus one
       for every ``floor_growth_steps`` engine steps in which the rule has refused a
       candidate, up to ``max_floor``. State: the refused-step count (cleared by :meth:`reset`).
    """

    name = "feather-rule"

    def __init__(self, *, loss_limit: int = 5, crowded_loss_limit: int = 7, crowded_waiting: int = 10,
                 floor_start: int = 1, max_floor: int = 10, floor_growth_steps: int = 4) -> None:
        if floor_growth_steps < 1:
            raise ValueError(f"floor_growth_steps must be >= 1, got {floor_growth_steps}")
        self.loss_limit, self.crowded_loss_limit, self.crowded_waiting = loss_limit, crowded_loss_limit, crowded_waiting
        self.floor_start, self.max_floor, self.floor_growth_steps = floor_start, max_floor, floor_growth_steps
        self.reset()

    def reset(self) -> None:
        self._refused_steps = 0
        self._last_refused_step = None

    @property
    def floor(self) -> int:
        return min(self.max_floor, self.floor_start + self._refused_steps // self.floor_growth_steps)

    def decide(self, point) -> int:
        if point.batch_size == 0:
            return ADD
        stats = point.stats
        crowded = stats.same_prefix_waiting + 1 >= self.crowded_waiting
        if stats.chunk_loss <= (self.crowded_loss_limit if crowded else self.loss_limit):
            return ADD
        if point.sim.step != self._last_refused_step:
            self._last_refused_step = point.sim.step
            self._refused_steps += 1
        return ADD if point.batch_size < self.floor else STOP


class GroupOracle(Policy):
    """Knows the true group labels (``Request.group``): batches stay within running groups.

    ADD when the candidate's group already runs, when it has no label (it shares with no one,
    so it cannot break a group's sharing), or while the batch is below ``min_batch``;
    otherwise STOP. The :class:`GroupOrder` ordering proposes running groups first.
    """

    name = "oracle"

    def __init__(self, *, min_batch: int = 10) -> None:
        self.min_batch = min_batch

    def make_order(self) -> WaitingOrder:
        return GroupOrder()

    def decide(self, point) -> int:
        if point.batch_size < self.min_batch or point.request.group is None:
            return ADD
        group_of, candidate_group = point.sim.group_of, point.sim.group_of[point.candidate]
        return ADD if any(group_of[idx] == candidate_group for idx in point.sim.running) else STOP


class OnnxFilePolicy(Policy):
    """A trained policy file (``*.onnx``): greedy ADD/STOP on the observation, CHT candidates.

    onnxruntime is imported when the first decision is made, not before.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.name = path
        self._runtime = None

    def decide(self, point) -> int:
        if self._runtime is None:
            from feather_gym.policy_runtime import OnnxPolicy

            self._runtime = OnnxPolicy(self.path)
        return ADD if self._runtime.decide(point.observation) else STOP


BASELINES = {
    "fcfs": lambda: AlwaysAdd("fcfs", FCFSOrder),
    "lpm": lambda: AlwaysAdd("lpm", LPMOrder),
    "dfs": lambda: AlwaysAdd("dfs", DFSWeightOrder),
    "feather-rule": FeatherRule,
    "oracle": GroupOracle,
}


def make_policy(name_or_path: str) -> Policy:
    """A baseline by name (:data:`BASELINES`) or a trained policy from a ``*.onnx`` path."""
    if name_or_path.endswith(".onnx"):
        return OnnxFilePolicy(name_or_path)
    if name_or_path not in BASELINES:
        raise ValueError(f"unknown policy {name_or_path!r}; choose one of {', '.join(BASELINES)} or a *.onnx file")
    return BASELINES[name_or_path]()
