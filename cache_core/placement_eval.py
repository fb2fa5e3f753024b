"""Placement reports: the recompute-vs-states frontier of a workload, and the solver benchmark.

Both return plain dicts (snake_case keys carrying their unit) that ``feather placement eval``
and ``feather bench placement`` print (cache_core/placement_cli.py).
"""

from __future__ import annotations

import time

import numpy as np

from cache_core.overlap_estimator import OnlineOverlapEstimator
from cache_core.placement import PlacementProblem, resume_positions, solve, solve_oracle
from cache_core.placement_heuristics import PlacementHeuristic, default_heuristics


def replay_online(depths: np.ndarray, budgets: list[int], *, num_positions: int, decay: float,
                  resolve_every: int) -> tuple[list[float], list[int]]:
    """Mean recompute (blocks) and final states per budget when placements are learnt online.

    Requests arrive in trace order; each is served by the placement of the last re-solve
    before it (none before the first), then its depth enters the estimator. This is what a
    server running :class:`OnlineOverlapEstimator` would recompute, with no hindsight.
    """
    estimator = OnlineOverlapEstimator(num_positions, max(budgets), decay=decay, resolve_every=resolve_every)
    depths = np.minimum(depths, num_positions)
    total = np.zeros(len(budgets))
    for start in range(0, depths.size, resolve_every):
        chunk = depths[start : start + resolve_every]
        for i, budget in enumerate(budgets):
            total[i] += np.sum(chunk - resume_positions(estimator.placement(budget), chunk))
        estimator.observe_many(chunk)
    return (total / depths.size).tolist(), [int(estimator.placement(m).size) for m in budgets]


def evaluate_placements(depths, *, block_size: int, budgets: list[int],
                        heuristics: tuple[PlacementHeuristic, ...] | None = None,
                        decay: float = 0.999, resolve_every: int = 64) -> dict:
    """Expected recomputed tokens per request for the exact DP and each heuristic at each budget.

    ``depths`` are overlap depths in blocks of ``block_size`` tokens, in arrival order; the
    horizon ``N`` is the deepest one. Per method the report lists ``states_stored``
    (checkpoints actually used, at most the budget) next to ``expected_recompute_tokens``:
    the points of the Pareto plot. ``dp`` is solved on the whole trace's distribution (the
    hindsight optimum); ``dp_online`` replays the trace through the online estimator
    (``decay``, ``resolve_every``; see :func:`replay_online`; its states are those of the
    final placement). ``dp_gain_vs_best_heuristic_pct[i]`` is how much less ``dp``
    recomputes than the best heuristic at ``budgets[i]`` (0 when both recompute nothing).
    """
    if not budgets or min(budgets) < 0:
        raise ValueError(f"budgets must be a non-empty list of non-negative integers, got {budgets}")
    heuristics = default_heuristics() if heuristics is None else heuristics
    depths = np.asarray(depths, dtype=np.int64)
    problem = PlacementProblem.from_depths(depths)
    n = problem.num_positions
    start = time.perf_counter()
    solution = solve(problem, max(budgets))
    solve_ms = (time.perf_counter() - start) * 1e3

    def row(placements: list[np.ndarray]) -> dict:
        return {"states_stored": [int(c.size) for c in placements],
                "expected_recompute_tokens": [problem.cost(c) * block_size for c in placements]}

    methods = {"dp": row([solution.checkpoints(m) for m in budgets])}
    online_blocks, online_states = replay_online(depths, budgets, num_positions=n, decay=decay,
                                                 resolve_every=resolve_every)
    methods["dp_online"] = {"states_stored": online_states,
                            "expected_recompute_tokens": [b * block_size for b in online_blocks]}
    for heuristic in heuristics:
        methods[heuristic.name] = row([heuristic.place(n, m) for m in budgets])
    dp = np.array(methods["dp"]["expected_recompute_tokens"])
    best = np.min([methods[h.name]["expected_recompute_tokens"] for h in heuristics], axis=0)
    gain = np.divide(100 * (best - dp), best, out=np.zeros_like(best), where=best > 0)
    return {
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
