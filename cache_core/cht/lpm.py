"""SGLang's radix cache and LPM pass, re-implemented as the baseline of ``feather bench cht``.

It follows ``sglang/srt/mem_cache/radix_cache.py`` with ``page_size=1``: a node holds a
segment of token ids (``key``) and their KV indices (``value``); children are keyed by the
first token of their segment; a match walks segment by segment, comparing tokens one at
a time in Python (``_key_match_page_size1``), refreshes ``last_access_time``, splits a node
when the match ends inside its segment, and concatenates the matched values. The
longest-prefix-match policy (``schedule_policy.py``, ``CacheAwarePolicy.LPM``) calls
``match_prefix`` for every waiting request and sorts the queue by matched length: that
whole pass is what one CHT scheduling decision replaces. Values are numpy arrays instead
of torch tensors; nothing else is simplified away.
"""

from __future__ import annotations

import time

import numpy as np


class RadixNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time")

    def __init__(self) -> None:
        self.children: dict[int, RadixNode] = {}
        self.parent: RadixNode | None = None
        self.key: list[int] = []
        self.value = np.empty(0, dtype=np.int64)
        self.lock_ref = 0
        self.last_access_time = time.monotonic()


def _key_match(key0: list[int], key1: list[int]) -> int:
    i = 0
    for k0, k1 in zip(key0, key1):
        if k0 != k1:
            break
        i += 1
    return i


class RadixCache:
    """Token-level radix tree over cached prompts (here: the running requests)."""

    def __init__(self) -> None:
        self.root = RadixNode()
        self._next_kv_index = 0

    def insert(self, key: list[int]) -> int:
        """Insert a prompt (KV indices allocated sequentially); returns the cached prefix length."""
        value = np.arange(self._next_kv_index, self._next_kv_index + len(key), dtype=np.int64)
        self._next_kv_index += len(key)
        node, now, total = self.root, time.monotonic(), 0
        node.last_access_time = now
        while key and key[0] in node.children:
            node = node.children[key[0]]
            node.last_access_time = now
            prefix_len = _key_match(node.key, key)
            total += prefix_len
            key, value = key[prefix_len:], value[prefix_len:]
            if prefix_len < len(node.key):
                node = self._split_node(node, prefix_len)
        if key:
            child = RadixNode()
            child.parent, child.key, child.value = node, key, value.copy()
            node.children[key[0]] = child
        return total

    def match_prefix(self, key: list[int]) -> tuple[np.ndarray, RadixNode]:
        """KV indices of the longest cached prefix of ``key``, and its last node."""
        node, now, values = self.root, time.monotonic(), []
        node.last_access_time = now
        while key and key[0] in node.children:
            child = node.children[key[0]]
            child.last_access_time = now
            prefix_len = _key_match(child.key, key)
            if prefix_len < len(child.key):
                node = self._split_node(child, prefix_len)
                values.append(node.value)
                break
            values.append(child.value)
            node = child
            key = key[prefix_len:]
        return (np.concatenate(values) if values else np.empty(0, dtype=np.int64)), node

    @staticmethod
    def _split_node(child: RadixNode, split_len: int) -> RadixNode:
        new_node = RadixNode()
        new_node.children = {child.key[split_len]: child}
        new_node.parent, new_node.lock_ref = child.parent, child.lock_ref
        new_node.key, new_node.value = child.key[:split_len], child.value[:split_len].copy()
        child.parent = new_node
        child.key, child.value = child.key[split_len:], child.value[split_len:].copy()
        new_node.parent.children[new_node.key[0]] = new_node
        return new_node


def lpm_pass(cache: RadixCache, waiting: list[list[int]]) -> list[int]:
    """One SGLang LPM scheduling pass: match every waiting prompt, longest match first.

    Returns the queue order (indices into ``waiting``). Cost: O(sum of matched tokens)
    Python-level token comparisons.
    """
    matched = [len(cache.match_prefix(prompt)[0]) for prompt in waiting]
    return sorted(range(len(waiting)), key=lambda i: -matched[i])
