"""The simulator's hybrid mode: which recurrent states the engine keeps, and where a hit resumes.

A hybrid model (attention plus Gated DeltaNet layers) resumes a cached prefix only from a
kept recurrent state: a lookup matching ``A`` blocks of attention KV resumes at the deepest
kept state ``M <= A`` and recomputes blocks ``M..A`` (vLLM 0.32's align mode; see
:mod:`deploy.hybrid_placement`). Which states are kept (:class:`HybridSimConfig.placement`):

==========  =================================================================================
placement   states kept as a prefill passes block boundary ``k``
==========  =================================================================================
``vllm``    vLLM 0.32's own rule: the prompt's last full block ``(P - 1) // B``, and the
            "junction" ``A`` of a lookup whose attention hit ``A`` was deeper than its state hit
``dp``      the prompt's last full block, and ``k`` in the exact DP's placement for the
            overlap depths observed so far in the prompt's family
            (:class:`~cache_core.hybrid.rooted_placement.RootedPlacement`, as the plug-in: the DP
            replaces vLLM's junctions); vLLM's rule while that placement is empty
``grid``    every ``grid_blocks``-th boundary (a fixed grid, e.g. one state per 1,024 tokens)
==========  =================================================================================

SuffixReplay (``anchor_pages > 0``, as :mod:`deploy.replay_scheduler`): anchors are recorded
at every prompt page boundary a prefill passes (unless that page already has them), at most
``anchor_pages`` pages (least recently used evicted), and a hit resumes at the deeper of the
deepest kept state and the deepest anchored page within the attention match; vLLM's junction is
recorded as if there were no anchors, as in the engine. Anchors live in host memory, not in
the KV capacity, and their rebuild time is not simulated (the engine reports it as
``feather:rebuild_seconds``). Anchors are usable as soon as the prefill is scheduled (the engine
stores them after the step's forward).

Bytes: a kept state occupies ``state_blocks`` KV blocks (vLLM pads a GDN state page to the
attention page; one per GDN group). The simulator reserves ``max_states x state_blocks``
blocks of its KV capacity for states, and :class:`~cache_core.hybrid.state_registry.StateRegistry`
(shared with the plug-in) evicts beyond ``max_states``.

Divergences from the live engine: the reserve is a fixed partition (vLLM's states and KV share
one LRU pool, the plug-in caps the states); states and anchors are kept at prompt boundaries only
(vLLM can also keep decode-phase boundaries, and the engine anchors them with
``anchor_decode_pages``; only a later turn of the same conversation hits those).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cache_core.hybrid.rooted_placement import FamilyPlacementSettings
from cache_core.hybrid.state_registry import StateRegistry

PLACEMENTS = ("vllm", "dp", "grid")


@dataclass(frozen=True)
class HybridSimConfig(FamilyPlacementSettings):
    """The hybrid mode of the simulator (see the module docstring); the ``dp`` placement's
    settings are the plug-in's (:class:`~cache_core.hybrid.rooted_placement.FamilyPlacementSettings`)."""

    placement: str = "vllm"
    max_states: int = 32
    state_blocks: int = 3
    grid_blocks: int = 1
    anchor_pages: int = 0

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if min(self.state_blocks, self.grid_blocks, self.checkpoints, self.horizon_blocks) < 1:
            raise ValueError(f"{self}: state_blocks, grid_blocks, checkpoints, horizon_blocks must be >= 1")
        if min(self.max_states, self.anchor_pages) < 0:
            raise ValueError(f"{self}: max_states and anchor_pages must be >= 0")

    @staticmethod
    def state_blocks_for(layout) -> int:
        """KV blocks one state occupies for a :class:`~cache_core.hybrid.layout.HybridCacheLayout`:
        vLLM groups layers so every group has as many layers, hence GDN groups per attention group."""
        return math.ceil(layout.linear_layers / layout.attention_layers)


class StateKeeper:
    """Kept states and the lookup rule of one simulated hybrid engine."""

    def __init__(self, config: HybridSimConfig) -> None:
        self.config = config
        self.registry = StateRegistry(config.max_states)
        self.anchors = StateRegistry(config.anchor_pages)          # anchored pages (SuffixReplay)
        self.replay_hits = 0
        self.placement = config.rooted_placement()
        self._junction: dict[int, int] = {}
        self._observed: set[int] = set()
        self.evicted = 0

    def resumable(self, chain: list[int], shared_blocks: int) -> int:
        """Blocks of a ``shared_blocks``-block match that a hit can resume (deepest kept state or
        anchored page)."""
        return max(self.registry.deepest(chain, shared_blocks), self.anchors.deepest(chain, shared_blocks))

    def lookup(self, request: int, chain: list[int], kv_hit_blocks: int) -> int:
        """The hit of ``request`` whose attention KV matches ``kv_hit_blocks`` blocks: the deepest
        kept state or anchored page at or below it. Records the depth (once per request) and
        vLLM's junction (from the kept states alone)."""
        if request not in self._observed:
            self._observed.add(request)
            self.placement.observe(_root(chain), kv_hit_blocks)
        resume = self.registry.deepest(chain, kv_hit_blocks)
        if resume:
            self.registry.touch(chain[resume - 1])
        if self._rule(chain) == "vllm" and kv_hit_blocks > resume:
            self._junction[request] = kv_hit_blocks
        replay = self.anchors.deepest(chain, kv_hit_blocks)
        if replay > resume:
            self.anchors.touch(chain[replay - 1])
            self.replay_hits += 1
            return replay
        return resume

    def _rule(self, chain: list[int]) -> str:
        """The placement deciding for a prompt: ``dp`` falls back to vLLM's rule while its
        family's placement is empty."""
        placement = self.config.placement
        if placement == "dp" and not self.placement.chosen(_root(chain)):
            return "vllm"
        return placement

    def _keeps(self, request: int, rule: str, root, position: int, last_boundary: int) -> bool:
        if rule == "vllm":
            return position == last_boundary or position == self._junction.get(request)
        if rule == "dp":
            return position == last_boundary or position in self.placement.chosen(root)
        return position % self.config.grid_blocks == 0

    def prefilled(self, request: int, chain: list[int], from_blocks: int, to_blocks: int, last_boundary: int) -> None:
        """``request``'s prefill passed block boundaries ``from_blocks + 1 .. to_blocks``: keep the
        states the placement wants there (prompt boundaries only), then apply the budget."""
        root, rule = _root(chain), self._rule(chain)
        for k in range(from_blocks + 1, min(to_blocks, last_boundary) + 1):
            if self._keeps(request, rule, root, k, last_boundary):
                self.registry.keep(chain[k - 1], k)
            if self.config.anchor_pages and chain[k - 1] not in self.anchors:
                self.anchors.keep(chain[k - 1], k)
                self.anchors.enforce()
        self.evicted += len(self.registry.enforce())

    def finished(self, request: int) -> None:
        self._junction.pop(request, None)
        self._observed.discard(request)

    def metrics(self) -> dict:
        return {"hybrid_placement": self.config.placement, "states_kept": len(self.registry),
                "peak_states": self.registry.peak, "states_evicted": self.evicted,
                "dp_solves": self.placement.num_solves, "anchor_pages_kept": len(self.anchors),
                "replay_hits": self.replay_hits}


def _root(chain: list[int]):
    """A prompt's prefix family: its first block's digest (None before a full block)."""
    return chain[0] if chain else None
