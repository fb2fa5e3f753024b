"""Checkpoint placement for recurrent-state prefix caching: the problem and its exact solvers.

A recurrent (SSM) layer can resume a prompt only from a stored state. Along one shared
prefix we may store states at a budget of ``M`` block boundaries; a request whose prompt
matches the prefix to depth ``t`` resumes from the deepest stored state at or before ``t``
and recomputes the rest of the match.

The problem
-----------
* Positions ``0..N`` are block boundaries (position ``t`` = the first ``t`` blocks).
* ``p[t]`` (``t = 0..N``) is the probability that a request's overlap depth is ``t`` blocks.
* ``w[u] > 0`` (``u = 0..N-1``) is the cost of recomputing block ``u`` (default 1, so costs
  are in blocks; a cost that grows with position models attention's prefill cost).
  ``W[t] = sum(w[:t])`` is the cost of recomputing positions ``0..t``.
* A placement is a set ``C`` of at most ``M`` checkpoints in ``1..N``. Position 0 is always
  available as the implicit start: resuming from it means recomputing from scratch, and it
  costs no budget.
* ``cost(C) = E_t[W[t] - W[c(t)]]`` with ``c(t) = max{c in C u {0} : c <= t}``: the expected
  recompute spent on the matched prefix. Work past the match (the request's own suffix) is
  the same for every placement and is not counted. A depth beyond ``N`` behaves like depth
  ``N`` up to a placement-independent constant, so callers clip depths to ``N``.

The dynamic program
-------------------
``F_k(e)`` is the least cost of the depths ``0..e`` with at most ``k`` checkpoints in
``1..e``. With ``seg(s, e) = sum_{t=s..e} p[t] (W[t] - W[s])`` (depths ``s..e`` served by a
checkpoint at ``s``)::

    F_0(e) = seg(0, e)
    F_k(e) = min_{0 <= s <= e} G_k(s) + seg(s, e),   G_k(0) = 0,  G_k(s) = F_{k-1}(s - 1)

and the answer for budget ``k`` is ``F_k(N)``. Prefix sums ``P(x) = sum_{t<x} p[t]`` and
``Q(x) = sum_{t<x} p[t] W[t]`` give ``seg(s, e) = Q(e+1) - Q(s) - W[s] (P(e+1) - P(s))``, so
the textbook oracle is ``O(M N^2)`` with ``O(1)`` per term (:func:`solve_oracle`).

Why a faster exact solver exists (the structure, with proof)
------------------------------------------------------------
Write ``A_k[e, s] = G_k(s) + seg(s, e)``. Expanding ``seg``::

    A_k[e, s] = a_s - W[s] * x_e + Q(e+1),   a_s = G_k(s) - Q(s) + W[s] P(s),   x_e = P(e+1).

1. *Monge.* For ``s < s'`` and ``e < e'``:
   ``A[e,s] + A[e',s'] - A[e,s'] - A[e',s] = (W[s'] - W[s]) (x_e - x_e') <= 0`` because ``W``
   increases and ``x`` does not decrease. So ``seg`` satisfies the quadrangle inequality
   and the row argmin is monotone in ``e`` (the classic divide-and-conquer / SMAWK
   structure). This holds for any positive block costs ``w``: the weighted variant is
   exactly as tractable as the unweighted one.
2. *Lower envelope.* Row ``e`` of ``A_k`` (minus its constant ``Q(e+1)``) is the lower
   envelope of the lines ``y = a_s - W[s] x`` at ``x = x_e``. Its minimiser is a vertex of
   the lower convex hull of the points ``(W[s], a_s)``: the vertex whose adjacent hull edges
   have slopes bracketing ``x_e``, found by binary search over the (increasing) edge slopes.
3. *No causality mask needed.* Evaluating the formula at ``s > e`` gives
   ``G_k(s) + sum_{e<t<s} p[t] (W[s] - W[t]) >= F_{k-1}(s-1) >= F_{k-1}(e) >= F_k(e)``
   (``F`` does not decrease in ``e`` and does not increase in ``k``), and ``s = e + 1``
   gives exactly ``F_{k-1}(e)``. So minimising over *all* ``s`` gives the same ``F_k(e)``;
   an argmin ``s > e`` means "layer ``k`` adds no checkpoint in ``1..e``" (backtracking
   skips the layer). One hull therefore serves every ``e`` of the layer at once.
4. *Only support positions matter.* Moving a checkpoint ``c`` right to the next position
   ``c'`` with ``p[c'] > 0`` never raises the cost (depths in ``c..c'-1`` have mass 0 and
   every depth ``>= c'`` resumes later), so candidates are restricted to ``{0} u supp(p)``
   and ``n = |{0} u supp(p)|`` replaces ``N + 1``.

The hull is built in two vectorised steps, both resting on one fact: a point on or above
the chord of two other points of the set that bracket it is not a strict hull vertex.
(a) Warm start: the chain through the previous layer's hull vertices (evaluated at this
layer's ``a``) is a chain of such chords, so every point above it is dropped at once; this
removes most long hull edges, which local pruning handles one point per round. (b) Pruning
rounds: every point on or above the chord of its current neighbours is dropped; a round
that drops nothing leaves a convex chain, hence the hull. When rounds stall at a few drops
each, tangents from the stalled spots drop whole runs at once (:func:`_lower_hull`).
:func:`solve` costs ``O(M n (r + log n))`` with ``r`` pruning rounds per layer: about 3 in
practice (it is bounded by ``n``; ``feather bench placement`` times several distribution
shapes), against ``O(M N^2)`` for the oracle. Layers stop early once the cost reaches 0 or
stops falling: the optimal cost of a Monge k-link path is convex in ``k`` (Aggarwal,
Schieber & Tokuyama, 1994), so once it stops falling it never falls again. The solver is
exact up to float64 rounding (tests compare with the oracle and brute force at a relative
tolerance of 1e-9).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

#: |sum(p) - 1| above this is rejected as a non-normalised distribution.
NORMALISATION_TOLERANCE = 1e-9


@dataclass(frozen=True, eq=False)
class PlacementProblem:
    """Overlap-depth distribution ``depth_probs[t]`` (t = 0..N) and per-block recompute costs.

    Invariants (``ValueError`` otherwise): ``depth_probs`` is finite, non-negative, sums to 1
    within :data:`NORMALISATION_TOLERANCE` and has length ``N + 1 >= 2``; ``block_costs`` (if
    given) has length ``N`` and is finite and positive.
    """

    depth_probs: np.ndarray
    block_costs: np.ndarray | None = None

    def __post_init__(self) -> None:
        p = np.asarray(self.depth_probs, dtype=np.float64)
        if p.ndim != 1 or p.size < 2:
            raise ValueError(f"depth_probs must be a 1-D array over positions 0..N with N >= 1, got shape {p.shape}")
        if not np.all(np.isfinite(p)) or np.any(p < 0):
            raise ValueError(f"depth_probs must be finite and non-negative (min {p.min()!r})")
        if abs(p.sum() - 1.0) > NORMALISATION_TOLERANCE:
            raise ValueError(f"depth_probs must sum to 1, got {p.sum()!r}; use PlacementProblem.from_counts")
        object.__setattr__(self, "depth_probs", p)
        if self.block_costs is not None:
            w = np.asarray(self.block_costs, dtype=np.float64)
            if w.shape != (p.size - 1,):
                raise ValueError(f"block_costs must have one entry per block ({p.size - 1}), got shape {w.shape}")
            if not np.all(np.isfinite(w)) or np.any(w <= 0):
                raise ValueError("block_costs must be finite and positive")
            object.__setattr__(self, "block_costs", w)

    @classmethod
    def from_counts(cls, counts, block_costs=None) -> PlacementProblem:
        """The problem whose ``p`` is the histogram ``counts`` (non-negative, not all 0) normalised."""
        counts = np.asarray(counts, dtype=np.float64)
        if counts.ndim != 1 or np.any(counts < 0) or not np.all(np.isfinite(counts)) or counts.sum() <= 0:
            raise ValueError("counts must be a 1-D array of finite non-negative values with a positive sum")
        return cls(counts / counts.sum(), block_costs)

    @classmethod
    def from_depths(cls, depths, num_positions: int | None = None, block_costs=None) -> PlacementProblem:
        """Empirical problem from overlap depths in blocks; depths above ``num_positions`` are clipped.

        ``num_positions`` (``N``) defaults to the largest depth (at least 1).
        """
        depths = np.asarray(depths, dtype=np.int64)
        if depths.ndim != 1 or depths.size == 0 or np.any(depths < 0):
            raise ValueError("depths must be a non-empty 1-D array of non-negative integers")
        n = max(int(depths.max()), 1) if num_positions is None else int(num_positions)
        if n < 1:
            raise ValueError(f"num_positions must be >= 1, got {n}")
        return cls.from_counts(np.bincount(np.minimum(depths, n), minlength=n + 1), block_costs)

    @property
    def num_positions(self) -> int:
        """``N``: the deepest position (positions are ``0..N``)."""
        return self.depth_probs.size - 1

    @property
    def cumulative_cost(self) -> np.ndarray:
        """``W[t]``: the cost of recomputing positions ``0..t`` (``W[0] = 0``), length ``N + 1``."""
        w = np.ones(self.num_positions) if self.block_costs is None else self.block_costs
        return np.concatenate(([0.0], np.cumsum(w)))

    def cost(self, checkpoints) -> float:
        """``E_t[W[t] - W[c(t)]]`` straight from the definition (checkpoints in ``1..N``)."""
        c = np.unique(np.asarray(checkpoints, dtype=np.int64))
        if c.size and (c[0] < 1 or c[-1] > self.num_positions):
            raise ValueError(f"checkpoints must lie in 1..{self.num_positions}, got {c[0]}..{c[-1]}")
        depths = np.arange(self.num_positions + 1)
        W = self.cumulative_cost
        return float(self.depth_probs @ (W[depths] - W[resume_positions(c, depths)]))


def resume_positions(checkpoints: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """``c(t)`` for each depth: the deepest checkpoint ``<= t``, or 0 (sorted ``checkpoints``)."""
    starts = np.concatenate(([0], checkpoints))
    return starts[np.searchsorted(starts, depths, side="right") - 1]


class PlacementSolution:
    """Optimal costs and placements for every budget ``0..max_budget`` from one DP run.

    ``costs[k]`` is the optimal expected cost with at most ``k`` checkpoints (non-increasing
    in ``k``). ``checkpoints(k)`` backtracks the stored per-layer argmins in ``O(k)``;
    ``checkpoints(k, horizon=L)`` backtracks from a shallower position, giving the optimal
    placement for the depths ``0..L`` alone.
    """

    def __init__(self, costs: np.ndarray, argmins: list[np.ndarray], positions: np.ndarray) -> None:
        self.costs = costs
        self._argmins = argmins          # argmins[k-1][e] = best s of layer k (s > e: layer unused)
        self._positions = positions      # candidate index -> position

    @property
    def max_budget(self) -> int:
        return self.costs.size - 1

    def checkpoints(self, budget: int, horizon: int | None = None) -> np.ndarray:
        """Sorted optimal checkpoint positions for ``budget`` (``0 <= budget <= max_budget``),
        all ``<= horizon``, minimising the expected cost over the depths ``0..horizon`` alone.

        ``horizon=None`` means ``N`` (every depth). Otherwise this backtracks ``F_budget(e)``
        from the deepest candidate position ``e <= horizon``: every ``F_k(e)`` is optimal for
        the distribution truncated to ``0..e`` (unnormalised; normalising does not move the
        argmin), and ``p`` is 0 between ``e`` and ``horizon``, so no re-solve is needed. A
        horizon beyond ``N`` acts as ``N``. This is the reference's per-request-length
        placement (``HistogramTracker.get_positions(seq_len)``, "adaptive backtrack").

        Limitation: :func:`solve` stops adding layers once ``F_k(N)`` reaches 0 or stops
        falling. In exact arithmetic ``F_k(N)`` falls while it is positive, and ``F_k(N) = 0``
        implies ``F_k(e) = 0`` for every ``e``, so the stop loses nothing; but a stop caused by
        float rounding at ``N`` (a gain below the rounding of ``F(N)``) also ends the layers
        for shallower horizons, whose placements for larger budgets then use only the solved
        layers. :func:`solve_oracle` never stops early.
        """
        if not 0 <= budget <= self.max_budget or int(budget) != budget:
            raise ValueError(f"budget must be an integer in 0..{self.max_budget}, got {budget!r}")
        if horizon is not None and horizon < 0:
            raise ValueError(f"horizon must be >= 0, got {horizon}")
        last = self._positions.size - 1
        e = last if horizon is None else int(np.searchsorted(self._positions, horizon, side="right")) - 1
        chosen = []
        for layer in range(min(int(budget), len(self._argmins)), 0, -1):
            s = int(self._argmins[layer - 1][e])
            if s == 0:
                break
            if s <= e:
                chosen.append(int(self._positions[s]))
                e = s - 1
        return np.array(sorted(chosen), dtype=np.int64)


def _check_budget(budget: int) -> int:
    if int(budget) != budget or budget < 0:
        raise ValueError(f"budget must be a non-negative integer, got {budget!r}")
    return int(budget)


def _lower_hull(x: np.ndarray, y: np.ndarray, *, tangent_max_points: int = 4, stalled_rounds: int = 2) -> np.ndarray:
    """Indices of the strict lower convex hull of points sorted by strictly increasing ``x``.

    Each round drops every point on or above the chord of its current neighbours (such a
    point is never a strict hull vertex); a round that drops nothing leaves a convex chain.
    A long hull edge over a locally convex chain would cost one round per point, so after
    ``stalled_rounds`` rounds in a row with at most ``tangent_max_points`` drops, the
    neighbours of each dropped point instead drop everything up to their tangent point
    (see :func:`_tangent_spans`): ``O(n)`` per such point.
    """
    idx = np.arange(x.size)
    stalled = 0
    while idx.size > 2:
        xs, ys = x[idx], y[idx]
        dx, dy = xs[1:] - xs[:-1], ys[1:] - ys[:-1]
        convex = dy[:-1] * dx[1:] < dy[1:] * dx[:-1]
        num_dropped = convex.size - np.count_nonzero(convex)
        if num_dropped == 0:
            break
        keep = np.concatenate(([True], convex, [True]))
        stalled = stalled + 1 if num_dropped <= tangent_max_points else 0
        if stalled >= stalled_rounds:
            for first, stop in _tangent_spans(xs, ys, np.flatnonzero(~keep)):
                keep[first:stop] = False
        idx = idx[keep]
    return idx


def _tangent_spans(xs: np.ndarray, ys: np.ndarray, dropped: np.ndarray) -> list[tuple[int, int]]:
    """Index ranges ``[first, stop)`` strictly inside hull-certificate chords around ``dropped``.

    For the left neighbour ``l`` of a dropped point, the point ``r > l`` of least slope from
    ``l`` puts every point between them on or above the chord ``(l, r)``; symmetrically for
    the right neighbour and the point of greatest slope into it.
    """
    pos = np.arange(xs.size)
    left, right = dropped - 1, dropped + 1
    with np.errstate(divide="ignore", invalid="ignore"):
        from_left = (ys[None, :] - ys[left, None]) / (xs[None, :] - xs[left, None])
        into_right = (ys[right, None] - ys[None, :]) / (xs[right, None] - xs[None, :])
    from_left[pos[None, :] <= left[:, None]] = np.inf
    into_right[pos[None, :] >= right[:, None]] = -np.inf
    spans = zip(left + 1, from_left.argmin(axis=1))
    return [*spans, *zip(into_right.argmax(axis=1) + 1, right)]


def solve(problem: PlacementProblem, max_budget: int) -> PlacementSolution:
    """Exact optimal placement for every budget ``0..max_budget`` (lower-envelope DP, see module doc)."""
    max_budget = _check_budget(max_budget)
    p_all = problem.depth_probs
    positions = np.flatnonzero(p_all > 0)
    if positions[0] != 0:
        positions = np.concatenate(([0], positions))
    p, W = p_all[positions], problem.cumulative_cost[positions]
    P = np.concatenate(([0.0], np.cumsum(p)))
    Q = np.concatenate(([0.0], np.cumsum(p * W)))
    x, q_end = P[1:], Q[1:]
    base = W * P[:-1] - Q[:-1]            # a_s without G_k(s)
    F = q_end.copy()                        # F_0(e) = seg(0, e)
    costs = [float(F[-1])]
    argmins = []
    hull = np.array([0, positions.size - 1])
    W_hull = W[hull]
    a = base.copy()
    for _ in range(min(max_budget, positions.size - 1)):
        np.add(base[1:], F[:-1], out=a[1:])  # a_s with G_k(s) = F_{k-1}(s-1), G_k(0) = 0
        # Warm start: points strictly above the chain through last layer's hull vertices are out.
        below = np.flatnonzero(a <= np.interp(W, W_hull, a[hull]))
        W_below, a_below = W[below], a[below]
        on_hull = _lower_hull(W_below, a_below)
        hull, W_hull, a_hull = below[on_hull], W_below[on_hull], a_below[on_hull]
        # Query x_e is served by hull vertex #{edges with slope < x_e}; counting, per edge, the
        # queries above its slope costs O(h log n + n) instead of O(n log h).
        slopes = (a_hull[1:] - a_hull[:-1]) / (W_hull[1:] - W_hull[:-1])
        vertex = np.cumsum(np.bincount(np.searchsorted(x, slopes, side="right"), minlength=x.size)[: x.size])
        argmins.append(hull[vertex])
        F_next = np.minimum(a_hull[vertex] - W_hull[vertex] * x + q_end, F)   # clamp float noise: F_k <= F_{k-1}
        costs.append(float(F_next[-1]))
        if not 0 < F_next[-1] < F[-1]:
            break
        F = F_next
    costs += [costs[-1]] * (max_budget + 1 - len(costs))
    return PlacementSolution(np.maximum(np.array(costs), 0.0), argmins, positions)


def solve_oracle(problem: PlacementProblem, max_budget: int, *, rows_per_chunk: int = 256) -> PlacementSolution:
    """The textbook ``O(M N^2)`` DP over all positions (vectorised per block of ``e`` rows).

    Kept as the test oracle and the benchmark baseline; it uses no structure beyond prefix
    sums and masks ``s > e`` explicitly.
    """
    max_budget = _check_budget(max_budget)
    n = problem.num_positions + 1
    p, W = problem.depth_probs, problem.cumulative_cost
    P = np.concatenate(([0.0], np.cumsum(p)))
    Q = np.concatenate(([0.0], np.cumsum(p * W)))
    s = np.arange(n)
    F = Q[1:].copy()
    costs = [float(F[-1])]
    argmins = []
    for _ in range(min(max_budget, n - 1)):
        G = np.concatenate(([0.0], F[:-1]))
        a = G - Q[:-1] + W * P[:-1]
        best = np.empty(n, dtype=np.int64)
        for lo in range(0, n, rows_per_chunk):
            e = np.arange(lo, min(lo + rows_per_chunk, n))
            total = a[None, :] - W[None, :] * P[e + 1][:, None]
            total[s[None, :] > e[:, None]] = np.inf
            best[e] = np.argmin(total, axis=1)
        F = G[best] + Q[s + 1] - Q[best] - W[best] * (P[s + 1] - P[best])
        argmins.append(best)
        costs.append(float(F[-1]))
    costs += [costs[-1]] * (max_budget + 1 - len(costs))
    return PlacementSolution(np.maximum(np.array(costs), 0.0), argmins, s)


def solve_brute_force(problem: PlacementProblem, budget: int) -> tuple[np.ndarray, float]:
    """Best of all placements of at most ``budget`` checkpoints (tiny ``N`` only: ``2^N`` sets)."""
    budget = _check_budget(budget)
    n = problem.num_positions
    if n > 16:
        raise ValueError(f"brute force is for N <= 16, got N = {n}")
    best = (np.zeros(0, dtype=np.int64), problem.cost([]))
    for k in range(1, min(budget, n) + 1):
        for combo in itertools.combinations(range(1, n + 1), k):
            cost = problem.cost(combo)
            if cost < best[1]:
                best = (np.array(combo, dtype=np.int64), cost)
    return best
