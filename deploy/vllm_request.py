"""Real vLLM v1 ``Request`` objects built outside an engine, as the engine builds them."""

from __future__ import annotations

import numpy as np


def vllm_request(request_id: str, tokens: np.ndarray, *, block_size: int, arrival_time: float,
                 max_tokens: int = 16):
    """A real vLLM v1 ``Request`` with its prefix-cache block hashes (sha256, as the engine's default)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(request_id, [int(t) for t in tokens], SamplingParams(max_tokens=max_tokens), None,
                   arrival_time=arrival_time, block_hasher=get_request_block_hasher(block_size, sha256))
