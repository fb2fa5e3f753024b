"""deploy.resident_prefix: the compiled lookup is vLLM's own prefix-cache hit.

A model-free vLLM scheduler's block pool is filled with cached prefixes of requests that share
prefixes, twice over for some (duplicate blocks), with blocks evicted in the middle of chains,
and whole prompts cached (the last-token cap); the compiled scan must give, for every request,
the hit length of the KV cache coordinator's ``find_longest_cache_hit``.
"""

from __future__ import annotations

import numpy as np
import pytest

from deploy.model_free import model_free_scheduler
from deploy.resident_prefix import ResidentPrefix
from deploy.scheduler import FeatherConfig, FeatherScheduler
from deploy.vllm_request import vllm_request

BLOCK = 16


@pytest.fixture(scope="module")
def scheduler():
    return model_free_scheduler(FeatherScheduler, block_size=BLOCK, num_blocks=512, max_num_seqs=64,
                                max_num_batched_tokens=2048, max_model_len=4096,
                                feather_config=FeatherConfig(policy="feather-rule"))


def requests(seed: int, n: int = 40) -> list:
    """Prompts of 1-12 blocks plus 0-15 tokens (every fifth of whole blocks only), half of them
    under one of four shared prefixes."""
    rng = np.random.default_rng(seed)
    stems = [rng.integers(300, 30_000, BLOCK * int(rng.integers(1, 6))) for _ in range(4)]
    made = []
    for i in range(n):
        tail = 0 if i % 5 == 0 else int(rng.integers(0, BLOCK))
        own = rng.integers(300, 30_000, BLOCK * int(rng.integers(1, 8)) + tail)
        prompt = np.concatenate([stems[i % 4], own]) if i % 2 else own
        made.append(vllm_request(f"r{seed}-{i}", prompt, block_size=BLOCK, arrival_time=0.0))
    return made


@pytest.mark.parametrize("seed", range(4))
def test_the_compiled_scan_gives_the_coordinators_hit(scheduler, seed):
    rng = np.random.default_rng(100 + seed)
    pool, coordinator = scheduler.kv_cache_manager.block_pool, scheduler.kv_cache_manager.coordinator
    assert pool.reset_prefix_cache()
    lookup = ResidentPrefix(scheduler.kv_cache_manager)
    assert lookup.kind == "compiled"
    made = requests(seed)
    for request in made:
        for _ in range(int(rng.integers(0, 3))):                # 0, 1 or 2 copies: misses and duplicates
            full = len(request.block_hashes)
            cached = int(rng.integers(1, full + 1)) if full else 0
            if cached:
                blocks = pool.get_new_blocks(cached)
                pool.cache_full_blocks(request, blocks, 0, cached, BLOCK, 0)
                pool.free_blocks(blocks)
    cached_ids = [block.block_id for block in pool.blocks if block.block_hash is not None]
    pool.evict_blocks(set(rng.choice(cached_ids, size=len(cached_ids) // 10, replace=False).tolist()))
    got = [lookup(request) for request in made]
    expected = [coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)[1]
                for request in made]
    assert got == expected
    assert 0 in got and sum(hit > 0 for hit in got) >= 5, got
    assert any(0 < hit < BLOCK * (len(r.block_hashes) - 1) for r, hit in zip(made, got)), "no chain cut short"
    assert any(r.num_tokens % BLOCK == 0 and hit == r.num_tokens - BLOCK for r, hit in zip(made, got)), \
        "no whole prompt cached to the last-token cap"
