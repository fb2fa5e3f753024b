"""Checkpoint placement inside vLLM: which recurrent states a hybrid model's prefix cache keeps.

Plug it in the way the Feather scheduler is plugged in::

    python -m vllm.entrypoints.openai.api_server --model HYBRID --enable-prefix-caching \\
        --scheduler-cls deploy.hybrid_placement.HybridPlacementScheduler \\
        --additional-config '{"feather_hybrid": {"placement": "dp", "state_budget_bytes": 33554432}}'

How vLLM 0.32 and 0.33 cache recurrent state (``mamba_cache_mode="align"``, the mode prefix caching
turns on for hybrids; read from the installed source):

* a state exists only at the end of a scheduled chunk, and chunks end on block boundaries;
* which chunk-end states are registered in the prefix cache is decided per Mamba manager by
  ``MambaManager.reachable_block_mask`` (by default: the prompt's last full block, plus a
  "junction" where a lookup found a longer attention hit than state hit) and by
  ``_cache_partial_tail_block`` (the prompt's last boundary);
* a lookup matches attention KV left to right (``A`` tokens), then takes the deepest block
  boundary ``<= A`` whose state is registered in every Gated DeltaNet group, copies that state
  into the request's running slot and recomputes the rest exactly. Resuming from the deepest
  kept state is therefore vLLM's own behaviour; this plug-in only chooses what is kept.
* a kept state costs one pool block per GDN group (vLLM pads the state page to the attention
  page), in the same LRU pool as attention KV; vLLM puts no cap on their number.

What :class:`HybridPlacementMixin` changes (attention KV, budgets and outputs stay vLLM's):

* ``placement="dp"``: the positions kept are those of the exact DP
  (:func:`cache_core.hybrid.placement.solve`) for the overlap-depth distribution learnt online from
  every lookup (the depth is the attention hit, in blocks: how far the prompt matched cached
  text), one distribution per prefix family (:class:`~cache_core.hybrid.rooted_placement.RootedPlacement`:
  the family is the prompt's first block). The DP replaces vLLM's junction rule: prefill
  chunks are cut at the DP's positions so their states exist, the masks keep them and vLLM's
  replay boundary (the prompt's last full block, which a resend or an extension of the prompt
  resumes from), and vLLM's junction stop is switched off. A family whose placement is still
  empty (no overlap seen yet) keeps vLLM's own positions, junctions included.
* ``placement="vllm"``: vLLM's own positions.
* Both: at most ``state_budget_bytes`` of kept states (``floor(budget / bytes per state)``
  states); over the cap the least recently kept or hit go first
  (:class:`~cache_core.hybrid.state_registry.StateRegistry`). Eviction only removes a state's hash
  (vLLM's ``evict_blocks``) in all GDN groups at once, after ``schedule()`` returns: reference
  counts, free queue and block tables stay vLLM's.

Configuration: ``additional_config["feather_hybrid"]``, keys of :class:`HybridPlacementConfig`.
:class:`FeatherHybridScheduler` composes the Feather scheduler with this plug-in: its policy's
view counts a shared block as cached only up to the deepest kept state
(:meth:`HybridPlacementMixin.resumable_blocks`), as the simulator's hybrid mode does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from deploy.vllm_compat import local_prefix_cache_hit, require_supported_vllm

require_supported_vllm()  # before touching vLLM internals

from vllm.v1.core.kv_cache_utils import get_block_hash, make_block_hash_with_group_id  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import MambaManager  # noqa: E402
from vllm.v1.kv_cache_interface import MambaSpec  # noqa: E402

from cache_core.hybrid.rooted_placement import FamilyPlacementSettings  # noqa: E402
from cache_core.hybrid.state_registry import StateRegistry  # noqa: E402
from deploy.metrics import MetricsRecorder  # noqa: E402
from deploy.plugin_config import config_section  # noqa: E402
from deploy.scheduler import FeatherSchedulingMixin  # noqa: E402

logger = logging.getLogger(__name__)

#: The ``additional_config`` key holding :class:`HybridPlacementConfig` fields.
ADDITIONAL_CONFIG_KEY = "feather_hybrid"
PLACEMENTS = ("dp", "vllm")


@dataclass(frozen=True)
class HybridPlacementConfig(FamilyPlacementSettings):
    """Settings of the hybrid placement plug-in (see the module docstring): the DP's per family
    (:class:`~cache_core.hybrid.rooted_placement.FamilyPlacementSettings`), ``placement`` and
    ``state_budget_bytes`` (pool bytes, ``None`` = no cap) bounding all kept states together."""

    placement: str = "dp"
    state_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"feather_hybrid.placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.state_budget_bytes is not None and self.state_budget_bytes < 0:
            raise ValueError(f"feather_hybrid.state_budget_bytes must be >= 0, got {self.state_budget_bytes}")

    @classmethod
    def from_additional_config(cls, additional_config: Mapping | None) -> HybridPlacementConfig:
        """Read ``additional_config["feather_hybrid"]``; unknown keys raise ``ValueError``."""
        return cls(**config_section(cls, additional_config, ADDITIONAL_CONFIG_KEY))


class HybridPlacementMixin:
    """Chooses the recurrent states a hybrid model's prefix cache keeps (see the module docstring)."""

    def __init__(self, *args, hybrid_config: HybridPlacementConfig | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not self.cache_config.enable_prefix_caching:
            raise ValueError("the hybrid placement plug-in needs prefix caching: start vLLM with "
                             "--enable-prefix-caching")
        self.hybrid_config = config = (hybrid_config or HybridPlacementConfig.from_additional_config(
            self.vllm_config.additional_config))
        managers = self.kv_cache_manager.coordinator.single_type_managers
        self._mamba = {gid: m for gid, m in enumerate(managers) if isinstance(m, MambaManager)}
        if not self._mamba:
            raise ValueError("the hybrid placement plug-in serves hybrid models (attention plus Mamba/GDN "
                             "layers); this model has no recurrent-state cache group")
        groups = self.kv_cache_config.kv_cache_groups
        block_bytes = max(len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in groups)
        #: Pool bytes one kept state occupies (a block in every GDN group), and its real content.
        self.state_pool_bytes = len(self._mamba) * block_bytes
        self.state_content_bytes = sum(len(groups[g].layer_names) * groups[g].kv_cache_spec.real_page_size_bytes
                                       for g in self._mamba if isinstance(groups[g].kv_cache_spec, MambaSpec))
        self.max_states = (None if config.state_budget_bytes is None
                           else config.state_budget_bytes // self.state_pool_bytes)
        self.states = StateRegistry(self.max_states)              # vLLM block hash -> position (blocks)
        self.placement = config.rooted_placement()
        self.evicted_states = 0
        self.metrics = getattr(self, "metrics", None) or MetricsRecorder()   # one per scheduler, shared by the mixins
        self._observed: set[str] = set()                          # requests whose depth the estimator has
        if config.placement == "dp":
            for manager in self._mamba.values():
                self._keep_dp_positions(manager)
        logger.info("hybrid placement %s: %s bytes per state (content %s), at most %s states",
                    config.placement, self.state_pool_bytes, self.state_content_bytes, self.max_states)

    # -- which states are registered ---------------------------------------------------------

    @staticmethod
    def root(request):
        """The request's prefix family: its first block's hash (None before a full block)."""
        return request.block_hashes[0] if request.block_hashes else None

    def chosen_positions(self, request) -> frozenset[int]:
        """Block boundaries (in blocks) whose states the DP placement of ``request``'s family keeps
        (empty: the family has none yet, and vLLM's own positions are kept)."""
        return self.placement.chosen(self.root(request))

    def _keep_dp_positions(self, manager: MambaManager) -> None:
        """Register the chunk-end states vLLM keeps plus those at the DP's positions for the
        request being cached (instance-level overrides: vLLM's mask has no request argument,
        so ``cache_blocks`` records it). vLLM's junctions are off where the DP decides."""
        cache_blocks, vllm_mask = manager.cache_blocks, manager.reachable_block_mask
        caching = []

        def cache_blocks_of(request, *args, **kwargs):
            caching.append(request)
            try:
                return cache_blocks(request, *args, **kwargs)
            finally:
                caching.pop()

        def mask(start_block, end_block, *args, **kwargs):
            vllm_keeps = vllm_mask(start_block, end_block, *args, **kwargs)   # None: vLLM keeps every one
            if vllm_keeps is None:
                return None
            chosen = self.chosen_positions(caching[-1])   # block i holds the state after (i + 1) blocks
            return [kept or (i + 1) in chosen for i, kept in zip(range(start_block, end_block), vllm_keeps)]

        manager.cache_blocks = cache_blocks_of
        manager.reachable_block_mask = mask

    def _mamba_block_aligned_split(self, request, num_new_tokens, num_new_local_computed_tokens=0,
                                   num_external_computed_tokens=0):
        """vLLM's split, then cut at the first chosen boundary inside the chunk (``dp`` only)."""
        n = super()._mamba_block_aligned_split(request, num_new_tokens, num_new_local_computed_tokens,
                                               num_external_computed_tokens)
        if self.hybrid_config.placement != "dp" or n <= 0:
            return n
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        if start >= max(request.num_prompt_tokens, request.num_tokens - 1):
            return n
        block_size = self.block_size
        stops = [c * block_size for c in self.chosen_positions(request) if start < c * block_size < start + n]
        return min(stops, default=start + n) - start

    def _get_local_prefix_cache_hit(self, request, max_cache_hit_length=None):
        """vLLM's lookup; records the overlap depth (once per request) and the hit state's recency."""
        blocks, num_local, junction, diverged = local_prefix_cache_hit(super()._get_local_prefix_cache_hit,
                                                                       request, max_cache_hit_length)
        if request.request_id not in self._observed:
            self._observed.add(request.request_id)
            self.placement.observe(self.root(request), (junction or num_local) // self.block_size)
        if num_local:
            state = blocks.blocks[next(iter(self._mamba))][-1].block_hash
            if state is not None:
                self.states.touch(get_block_hash(state))
        if self.hybrid_config.placement == "dp" and self.chosen_positions(request):
            junction = 0                         # the DP, not vLLM's junction rule, decides what is kept
        return blocks, num_local, junction, diverged

    def _free_request(self, request, delay_free_blocks: bool = False):
        self._observed.discard(request.request_id)
        return super()._free_request(request, delay_free_blocks)

    # -- the byte budget ---------------------------------------------------------------------

    def schedule(self, *args, **kwargs):
        output = super().schedule(*args, **kwargs)
        self._track_new_states()
        self._drop_evicted()
        self._enforce_budget()
        self.metrics.kept_states(len(self.states) * self.state_pool_bytes)
        return output

    def _track_new_states(self) -> None:
        pool = self.kv_cache_manager.block_pool
        for manager in self._mamba.values():
            for key in manager.cached_blocks_this_step:
                block = pool.cached_block_hash_to_block.get_one_block(key)
                if block is not None:
                    self.states.keep(get_block_hash(key), block.block_hash_num_tokens // self.block_size)

    def _live(self, state_hash) -> list | None:
        """The blocks holding ``state_hash`` in every GDN group, or None when vLLM evicted any of them."""
        pool = self.kv_cache_manager.block_pool
        blocks = [pool.cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(state_hash, gid))
                  for gid in self._mamba]
        return None if any(b is None for b in blocks) else blocks

    def _drop_evicted(self) -> None:
        """Forget states vLLM itself evicted (their blocks were reused for other content)."""
        for state_hash in self.states:
            if self._live(state_hash) is None:
                self.states.discard(state_hash)

    def _enforce_budget(self) -> None:
        victims = self.states.enforce()
        if victims:
            self.kv_cache_manager.evict_blocks({b.block_id for h in victims for b in self._live(h)})
            self.evicted_states += len(victims)

    def resumable_blocks(self, request, shared_blocks: int) -> int:
        """Of ``request``'s first ``shared_blocks`` blocks, those a hit can resume now: up to the
        deepest kept state (the view a Feather policy reads on a hybrid engine)."""
        return self.states.deepest(request.block_hashes, shared_blocks)

    def feather_stats(self) -> dict:
        """Kept states (now and at the peak, after each step's budget), their bytes, the
        current placement and the DP's solves."""
        self._drop_evicted()
        live = len(self.states)
        return {"placement": self.hybrid_config.placement, "states_kept": live,
                "state_bytes_kept": live * self.state_pool_bytes, "peak_states": self.states.peak,
                "peak_state_bytes": self.states.peak * self.state_pool_bytes,
                "state_pool_bytes": self.state_pool_bytes,
                "state_content_bytes": self.state_content_bytes, "max_states": self.max_states,
                "states_evicted": self.evicted_states, "dp_solves": self.placement.num_solves,
                "dp_families": len(self.placement), "chosen_positions_blocks": sorted(self.placement.all_chosen())}


class HybridPlacementScheduler(HybridPlacementMixin, Scheduler):
    """Hybrid checkpoint placement on vLLM's synchronous scheduler (the CPU platform)."""


class FeatherHybridScheduler(FeatherSchedulingMixin, HybridPlacementMixin, Scheduler):
    """The Feather scheduler on a hybrid engine, with the placement plug-in: its policy sees
    only the shared blocks a hit can resume (``additional_config`` keys ``feather`` and
    ``feather_hybrid``)."""

    def feather_stats(self) -> dict:
        return {**FeatherSchedulingMixin.feather_stats(self), **HybridPlacementMixin.feather_stats(self)}
