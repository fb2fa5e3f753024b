"""The anchor sidecar: SuffixReplay's anchors, kept beside (not inside) the KV prefix cache.

An entry is the anchors of one page boundary: for every anchored GDN layer ``l``, the last
``R_l`` layer inputs before the boundary, ``[R_l, hidden]`` in the store dtype. ``R_l`` is
``replay_tokens[l]``; with ``split_rows`` an entry may split the same total ``sum_l
replay_tokens[l]`` among its layers differently (each ``R_l >= 1``), as the engine does when it
splits each page's replay budget by the gate memory measured on that page. It is keyed by
the chained digest of the prefix that ends at that boundary, the same key the CHT and the
prefix cache use (:func:`traces.chunk_hash.chained_chunk_hashes` with ``chunk_size`` = the
page size; :meth:`AnchorStore.keys_for` computes them), so a KV prefix hit of ``i + 1`` pages
looks up ``keys[i]``.

Any hashable key works: vLLM's own chained block hashes (``bytes``) key the store inside the
engine (:mod:`deploy.replay_scheduler`); numpy integers are stored as Python ``int``.

Invariants (``tests/test_suffix_replay.py``):

* every entry has exactly the configured layers and shapes (with ``split_rows``: the configured
  total of rows), so all entries have the same size, :attr:`AnchorStore.entry_bytes` ``= sum_l
  R_l * hidden * dtype bytes``; ``used_bytes`` is the sum over entries and never exceeds
  ``budget_bytes``; ``layer_bytes[l]`` is what layer ``l`` holds over all entries, and the
  layers' bytes sum to ``used_bytes``;
* storage per cached token is :attr:`AnchorStore.bytes_per_cached_token` ``= entry_bytes /
  page_tokens`` (one entry per page of prefix kept);
* a ``put`` or a successful ``get`` makes an entry the most recent and counts one use of it;
  ``put`` evicts entries until the new one fits, and returns them. Which go (``eviction``):
  ``"lru"``, the least recent; ``"utility"``, Marconi's criterion (Pan et al., 2024): the lowest
  expected reuse times recompute saved per byte, :meth:`AnchorStore.utility` ``= uses x decay^age
  x saved / entry_bytes``, where ``uses`` counts its puts and gets, each weighted by ``decay`` per
  store operation since (half-life: one store's worth of entries, :attr:`AnchorStore.capacity_entries`
  operations), and ``saved`` is what a hit on it saves (given at ``put``: the prefill time of the
  prefix up to its page); ties go least recent first.

Errors are explicit: ``KeyError`` for a hit without anchors (the caller falls back to a stored
state or recomputation), ``ValueError`` for a budget that cannot hold one entry and for anchors
whose layers, shapes or sizes do not match the store's configuration.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from traces.chunk_hash import chained_chunk_hashes

#: Store dtypes and their sizes in bytes.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: Eviction orders (see the module docstring).
EVICTIONS = ("lru", "utility")


def _key(key):
    """The stored form of a key: numpy and Python integers as ``int``, anything else as is."""
    return int(key) if isinstance(key, (int, np.integer)) else key


class AnchorStore:
    """A byte-budgeted map: chained page digest -> {GDN layer: anchors [R_l, hidden]}, evicting by
    recency or by utility (see the module docstring)."""

    def __init__(self, budget_bytes: int, *, hidden_size: int, replay_tokens: dict[int, int],
                 page_tokens: int = 256, dtype: str = "bfloat16", split_rows: bool = False,
                 eviction: str = "lru") -> None:
        if dtype not in DTYPES:
            raise ValueError(f"unknown anchor dtype {dtype!r}; choose from {sorted(DTYPES)}")
        if eviction not in EVICTIONS:
            raise ValueError(f"unknown anchor eviction {eviction!r}; choose from {EVICTIONS}")
        if not replay_tokens or min(replay_tokens.values()) < 1 or hidden_size < 1 or page_tokens < 1:
            raise ValueError("need at least one anchored layer, R_l >= 1, hidden_size >= 1 and page_tokens >= 1")
        self.hidden_size, self.page_tokens, self.dtype = int(hidden_size), int(page_tokens), DTYPES[dtype]
        self.replay_tokens = {int(l): int(r) for l, r in sorted(replay_tokens.items())}
        self.split_rows = bool(split_rows)
        self.row_bytes = self.hidden_size * self.dtype.itemsize
        self.entry_bytes = sum(self.replay_tokens.values()) * self.row_bytes
        if budget_bytes < self.entry_bytes:
            raise ValueError(f"anchor budget of {budget_bytes} bytes is too small for one entry of "
                             f"{self.entry_bytes} bytes ({sum(self.replay_tokens.values())} anchors x "
                             f"{self.hidden_size} x {self.dtype.itemsize} B)")
        self.budget_bytes = int(budget_bytes)
        self.eviction = eviction
        self._entries: OrderedDict[int, dict[int, torch.Tensor]] = OrderedDict()
        self.used_bytes = 0
        self.layer_bytes = dict.fromkeys(self.replay_tokens, 0)
        self.evictions = 0
        #: Per entry: what a hit saves, and (uses decayed to ``stamp``, ``stamp``) on the operation clock.
        self._saved: dict = {}
        self._uses: dict = {}
        self._clock = 0
        self.decay = 0.5 ** (1 / self.capacity_entries)

    @property
    def bytes_per_cached_token(self) -> float:
        """Anchor bytes per prefix token kept (one entry per page)."""
        return self.entry_bytes / self.page_tokens

    @property
    def capacity_entries(self) -> int:
        return self.budget_bytes // self.entry_bytes

    def mean_replay_tokens(self) -> dict[int, float]:
        """Per layer, the anchors an entry holds on average (0 when the store is empty)."""
        return {layer: kept / (self.row_bytes * len(self)) if self._entries else 0.0
                for layer, kept in self.layer_bytes.items()}

    def keys_for(self, tokens) -> np.ndarray:
        """The digest of every page boundary of ``tokens`` (uint64, one per full page)."""
        return chained_chunk_hashes(np.asarray(tokens), self.page_tokens)

    def put(self, key, anchors: dict[int, torch.Tensor | np.ndarray], *, saved: float = 1.0) -> list[int]:
        """Store (or refresh) the anchors of page digest ``key``, a hit on which saves ``saved``
        (any unit, the same for every entry; only ``"utility"`` eviction reads it); returns the
        evicted keys."""
        key = _key(key)
        if not saved > 0:
            raise ValueError(f"saved must be > 0, got {saved}")
        if sorted(anchors) != list(self.replay_tokens):
            raise ValueError(f"anchors for layers {sorted(anchors)}, store keeps layers {list(self.replay_tokens)}")
        entry = {}
        for layer, r in self.replay_tokens.items():
            tensor = torch.as_tensor(anchors[layer])
            shape = tuple(tensor.shape)
            if len(shape) != 2 or shape[1] != self.hidden_size or not (shape[0] >= 1 if self.split_rows
                                                                     else shape[0] == r):
                raise ValueError(f"layer {layer}: anchors of shape {shape}, "
                                 f"expected ({'R_l >= 1' if self.split_rows else r}, {self.hidden_size})")
            entry[layer] = tensor.detach().to(self.dtype).contiguous().clone()
        rows = sum(t.shape[0] for t in entry.values())
        if rows * self.row_bytes != self.entry_bytes:
            raise ValueError(f"anchors of {rows} rows in all, an entry holds {self.entry_bytes // self.row_bytes}")
        if key in self._entries:
            self._remove(key)
        evicted = []
        while self.used_bytes + self.entry_bytes > self.budget_bytes:
            victim = next(iter(self._entries)) if self.eviction == "lru" else min(self._entries, key=self.utility)
            self._remove(victim)
            evicted.append(victim)
        self.evictions += len(evicted)
        self._entries[key] = entry
        self._account(entry, +1)
        self._saved[key], self._uses[key] = float(saved), (0.0, self._clock)
        self._use(key)
        return evicted

    def utility(self, key) -> float:
        """Expected reuse times recompute saved per byte of the entry ``key`` (the ``"utility"``
        eviction's order, lowest first): its decayed uses x its ``saved`` / :attr:`entry_bytes`."""
        uses, stamp = self._uses[_key(key)]
        return uses * self.decay ** (self._clock - stamp) * self._saved[_key(key)] / self.entry_bytes

    def _use(self, key) -> None:
        """One store operation on ``key``: the clock advances, and the entry counts one use."""
        self._clock += 1
        uses, stamp = self._uses[key]
        self._uses[key] = (uses * self.decay ** (self._clock - stamp) + 1.0, self._clock)

    def get(self, key) -> dict[int, torch.Tensor]:
        """The anchors of ``key`` (made most recent); ``KeyError`` when the prefix has no anchors."""
        key = _key(key)
        if key not in self._entries:
            raise KeyError(f"no anchors for page digest {key!r}: a KV prefix hit without anchors "
                           f"(never stored or evicted); fall back to a stored state or recompute")
        self._entries.move_to_end(key)
        self._use(key)
        return self._entries[key]

    def deepest_hit(self, keys) -> int:
        """Index of the deepest page digest in ``keys`` that has anchors, or -1 (no LRU update)."""
        return next((i for i in range(len(keys) - 1, -1, -1) if _key(keys[i]) in self._entries), -1)

    def _remove(self, key) -> None:
        self._account(self._entries.pop(key), -1)
        del self._saved[key], self._uses[key]

    def _account(self, entry: dict[int, torch.Tensor], sign: int) -> None:
        """Add (``sign`` 1) or remove (-1) an entry's bytes, per layer and in all."""
        for layer, tensor in entry.items():
            size = sign * tensor.numel() * tensor.element_size()
            self.layer_bytes[layer] += size
            self.used_bytes += size

    def __contains__(self, key) -> bool:
        return _key(key) in self._entries

    def __iter__(self):
        """The stored keys, least recently used first (no LRU update)."""
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)
