"""Trace statistics: overlap depths (infinite and LRU caches), sharing ratio, histogram, groups."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces import Request, Trace
from traces.stats import PrefixBlockCache, depth_histogram, overlap_depths, trace_stats

BS = 4


def block_trace(*prompts, input_lens=None):
    """A trace of block-id prompts (block size 4), one second apart."""
    input_lens = input_lens or [BS * len(p) for p in prompts]
    return Trace("t", [Request(str(i), float(i), n, 1, block_ids=np.array(p), block_size=BS)
                       for i, (p, n) in enumerate(zip(prompts, input_lens))], block_size=BS)


def test_infinite_cache_depths_and_sharing_by_hand():
    trace = block_trace([1, 2, 3], [1, 2, 9], [1, 5], [7], [1, 2, 3, 4], input_lens=[12, 12, 8, 4, 15])
    np.testing.assert_array_equal(overlap_depths(trace, block_size=BS), [0, 2, 1, 0, 3])
    stats = trace_stats(trace, block_size=BS)
    assert stats["prefix_sharing_ratio"] == pytest.approx((2 + 1 + 3) * BS / (12 + 12 + 8 + 4 + 15))
    assert stats["overlap_depth_blocks_hist"] == {"0": 2, "1": 1, "2-3": 2}
    assert stats["prefix_groups"] == 1 and stats["largest_prefix_group_requests"] == 4
    assert stats["requests_with_prefix_hit_fraction"] == pytest.approx(3 / 5)
    assert stats["num_requests"] == 5 and stats["rate_req_s"] == pytest.approx(1.0)


def test_partial_blocks_never_match():
    trace = block_trace([1, 2], [1, 2], input_lens=[7, 8])       # request 0's block 2 is partial
    np.testing.assert_array_equal(overlap_depths(trace, block_size=BS), [0, 1])


def test_token_prompts_are_hashed_at_any_block_size():
    shared = np.arange(100, 120)
    trace = Trace("t", [Request("a", 0, 25, 1, token_ids=np.concatenate((shared, [1, 2, 3, 4, 5]))),
                        Request("b", 1, 23, 1, token_ids=np.concatenate((shared, [9, 9, 9])))])
    np.testing.assert_array_equal(overlap_depths(trace, block_size=4), [0, 5])
    np.testing.assert_array_equal(overlap_depths(trace, block_size=8), [0, 2])
    np.testing.assert_array_equal(overlap_depths(trace, block_size=1), [0, 20])


def test_block_ids_rehashed_at_another_block_size_keep_sharing():
    trace = block_trace([1, 2, 3], [1, 2, 8])
    np.testing.assert_array_equal(overlap_depths(trace, block_size=2), [0, 4])   # synthesised tokens


def test_lru_evicts_a_prefix_tail_before_its_root():
    cache = PrefixBlockCache(capacity=3)
    cache.insert([1, 2, 3])
    cache.insert([7])                   # evicts 3, the tail of the least recently used prefix
    assert len(cache) == 3 and cache.match([1, 2, 3]) == 2
    cache.insert([8, 9])                # evicts 2 then 1
    assert cache.match([1, 2]) == 0 and cache.match([8, 9]) == 2


def test_lru_depths_by_hand():
    trace = block_trace([1, 2, 3], [4, 5], [1, 2, 3], [4, 5])
    np.testing.assert_array_equal(overlap_depths(trace, block_size=BS, cache_blocks=3), [0, 0, 1, 0])
    np.testing.assert_array_equal(overlap_depths(trace, block_size=BS, cache_blocks=5), [0, 0, 3, 2])
    np.testing.assert_array_equal(overlap_depths(trace, block_size=BS, cache_blocks=0), [0, 0, 0, 0])
    with pytest.raises(ValueError, match="capacity"):
        overlap_depths(trace, block_size=BS, cache_blocks=-1)


@settings(max_examples=80, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=25),
       capacity=st.integers(0, 12))
def test_lru_depth_is_monotone_in_capacity_and_bounded_by_infinite(prompts, capacity):
    # chained ids: a prompt's id at depth i encodes its whole prefix up to i
    chained = [[hash(tuple(p[:i + 1])) & 0xFFFFFFFF for i in range(len(p))] for p in prompts]
    trace = block_trace(*chained)
    infinite = overlap_depths(trace, block_size=BS)
    small = overlap_depths(trace, block_size=BS, cache_blocks=capacity)
    larger = overlap_depths(trace, block_size=BS, cache_blocks=capacity + 3)
    assert np.all(small <= larger) and np.all(larger <= infinite)
    assert np.all(infinite <= [len(p) for p in prompts])
    everything = overlap_depths(trace, block_size=BS, cache_blocks=sum(map(len, prompts)))
    np.testing.assert_array_equal(everything, infinite)


def test_depth_histogram_buckets():
    assert depth_histogram(np.array([0, 0, 1, 2, 3, 4, 7, 8, 100])) == \
        {"0": 2, "1": 1, "2-3": 2, "4-7": 2, "8-15": 1, "64-127": 1}
    assert depth_histogram(np.array([], dtype=np.int64)) == {}


def test_stats_of_an_empty_trace():
    stats = trace_stats(Trace("empty", []))
    assert stats["num_requests"] == 0 and stats["prefix_sharing_ratio"] == 0.0 and stats["rate_req_s"] == 0.0
