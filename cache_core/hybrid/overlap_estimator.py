"""Online overlap-depth estimate that keeps a checkpoint placement following the traffic.

Each observed overlap depth (in blocks, clipped to the horizon ``N``) enters an
exponentially decayed histogram: an observation made ``j`` observations ago weighs
``decay**j``, so the estimate forgets old traffic with a half-life of
``ln 2 / -ln(decay)`` observations. Every ``resolve_every`` observations the exact DP
(:func:`cache_core.hybrid.placement.solve`) re-solves the placement for the current estimate.

Cost: ``observe`` is O(1) amortised (decay is applied lazily through a growing weight and
folded into the histogram only when that weight nears overflow); a re-solve costs one DP
run, so amortised per observation it is ``solve`` / ``resolve_every``.
"""

from __future__ import annotations

import numpy as np

from cache_core.hybrid.placement import PlacementProblem, PlacementSolution, solve

#: Fold the lazy weight into the histogram before it can overflow float64.
_RESCALE_ABOVE = 1e200


class OnlineOverlapEstimator:
    """Decayed histogram of overlap depths plus the optimal placement for it.

    Args:
        num_positions: horizon ``N`` in blocks; deeper observations count as depth ``N``.
        budget: checkpoints to place (``M``).
        decay: per-observation weight multiplier in ``(0, 1]`` (1 = plain histogram).
        resolve_every: re-solve the placement after this many new observations (``k``).
        block_costs: optional per-block recompute costs, as in :class:`PlacementProblem`.
    """

    def __init__(self, num_positions: int, budget: int, *, decay: float = 0.999, resolve_every: int = 64,
                 block_costs=None) -> None:
        if num_positions < 1:
            raise ValueError(f"num_positions must be >= 1, got {num_positions}")
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if resolve_every < 1:
            raise ValueError(f"resolve_every must be >= 1, got {resolve_every}")
        self.num_positions, self.budget = num_positions, budget
        self.decay, self.resolve_every = decay, resolve_every
        self.block_costs = block_costs
        self._counts = np.zeros(num_positions + 1)
        self._weight = 1.0                  # weight of the next observation (grows by 1/decay)
        self._since_solve = 0
        self.num_solves = 0
        #: The last solve, for every budget ``0..budget`` (None before the first one).
        self.solution: PlacementSolution | None = None

    @property
    def checkpoints(self) -> np.ndarray:
        """The current placement for ``budget`` (none before the first solve)."""
        return self.placement(self.budget)

    def placement(self, budget: int) -> np.ndarray:
        """The current placement for any ``budget <= self.budget`` (none before the first solve)."""
        return np.zeros(0, dtype=np.int64) if self.solution is None else self.solution.checkpoints(budget)

    @property
    def expected_cost(self) -> float:
        """Expected cost of the current placement under the estimate it was solved for."""
        if self.solution is None:
            raise ValueError("no placement solved yet")
        return float(self.solution.costs[self.budget])

    def observe(self, depth: int) -> bool:
        """Record one request's overlap depth; returns True when this triggered a re-solve."""
        if depth < 0:
            raise ValueError(f"overlap depth must be >= 0, got {depth}")
        self._counts[min(int(depth), self.num_positions)] += self._weight
        self._weight /= self.decay
        if self._weight > _RESCALE_ABOVE:
            self._counts /= self._weight
            self._weight = 1.0
        self._since_solve += 1
        if self._since_solve < self.resolve_every:
            return False
        self.resolve()
        return True

    def observe_many(self, depths) -> int:
        """``observe`` each depth in order; returns the number of re-solves triggered."""
        return sum(self.observe(d) for d in np.asarray(depths, dtype=np.int64))

    @property
    def depth_probs(self) -> np.ndarray:
        """The current decayed estimate of ``p`` over depths ``0..N`` (requires an observation)."""
        total = self._counts.sum()
        if total <= 0:
            raise ValueError("no overlap depth observed yet")
        return self._counts / total

    def observed_depths(self) -> np.ndarray:
        """The depths ``1 .. N - 1`` (blocks) observed at least once, ascending (``N``, the clip, is
        not an exact depth)."""
        return np.flatnonzero(self._counts[1:self.num_positions] > 0) + 1

    def resolve(self) -> None:
        """Re-solve the placement for the current estimate now."""
        self.solution = solve(PlacementProblem(self.depth_probs, self.block_costs), self.budget)
        self.num_solves += 1
        self._since_solve = 0
