"""Chained chunk digests: the prefix identity used by the CHT, the trace statistics and
checkpoint placement.

``chained_chunk_hashes(tokens, c)[i]`` is the xxh3_64 digest of chunk ``i`` (tokens
``[i*c, (i+1)*c)``) seeded with the digest of chunk ``i-1``. So equal digests at depth
``i`` mean (up to a 2**-64 collision) equal prefixes of ``i+1`` chunks. Only full chunks
are hashed: a trailing partial chunk is never shared, as in vLLM's prefix cache.
"""

from __future__ import annotations

import numpy as np
import xxhash

#: The digest chain starts from this seed (the "parent" of chunk 0).
ROOT_SEED = 0


def chained_chunk_hashes(tokens: np.ndarray, chunk_size: int) -> np.ndarray:
    """Digests of the full chunks of ``tokens`` (uint64 array of length len // chunk_size).

    Cost: O(len(tokens)) bytes hashed, one xxh3 call per chunk (no per-token Python loop).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    n_chunks = len(tokens) // chunk_size
    data = np.ascontiguousarray(tokens[: n_chunks * chunk_size], dtype=np.int64).tobytes()
    step = chunk_size * 8
    out = np.empty(n_chunks, dtype=np.uint64)
    digest = ROOT_SEED
    hash_chunk = xxhash.xxh3_64_intdigest
    for i in range(n_chunks):
        digest = hash_chunk(data[i * step:(i + 1) * step], digest)
        out[i] = digest
    return out


def chained_block_ids(block_ids: np.ndarray) -> np.ndarray:
    """Precomputed chained ids (Mooncake ``hash_ids``, vLLM ``block_hashes``) as digests.

    They already identify a whole prefix, so they are only mixed into the uint64 digest
    space (so that small integer ids never collide with xxh3 digests by accident).
    """
    ids = np.asarray(block_ids, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        x = (ids + np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
        return x ^ (x >> np.uint64(31))
