"""The recurrent states a hybrid prefix cache keeps, and which go first when over budget.

One definition for the simulator's hybrid mode (:mod:`feather_gym.simulator`) and the vLLM
plug-in (:mod:`deploy.hybrid_placement`). A state is keyed by the chained digest of the
prefix it summarises (the digest of the block it ends) and sits at a position in blocks.

Eviction when more than ``max_states`` are kept (:meth:`StateRegistry.enforce`): the least
recently used first (a state is used when it is kept or when a lookup resumes from it). Which
states are kept at all is the placement's choice, made before they reach the registry.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class StateRegistry:
    """Kept states ``key -> position`` in LRU order; at most ``max_states`` (``None``: no cap)
    once :meth:`enforce` has run. ``peak`` is the most states held after an :meth:`enforce`."""

    def __init__(self, max_states: int | None = None) -> None:
        if max_states is not None and max_states < 0:
            raise ValueError(f"max_states must be >= 0, got {max_states}")
        self.max_states = max_states
        self._states: OrderedDict[Hashable, int] = OrderedDict()
        self.peak = 0

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, key) -> bool:
        return key in self._states

    def __iter__(self):
        return iter(list(self._states))

    def keep(self, key, position: int) -> None:
        """Record (or refresh) a kept state."""
        self._states[key] = position
        self._states.move_to_end(key)

    def touch(self, key) -> None:
        """A lookup resumed from ``key``: it becomes the most recently used."""
        if key in self._states:
            self._states.move_to_end(key)

    def discard(self, key) -> None:
        self._states.pop(key, None)

    def enforce(self) -> list:
        """Remove and return the least recently used states over ``max_states``."""
        excess = 0 if self.max_states is None else max(0, len(self._states) - self.max_states)
        victims = [self._states.popitem(last=False)[0] for _ in range(excess)]
        self.peak = max(self.peak, len(self._states))
        return victims

    def deepest(self, chain: list, max_blocks: int) -> int:
        """The deepest position ``k <= max_blocks`` whose state (key ``chain[k - 1]``) is kept; 0 if none."""
        for k in range(min(max_blocks, len(chain)), 0, -1):
            if chain[k - 1] in self._states:
                return k
        return 0
