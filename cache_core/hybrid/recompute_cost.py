"""Prefill time of a prompt span: the time side of the placement problem (cache_core.hybrid.placement).

Model. Computing prompt positions ``0..n`` from nothing costs the cumulative time

    T(n) = b n + c n^2  (ms),

linear work per token (weights, MLPs, the Gated DeltaNet recurrence) plus attention over
pairs of tokens; every prefill also pays a fixed ``a`` ms (scheduling, the final logits).
Resuming from position ``from`` (the KV and recurrent state of ``0..from`` available) and
computing up to ``to`` costs ``T(to) - T(from) + a`` when ``to > from``, else nothing
(:meth:`PrefillTime.ms`). So the recompute of block ``u`` (tokens ``uB..(u+1)B``) costs
``w[u] = T((u+1)B) - T(uB)``, the DP's block costs in ms (:meth:`PrefillTime.block_costs`),
and ``W[t] = T(tB)``.

:meth:`PrefillTime.fit` fits ``a, b, c >= 0`` to measured ``(tokens, ms)`` prefills from 0
(``ms = a + T(tokens)``), the points that :mod:`feather_gym.costmodel.prefill_profiler`
measures.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class PrefillTime:
    """``ms(from, to) = a + T(to) - T(from)`` with ``T(n) = b n + c n^2`` (to > from; else 0).

    Invariants (``ValueError`` otherwise): the three coefficients are finite and
    non-negative, so ``ms`` never decreases in ``to`` nor increases in ``from``.
    """

    fixed_ms: float                 # a: per prefill
    ms_per_token: float             # b
    ms_per_token_squared: float     # c

    def __post_init__(self) -> None:
        values = np.array([self.fixed_ms, self.ms_per_token, self.ms_per_token_squared], dtype=np.float64)
        if not np.all(np.isfinite(values)) or np.any(values < 0):
            raise ValueError(f"prefill coefficients must be finite and non-negative, got {values.tolist()}")

    def cumulative_ms(self, tokens):
        """``T(n)``: computing positions ``0..n`` without the fixed cost (elementwise)."""
        n = np.asarray(tokens, dtype=np.float64)
        return self.ms_per_token * n + self.ms_per_token_squared * n * n

    def ms(self, tokens_from, tokens_to):
        """Time to compute prompt positions ``from..to`` given the KV/state of ``0..from``
        (elementwise; a float for scalar arguments): ``T(to) - T(from) + a`` if ``to > from``, else 0."""
        start, stop = np.asarray(tokens_from, dtype=np.float64), np.asarray(tokens_to, dtype=np.float64)
        out = np.where(stop > start, self.cumulative_ms(stop) - self.cumulative_ms(start) + self.fixed_ms, 0.0)
        return float(out) if out.ndim == 0 else out

    def block_costs(self, block_size: int, num_blocks: int) -> np.ndarray:
        """``w[u] = T((u+1) B) - T(u B)`` ms for ``u = 0..num_blocks-1``: a
        :class:`~cache_core.hybrid.placement.PlacementProblem`'s ``block_costs`` (positive, so the
        model must have ``b > 0`` or ``c > 0``)."""
        if block_size < 1 or num_blocks < 1:
            raise ValueError(f"block_size and num_blocks must be >= 1, got {block_size}, {num_blocks}")
        if self.ms_per_token <= 0 and self.ms_per_token_squared <= 0:
            raise ValueError("a prefill model with no per-token cost gives zero block costs")
        return np.diff(self.cumulative_ms(np.arange(num_blocks + 1) * block_size))

    @classmethod
    def fit(cls, points) -> PrefillTime:
        """Non-negative least squares of ``ms = a + b n + c n^2`` over ``(n, ms)`` pairs of prefills from 0.

        Exact: the non-negative optimum is the unconstrained least-squares fit on some subset of
        the three columns, so every subset is solved (columns scaled to unit norm, as ``n^2``
        spans many more orders of magnitude than ``1``) and the best non-negative fit kept.
        Needs at least one point with ``n >= 1``.
        """
        data = np.asarray(points, dtype=np.float64).reshape(-1, 2)
        n, ms = data[:, 0], data[:, 1]
        if n.size == 0 or np.any(n < 1) or not np.all(np.isfinite(data)) or np.any(ms < 0):
            raise ValueError("points must be (tokens >= 1, ms >= 0) pairs, at least one")
        design = np.stack([np.ones_like(n), n, n * n], axis=1)
        scale = np.linalg.norm(design, axis=0)
        scaled = design / scale
        best, best_error = np.zeros(3), float(ms @ ms)
        for subset in itertools.chain.from_iterable(itertools.combinations(range(3), k) for k in (1, 2, 3)):
            columns = list(subset)
            solution = np.linalg.lstsq(scaled[:, columns], ms, rcond=None)[0]
            if np.all(solution >= 0):
                coef = np.zeros(3)
                coef[columns] = solution
                error = float(np.sum((scaled @ coef - ms) ** 2))
                if error < best_error:
                    best, best_error = coef, error
        return cls(*(best / scale).tolist())

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PrefillTime:
        """The model from :meth:`to_dict`'s keys; other keys (the profile's points, backend) are ignored."""
        return cls(float(data["fixed_ms"]), float(data["ms_per_token"]), float(data["ms_per_token_squared"]))
