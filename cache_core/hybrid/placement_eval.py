"""Placement reports: the recompute-vs-states frontier of a workload, and the solver benchmark.

Both return plain dicts (snake_case keys carrying their unit) that ``feather placement eval``
and ``feather bench placement`` print (feather_cli/placement.py).
"""

from __future__ import annotations

import time

import numpy as np

from cache_core.hybrid.layout import HybridCacheLayout
from cache_core.hybrid.overlap_estimator import OnlineOverlapEstimator
from cache_core.hybrid.placement import PlacementProblem, PlacementSolution, resume_positions, solve, solve_oracle
from cache_core.hybrid.placement_heuristics import PlacementHeuristic, default_heuristics, engine_grids
from cache_core.hybrid.recompute_cost import PrefillTime
from cache_core.hybrid.replay_placement import ReplayCost, compare_at_equal_bytes, hit_tree_copies, ttft_ms
from traces.stats import overlap_depths, request_digests

#: Budgets of the evaluation unless told otherwise: 1, 2, 4, ..., 256.
DEFAULT_BUDGETS = tuple(2**i for i in range(9))
#: Block size for traces that carry token ids (a trace with block ids uses its own).
DEFAULT_BLOCK_SIZE = 16


def replay_online(depths: np.ndarray, budgets: list[int], *, num_positions: int, decay: float,
                  resolve_every: int) -> tuple[np.ndarray, list[int]]:
    """Per budget and request, the position (blocks) it resumes from when placements are learnt
    online, shape ``(len(budgets), len(depths))``, and the final states per budget.

    Requests arrive in trace order; each is served by the placement of the last re-solve
    before it (none before the first), then its depth enters the estimator. This is what a
    server running :class:`OnlineOverlapEstimator` would recompute, with no hindsight.
    """
    estimator = OnlineOverlapEstimator(num_positions, max(budgets), decay=decay, resolve_every=resolve_every)
    depths = np.minimum(depths, num_positions)
    resume = np.zeros((len(budgets), depths.size), dtype=np.int64)
    for start in range(0, depths.size, resolve_every):
        chunk = depths[start : start + resolve_every]
        for i, budget in enumerate(budgets):
            resume[i, start : start + chunk.size] = resume_positions(estimator.placement(budget), chunk)
        estimator.observe_many(chunk)
    return resume, [int(estimator.placement(m).size) for m in budgets]


def resume_per_length(solution: PlacementSolution, depths: np.ndarray, horizons: np.ndarray,
                      budgets: list[int]) -> tuple[np.ndarray, list[int]]:
    """Resume positions when request ``i`` uses ``solution.checkpoints(m, horizons[i])``, shape
    ``(len(budgets), len(depths))``, and per budget the most states one request's placement holds.

    One backtrack per distinct horizon and budget (``O(m)`` each); requests are grouped by horizon.
    """
    unique, inverse = np.unique(horizons, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    groups = np.split(order, np.cumsum(np.bincount(inverse, minlength=unique.size))[:-1])
    resume = np.zeros((len(budgets), depths.size), dtype=np.int64)
    states = []
    for i, budget in enumerate(budgets):
        placements = [solution.checkpoints(budget, int(h)) for h in unique]
        for placement, members in zip(placements, groups):
            resume[i, members] = resume_positions(placement, depths[members])
        states.append(max(c.size for c in placements))
    return resume, states


def evaluate_placements(depths, *, block_size: int, budgets: list[int],
                        heuristics: tuple[PlacementHeuristic, ...] | None = None,
                        decay: float = 0.999, resolve_every: int = 64, prompt_tokens=None,
                        layout: HybridCacheLayout | None = None, prefill: PrefillTime | None = None,
                        replay: ReplayCost | None = None, tree=None) -> dict:
    """Expected recomputed tokens per request for the exact DP and each heuristic at each budget.

    ``depths`` are overlap depths in blocks of ``block_size`` tokens, in arrival order; the
    horizon ``N`` is the deepest one. Per method the report lists ``states_stored``
    (checkpoints actually used, at most the budget) next to ``expected_recompute_tokens``
    (mean over requests of ``(t - c(t)) * block_size``, the matched prefix recomputed): the
    points of the Pareto plot. ``dp`` is solved on the whole trace's distribution (the
    hindsight optimum); ``dp_online`` replays the trace through the online estimator
    (``decay``, ``resolve_every``; see :func:`replay_online`; its states are those of the
    final placement). ``dp_gain_vs_best_heuristic_pct[i]`` is how much less ``dp``
    recomputes than the best heuristic at ``budgets[i]`` (0 when both recompute nothing).

    Hybrid models. ``prompt_tokens`` (per request, tokens; ``depths[i] * block_size`` must not
    exceed it), ``layout`` and ``prefill`` are optional; with any of them the report adds:

    * methods ``no_cache`` (nothing kept: resume from 0) and ``kv_only`` (attention KV kept,
      no recurrent state: the linear layers need a state, so a hybrid still resumes from 0),
      the reference's baselines; both recompute the budget-0 amount at every budget;
    * with ``prompt_tokens``: ``dp_per_length``, where request ``i`` is served by the same DP
      backtracked from its own length, ``checkpoints(m, horizon=prompt_tokens[i] //
      block_size)`` (the reference's per-length re-derivation). Each request is evaluated
      with its own horizon's placement, as if it found that placement stored; its
      ``states_stored`` is the most one request's placement holds;
    * with ``layout`` (:class:`HybridCacheLayout`), per method and budget: ``state_bytes``
      = ``states_stored * layout.state_bytes``, the recurrent states kept along one shared
      prefix (per prefix path of the prefix tree: each distinct shared prefix keeps its own
      placement); ``kv_bytes`` = attention KV of the mean cached overlap,
      ``mean(depths) * block_size * layout.kv_bytes_per_token`` (0 for ``no_cache``; the
      same for every placement, since the whole match keeps its KV);
    * with ``prefill`` (:class:`PrefillTime`, needs ``prompt_tokens``): ``ttft_est_ms``, the
      mean over requests of ``prefill.ms(resume, prompt_tokens[i])`` with ``resume =
      c(t) * block_size`` capped at ``prompt_tokens[i] - 1`` (an engine computes at least
      the last prompt token to sample the first output token); and method ``dp_time``, the
      DP solved with ``block_costs = prefill.block_costs(block_size, N)``: it minimises the
      expected recompute time (ms) rather than tokens.

    SuffixReplay. With ``replay`` (:class:`~cache_core.hybrid.replay_placement.ReplayCost`, needs
    ``layout``) the report adds ``equal_bytes``: align grid, DP only, replay only and DP plus
    replay at ``budgets[i] * layout.state_bytes`` bytes
    (:func:`~cache_core.hybrid.replay_placement.compare_at_equal_bytes`): per shared prefix, where its
    ``dp`` is ``dp`` here, or, with ``tree = (family, copies)``
    (:func:`~cache_core.hybrid.replay_placement.hit_tree_copies`), on the workload's whole prefix tree.
    """
    if not budgets or min(budgets) < 0:
        raise ValueError(f"budgets must be a non-empty list of non-negative integers, got {budgets}")
    heuristics = default_heuristics() if heuristics is None else heuristics
    depths = np.asarray(depths, dtype=np.int64)
    if prompt_tokens is not None:
        prompt_tokens = np.asarray(prompt_tokens, dtype=np.int64)
        if prompt_tokens.shape != depths.shape or np.any(depths * block_size > prompt_tokens):
            raise ValueError("prompt_tokens needs one length per request, each >= its depth * block_size")
    if prefill is not None and prompt_tokens is None:
        raise ValueError("prefill needs prompt_tokens (the time to first token depends on the prompt length)")
    if replay is not None and layout is None:
        raise ValueError("replay needs layout (anchors are compared with exact states at equal bytes)")
    problem = PlacementProblem.from_depths(depths)
    n = problem.num_positions
    start = time.perf_counter()
    solution = solve(problem, max(budgets))
    solve_ms = (time.perf_counter() - start) * 1e3
    kv_bytes = 0 if layout is None else float(depths.mean() * block_size * layout.kv_bytes_per_token)

    def row(states: list[int], resume: np.ndarray, *, holds_kv: bool = True) -> dict:
        """The report row of a method: ``resume[i, r]`` is where request ``r`` resumes (blocks) at ``budgets[i]``."""
        out = {"states_stored": [int(s) for s in states],
               "expected_recompute_tokens": ((depths - resume).mean(axis=1) * block_size).tolist()}
        if layout is not None:
            out["state_bytes"] = [int(s) * layout.state_bytes for s in states]
            out["kv_bytes"] = [kv_bytes if holds_kv else 0.0] * len(budgets)
        if prefill is not None:
            out["ttft_est_ms"] = ttft_ms(prefill, resume, block_size=block_size,
                                         prompt_tokens=prompt_tokens).mean(axis=1).tolist()
        return out

    def static_row(placements: list[np.ndarray]) -> dict:
        return row([c.size for c in placements], np.stack([resume_positions(c, depths) for c in placements]))

    methods = {"dp": static_row([solution.checkpoints(m) for m in budgets])}
    online_resume, online_states = replay_online(depths, budgets, num_positions=n, decay=decay,
                                                 resolve_every=resolve_every)
    methods["dp_online"] = row(online_states, online_resume)
    hybrid = prompt_tokens is not None or layout is not None or prefill is not None
    if prompt_tokens is not None:
        resume, states = resume_per_length(solution, depths, prompt_tokens // block_size, budgets)
        methods["dp_per_length"] = row(states, resume)
    if prefill is not None:
        timed = solve(PlacementProblem.from_depths(depths, block_costs=prefill.block_costs(block_size, n)),
                      max(budgets))
        methods["dp_time"] = static_row([timed.checkpoints(m) for m in budgets])
    for heuristic in heuristics:
        methods[heuristic.name] = static_row([heuristic.place(n, m) for m in budgets])
    if hybrid:
        start_only = np.zeros((len(budgets), depths.size), dtype=np.int64)
        methods["kv_only"] = row([0] * len(budgets), start_only)
        methods["no_cache"] = row([0] * len(budgets), start_only, holds_kv=False)
    dp = np.array(methods["dp"]["expected_recompute_tokens"])
    best = np.min([methods[h.name]["expected_recompute_tokens"] for h in heuristics], axis=0)
    gain = np.divide(100 * (best - dp), best, out=np.zeros_like(best), where=best > 0)
    report = {
        "num_requests": int(depths.size),
        "block_size_tokens": block_size,
        "horizon_blocks": n,
        "hit_fraction": float(np.mean(depths > 0)),
        "mean_overlap_tokens": float(depths.mean() * block_size),
        "budgets": list(budgets),
        "methods": methods,
        "dp_gain_vs_best_heuristic_pct": gain.tolist(),
        "online_decay": decay,
        "online_resolve_every": resolve_every,
        "dp_solve_ms": solve_ms,
    }
    if prompt_tokens is not None:
        report["mean_prompt_tokens"] = float(prompt_tokens.mean())
    if layout is not None:
        report["layout"] = layout.as_dict()
    if prefill is not None:
        report["prefill"] = prefill.to_dict()
    if replay is not None:
        report["equal_bytes"] = compare_at_equal_bytes(depths, block_size=block_size, budgets=budgets,
                                                       state_bytes=layout.state_bytes, replay=replay,
                                                       prompt_tokens=prompt_tokens, prefill=prefill,
                                                       **dict(zip(("family", "copies"), tree or ())))
    return report


def benchmark_solver(*, num_positions: int = 4096, budget: int = 256, repeats: int = 5,
                     oracle_budget: int | None = None, seed: int = 0) -> dict:
    """Time the exact solver against the ``O(M N^2)`` oracle in one run, on the same problem.

    The headline problem is a Dirichlet(1) distribution with full support (no support
    compression helps). The oracle does identical work per layer, so when
    ``oracle_budget < budget`` it is timed at ``oracle_budget`` layers and scaled linearly to
    ``budget``; its keys then end in ``_extrapolated``. Wall times (``*_ms``) come with CPU
    times (``*_cpu_ms``, the process's CPU time: on a shared, loaded machine the wall time
    also counts waiting for a core). Costs of both solvers are compared for every budget
    the oracle ran. ``fast_ms_by_shape`` (wall, median) times the solver on other
    distribution shapes (its pruning rounds depend on the shape).
    """
    oracle_budget = budget if oracle_budget is None else min(oracle_budget, budget)
    if num_positions < 1 or budget < 1 or repeats < 1 or oracle_budget < 1:
        raise ValueError("num_positions, budget, repeats and oracle_budget must be >= 1")
    rng = np.random.default_rng(seed)
    problem = PlacementProblem(rng.dirichlet(np.ones(num_positions + 1)))

    def timed(run) -> tuple[float, float]:
        """(wall ms, CPU ms) of one call: on a shared machine CPU time shows the work done."""
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3

    def repeated(shape_problem: PlacementProblem) -> np.ndarray:
        return np.array([timed(lambda: solve(shape_problem, budget)) for _ in range(repeats)])

    fast_times = repeated(problem)
    fast = solve(problem, budget)
    oracle_holder = []
    oracle_wall, oracle_cpu = timed(lambda: oracle_holder.append(solve_oracle(problem, oracle_budget)))
    oracle = oracle_holder[0]
    scale = budget / oracle_budget
    rel_diff = np.abs(fast.costs[: oracle_budget + 1] - oracle.costs) / np.maximum(oracle.costs, 1e-300)
    t = np.arange(num_positions + 1)
    shapes = {
        "geometric": np.exp(-t / (num_positions / 8)),
        "zipf": 1.0 / (t + 1.0),
        "two_modes": np.exp(-(((t - num_positions / 4) / (num_positions / 50)) ** 2))
        + np.exp(-(((t - 3 * num_positions / 4) / (num_positions / 100)) ** 2)),
        "dirichlet_weighted": rng.dirichlet(np.ones(num_positions + 1)),
    }
    growth = 1 + 2 * np.arange(num_positions) / num_positions     # prefill cost per block grows with position
    by_shape = {name: float(np.median(repeated(PlacementProblem.from_counts(
        v, growth if name.endswith("weighted") else None))[:, 0])) for name, v in shapes.items()}
    suffix = "" if oracle_budget == budget else "_extrapolated"
    fast_ms_p50, fast_cpu_ms_p50 = np.median(fast_times, axis=0)
    return {
        "num_positions": num_positions,
        "budget": budget,
        "repeats": repeats,
        "fast_ms_p50": float(fast_ms_p50),
        "fast_ms_min": float(fast_times[:, 0].min()),
        "fast_cpu_ms_p50": float(fast_cpu_ms_p50),
        f"oracle_ms{suffix}": oracle_wall * scale,
        f"oracle_cpu_ms{suffix}": oracle_cpu * scale,
        "oracle_budget_timed": oracle_budget,
        "speedup_x": oracle_wall * scale / fast_ms_p50,
        "speedup_cpu_x": oracle_cpu * scale / fast_cpu_ms_p50,
        "max_cost_rel_diff": float(rel_diff.max()),
        "optimal_cost_blocks": float(fast.costs[budget]),
        "fast_ms_by_shape": by_shape,
    }


def evaluate_workload(trace, *, block_size: int | None, cache_blocks: int | None, budgets: list[int],
                      decay: float, resolve_every: int, layout: HybridCacheLayout | None = None,
                      prefill: PrefillTime | None = None, replay: ReplayCost | None = None,
                      replay_accounting: str = "tree") -> dict:
    """:func:`evaluate_placements` on the overlap depths of ``trace`` (infinite cache, or LRU of
    ``cache_blocks`` blocks) at ``block_size`` (default: the trace's own, else
    :data:`DEFAULT_BLOCK_SIZE`). With a layout or a prefill model, the engine's grids join the
    heuristics; with ``replay`` and ``replay_accounting="tree"``, bytes are counted on the
    workload's whole prefix tree."""
    if block_size is None:
        block_size = trace.block_size or DEFAULT_BLOCK_SIZE      # a token trace has no block size of its own
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    depths = overlap_depths(trace, block_size=block_size, cache_blocks=cache_blocks)
    hybrid = layout is not None or prefill is not None
    heuristics = (*default_heuristics(), *engine_grids(block_size)) if hybrid else None
    prompt_tokens = np.array([r.input_len for r in trace]) if hybrid else None
    tree = None
    if replay is not None and replay_accounting == "tree":
        tree = hit_tree_copies(request_digests(trace, block_size), depths)
    return evaluate_placements(depths, block_size=block_size, budgets=budgets, decay=decay,
                               resolve_every=resolve_every, prompt_tokens=prompt_tokens, layout=layout,
                               prefill=prefill, heuristics=heuristics, replay=replay, tree=tree)
