"""Scheduling policies for the Feather MDP: an ordering proposes, the policy admits one or STOPs.

At every admission point the simulator shows a policy up to ``policy.num_candidates`` (``k``)
candidates its ordering proposes (:mod:`feather_gym.orderings`; slot 0 is the ordering's own
candidate) as an :class:`~feather_gym.simulator.AdmissionPoint`: ``batch_size``, ``step``,
``candidates``, the ``raw`` features of slot 0, every slot's ``raw_rows`` and the normalised
``observation`` (:class:`~feather_gym.observation.DecisionPoint`), plus the simulator-only
``request``, CHT ``stats`` and ``sim`` (slot 0's). A policy answers an action: 0 STOP, ``i``
admit slot ``i - 1`` (``k = 1``: STOP or ADD). Policies that read only the
:class:`DecisionPoint` part and order by the CHT (cht, the rule, cht-dfs, trained policies)
are *deployable*: :mod:`deploy.admission` runs the same objects inside vLLM.

==============  ================  ============================================================
name            ordering          decision
==============  ================  ============================================================
fcfs            FCFSOrder         always ADD: vLLM's default (the batch is bounded by
                                  ``max_num_seqs``, the token budget and the KV cache)
lpm             LPMOrder          always ADD: SGLang's longest-prefix-match (FCFS beyond 128)
dfs             DFSWeightOrder    always ADD: SGLang's DFS-weight
cht             CHTOrder          always ADD: the Feather scheduler's order without its STOPs
                                  (what of a gain is the CHT's ordering; deployable)
feather-rule    CHTOrder          the threshold rule of the Feather vLLM pull request
feather-hold    CHTOrder          the rule holding new requests for :data:`DEFAULT_HOLD_STEPS`
                                  engine steps while a batch runs (:func:`feather_hold`)
feather-        CHTOrder, k = 4   the hold on the one of the CHT's 4 best groups' candidates whose
resident                          prefix the KV cache holds deepest (:class:`ResidentFirstRule`)
cht-dfs         CHTOrder, k = 4   always admits, choosing among the CHT's 4 candidate groups
                                  the one with the most waiting requests (DFS-weight's
                                  heavier-subtree-first as a k-way choice)
hrrn            HRRNOrder         always ADD: SGLang's highest-response-ratio-next (waiting
                                  and uncached prefill in engine steps); simulator-only, see
                                  :func:`hrrn`
group-label     GroupOrder        ADD within the running groups (the generators' group
                                  labels), else STOP once the batch reaches ``min_batch``;
                                  not an upper bound, and FCFS on traces without labels
rule-playout    CHTOrder, k = 4   plays every action out on a copy of the simulator, the rule
                                  deciding after it, and takes the one finishing soonest (one
                                  exact step of policy iteration on the rule); simulator-only
                                  and clairvoyant (the playouts know the true output lengths)
rule-playout-   CHTOrder, k = 4   the same on 4 futures whose output lengths are drawn from
sampled                           the trace's distribution given what each request emitted:
                                  no foresight of lengths; simulator-only
rule-playout-   CHTOrder, k = 4   ``rule-playout`` taking the action whose playout has the most
goodput                           requests within the device's default SLO; simulator-only and
                                  clairvoyant (``rule-playout-sampled-goodput``: on 4 sampled
                                  futures, as ``rule-playout-sampled``)
PATH.onnx       CHTOrder, its k   a trained policy's greedy action on the observation
==============  ================  ============================================================

:func:`make_policy` builds any of them by name. Policies are stateful only where documented
and :meth:`Policy.reset` clears that state before each run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from feather_gym.observation import ADD, DEFAULT_NUM_CANDIDATES, FEATURE_INDEX, STOP, check_num_candidates
from feather_gym.orderings import (
    CHTOrder,
    DFSWeightOrder,
    FCFSOrder,
    GroupOrder,
    HRRNOrder,
    LPMOrder,
    WaitingOrder,
)
from feather_gym.slo import DEFAULT_SLOS

#: Waiting-time bound of the admission, in engine steps, in the simulator and in the deployed
#: scheduler alike: the earliest-arrived waiting request is admitted, unasked, once this many
#: engine steps have begun since the step it arrived in. Counted in steps, not seconds, so a
#: simulated and a live engine that schedule alike also bound alike, whatever the machine's speed.
DEFAULT_MAX_WAIT_STEPS = 32


def check_max_wait_steps(steps: int) -> int:
    """``steps`` as an int, or ``ValueError`` unless it is a whole number >= 0."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
        raise ValueError(f"max_wait_steps must be a whole number of engine steps >= 0, got {steps!r}")
    return int(steps)
_LOSS, _SAME, _WAITED, _RESIDENT = (FEATURE_INDEX["chunk_loss_tokens"], FEATURE_INDEX["same_prefix_waiting"],
                                    FEATURE_INDEX["oldest_wait_steps"], FEATURE_INDEX["candidate_resident_tokens"])


class Policy(ABC):
    """An admission policy: :meth:`make_order` gives its ordering, :meth:`decide` an action.

    ``num_candidates`` (``k``) is how many candidates it wants offered; a policy that answers
    only STOP (0) or ADD (1, slot 0) works with points of any ``k``.
    """

    name: str = ""
    num_candidates: int = DEFAULT_NUM_CANDIDATES

    def make_order(self) -> WaitingOrder:
        """A fresh ordering for one simulation run (the CHT's best candidate by default)."""
        return CHTOrder()

    def reset(self) -> None:
        """Forget per-run state (called before each run)."""

    @abstractmethod
    def decide(self, point) -> int:
        """The action for ``point`` (an :class:`~feather_gym.simulator.AdmissionPoint`): STOP (0),
        or ``i`` to admit its slot ``i - 1`` (ADD = 1, the first candidate)."""


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

    Reads only the observation's raw features and the engine step, so the same object decides
    in the simulator and in vLLM (:mod:`deploy.admission`). Thresholds are in tokens (the
    pull request's 5 and 7 chunks of 256 tokens), so they mean the same at every block size.

    1. The first request (empty batch) is always admitted.
    2. ADD while the candidate's chunk loss is at most ``loss_limit_tokens``, or at most
       ``crowded_loss_limit_tokens`` when ``crowded_waiting`` or more waiting requests (the
       candidate included) share its prefix.
    3. Otherwise ADD only while the batch is smaller than a floor: ``floor_start`` plus one
       for every ``floor_growth_steps`` engine steps in which the rule has refused a
       candidate, up to ``max_floor``. State: the refused-step count (cleared by :meth:`reset`).
    4. With ``hold_steps`` H > 0, an ADD of rules 2-3 is a STOP while the earliest-arrived waiting
       request has waited fewer than H engine steps (``oldest_wait_steps``): while a batch
       runs, new requests gather for H steps before any is admitted, so the CHT chooses among
       more of them and fewer steps mix a new prefill into the running decodes. An engine step
       with an empty batch still admits (rule 1), and the waiting-time bound of the admission
       still admits every request that waits too long. Held STOPs do not grow the floor.
    """

    name = "feather-rule"

    def __init__(self, *, loss_limit_tokens: int = 1280, crowded_loss_limit_tokens: int = 1792,
                 crowded_waiting: int = 10, floor_start: int = 1, max_floor: int = 10,
                 floor_growth_steps: int = 4, hold_steps: int = 0) -> None:
        if floor_growth_steps < 1:
            raise ValueError(f"floor_growth_steps must be >= 1, got {floor_growth_steps}")
        if isinstance(hold_steps, bool) or not isinstance(hold_steps, int) or hold_steps < 0:
            raise ValueError(f"hold_steps must be a whole number of engine steps >= 0, got {hold_steps!r}")
        self.hold_steps = hold_steps
        self.loss_limit_tokens, self.crowded_loss_limit_tokens = loss_limit_tokens, crowded_loss_limit_tokens
        self.crowded_waiting = crowded_waiting
        self.floor_start, self.max_floor, self.floor_growth_steps = floor_start, max_floor, floor_growth_steps
        self.reset()

    @classmethod
    def steady_state(cls) -> FeatherRule:
        """The rule with its floor at ``max_floor`` from the start (:meth:`in_steady_state`)."""
        return cls().in_steady_state()

    def in_steady_state(self) -> FeatherRule:
        """This rule, its floor set at ``max_floor`` from the start: stateless, a function of the
        observation (what the warm start clones, and what :class:`RulePlayout` plays out)."""
        self.floor_start = self.max_floor
        self.reset()
        return self

    def reset(self) -> None:
        self._refused_steps = 0
        self._last_refused_step = None

    @property
    def floor(self) -> int:
        return min(self.max_floor, self.floor_start + self._refused_steps // self.floor_growth_steps)

    def decide(self, point) -> int:
        return ADD if self._admits(point, point.raw) else STOP

    def _admits(self, point, raw) -> bool:
        """Rules 1-4 on the candidate whose raw features are ``raw`` (counting a refusal)."""
        if point.batch_size == 0:
            return True
        crowded = raw[_SAME] + 1 >= self.crowded_waiting
        if raw[_LOSS] > (self.crowded_loss_limit_tokens if crowded else self.loss_limit_tokens):
            if point.step != self._last_refused_step:
                self._last_refused_step = point.step
                self._refused_steps += 1
            if point.batch_size >= self.floor:
                return False
        return raw[_WAITED] >= self.hold_steps


#: The hold of ``feather-hold``, in engine steps: chosen on the CPU training mix (its generators'
#: seeds and Mooncake's training part, not the sweeps' workloads) as the longest hold tried under
#: which no burst of the mix lost all its requests within the SLO (a burst waits the hold with
#: one request running).
DEFAULT_HOLD_STEPS = 2


def feather_hold(hold_steps: int = DEFAULT_HOLD_STEPS) -> FeatherRule:
    """The Feather rule holding new requests ``hold_steps`` engine steps while a batch runs (rule 4
    of :class:`FeatherRule`), named ``feather-hold``. Deployable, as the rule is."""
    rule = FeatherRule(hold_steps=hold_steps)
    rule.name = "feather-hold"
    return rule


class ResidentFirstRule(FeatherRule):
    """The Feather rule on the CHT's candidate whose prefix the KV cache holds deepest.

    Of the candidates of the CHT's ``num_candidates`` best prefix groups it takes the one with
    the most ``candidate_resident_tokens`` (ties: the CHT's order, so with nothing resident it
    is the rule's own candidate) and admits it when the rule would admit it in slot 0 (rules
    1-4 on its row). It holds new requests as ``feather-hold`` does (``hold_steps``, by default
    :data:`DEFAULT_HOLD_STEPS`, which the same check on the training mix chose for it). The CHT
    ranks groups against the running set only, so a group whose requests finished while its
    prefix stays cached ranks cold there; the KV cache's residency (SGLang LPM's information)
    is what this adds. Deployable (reads only ``raw_rows``); state: the rule's floor.
    """

    name = "feather-resident"

    def __init__(self, num_candidates: int = 4, *, hold_steps: int = DEFAULT_HOLD_STEPS, **rule) -> None:
        super().__init__(hold_steps=hold_steps, **rule)
        self.num_candidates = check_num_candidates(num_candidates)

    def decide(self, point) -> int:
        rows = point.raw_rows[:len(point.candidates)]
        slot = int(np.argmax(rows[:, _RESIDENT]))          # the first of equals
        return ADD + slot if self._admits(point, rows[slot]) else STOP


def hrrn() -> AlwaysAdd:
    """SGLang's HRRN as a baseline: admits whatever :class:`~feather_gym.orderings.HRRNOrder`
    proposes, the starvation-free answer of a cache-aware order (LPM, DFS-weight) to tail latency.

    Simulator-only, like ``lpm`` and ``dfs``: the Feather scheduler in vLLM proposes the CHT's
    candidates (:func:`deploy.scheduler.load_deployable_policy` refuses every other ordering), and
    the observation a deployed policy reads has no per-request waiting time, only the oldest
    request's. Deployed, HRRN would be a waiting queue of its own (vLLM's ``RequestQueue``
    ranking every waiting request by its ratio each step), not a policy over the CHT's candidates.
    """
    return AlwaysAdd("hrrn", HRRNOrder)


class HeaviestGroup(Policy):
    """Always admits, choosing among the CHT's candidate groups the one with the most waiting
    requests (feature ``same_prefix_waiting``; ties: the CHT's order). DFS-weight's heavier
    subtree first, expressed as a k-way choice over the CHT's groups. Deployable (reads only
    ``raw_rows``); stateless. Works on points of any ``k`` (ADD when only one is offered)."""

    name = "cht-dfs"

    def __init__(self, num_candidates: int = 4) -> None:
        self.num_candidates = num_candidates

    def decide(self, point) -> int:
        if len(point.candidates) == 1:
            return ADD
        return ADD + int(np.argmax(point.raw_rows[:len(point.candidates), _SAME]))


class GroupLabelPolicy(Policy):
    """Reads the group labels the generators write (``Request.group``): batches stay within
    running groups.

    ADD when the candidate's group already runs, when it has no label (it shares with no one,
    so it cannot break a group's sharing), or while the batch is below ``min_batch``;
    otherwise STOP. The :class:`GroupOrder` ordering proposes running groups first. It is a
    reference, not an upper bound (other policies can beat it), and on a trace without labels
    it admits everything in arrival order, as FCFS does.
    """

    name = "group-label"

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
    """A trained policy file (``*.onnx``): its greedy action on the observation, over as many
    CHT candidates as it was trained with (``num_candidates``, from its metadata).

    The file is loaded, and its observation contract checked, when the policy is built
    (:class:`~feather_gym.policy_runtime.OnnxPolicy`; ``device`` "cpu" or "cuda"). Its
    ``decide`` raises what the runtime raises (a non-finite output, a broken session).
    """

    def __init__(self, path: str, *, device: str = "cpu") -> None:
        from feather_gym.policy_runtime import OnnxPolicy

        self.path = path
        self.name = path
        self.runtime = OnnxPolicy(path, device=device)
        self.num_candidates = self.runtime.num_candidates

    def decide(self, point) -> int:
        return self.runtime.act(point.observation)


class RulePlayout(Policy):
    """One step of policy iteration on the Feather rule, by simulation: at each decision every
    distinct action (STOP and each filled candidate slot) is played out on a fork of the
    simulator (:meth:`~feather_gym.simulator.Simulator.fork`), the steady-state rule
    (:meth:`FeatherRule.steady_state`) deciding every later admission, and the action whose
    playout finishes the run soonest is taken (the rule's own unless another finishes sooner by
    more than a relative ``1e-9``).

    ``objective="goodput"`` (``rule-playout-goodput``) takes instead the action whose playout has
    the most requests meeting the SLO of the profile's device
    (:data:`feather_gym.slo.DEFAULT_SLOS`), the rule's own unless another has more: the same
    bound for goodput, where below capacity every action finishes with the last arrival.

    With ``samples=None`` (``rule-playout``) the playouts run the trace's true output lengths:
    exact, and clairvoyant, so a bound on what one step of improving the rule is worth. With
    ``samples=S`` (``rule-playout-sampled``) each action is played out on ``S`` futures whose
    unfinished requests' output lengths are drawn by :func:`sampled_output_lengths` (the same
    futures for every action, :func:`playout_futures`), and the action with the soonest mean
    finish is taken: no foresight of output lengths, so what an observation of the queue could
    reach. Both read the simulator's whole state, every later arrival included: never
    deployable, never a target. They cost about ``decisions x (k + 1) x max(S, 1)`` playouts
    per run. Stateless."""

    def __init__(self, samples: int | None = None, objective: str = "finish") -> None:
        if samples is not None and samples < 1:
            raise ValueError(f"samples: at least 1 (or None for the true output lengths), got {samples}")
        if objective not in PLAYOUT_OBJECTIVES:
            raise ValueError(f"objective: one of {', '.join(PLAYOUT_OBJECTIVES)}, got {objective!r}")
        self.rule = FeatherRule.steady_state()
        self.samples, self.objective = samples, objective
        self.name = ("rule-playout" + ("" if samples is None else "-sampled")
                     + ("" if objective == "finish" else f"-{objective}"))

    def decide(self, point) -> int:
        own, sim = self.rule.decide(point), point.sim
        futures = playout_futures(sim, self.samples)
        score = {action: np.mean([self._playout(sim.fork(future), action) for future in futures])
                 for action in point.distinct_actions}
        best = max(score, key=score.get)
        return best if score[best] > score.get(own, -np.inf) + 1e-9 * abs(score.get(own, 0.0)) else own

    def _playout(self, sim, action: int) -> float:
        """The objective's score (higher is better) of ``sim`` run to its end with ``action`` taken
        now and the rule deciding after it: minus the finish time, or the requests meeting the SLO."""
        sim.apply(action)
        while (later := sim.next_admission()) is not None:
            sim.apply(self.rule.decide(later))
        return PLAYOUT_OBJECTIVES[self.objective](sim)


def _finish_score(sim) -> float:
    """Minus when the finished simulation ``sim`` ended (seconds)."""
    return -sim.now_s


def _goodput_score(sim) -> float:
    """The requests of the finished simulation ``sim`` that meet its device's default SLO."""
    return float(DEFAULT_SLOS[sim.cost_model.device].met(*sim.result().latencies()).sum())


#: What a :class:`RulePlayout` maximises at the end of each playout, by name.
PLAYOUT_OBJECTIVES = {"finish": _finish_score, "goodput": _goodput_score}


def sampled_output_lengths(sim, rng: np.random.Generator) -> np.ndarray:
    """One draw of every request's output length given only what a scheduler can know: each
    request's length is drawn uniformly from the trace's output lengths (the workload's
    distribution, not which request has which) that exceed the tokens it has emitted
    (:meth:`~feather_gym.simulator.Simulator.emitted_tokens`); emitted ``+ 1`` when none does.
    Finished requests' draws are ignored by :meth:`~feather_gym.simulator.Simulator.fork`."""
    pool = np.sort([request.output_len for request in sim.trace.requests])
    emitted = sim.emitted_tokens()
    first = np.searchsorted(pool, emitted, side="right")
    draw = first + np.floor(rng.random(len(emitted)) * (len(pool) - first)).astype(np.int64)
    return np.where(first < len(pool), pool[np.minimum(draw, len(pool) - 1)], emitted + 1)


def playout_futures(sim, samples: int | None) -> list[np.ndarray | None]:
    """The output lengths to play ``sim``'s pending decision out on: ``[None]`` (the trace's true
    ones) for ``samples=None``, else ``samples`` draws of :func:`sampled_output_lengths` from a
    generator seeded by the decision (its step and index), so every action played out there,
    and every run of the same decision, gets the same futures."""
    if samples is None:
        return [None]
    rng = np.random.default_rng([sim.step, sim.num_decisions])
    return [sampled_output_lengths(sim, rng) for _ in range(samples)]


#: Output-length futures per action of ``rule-playout-sampled`` and of the improved warm start.
DEFAULT_PLAYOUT_SAMPLES = 4

#: Policies that need the simulator's state (:class:`RulePlayout`): built by :func:`make_policy`
#: on request, never run as baselines.
SIMULATOR_ONLY = {"rule-playout": RulePlayout,
                  "rule-playout-sampled": lambda: RulePlayout(samples=DEFAULT_PLAYOUT_SAMPLES),
                  "rule-playout-goodput": lambda: RulePlayout(objective="goodput"),
                  "rule-playout-sampled-goodput": lambda: RulePlayout(samples=DEFAULT_PLAYOUT_SAMPLES,
                                                                      objective="goodput")}
#: The playout references of :mod:`trainer.headroom`.
PLAYOUT_REFERENCES = ("rule-playout", "rule-playout-sampled")

BASELINES = {
    "fcfs": lambda: AlwaysAdd("fcfs", FCFSOrder),
    "lpm": lambda: AlwaysAdd("lpm", LPMOrder),
    "dfs": lambda: AlwaysAdd("dfs", DFSWeightOrder),
    "cht": lambda: AlwaysAdd("cht", CHTOrder),
    "hrrn": hrrn,
    "feather-rule": FeatherRule,
    "feather-hold": feather_hold,
    "feather-resident": ResidentFirstRule,
    "cht-dfs": HeaviestGroup,
    "group-label": GroupLabelPolicy,
}


def make_policy(name_or_path: str, *, device: str = "cpu") -> Policy:
    """A baseline by name (:data:`BASELINES`), a simulator-only reference (:data:`SIMULATOR_ONLY`)
    or a trained policy from a ``*.onnx`` path."""
    if name_or_path.endswith(".onnx"):
        return OnnxFilePolicy(name_or_path, device=device)
    named = {**BASELINES, **SIMULATOR_ONLY}
    if name_or_path not in named:
        raise ValueError(f"unknown policy {name_or_path!r}; choose one of {', '.join(named)} or a *.onnx file")
    return named[name_or_path]()
