"""One checkpoint placement per prefix family, learnt online: the DP's problem is per shared prefix.

The exact DP (:mod:`cache_core.hybrid.placement`) places states along *one* shared prefix, given the
distribution of overlap depths with it. A server holds many unrelated prefixes (documents,
conversations, system prompts), whose depth distributions differ: one placement at absolute
depths for all of them fits none. :class:`RootedPlacement` keeps one
:class:`~cache_core.hybrid.overlap_estimator.OnlineOverlapEstimator` per *root*, the digest of a
prompt's first block (prompts that share nothing are in different families), for the
``max_roots`` most recently seen roots (least recently seen forgotten first).

A request with no full block has no root and no placement. Cost per observation: O(1), plus a
DP solve every ``resolve_every`` observations of its root.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from cache_core.hybrid.overlap_estimator import OnlineOverlapEstimator

_NONE: frozenset[int] = frozenset()


@dataclass(frozen=True)
class FamilyPlacementSettings:
    """The DP's settings per prefix family: ``checkpoints`` states over ``horizon_blocks`` blocks,
    the estimator's ``decay`` and ``resolve_every`` (observations of the family)."""

    checkpoints: int = 8
    horizon_blocks: int = 64
    decay: float = 0.999
    resolve_every: int = 1

    def rooted_placement(self) -> RootedPlacement:
        return RootedPlacement(self.horizon_blocks, self.checkpoints, decay=self.decay,
                               resolve_every=self.resolve_every)


class RootedPlacement:
    """Per-root online placements (see the module docstring)."""

    def __init__(self, horizon_blocks: int, budget: int, *, decay: float = 0.999, resolve_every: int = 1,
                 max_roots: int = 1024) -> None:
        if max_roots < 1:
            raise ValueError(f"max_roots must be >= 1, got {max_roots}")
        self.horizon_blocks, self.budget = horizon_blocks, budget
        self.decay, self.resolve_every, self.max_roots = decay, resolve_every, max_roots
        OnlineOverlapEstimator(horizon_blocks, budget, decay=decay, resolve_every=resolve_every)  # validates
        self._roots: OrderedDict[Hashable, tuple[OnlineOverlapEstimator, frozenset[int]]] = OrderedDict()
        self.num_solves = 0

    def observe(self, root: Hashable | None, depth_blocks: int) -> None:
        """Record one request's overlap depth (blocks) within its family ``root``."""
        if root is None:
            return
        entry = self._roots.get(root)
        if entry is None:
            estimator = OnlineOverlapEstimator(self.horizon_blocks, self.budget, decay=self.decay,
                                               resolve_every=self.resolve_every)
            entry = (estimator, _NONE)
        estimator = entry[0]
        if estimator.observe(min(depth_blocks, self.horizon_blocks)):
            self.num_solves += 1
            entry = (estimator, frozenset(int(c) for c in estimator.checkpoints))
        self._roots[root] = entry
        self._roots.move_to_end(root)
        if len(self._roots) > self.max_roots:
            self._roots.popitem(last=False)

    def chosen(self, root: Hashable | None) -> frozenset[int]:
        """The block positions kept for family ``root`` (empty before its first solve)."""
        entry = self._roots.get(root)
        return entry[1] if entry is not None else _NONE

    def observed(self, root: Hashable | None) -> frozenset[int]:
        """The overlap depths (blocks) observed in family ``root`` (:meth:`OnlineOverlapEstimator.observed_depths`)."""
        entry = self._roots.get(root)
        return frozenset(int(d) for d in entry[0].observed_depths()) if entry is not None else _NONE

    def all_chosen(self) -> frozenset[int]:
        """Every position some family keeps (for reports)."""
        return frozenset().union(*(chosen for _, chosen in self._roots.values()))

    def __len__(self) -> int:
        return len(self._roots)
