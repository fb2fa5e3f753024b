"""Exact checkpoint placement (cache_core.hybrid.placement): fast solver vs O(M N^2) oracle vs brute force."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_core.hybrid.placement import PlacementProblem, _lower_hull, solve, solve_brute_force, solve_oracle

TOL = 1e-9


@st.composite
def problems(draw, max_positions=40, weighted=None):
    """Random p from small integer counts (so ties and zeros are common), optionally weighted."""
    n = draw(st.integers(1, max_positions))
    counts = np.array(draw(st.lists(st.integers(0, 3), min_size=n + 1, max_size=n + 1)), dtype=float)
    if counts.sum() == 0:
        counts[draw(st.integers(0, n))] = 1
    if weighted is None:
        weighted = draw(st.booleans())
    costs = None
    if weighted:  # per-block recompute cost growing with position, like prefill
        growth = draw(st.floats(0.0, 4.0))
        costs = 1 + growth * np.arange(n) / n
    return PlacementProblem.from_counts(counts, costs)


def assert_close(a, b):
    assert abs(a - b) <= TOL * max(1.0, abs(b)), (a, b)


@settings(max_examples=150, deadline=None)
@given(problems(max_positions=9), st.integers(0, 11))
def test_fast_solver_matches_brute_force(problem, budget):
    solution = solve(problem, budget)
    best_checkpoints, best_cost = solve_brute_force(problem, budget)
    assert_close(solution.costs[budget], best_cost)
    chosen = solution.checkpoints(budget)
    assert chosen.size <= budget
    assert_close(problem.cost(chosen), best_cost)
    assert_close(problem.cost(best_checkpoints), best_cost)


@settings(max_examples=60, deadline=None)
@given(problems(max_positions=40), st.integers(0, 45))
def test_fast_solver_matches_oracle_for_every_budget(problem, max_budget):
    fast, oracle = solve(problem, max_budget), solve_oracle(problem, max_budget)
    assert fast.costs.shape == oracle.costs.shape == (max_budget + 1,)
    for budget in range(max_budget + 1):
        assert_close(fast.costs[budget], oracle.costs[budget])
        assert_close(problem.cost(fast.checkpoints(budget)), oracle.costs[budget])
        assert_close(problem.cost(oracle.checkpoints(budget)), oracle.costs[budget])


@settings(max_examples=60, deadline=None)
@given(problems(max_positions=60), st.integers(0, 70))
def test_cost_is_non_increasing_in_budget(problem, max_budget):
    costs = solve(problem, max_budget).costs
    assert np.all(np.diff(costs) <= TOL)
    assert costs[0] == pytest.approx(problem.cost([]))


@pytest.mark.parametrize("shape", ["uniform", "geometric", "zipf", "two_modes", "spikes"])
def test_structured_shapes_match_oracle(shape):
    """Shapes with long hull edges, collinear points and large hulls (uniform, geometric)."""
    t = np.arange(401)
    counts = {
        "uniform": np.ones(401),
        "geometric": np.exp(-t / 50),
        "zipf": 1 / (t + 1.0),
        "two_modes": np.exp(-(((t - 100) / 8) ** 2)) + np.exp(-(((t - 300) / 4) ** 2)),
        "spikes": np.isin(t, [0, 7, 8, 9, 200, 201, 400]).astype(float),
    }[shape]
    problem = PlacementProblem.from_counts(counts)
    fast, oracle = solve(problem, 30), solve_oracle(problem, 30)
    np.testing.assert_allclose(fast.costs, oracle.costs, rtol=TOL, atol=TOL)
    assert problem.cost(fast.checkpoints(30)) == pytest.approx(oracle.costs[30], rel=TOL, abs=TOL)


def test_larger_random_instance_matches_oracle():
    rng = np.random.default_rng(7)
    p = rng.dirichlet(np.full(301, 0.3))
    p[rng.random(301) < 0.3] = 0
    problem = PlacementProblem(p / p.sum(), 1 + 0.01 * np.arange(300))
    fast, oracle = solve(problem, 40), solve_oracle(problem, 40)
    np.testing.assert_allclose(fast.costs, oracle.costs, rtol=TOL, atol=TOL)


def test_budget_at_least_positions_costs_nothing():
    problem = PlacementProblem.from_counts([1, 2, 3, 4, 5])
    for budget in (4, 5, 100):
        solution = solve(problem, budget)
        assert solution.costs[budget] == pytest.approx(0, abs=TOL)
        assert solution.checkpoints(budget).tolist() == [1, 2, 3, 4]


def test_all_mass_at_zero_needs_no_checkpoint():
    problem = PlacementProblem(np.r_[1.0, np.zeros(50)])
    solution = solve(problem, 8)
    np.testing.assert_allclose(solution.costs, 0, atol=TOL)
    assert solution.checkpoints(8).size == 0


def test_all_mass_at_the_end_needs_one_checkpoint_there():
    n = 50
    problem = PlacementProblem(np.r_[np.zeros(n), 1.0])
    solution = solve(problem, 8)
    assert solution.costs[0] == pytest.approx(n)
    np.testing.assert_allclose(solution.costs[1:], 0, atol=TOL)
    assert solution.checkpoints(1).tolist() == [n]


def test_known_two_point_instance():
    # Depths 4 and 10 equally likely, N = 10: one checkpoint at 4 saves 2, at 10 saves 5.
    p = np.zeros(11)
    p[[4, 10]] = 0.5
    solution = solve(PlacementProblem(p), 2)
    np.testing.assert_allclose(solution.costs, [7.0, 2.0, 0.0], atol=TOL)
    assert solution.checkpoints(1).tolist() == [10]
    assert solution.checkpoints(2).tolist() == [4, 10]


def test_weighted_cost_counts_block_costs():
    # Blocks cost 1, 2, 3: recomputing depth 3 from scratch costs 6, from position 2 costs 3.
    problem = PlacementProblem(np.array([0, 0, 0, 1.0]), np.array([1.0, 2.0, 3.0]))
    assert problem.cost([]) == 6
    assert problem.cost([2]) == 3
    assert solve(problem, 1).checkpoints(1).tolist() == [3]


def test_from_depths_clips_to_horizon():
    problem = PlacementProblem.from_depths([0, 2, 2, 9], num_positions=4)
    np.testing.assert_allclose(problem.depth_probs, [0.25, 0, 0.5, 0, 0.25])


@pytest.mark.parametrize(
    "probs, message",
    [
        ([0.5, -0.1, 0.6], "non-negative"),
        ([0.5, 0.6], "sum to 1"),
        ([0.2, 0.2], "sum to 1"),
        ([1.0], "N >= 1"),
        ([np.nan, 1.0], "finite"),
    ],
)
def test_bad_distributions_are_rejected(probs, message):
    with pytest.raises(ValueError, match=message):
        PlacementProblem(np.array(probs))


def test_bad_block_costs_and_budgets_are_rejected():
    with pytest.raises(ValueError, match="one entry per block"):
        PlacementProblem(np.array([0.5, 0.5]), np.ones(3))
    with pytest.raises(ValueError, match="positive"):
        PlacementProblem(np.array([0.5, 0.5]), np.zeros(1))
    problem = PlacementProblem(np.array([0.5, 0.5]))
    for solver in (solve, solve_oracle, solve_brute_force):
        with pytest.raises(ValueError, match="budget"):
            solver(problem, -1)
    with pytest.raises(ValueError, match="budget"):
        solve(problem, 2).checkpoints(3)
    with pytest.raises(ValueError, match="1..1"):
        problem.cost([2])
    with pytest.raises(ValueError, match="counts"):
        PlacementProblem.from_counts([0, 0])


def monotone_chain_lower_hull(x, y):
    """Andrew's monotone chain (strict vertices only), the reference for _lower_hull."""
    hull = []
    for i in range(len(x)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (y[b] - y[a]) * (x[i] - x[b]) < (y[i] - y[b]) * (x[b] - x[a]):
                break
            hull.pop()
        hull.append(i)
    return hull


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-20, 20), min_size=1, max_size=60), st.sampled_from([(4, 2), (10**6, 1), (0, 10**6)]))
def test_lower_hull_matches_monotone_chain(ys, tangent_settings):
    """Integer heights make collinear points common; settings force or disable the tangent step."""
    max_points, stalled = tangent_settings
    x, y = np.arange(len(ys), dtype=float), np.array(ys, dtype=float)
    hull = _lower_hull(x, y, tangent_max_points=max_points, stalled_rounds=stalled)
    assert hull.tolist() == monotone_chain_lower_hull(x, y)


def test_lower_hull_long_edge_over_convex_chain():
    """A convex chain ending in a far, low point: local pruning alone needs one round per point."""
    x = np.arange(501, dtype=float)
    y = (x / 100) ** 2
    y[-1] = -50
    assert _lower_hull(x, y).tolist() == monotone_chain_lower_hull(x, y)
    y2 = y[::-1].copy()
    assert _lower_hull(x, y2).tolist() == monotone_chain_lower_hull(x, y2)
