"""Placement baselines (cache_core.hybrid.placement_heuristics) and the DP's dominance over them."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_core.hybrid.placement import PlacementProblem, solve
from cache_core.hybrid.placement_heuristics import (
    Balanced,
    Dyadic,
    EndOfPrompt,
    EveryBlocks,
    SqrtSpacing,
    default_heuristics,
)


@pytest.mark.parametrize(
    "heuristic, n, budget, expected",
    [
        (EveryBlocks(4), 18, 3, [4, 8, 12]),
        (EveryBlocks(4), 18, 10, [4, 8, 12, 16]),
        (Balanced(), 11, 2, [4, 8]),
        (Balanced(), 3, 10, [1, 2, 3]),
        (SqrtSpacing(), 20, 10, [5, 10, 15, 20]),
        (SqrtSpacing(), 16, 2, [4, 8]),
        (Dyadic(), 20, 10, [1, 2, 4, 8, 16]),
        (Dyadic(), 20, 2, [8, 16]),
        (EndOfPrompt(), 20, 5, [20]),
        (EndOfPrompt(), 20, 0, []),
    ],
)
def test_heuristic_positions(heuristic, n, budget, expected):
    assert heuristic.place(n, budget).tolist() == expected


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 300), st.integers(0, 300))
def test_heuristics_respect_budget_and_range(n, budget):
    for heuristic in default_heuristics():
        positions = heuristic.place(n, budget)
        assert positions.size <= budget
        assert np.all(np.diff(positions) > 0)
        assert positions.size == 0 or (positions[0] >= 1 and positions[-1] <= n)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 120),
    st.lists(st.integers(0, 5), min_size=2, max_size=121),
    st.booleans(),
    st.integers(1, 8),
)
def test_dp_is_never_worse_than_any_heuristic(n, raw_counts, weighted, interval):
    counts = np.resize(np.array(raw_counts, dtype=float), n + 1)
    if counts.sum() == 0:
        counts[-1] = 1
    problem = PlacementProblem.from_counts(counts, 1 + 0.05 * np.arange(n) if weighted else None)
    budgets = [0, 1, 2, 3, 5, 8, 16, 64]
    solution = solve(problem, max(budgets))
    for heuristic in default_heuristics(interval):
        for budget in budgets:
            assert solution.costs[budget] <= problem.cost(heuristic.place(n, budget)) + 1e-9


def test_bad_arguments():
    with pytest.raises(ValueError, match="interval"):
        EveryBlocks(0)
    with pytest.raises(ValueError, match="budget"):
        Balanced().place(10, -1)


def test_engine_grids_place_by_tokens_and_sglang_adds_the_prompt_end():
    from cache_core.hybrid.placement_heuristics import SGLangChunks, TokenGrid, engine_grids

    assert TokenGrid(512, 16).place(100, 10).tolist() == [32, 64, 96]
    assert TokenGrid(256, 384).place(5, 10).tolist() == [1, 2, 3, 4, 5]          # at least one block
    assert SGLangChunks(8192, 1024).place(20, 10).tolist() == [8, 16, 20]
    assert SGLangChunks(8192, 1024).place(20, 2).tolist() == [8, 16]              # over budget: shallowest
    assert [h.name for h in engine_grids(16)] == ["grid_256", "grid_512", "grid_1024", "grid_2048", "sglang_8192"]
