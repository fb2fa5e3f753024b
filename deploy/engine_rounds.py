"""Rounds of requests through one in-process vLLM engine, each with a fresh scheduler instance.

:func:`install_scheduler` replaces the idle engine core's scheduler by a fresh instance of any
class (vLLM's own ``Scheduler``, :class:`deploy.scheduler.FeatherScheduler`, ...), with the
constructor arguments the engine core gave the old one: same KV-cache layout, empty prefix cache.
:func:`run_round` serves a whole trace with it and returns a :class:`RoundResult`.

Arrivals (:data:`DEFAULT_ONLINE`): ``online`` (the default), each request is submitted once the
wall time since the round's start reaches its trace ``arrival_s`` (from the first arrival) times
``time_scale``, the engine stepping in between and sleeping when idle until the next arrival;
otherwise every request is submitted at the round's start, before the first step. A request
*arrives* at the round's start plus its offset (it is submitted at the first pass of the loop
after that, between two steps). Its TTFT is the time from its arrival to the end of the engine
step that returned its first output token, its TPOT ``(finish - first token) / (output tokens - 1)``,
as the simulator's ``SimResult.latencies`` defines both. Every request is greedy with
``ignore_eos`` and the trace's output length. A request is *lost* when it does not finish with
its full output length within the round's time limit.
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
#: A round that runs longer than this aborts its unfinished requests (they count as lost).
DEFAULT_ROUND_TIMEOUT_S = 600.0


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

    ``outputs`` holds the output tokens of the requests that finished; ``ttft_s`` and ``tpot_s``
    the TTFT and TPOT (seconds) of each request that finished with its full output length, in
    trace order (TPOT NaN for a one-token output); ``lost`` counts the trace's requests that did not
    finish with their full output length (aborted at the time limit, or never submitted);
    ``first_scheduled_step`` the engine step (from 1) that first scheduled each request, in
    trace order (0: never), the simulator's :attr:`~feather_gym.simulator.SimResult.first_scheduled_step`.
    """

    label: str
    wall_s: float
    output_tokens: int
    cached_tokens: int
    ttft_s: np.ndarray
    tpot_s: np.ndarray
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
    arrived: dict[str, float] = {}
    first_token: dict[str, float] = {}
    finished_at: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    outputs, cached, next_index = {}, 0, 0
    engine_ids: list[str | None] = [None] * len(prompts)
    clock = time.perf_counter
    start = clock()
    while True:
        now = clock() - start
        while next_index < len(prompts) and offsets[next_index] <= now:
            engine_ids[next_index] = engine.add_request(*prompts[next_index])   # vLLM adds a random suffix
            arrived[prompts[next_index][0]] = start + offsets[next_index]
            next_index += 1
        if now > timeout_s:
            _abort_unfinished(engine, arrived, outputs, label, timeout_s)
            break
        if engine.has_unfinished_requests():
            step_outputs = engine.step()
            stepped = clock()
            for out in step_outputs:
                new = out.outputs[0].token_ids
                if new and out.request_id not in tokens:
                    first_token[out.request_id] = stepped
                tokens.setdefault(out.request_id, []).extend(new)
                if out.finished:
                    outputs[out.request_id.split(":", 1)[1]] = tokens[out.request_id]
                    finished_at[out.request_id] = stepped
                    cached += out.num_cached_tokens or 0
        elif next_index < len(prompts):
            time.sleep(max(0.0, offsets[next_index] - now))
        else:
            break
    wall_s = clock() - start
    done = [(rid, r.output_len) for (rid, _, _), r in zip(prompts, trace)
            if len(outputs.get(r.request_id, ())) == r.output_len]
    complete = len(done)
    output_tokens = sum(map(len, outputs.values()))
    logger.info("round %d %s: %.2f s, %d steps, %.2f output tok/s, %d/%d complete", round_index, label, wall_s,
                meter.steps, output_tokens / wall_s, complete, len(trace))
    stats = scheduler.feather_stats() if hasattr(scheduler, "feather_stats") else {}
    first_step = np.array([meter.first_scheduled_step.get(engine_id, 0) for engine_id in engine_ids])
    ttft = np.array([first_token[rid] - arrived[rid] for rid, _ in done])
    tpot = np.array([(finished_at[rid] - first_token[rid]) / (n - 1) if n > 1 else np.nan for rid, n in done])
    return RoundResult(label, wall_s, output_tokens, cached, ttft, tpot, len(outputs),
                       len(trace) - complete, meter, first_step, outputs, stats)


def _abort_unfinished(engine, submitted, outputs: dict, label: str, timeout_s: float) -> None:
    """Abort the ``submitted`` requests (engine ids) that have not finished (the round ran past ``timeout_s``)."""
    unfinished = [rid for rid in submitted if rid.split(":", 1)[1] not in outputs]
    logger.warning("%s: round ran past %.0f s; aborting %d unfinished requests", label, timeout_s, len(unfinished))
    engine.abort_request(unfinished)
    while engine.has_unfinished_requests():
        engine.step()
