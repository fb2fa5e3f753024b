"""Online overlap-depth estimator (cache_core.hybrid.overlap_estimator)."""

import numpy as np
import pytest

from cache_core.hybrid.overlap_estimator import OnlineOverlapEstimator
from cache_core.hybrid.placement import PlacementProblem, solve


def test_resolves_every_k_observations():
    estimator = OnlineOverlapEstimator(32, 2, resolve_every=10, decay=1.0)
    triggered = [estimator.observe(d) for d in range(25)]
    assert [i for i, t in enumerate(triggered) if t] == [9, 19]
    assert estimator.num_solves == 2


def test_undecayed_estimate_is_the_empirical_histogram_and_its_optimum():
    rng = np.random.default_rng(0)
    depths = rng.integers(0, 40, 200)
    estimator = OnlineOverlapEstimator(30, 3, decay=1.0, resolve_every=200)
    assert estimator.observe_many(depths) == 1
    problem = PlacementProblem.from_depths(depths, num_positions=30)
    np.testing.assert_allclose(estimator.depth_probs, problem.depth_probs)
    assert estimator.expected_cost == pytest.approx(solve(problem, 3).costs[3])
    assert problem.cost(estimator.checkpoints) == pytest.approx(estimator.expected_cost)


def test_placement_follows_a_traffic_shift():
    estimator = OnlineOverlapEstimator(100, 1, decay=0.95, resolve_every=20)
    estimator.observe_many([30] * 200)
    assert estimator.checkpoints.tolist() == [30]
    estimator.observe_many([70] * 200)
    assert estimator.checkpoints.tolist() == [70]
    assert estimator.depth_probs[30] < 1e-4


def test_placement_for_smaller_budgets_and_before_the_first_solve():
    estimator = OnlineOverlapEstimator(20, 3, decay=1.0, resolve_every=6)
    assert estimator.checkpoints.size == 0
    with pytest.raises(ValueError, match="no placement"):
        estimator.expected_cost
    estimator.observe_many([4, 4, 9, 9, 15, 15])
    assert estimator.placement(3).tolist() == [4, 9, 15]
    assert estimator.placement(1).size == 1


def test_decay_weights_recent_observations_more():
    estimator = OnlineOverlapEstimator(10, 1, decay=0.5, resolve_every=1000)
    estimator.observe_many([2, 5])
    assert estimator.depth_probs[5] == pytest.approx(2 / 3)


def test_long_streams_stay_finite():
    estimator = OnlineOverlapEstimator(8, 1, decay=0.5, resolve_every=10_000)
    estimator.observe_many(np.arange(3000) % 9)
    assert np.all(np.isfinite(estimator.depth_probs))
    assert estimator.depth_probs.sum() == pytest.approx(1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_positions=0, budget=1), "num_positions"),
        (dict(num_positions=4, budget=-1), "budget"),
        (dict(num_positions=4, budget=1, decay=0), "decay"),
        (dict(num_positions=4, budget=1, resolve_every=0), "resolve_every"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OnlineOverlapEstimator(**kwargs)


def test_negative_depth_and_empty_estimate_are_rejected():
    estimator = OnlineOverlapEstimator(4, 1)
    with pytest.raises(ValueError, match="no overlap depth"):
        estimator.depth_probs
    with pytest.raises(ValueError, match=">= 0"):
        estimator.observe(-1)
