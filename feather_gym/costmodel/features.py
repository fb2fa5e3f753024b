"""Batch composition and the physical features a step's time is linear in.

A decode step over a batch reads the model weights once, reads the KV cache of every
request, and does matmul and attention FLOPs. What a batch's *composition* changes is how
many KV bytes come from DRAM and how many are cache hits:

* each request attends to ``shared prefix + own suffix``; a prefix group's prefix KV is one
  copy in memory (paged prefix caching), so ``total - unique`` tokens are *re-reads*;
* per-request attention (a paged-attention kernel) re-reads the prefix once per request.
  Re-reads hit the last-level cache when the prefixes being read at once fit in it: the
  hit fraction is ``min(1, cache_bytes / working_set)`` with ``working_set = groups x
  prefix KV bytes of one layer`` (layers run one after the other; requests of different
  groups are interleaved, the worst ordering);
* cascade attention reads each group's prefix once: no re-reads at all.

Feature columns (all non-negative, one coefficient each, see :data:`COLUMNS`)::

    fixed            1 per step (framework overhead + weight read; constant for one model)
    tokens           decode batch size B (per-sequence work: matmul FLOPs, sampling, launch)
    prefix_passes    shared-prefix attention passes: B for per-request, G for cascade, 0 without sharing
                     (per-pass setup: kernel call, softmax merge with the suffix)
    kv_dram_bytes    unique KV bytes + re-read bytes that miss the cache
    kv_hit_bytes     re-read bytes that hit the cache
    attn_flops       decode attention FLOPs
    prefill_tokens   new prefill tokens N
    prefill_attn_flops  N x (cached + (N+1)/2) x attention FLOPs per pair

The prefill's cached KV is read once from DRAM (``kv_dram_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .shapes import ModelShape

#: The columns that price prefill work (a clock calibration may scale them apart, :mod:`.clock`).
PREFILL_COLUMNS = ("prefill_tokens", "prefill_attn_flops")
COLUMNS = ("fixed", "tokens", "prefix_passes", "kv_dram_bytes", "kv_hit_bytes", "attn_flops", *PREFILL_COLUMNS)


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """The composition of the decode part of an engine step.

    ``batch_size``: requests decoding one token each. ``total_kv_tokens``: sum over requests
    of the context each attends to. ``unique_kv_tokens``: distinct KV tokens among them (a
    shared prefix counted once). ``num_groups``: prefix groups (requests sharing a cached
    prefix form one group; a request sharing nothing is a group of its own).
    Invariants: ``0 <= unique <= total``, ``batch_size >= 1`` implies
    ``1 <= num_groups <= batch_size``; the empty batch is all zeros.
    """

    batch_size: int
    total_kv_tokens: int
    unique_kv_tokens: int
    num_groups: int

    def __post_init__(self) -> None:
        if self.batch_size < 0 or self.unique_kv_tokens < 0:
            raise ValueError(f"{self}: counts must be non-negative")
        if self.unique_kv_tokens > self.total_kv_tokens:
            raise ValueError(f"{self}: unique_kv_tokens exceeds total_kv_tokens")
        if self.batch_size == 0:
            if self.total_kv_tokens or self.num_groups:
                raise ValueError(f"{self}: an empty batch has no KV tokens and no groups")
        elif not 1 <= self.num_groups <= self.batch_size:
            raise ValueError(f"{self}: num_groups must lie in [1, batch_size]")

    @classmethod
    def from_groups(cls, batch_size: int, num_groups: int, shared_prefix_tokens: int,
                    unique_tokens_per_request: int) -> DecodeBatch:
        """``batch_size`` requests in ``num_groups`` equal groups, each group sharing a prefix."""
        if num_groups == batch_size or shared_prefix_tokens == 0:
            context = shared_prefix_tokens + unique_tokens_per_request
            return cls(batch_size, batch_size * context, batch_size * context, batch_size)
        total = batch_size * (shared_prefix_tokens + unique_tokens_per_request)
        unique = num_groups * shared_prefix_tokens + batch_size * unique_tokens_per_request
        return cls(batch_size, total, unique, num_groups)


def cache_hit_fraction(batch: DecodeBatch, shape: ModelShape, cache_bytes: float) -> float:
    """Fraction of per-request prefix re-reads served by a cache of ``cache_bytes``.

    The prefix length per group is estimated as ``(total - unique) / (B - G)`` (exact for
    equal-prefix groups); the working set is the G prefixes' KV of one layer.
    """
    reread = batch.total_kv_tokens - batch.unique_kv_tokens
    if reread == 0:
        return 1.0
    prefix_tokens = reread / max(1, batch.batch_size - batch.num_groups)
    working_set = batch.num_groups * prefix_tokens * shape.kv_bytes_per_token_layer
    return min(1.0, cache_bytes / working_set)


def step_features(batch: DecodeBatch, prefill_new_tokens: int, prefill_cached_tokens: int,
                  shape: ModelShape, cache_bytes: float, cascade: bool) -> tuple[float, ...]:
    """The :data:`COLUMNS` row of a step: decode of ``batch`` plus a prefill of
    ``prefill_new_tokens`` after ``prefill_cached_tokens`` cached ones. One fixed cost per
    non-empty step; the variable terms add up. Pure Python, O(1): the simulator calls it per step.
    """
    if prefill_new_tokens < 0 or prefill_cached_tokens < 0:
        raise ValueError(f"prefill token counts must be non-negative, got new={prefill_new_tokens}, "
                         f"cached={prefill_cached_tokens}")
    kv = shape.kv_bytes_per_token
    pair_flops = shape.attention_flops_per_kv_token
    dram = hit_bytes = passes = 0.0
    if batch.batch_size:
        if batch.total_kv_tokens > batch.unique_kv_tokens:
            passes = float(batch.num_groups if cascade else batch.batch_size)
        reread = 0.0 if cascade else (batch.total_kv_tokens - batch.unique_kv_tokens) * kv
        hit = cache_hit_fraction(batch, shape, cache_bytes) if reread else 0.0
        dram = batch.unique_kv_tokens * kv + (1.0 - hit) * reread
        hit_bytes = hit * reread
    new = prefill_new_tokens
    if new:
        dram += prefill_cached_tokens * kv
    fixed = 1.0 if (batch.batch_size or new) else 0.0
    return (fixed, float(batch.batch_size), passes, dram, hit_bytes,
            float(batch.total_kv_tokens * pair_flops), float(new),
            new * (prefill_cached_tokens + (new + 1) / 2) * pair_flops)
