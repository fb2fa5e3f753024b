"""``feather sim validate``: the simulator against the live engine, one workload, the same policies.

Each policy serves the workload twice: in the simulator (:mod:`feather_gym.simulator`, step
times from the cost model of ``profile``) and on the live in-process vLLM engine
(:func:`deploy.bench.harness.run_schedulers`, rounds alternated). The simulator is configured as
the engine it is checked against: the engine's KV block size, token budget, ``max_num_seqs``
and KV capacity (read from the started engine), the admission's ``max_wait_steps``, and the same
regime (online at the trace's arrival times x ``time_scale``, the default, or every request at once).

Policies: ``fcfs`` is vLLM's own ``Scheduler``; every other one (``feather-rule``, a trained
``*.onnx``) runs in :class:`deploy.scheduler.FeatherScheduler`, in the simulator on the CHT's
candidate exactly as deployed (:func:`deploy.scheduler.load_deployable_policy`).

Per policy and figure (engine steps, output tokens/s, mean step time, cached prompt tokens,
TTFT p50/p99, preemptions, and a Feather policy's decisions and waiting-time-bound admissions:
the simulator asks it at the points the deployed scheduler does): simulated, live, and the relative error
``sim / live - 1``; and
``same_first_step_fraction``, the share of requests (over the live rounds) that the engine first
scheduled in the same step as the simulator: 1.0 when the simulator reproduces the engine's
admissions step for step. No admission reads a clock (the Feather admission's waiting-time bound
and its ``oldest_wait_steps`` feature count engine steps), so it depends on the engine model
alone, as long as no arrival falls near a step boundary (the benches' workloads arrive within
~0.1 s, during the first step; arrivals spread over many steps land in the step the machine's
speed puts them in).
Targets (:data:`TARGETS`): throughput and steps within 10%, and the same ranking of the policies by
throughput on both sides (:func:`same_ranking`: every pair the simulator separates by more than
:data:`RANKING_TIE` is ordered alike live; a pair it ties, e.g. a policy and its exact clone, makes no
claim). Beside them, each policy's throughput over the first policy's
(``ratio_to_first``, over all of its rounds, simulated and live alike): the comparison that does
not depend on how fast the machine runs today against the day its profile was measured.
``live_ratio_to_first`` is the live side's per-round pairing of the same ratio, with its spread.

Seeds: a generated workload is a different trace per seed; ``num_seeds`` runs seeds ``seed``,
``seed + 1``, ... one after another on the same engine (warm-up only before the first; seed
number ``k`` starts the rotation of the sides at ``k``, so the sides take turns at serving a new
trace first), and ``across_seeds`` gives, per policy after the first, the distribution over
seeds of its simulated and live ``ratio_to_first``. A recorded trace is the same for every
seed, so it runs once (seed ``seed``).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from deploy.engine_rounds import DEFAULT_ONLINE
from feather_gym.policies import DEFAULT_MAX_WAIT_STEPS
from feather_gym.sweep import policy_label
from traces.table import cut
from traces.workload import ENGINE_SIZED_WORKLOADS

logger = logging.getLogger(__name__)

#: Figures compared, as keys of both sides' reports.
FIGURES = ("steps", "output_tok_s", "step_ms_mean", "cached_prompt_tokens", "ttft_p50_s", "ttft_p99_s",
           "preemptions", "decisions", "forced_wait_admissions")
#: Largest |sim / live - 1| accepted per figure.
TARGETS = {"output_tok_s": 0.10, "steps": 0.10}
#: Simulated throughputs within this relative distance tie: the ranking target asks nothing of
#: their order live (the trainer's evaluator ties throughputs at the same distance).
RANKING_TIE = 0.001
DEFAULT_POLICIES = ("fcfs", "feather-rule")
#: Default workloads: one prefix-heavy (under KV pressure in the bench's 0.25 GiB), one without sharing.
DEFAULT_WORKLOADS = {name: ENGINE_SIZED_WORKLOADS[name] for name in ("prefix-heavy", "no-sharing")}


def as_served(trace, *, online: bool, time_scale: float):
    """``trace`` with the arrival times the live round submits it at (all 0 unless ``online``)."""
    import traces
    from deploy.engine_rounds import submission_offsets

    offsets = submission_offsets(trace, online=online, time_scale=time_scale)
    requests = [dataclasses.replace(r, arrival_s=float(t)) for r, t in zip(trace, offsets)]
    return traces.Trace(trace.name, requests, trace.source, trace.block_size)


def simulated_engine(llm, *, max_wait_steps: int):
    """The simulator's :class:`~feather_gym.simulator.EngineConfig` of the started engine ``llm``:
    its token budget, ``max_num_seqs``, KV block size and KV capacity, and the admission's bound."""
    from deploy.engine_rounds import kv_capacity
    from feather_gym.simulator import EngineConfig

    capacity = kv_capacity(llm)
    scheduler_config = llm.llm_engine.vllm_config.scheduler_config
    return EngineConfig(token_budget=scheduler_config.max_num_batched_tokens,
                        max_num_seqs=scheduler_config.max_num_seqs, block_size=capacity["kv_block_size_tokens"],
                        kv_capacity_tokens=capacity["kv_capacity_tokens"], max_wait_steps=max_wait_steps)


def simulated(trace, cost_model, engine_config, policy_name: str) -> dict:
    """The simulator's :data:`FIGURES` for ``policy_name`` on ``trace`` (``decisions``: the
    policy's answers; None for ``fcfs``, as vLLM's scheduler asks none), and the step that first
    scheduled each request (trace order)."""
    from feather_gym.simulator import simulate

    result = simulate(trace, cost_model, as_deployed(policy_name), config=engine_config)
    metrics = result.metrics()
    return {"steps": metrics["steps"], "output_tok_s": metrics["throughput_tok_s"],
            "step_ms_mean": metrics["step_ms_mean"], "cached_prompt_tokens": metrics["cached_prompt_tokens"],
            "ttft_p50_s": metrics["ttft_p50_s"], "ttft_p99_s": metrics["ttft_p99_s"],
            "preemptions": metrics["preemptions"],
            "decisions": None if policy_name == "fcfs" else metrics["decisions"],
            "forced_wait_admissions": None if policy_name == "fcfs" else metrics["forced_wait_admissions"],
            "first_scheduled_step": result.first_scheduled_step.tolist()}


def as_deployed(name: str):
    """A fresh policy ``name`` as the live sides run it: FCFS for ``fcfs`` (vLLM's own scheduler),
    else :func:`deploy.scheduler.load_deployable_policy` (``ValueError``/``OSError`` for one that
    cannot be deployed)."""
    from deploy.scheduler import load_deployable_policy
    from feather_gym.policies import make_policy

    return make_policy("fcfs") if name == "fcfs" else load_deployable_policy(name)


def live_sides(policies, *, max_wait_steps: int) -> dict:
    """``run_schedulers`` sides: vLLM's ``Scheduler`` for ``fcfs``, ``FeatherScheduler`` for the rest."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.scheduler import FeatherConfig, FeatherScheduler

    return {name: (Scheduler, {}) if name == "fcfs" else
            (FeatherScheduler, {"feather_config": FeatherConfig(policy=name, max_wait_steps=max_wait_steps)})
            for name in policies}


def _cell(sim, live) -> dict:
    """``{"sim", "live", "error"}`` with ``error = sim / live - 1`` (``None`` where undefined)."""
    error = (sim / live - 1.0) if sim is not None and live else None
    return {"sim": sim, "live": live, "error": None if error is None else round(error, 4)}


def ratios_to_first(side: dict[str, dict]) -> dict[str, float]:
    """Each policy's output tokens/s over the first policy's, for every policy after the first."""
    first, *others = side
    return {name: round(side[name]["output_tok_s"] / side[first]["output_tok_s"], 4) for name in others}


def same_first_step(sim_steps, live_rounds) -> float:
    """Share of the requests, over the live rounds (one list of steps each, trace order), that were
    first scheduled in the same engine step as in the simulator (``sim_steps``)."""
    import numpy as np

    return round(float((np.asarray(live_rounds) == np.asarray(sim_steps)).mean()), 4)


def compare_sides(sim: dict[str, dict], live: dict[str, dict]) -> dict:
    """Per policy and figure ``{"sim", "live", "error"}``; per policy its :func:`same_first_step`;
    per policy after the first, its ``ratio_to_first`` on both sides; the rankings and whether
    targets are met."""
    table = {name: {figure: _cell(sim[name][figure], live[name][figure]) for figure in FIGURES} for name in sim}
    sim_ratio, live_ratio = ratios_to_first(sim), ratios_to_first(live)
    sim_rank = sorted(sim, key=lambda n: -sim[n]["output_tok_s"])
    live_rank = sorted(live, key=lambda n: -live[n]["output_tok_s"])
    ranked = same_ranking({n: sim[n]["output_tok_s"] for n in sim}, {n: live[n]["output_tok_s"] for n in live})
    met = {figure: all(abs(table[n][figure]["error"]) <= bound for n in table) for figure, bound in TARGETS.items()}
    same_step = {name: same_first_step(sim[name]["first_scheduled_step"],
                                       live[name]["per_round"]["first_scheduled_step"]) for name in sim}
    return {"policies": table, "same_first_step_fraction": same_step,
            "ratio_to_first": {name: _cell(sim_ratio[name], live_ratio[name]) for name in sim_ratio},
            "sim_ranking": sim_rank, "live_ranking": live_rank,
            "same_ranking": ranked, "targets_met": {**met, "ranking": ranked}}


def tied(a: float, b: float) -> bool:
    """Whether two figures are within :data:`RANKING_TIE` (relative to the larger) of each other."""
    return abs(a - b) <= RANKING_TIE * max(a, b)


def same_ranking(sim: dict[str, float], live: dict[str, float], unchecked=()) -> bool:
    """Whether every pair of policies whose simulated figures (``sim``, name -> tok/s or goodput)
    differ by more than :data:`RANKING_TIE` (relative) has the same order in ``live``: the
    simulator's ranking, less the orders it does not claim, and less the pairs of ``unchecked``
    (pairs of names, either order), which the live measurement cannot order."""
    import itertools

    skip = {frozenset(pair) for pair in unchecked}
    return all((sim[a] > sim[b]) == (live[a] > live[b]) for a, b in itertools.combinations(sim, 2)
               if not tied(sim[a], sim[b]) and frozenset((a, b)) not in skip)


def across_seeds(per_seed: dict[str, dict]) -> dict:
    """Over the seeds of one workload: per policy after the first, :func:`~deploy.bench.harness.ratio_stats`
    of its simulated and its live ``ratio_to_first`` (one value per seed); per policy the mean
    over seeds of its ``same_first_step_fraction``; the seeds whose simulated and live rankings
    agree."""
    from deploy.bench.harness import ratio_stats

    results = list(per_seed.values())
    return {"policies": {name: {side: ratio_stats([r["ratio_to_first"][name][side] for r in results], unit="seed")
                                for side in ("sim", "live")}
                         for name in results[0]["ratio_to_first"]},
            "same_first_step_fraction": {
                name: round(sum(r["same_first_step_fraction"][name] for r in results) / len(results), 4)
                for name in results[0]["same_first_step_fraction"]},
            "seeds_same_ranking": sum(r["same_ranking"] for r in results), "num_seeds": len(results)}


def validate(workloads: dict[str, str], *, policies=DEFAULT_POLICIES, profile: str | None = None,
             rounds: int = 3, online: bool = DEFAULT_ONLINE, time_scale: float = 1.0,
             kv_cache_gib: float | None = None,
             max_wait_steps: int = DEFAULT_MAX_WAIT_STEPS, max_input_tokens: int | None = None,
             max_output_tokens: int | None = None, seed: int = 0, num_seeds: int = 1) -> dict:
    """The whole report: one engine, and per workload and seed the simulator and the engine on every policy."""
    from deploy.bench.harness import DEFAULT_BENCH_KV_CACHE_GIB, clip_lengths, run_schedulers
    from deploy.engine_rounds import kv_capacity
    from feather_gym.costmodel import hardware_profile, load_cost_model
    from feather_gym.vllm_engine import resolve_kv_cache_gib, start_engine
    from traces import resolve_workload
    from traces.workload import is_generated

    policies = list(dict.fromkeys(policies))
    if num_seeds < 1:
        raise ValueError(f"num_seeds must be >= 1, got {num_seeds}")
    seeds = range(seed, seed + num_seeds)
    for name in policies:            # refuse a bad policy before the engine starts
        as_deployed(name)
    profile = profile or hardware_profile()
    cost_model = load_cost_model(profile)
    started = time.perf_counter()
    traces = {name: {s: clip_lengths(resolve_workload(spec, seed=s), max_input_tokens=max_input_tokens,
                                     max_output_tokens=max_output_tokens)
                     for s in (seeds if is_generated(spec) else seeds[:1])}
              for name, spec in workloads.items()}
    longest = max(r.input_len + r.output_len for per_seed in traces.values() for t in per_seed.values() for r in t)
    kv_cache_gib = resolve_kv_cache_gib(kv_cache_gib, default=DEFAULT_BENCH_KV_CACHE_GIB)
    llm = start_engine(max_model_len=max(2048, longest), seed=seed, kv_cache_gib=kv_cache_gib)
    capacity = kv_capacity(llm)
    engine_config = simulated_engine(llm, max_wait_steps=max_wait_steps)
    report = {"profile": cost_model.name, "policies": policies, "rounds": rounds, "seeds": list(seeds),
              "online": online, "time_scale": time_scale, "max_wait_steps": max_wait_steps,
              "kv_cache_gib": kv_cache_gib,
              **capacity, "token_budget": engine_config.token_budget, "max_num_seqs": engine_config.max_num_seqs,
              "workloads": {}}
    sides = live_sides(policies, max_wait_steps=max_wait_steps)
    for name, per_seed in traces.items():
        results = {}
        for k, (s, trace) in enumerate(per_seed.items()):
            logger.info("%s, seed %d (%d of %d)", name, s, k + 1, len(per_seed))
            served = as_served(trace, online=online, time_scale=time_scale)
            sim = {policy: simulated(served, cost_model, engine_config, policy) for policy in policies}
            live = run_schedulers(llm, trace, sides, rounds=rounds, online=online, time_scale=time_scale,
                                  warm_up=k == 0, rotation=k)
            results[str(s)] = {"num_requests": len(trace), **compare_sides(sim, live["sides"]),
                               "live_ratio_to_first": live["ratios"], "live_order": live["order"],
                               "requests_lost": {p: live["sides"][p]["requests_lost"] for p in policies}}
        report["workloads"][name] = {"spec": workloads[name], "seeds": results, "across_seeds": across_seeds(results)}
    report["wall_s"] = round(time.perf_counter() - started, 1)
    return report


def format_report(report: dict) -> str:
    """The sim-against-live table: one row per workload, seed, policy and figure, then per
    workload one row per policy after the first over all its seeds."""
    rows = [f"profile {report['profile']}, {report['rounds']} live rounds per policy and seed, seeds "
            f"{report['seeds'][0]}-{report['seeds'][-1]}, {'online' if report['online'] else 'all requests at once'}, "
            f"KV {report['kv_capacity_tokens']} tokens",
            f"{'workload':<16}{'seed':>5}  {'policy':<22}{'figure':<22}{'sim':>12}{'live':>12}{'error':>9}"]
    for name, w in report["workloads"].items():
        short = cut(name, 15)
        for seed, result in w["seeds"].items():
            for policy, figures in result["policies"].items():
                cells = dict(figures)
                if policy in result["ratio_to_first"]:
                    cells["ratio_to_first"] = result["ratio_to_first"][policy]
                for figure, cell in cells.items():
                    error = "" if cell["error"] is None else f"{cell['error']:+.1%}"
                    rows.append(f"{short:<16}{seed:>5}  {_label(policy):<22}{figure:<22}{_num(cell['sim']):>12}"
                                f"{_num(cell['live']):>12}{error:>9}")
            rows.append(f"{short:<16}{seed:>5}  ranking sim {result['sim_ranking']} live {result['live_ranking']}; "
                        f"targets met {result['targets_met']}")
            rows.append(f"{short:<16}{seed:>5}  first scheduled in the simulator's step: " + _shares(result))
        seeds = w["across_seeds"]
        for policy, sides in seeds["policies"].items():
            rows.append(f"{short:<16}{'all':>5}  {_label(policy)} / {report['policies'][0]} over {seeds['num_seeds']} "
                        f"seeds: sim {_stats(sides['sim'])}, live {_stats(sides['live'])}")
        rows.append(f"{short:<16}{'all':>5}  same ranking on {seeds['seeds_same_ranking']}/{seeds['num_seeds']} seeds; "
                    "first scheduled in the simulator's step: " + _shares(seeds))
    return "\n".join(rows)


def _shares(result: dict) -> str:
    """``POLICY NN%, ...`` of ``result``'s ``same_first_step_fraction``."""
    return ", ".join(f"{_label(policy)} {share:.0%}" for policy, share in result["same_first_step_fraction"].items())


def _label(policy: str) -> str:
    return policy_label(policy, 21)


def _stats(stats: dict) -> str:
    spread = f" (95% CI {stats['ci95'][0]:.3f}-{stats['ci95'][1]:.3f})" if stats["ci95"] else ""
    return f"{stats['mean']:.3f}{spread}"


def _num(value) -> str:
    return "-" if value is None else f"{value:.4g}"
