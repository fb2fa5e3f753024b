"""Distribution-blind checkpoint placements, the baselines for the exact DP (cache_core.hybrid.placement).

Every heuristic maps ``(N, budget)`` to at most ``budget`` distinct positions in ``1..N``
(position 0, the implicit start, is never stored) and ignores the overlap distribution.
Some use fewer states than the budget allows; evaluations report the states actually
stored, so each heuristic is a point set on the recompute-vs-states Pareto plot.

=================  =======================================================================
name               positions for horizon N and budget M
=================  =======================================================================
``every_B``        ``B, 2B, 3B, ...`` (fixed block interval ``B``; the first ``M`` that fit)
``balanced``       ``M`` positions splitting ``0..N`` into ``M + 1`` near-equal segments
``sqrt``           every ``ceil(sqrt(N))`` blocks (the classic sqrt-decomposition interval)
``dyadic``         ``1, 2, 4, 8, ...`` (logarithmic); the deepest ``M`` when over budget
``end_of_prompt``  ``N`` only: keep the final state, as dense-style caches do
``grid_T``         every ``T`` tokens (:func:`engine_grids`: vLLM align-mode grids of 256,
                   512, 1,024 and 2,048-token blocks, when every block keeps its state)
``sglang_C``       SGLang-style: the end of every ``C``-token prefill chunk and the prompt's
                   end ``N`` (its extra state every 256 *decode* tokens is not modelled: the
                   depths here are prompt depths)
=================  =======================================================================
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np


class PlacementHeuristic(ABC):
    """A fixed rule for where to store states; ``name`` labels it in reports."""

    name: str

    #: Which end to keep when a rule proposes more positions than the budget.
    keep_shallowest = True

    def place(self, num_positions: int, budget: int) -> np.ndarray:
        """Sorted distinct positions in ``1..num_positions``, at most ``budget`` of them."""
        if num_positions < 1 or budget < 0:
            raise ValueError(f"need num_positions >= 1 and budget >= 0, got {num_positions}, {budget}")
        positions = np.unique(np.clip(self._positions(num_positions, budget), 1, num_positions))
        if budget >= positions.size:
            return positions
        return positions[:budget] if self.keep_shallowest else positions[positions.size - budget :]

    @abstractmethod
    def _positions(self, num_positions: int, budget: int) -> np.ndarray:
        """Candidate positions (may exceed the budget or repeat; ``place`` trims them)."""


class EveryBlocks(PlacementHeuristic):
    """A state every ``interval`` blocks from the start (block caching)."""

    def __init__(self, interval: int = 16) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.interval = interval
        self.name = f"every_{interval}"

    def interval_for(self, num_positions: int) -> int:
        return self.interval

    def _positions(self, num_positions: int, budget: int) -> np.ndarray:
        step = self.interval_for(num_positions)
        return np.arange(step, num_positions + 1, step)


class TokenGrid(EveryBlocks):
    """A state every ``tokens`` tokens (rounded to whole blocks of ``block_size``)."""

    def __init__(self, tokens: int, block_size: int) -> None:
        super().__init__(max(1, tokens // block_size))
        self.name = f"grid_{tokens}"


class SGLangChunks(PlacementHeuristic):
    """A state at the end of every prefill chunk of ``chunk_tokens`` and at the prompt's end."""

    def __init__(self, chunk_tokens: int, block_size: int) -> None:
        self.chunk_blocks = max(1, chunk_tokens // block_size)
        self.name = f"sglang_{chunk_tokens}"

    def _positions(self, num_positions: int, budget: int) -> np.ndarray:
        return np.append(np.arange(self.chunk_blocks, num_positions, self.chunk_blocks), num_positions)


class SqrtSpacing(EveryBlocks):
    """A state every ``ceil(sqrt(N))`` blocks."""

    def __init__(self) -> None:
        self.name = "sqrt"

    def interval_for(self, num_positions: int) -> int:
        return math.isqrt(num_positions - 1) + 1


class Balanced(PlacementHeuristic):
    """``M`` evenly spaced states: segments of ``0..N`` differ in length by at most one block."""

    name = "balanced"

    def _positions(self, num_positions: int, budget: int) -> np.ndarray:
        count = min(budget, num_positions)
        return (np.arange(1, count + 1) * (num_positions + 1)) // (count + 1)


class Dyadic(PlacementHeuristic):
    """States at powers of two (logarithmic spacing); the deepest ones when over budget."""

    name = "dyadic"
    keep_shallowest = False

    def _positions(self, num_positions: int, budget: int) -> np.ndarray:
        return 2 ** np.arange(num_positions.bit_length())


class EndOfPrompt(PlacementHeuristic):
    """Only the final state (position ``N``), whatever the budget (if at least 1)."""

    name = "end_of_prompt"

    def _positions(self, num_positions: int, budget: int) -> np.ndarray:
        return np.array([num_positions])


def default_heuristics(block_interval: int = 16) -> tuple[PlacementHeuristic, ...]:
    """The five baselines of the evaluation, in report order."""
    return (EveryBlocks(block_interval), Balanced(), SqrtSpacing(), Dyadic(), EndOfPrompt())


#: SGLang's default chunked-prefill size (tokens) for the ``sglang_C`` baseline.
SGLANG_CHUNK_TOKENS = 8192


def engine_grids(block_size: int) -> tuple[PlacementHeuristic, ...]:
    """The engines' fixed schedules at ``block_size``-token positions: vLLM grids of 256, 512,
    1,024 and 2,048 tokens and SGLang's per-chunk schedule."""
    return (*(TokenGrid(tokens, block_size) for tokens in (256, 512, 1024, 2048)),
            SGLangChunks(SGLANG_CHUNK_TOKENS, block_size))
