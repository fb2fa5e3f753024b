"""Chained chunk digests: the prefix identity used by the CHT, the trace statistics and
checkpoint placement.

``chained_chunk_hashes(tokens, c)[i]`` is the xxh3_64 digest of chunk ``i`` (tokens
``[i*c, (i+1)*c)``, as little-endian int64 bytes) seeded with the digest of chunk ``i-1``.
So equal digests at depth ``i`` mean (up to a 2**-64 collision) equal prefixes of ``i+1``
chunks. Only full chunks are hashed: a trailing partial chunk is never shared, as in
vLLM's prefix cache.

Precomputed chained block hashes (Mooncake ``hash_ids``, vLLM ``request.block_hashes``)
already identify prefixes, so :func:`block_hash_digests` takes the hash of the last block
of every chunk instead of hashing tokens again.

The hash is xxh3_64 (digests fit a uint64 array) and the default chunk is 256 tokens, so a
shared prefix loses at most 255 tokens to chunking; ``chunk_size`` is a parameter wherever finer
sharing matters. The chunk-size sweep behind the default is in docs/results.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

#: The digest chain starts from this seed (the "parent" of chunk 0).
ROOT_SEED = 0

#: Default chunk size in tokens (see the module docstring for the measurement).
DEFAULT_CHUNK_SIZE = 256


def chained_chunk_hashes(tokens: np.ndarray, chunk_size: int) -> np.ndarray:
    """Digests of the full chunks of ``tokens`` (uint64 array of length len // chunk_size).

    Cost: O(len(tokens)) bytes hashed, one xxh3 call per chunk over a zero-copy
    memoryview (no per-token Python loop).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    n_chunks = len(tokens) // chunk_size
    data = memoryview(np.ascontiguousarray(tokens[: n_chunks * chunk_size], dtype=np.int64)).cast("B")
    step = chunk_size * 8
    out = []
    append = out.append
    digest = ROOT_SEED
    hash_chunk = xxhash.xxh3_64_intdigest
    for start in range(0, n_chunks * step, step):
        digest = hash_chunk(data[start:start + step], digest)
        append(digest)
    return np.array(out, dtype=np.uint64)


def chained_block_ids(block_ids: np.ndarray) -> np.ndarray:
    """Precomputed chained ids (Mooncake ``hash_ids``, vLLM ``block_hashes``) as digests.

    They already identify a whole prefix, so they are only mixed into the uint64 digest
    space (so that small integer ids never collide with xxh3 digests by accident).
    """
    ids = np.asarray(block_ids, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        x = (ids + np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
        return x ^ (x >> np.uint64(31))


def block_hash_digests(block_hashes: Sequence[int] | Sequence[bytes] | np.ndarray, block_size: int,
                       chunk_size: int) -> np.ndarray:
    """Chunk digests from the chained hashes of a prompt's full blocks (no token hashing).

    ``block_hashes[j]`` identifies the prefix ending with block ``j`` (Mooncake integer
    ``hash_ids``, or vLLM's ``request.block_hashes`` as ``bytes``), so the hash of a
    chunk's last block identifies the chunk's prefix: chunk ``i`` takes block
    ``(i+1) * chunk_size // block_size - 1``. Integers go through
    :func:`chained_block_ids`; ``bytes`` contribute their first 8 bytes (little endian).
    ``chunk_size`` must be a multiple of ``block_size``. Cost: O(number of chunks).
    """
    if block_size < 1 or chunk_size % block_size:
        raise ValueError(f"chunk_size {chunk_size} is not a multiple of block_size {block_size}")
    step = chunk_size // block_size
    picked = block_hashes[step - 1::step]
    if len(picked) and isinstance(picked[0], (bytes, bytearray)):
        widths = set(map(len, picked))
        if len(widths) == 1 and (width := widths.pop()) >= 8:     # one digest size (vLLM's): no per-block slicing
            rows = np.frombuffer(b"".join(picked), dtype=np.uint8).reshape(len(picked), width)
            return np.ascontiguousarray(rows[:, :8]).view("<u8").ravel().astype(np.uint64)
        return np.frombuffer(b"".join(bytes(h[:8]) for h in picked), dtype="<u8").astype(np.uint64)
    return chained_block_ids(picked)


def request_chunk_hashes(request, chunk_size: int) -> np.ndarray:
    """Chained digests of a :class:`traces.Request`'s full chunks.

    A block-id prompt whose ``block_size`` divides ``chunk_size`` is not re-hashed: its
    ids already identify prefixes (:func:`block_hash_digests`). Otherwise the (possibly
    synthesised) tokens are hashed.
    """
    if request.block_ids is not None and chunk_size % request.block_size == 0:
        full_blocks = request.block_ids[: request.input_len // request.block_size]
        return block_hash_digests(full_blocks, request.block_size, chunk_size)
    return chained_chunk_hashes(request.tokens(), chunk_size)
