"""How much of a waiting request's prefix vLLM's prefix cache holds now.

The Feather observation's ``candidate_resident_tokens`` (:mod:`feather_gym.observation`) for a
vLLM engine: the tokens of the request's prefix a prefix-cache hit would take if it were
admitted now, at most all its tokens but the last. That is the lookup of vLLM's
``get_computed_blocks`` without its side effects (no stats, no events, no reference taken).

=====================  ==========================================================================
lookup                 where, and how
=====================  ==========================================================================
compiled scan          one full-attention KV cache group at the hash block size, without EAGLE or
                       context parallelism (a dense model's cache): vLLM's scan, leading cached
                       block hashes up to the first miss, in ``deploy._prefix_hits``
vLLM's coordinator     every other cache: ``find_longest_cache_hit``; on a hybrid model the
                       full-attention group's hit (``find_longest_cache_hit_per_group``), since the
                       recurrent states a hit can resume are the plug-ins' ``resumable_blocks``
=====================  ==========================================================================

Both give vLLM's own hit length (``tests/test_resident_prefix.py`` checks the compiled scan
against the coordinator on pools with duplicates, evictions and the last-token cap).
"""

from __future__ import annotations

from deploy._prefix_hits import leading_hits
from deploy.vllm_compat import prefix_cache_hit_limit


class ResidentPrefix:
    """``lookup(request)``: the tokens of ``request``'s prefix vLLM's prefix cache would hit now.

    Reads ``kv_cache_manager`` once to choose the lookup (module docstring); the cache's layout
    does not change while the engine runs. The block pool's map is read at every call
    (``reset_prefix_cache`` replaces it).
    """

    def __init__(self, kv_cache_manager) -> None:
        from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
        from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

        coordinator = self._coordinator = kv_cache_manager.coordinator
        pool = self._pool = coordinator.block_pool
        compiled = (type(coordinator) is UnitaryKVCacheCoordinator
                    and type(coordinator.single_type_managers[0]) is FullAttentionManager
                    and coordinator.block_size == pool.hash_block_size
                    and not coordinator.eagle_group_ids
                    and coordinator.dcp_world_size == 1 and coordinator.pcp_world_size == 1)
        self.kind = "compiled" if compiled else "coordinator"
        self._block_size = pool.hash_block_size
        self._suffix = (0).to_bytes(4, "big", signed=False)       # group 0, as make_block_hash_with_group_id

    def __call__(self, request) -> int:
        limit = prefix_cache_hit_limit(request)
        if self.kind == "compiled":
            table = self._pool.cached_block_hash_to_block._cache
            return self._block_size * leading_hits(request.block_hashes, limit // self._block_size, table,
                                                   self._suffix)
        coordinator = self._coordinator
        if getattr(coordinator, "full_attention_group_id", None) is not None:
            _, hits = coordinator.find_longest_cache_hit_per_group(request.block_hashes, limit)
            return hits[coordinator.full_attention_group_id]
        return coordinator.find_longest_cache_hit(request.block_hashes, limit)[1]
