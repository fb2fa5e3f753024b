"""The request record and the trace: the unit of work every other layer consumes.

A prompt is given in exactly one of two forms:

* ``token_ids``: the prompt's token ids, or
* ``block_ids`` with ``block_size``: chained block ids, as the Mooncake trace has them.
  Block ``i`` covers tokens ``[i*block_size, (i+1)*block_size)``; ids are chained from the
  start of the prompt, so two prompts with equal ids at positions ``0..i`` share a prefix
  of ``i+1`` blocks. The last block may be partial (``input_len`` need not be a multiple
  of ``block_size``).

:meth:`Request.tokens` gives token ids for either form. For block ids it synthesises them
deterministically from the id, so equal blocks give equal tokens and different blocks
differ (with probability ~1 - 2**-64 per token). A live engine then sees exactly the
sharing structure the trace describes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: Synthesised tokens fall in [SYNTH_TOKEN_LOW, SYNTH_TOKEN_LOW + SYNTH_TOKEN_RANGE): above
#: the special-token ids of Llama-family tokenizers and inside every vocabulary of >= 32K.
SYNTH_TOKEN_LOW = 256
SYNTH_TOKEN_RANGE = 32_000 - SYNTH_TOKEN_LOW


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, vectorised over uint64 (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def synthesise_tokens(block_ids: np.ndarray, block_size: int, input_len: int) -> np.ndarray:
    """Deterministic token ids for a chained block-id prompt (no per-token Python loop).

    Token ``j`` of a block with id ``b`` is ``splitmix64(splitmix64(b) + j)`` mapped into
    the synthetic token range; it depends on ``b`` and ``j`` only.
    """
    ids = np.asarray(block_ids, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        seeds = _splitmix64(ids)[:, None] + np.arange(block_size, dtype=np.uint64)[None, :]
        mixed = _splitmix64(seeds).reshape(-1)[:input_len]
    return (mixed % np.uint64(SYNTH_TOKEN_RANGE)).astype(np.int64) + SYNTH_TOKEN_LOW


@dataclass(frozen=True, eq=False, slots=True)
class Request:
    """One inference request.

    Invariants (checked at construction, ``ValueError`` otherwise):
    ``input_len >= 1``, ``output_len >= 1``, ``arrival_s >= 0``; exactly one prompt form;
    ``len(token_ids) == input_len``, or ``len(block_ids) == ceil(input_len / block_size)``.
    """

    request_id: str
    arrival_s: float
    input_len: int
    output_len: int
    token_ids: np.ndarray | None = None
    block_ids: np.ndarray | None = None
    block_size: int | None = None
    session: str | None = None
    group: str | None = None
    _tokens_cache: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.input_len < 1:
            raise ValueError(f"request {self.request_id}: input_len must be >= 1, got {self.input_len}")
        if self.output_len < 1:
            raise ValueError(f"request {self.request_id}: output_len must be >= 1, got {self.output_len}")
        if not self.arrival_s >= 0:
            raise ValueError(f"request {self.request_id}: arrival_s must be >= 0, got {self.arrival_s}")
        if (self.token_ids is None) == (self.block_ids is None):
            raise ValueError(f"request {self.request_id}: give exactly one of token_ids or block_ids")
        if self.token_ids is not None:
            if len(self.token_ids) != self.input_len:
                raise ValueError(
                    f"request {self.request_id}: {len(self.token_ids)} token_ids for input_len {self.input_len}")
        else:
            if not self.block_size or self.block_size < 1:
                raise ValueError(f"request {self.request_id}: block_ids need a positive block_size")
            need = -(-self.input_len // self.block_size)
            if len(self.block_ids) != need:
                raise ValueError(
                    f"request {self.request_id}: {len(self.block_ids)} block_ids for input_len "
                    f"{self.input_len} at block_size {self.block_size} (need {need})")

    def tokens(self) -> np.ndarray:
        """The prompt's token ids (int64); synthesised once and cached for block-id prompts."""
        if self.token_ids is not None:
            return np.asarray(self.token_ids, dtype=np.int64)
        if not self._tokens_cache:
            self._tokens_cache.append(synthesise_tokens(self.block_ids, self.block_size, self.input_len))
        return self._tokens_cache[0]


@dataclass(eq=False)
class Trace:
    """An ordered sequence of requests with metadata.

    Invariant: requests are sorted by ``arrival_s`` (non-decreasing) and ids are unique.
    ``block_size`` is the block size of block-id prompts (``None`` for token-id traces).
    ``skipped_lines`` counts the bad input lines a loader skipped (``load_trace(skip_bad=True)``);
    it is 0 for generated traces and for strict loads.
    """

    name: str
    requests: list[Request]
    source: str = ""
    block_size: int | None = None
    skipped_lines: int = 0

    def __post_init__(self) -> None:
        arrivals = np.fromiter((r.arrival_s for r in self.requests), dtype=np.float64, count=len(self.requests))
        if len(arrivals) > 1 and np.any(np.diff(arrivals) < 0):
            bad = int(np.argmax(np.diff(arrivals) < 0)) + 1
            raise ValueError(f"trace {self.name}: request {bad} arrives before request {bad - 1}")
        if len({r.request_id for r in self.requests}) != len(self.requests):
            raise ValueError(f"trace {self.name}: request ids are not unique")

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):
        return iter(self.requests)

    def __getitem__(self, i: int) -> Request:
        return self.requests[i]

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0
