"""Trace statistics: lengths, rate, and the prefix structure a prefix cache would see.

Prefix identity is the chained block digest of :func:`traces.chunk_hash.request_chunk_hashes`
(only full blocks count; a trailing partial block is never shared, as in vLLM). Requests are
replayed in arrival order against a block cache:

* :func:`overlap_depths` gives, per request, the number of leading blocks already cached
  when it arrives (its prefix-hit depth), with an infinite cache or an LRU cache.
* :func:`trace_stats` summarises a trace in one flat, JSON-ready dict.

Cost: one digest per full block (block-id prompts at their own block size are not
re-hashed) and O(1) dict work per block; Mooncake (290K blocks) takes well under a second.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

import numpy as np

from traces.chunk_hash import request_chunk_hashes
from traces.request import Trace

PERCENTILES = (50, 90, 99)


class PrefixBlockCache:
    """Block digests cached so far, optionally bounded to ``capacity`` blocks with LRU eviction.

    A request's blocks are touched deepest first, so its first block is the most recently
    used: under pressure a prefix loses its tail before its root (as vLLM's free-block queue
    does), and a cached block is then always reachable through its cached parents.
    """

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"cache capacity must be >= 0 blocks, got {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, digests: list[int]) -> int:
        """Number of leading ``digests`` present in the cache."""
        for depth, digest in enumerate(digests):
            if digest not in self._blocks:
                return depth
        return len(digests)

    def insert(self, digests: list[int]) -> None:
        """Cache (or refresh) all of a request's blocks, then evict down to capacity."""
        if self.capacity is None:
            self._blocks.update(dict.fromkeys(digests))
            return
        blocks = self._blocks
        for digest in reversed(digests):
            blocks[digest] = None
            blocks.move_to_end(digest)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)


def request_digests(trace: Trace, block_size: int) -> list[list[int]]:
    """Chained digests of every request's full blocks, as Python ints (for dict lookups)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return [request_chunk_hashes(r, block_size).tolist() for r in trace]


def _replay(digests: list[list[int]], cache: PrefixBlockCache) -> np.ndarray:
    depths = np.empty(len(digests), dtype=np.int64)
    for i, request_blocks in enumerate(digests):
        depths[i] = cache.match(request_blocks)
        cache.insert(request_blocks)
    return depths


def overlap_depths(trace: Trace, *, block_size: int, cache_blocks: int | None = None) -> np.ndarray:
    """Per request, in blocks: the longest prefix it shares with the blocks cached when it arrives.

    With ``cache_blocks=None`` the cache is infinite, so this is the longest prefix match
    against all earlier requests. Otherwise it is an LRU cache of ``cache_blocks`` blocks
    (see :class:`PrefixBlockCache`). ``depths[i] <= input_len_i // block_size``.
    """
    return _replay(request_digests(trace, block_size), PrefixBlockCache(cache_blocks))


def _summary(prefix: str, values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {f"{prefix}_mean": 0.0, **{f"{prefix}_p{p}": 0.0 for p in PERCENTILES}, f"{prefix}_max": 0.0}
    out = {f"{prefix}_mean": float(np.mean(values))}
    out.update({f"{prefix}_p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(values, PERCENTILES))})
    out[f"{prefix}_max"] = float(np.max(values))
    return out


def depth_histogram(depths: np.ndarray) -> dict[str, int]:
    """Counts of depths in power-of-two buckets: "0", "1", "2-3", "4-7", ... (empty buckets omitted)."""
    buckets = np.zeros(len(depths), dtype=np.int64)
    positive = depths > 0
    buckets[positive] = np.floor(np.log2(depths[positive])).astype(np.int64) + 1
    hist = {}
    for bucket, count in zip(*np.unique(buckets, return_counts=True)):
        low = 0 if bucket == 0 else 1 << (int(bucket) - 1)
        high = max(low, (1 << int(bucket)) - 1)
        hist[str(low) if low == high else f"{low}-{high}"] = int(count)
    return hist


def prefix_groups(digests: list[list[int]]) -> Counter:
    """Requests per prefix group: requests whose first full block is equal, kept when >= 2.

    A group is a root branch of the prefix tree that carries sharing. A prompt common to
    every request (a system prompt, Mooncake's block 0) makes a single group.
    """
    firsts = Counter(blocks[0] for blocks in digests if blocks)
    return Counter({first: n for first, n in firsts.items() if n >= 2})


def trace_stats(trace: Trace, *, block_size: int = 512) -> dict:
    """A flat summary of ``trace`` (JSON-ready; keys carry their unit).

    ``prefix_sharing_ratio`` is the fraction of all input tokens that are prefix hits with an
    infinite cache at ``block_size``: sum of overlap depths * block_size / sum of input lengths.
    """
    inputs = np.fromiter((r.input_len for r in trace), dtype=np.int64, count=len(trace))
    outputs = np.fromiter((r.output_len for r in trace), dtype=np.int64, count=len(trace))
    digests = request_digests(trace, block_size)
    depths = _replay(digests, PrefixBlockCache())
    groups = prefix_groups(digests)
    duration = trace.duration_s
    total_input = int(inputs.sum())
    return {
        "name": trace.name,
        "source": trace.source,
        "num_requests": len(trace),
        "skipped_lines": trace.skipped_lines,
        "duration_s": float(duration),
        "rate_req_s": float((len(trace) - 1) / duration) if duration > 0 else 0.0,
        "input_tokens_total": total_input,
        **_summary("input_len_tokens", inputs),
        **_summary("output_len_tokens", outputs),
        "block_size_tokens": block_size,
        "prefix_sharing_ratio": float(depths.sum() * block_size / total_input) if total_input else 0.0,
        "requests_with_prefix_hit_fraction": float(np.mean(depths > 0)) if len(trace) else 0.0,
        **_summary("overlap_depth_blocks", depths),
        "overlap_depth_blocks_hist": depth_histogram(depths),
        "prefix_groups": len(groups),
        "largest_prefix_group_requests": max(groups.values(), default=0),
    }
