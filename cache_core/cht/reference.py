"""A plain token-trie model of the CHT's answers, for tests only.

It shares no code or idea with :mod:`cache_core.cht.tree` beyond the definitions: no digests,
no heaps, every query a brute-force walk over a one-node-per-token trie. A request's
chunks are its full ``chunk_size``-token chunks; only those are inserted in the tries.
Misuse raises ``ValueError`` like the CHT does.
"""

from __future__ import annotations

from cache_core.cht.tree import CandidateStats, PrefixGroup


class _TrieNode:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _TrieNode] = {}
        self.count = 0


class TokenTrie:
    """A multiset of token sequences; every node counts the sequences through it."""

    def __init__(self) -> None:
        self.root = _TrieNode()

    def insert(self, tokens) -> None:
        node = self.root
        node.count += 1
        for token in tokens:
            node = node.children.setdefault(token, _TrieNode())
            node.count += 1

    def delete(self, tokens) -> None:
        node = self.root
        node.count -= 1
        for token in tokens:
            child = node.children[token]
            child.count -= 1
            if not child.count:
                del node.children[token]
                return
            node = child

    def path_counts(self, tokens) -> list[int]:
        """``counts[i]`` = sequences sharing the first ``i + 1`` tokens (stops at 0)."""
        counts, node = [], self.root
        for token in tokens:
            node = node.children.get(token)
            if node is None:
                break
            counts.append(node.count)
        return counts

    def common_length(self) -> int:
        """Tokens common to every stored sequence (0 when empty)."""
        total, length, node = self.root.count, 0, self.root
        while total:
            node = next((child for child in node.children.values() if child.count == total), None)
            if node is None:
                break
            length += 1
        return length

    def is_empty(self) -> bool:
        return not self.root.children and not self.root.count


class ReferenceScheduler:
    """The CHT's public behaviour on token ids, by brute force."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.waiting: dict[object, tuple[int, ...]] = {}   # insertion order = arrival order
        self.running: dict[object, tuple[int, ...]] = {}
        self._arrival: dict[object, int] = {}
        self._next = 0
        self.waiting_trie = TokenTrie()
        self.running_trie = TokenTrie()

    def _full(self, tokens) -> tuple[int, ...]:
        return tuple(tokens[: len(tokens) // self.chunk_size * self.chunk_size])

    def add(self, request_id, tokens) -> None:
        if request_id in self.waiting or request_id in self.running:
            raise ValueError(f"request {request_id!r} is already known")
        self.waiting[request_id] = self._full(tokens)
        self._arrival[request_id] = self._next
        self._next += 1
        self.waiting_trie.insert(self.waiting[request_id])

    def remove(self, request_id) -> None:
        if request_id not in self.waiting:
            raise ValueError(f"request {request_id!r} is not waiting")
        self.waiting_trie.delete(self.waiting.pop(request_id))

    def activate(self, request_id) -> None:
        if request_id not in self.waiting:
            raise ValueError(f"request {request_id!r} is not waiting")
        tokens = self.waiting.pop(request_id)
        self.waiting_trie.delete(tokens)
        self.running[request_id] = tokens
        self.running_trie.insert(tokens)

    def finish(self, request_id) -> None:
        if request_id not in self.running:
            raise ValueError(f"request {request_id!r} is not running")
        self.running_trie.delete(self.running.pop(request_id))

    def shared_chunks(self, request_id) -> int:
        return len(self.running_trie.path_counts(self.waiting[request_id])) // self.chunk_size

    def find_best(self):
        def key(request_id):
            n, shared = len(self.waiting[request_id]) // self.chunk_size, self.shared_chunks(request_id)
            return n - shared, -shared, self._arrival[request_id]
        return min(self.waiting, key=key, default=None)

    @property
    def running_common_prefix(self) -> int:
        return self.running_trie.common_length() // self.chunk_size

    def candidate_stats(self, request_id) -> CandidateStats:
        if request_id not in self.waiting:
            raise ValueError(f"request {request_id!r} is not waiting")
        tokens, c = self.waiting[request_id], self.chunk_size
        n, shared = len(tokens) // c, self.shared_chunks(request_id)
        chunk_loss = 0
        if self.running:
            common = self.running_trie.common_length()
            matched = sum(1 for count in self.running_trie.path_counts(tokens[:common]) if count == len(self.running))
            chunk_loss = common // c - matched // c
        counts = self.waiting_trie.path_counts(tokens)[c - 1::c]      # per chunk depth
        shared_depths = [count for count in counts if count >= 2]
        same_prefix = shared_depths[-1] - 1 if shared_depths else 0
        return CandidateStats(shared_chunks=shared, missing_chunks=n - shared, chunk_loss=chunk_loss,
                              same_prefix_waiting=same_prefix, num_chunks=n)

    def largest_groups(self, k: int) -> list[PrefixGroup]:
        groups, c = [], self.chunk_size
        stack = [(self.waiting_trie.root, 0)]
        while stack:
            node, length = stack.pop()
            if length and length % c == 0 and node.count >= 2:
                if node.count not in self._counts_at(node, c):
                    groups.append(PrefixGroup(length // c, node.count))
            stack.extend((child, length + 1) for child in node.children.values())
        groups.sort(key=lambda g: (g.size, g.depth), reverse=True)
        return groups[:k]

    @staticmethod
    def _counts_at(node: _TrieNode, distance: int) -> list[int]:
        """Counts of the descendants exactly ``distance`` tokens below ``node``."""
        level = [node]
        for _ in range(distance):
            level = [child for n in level for child in n.children.values()]
        return [n.count for n in level]

    def is_empty(self) -> bool:
        return (not self.waiting and not self.running and self.waiting_trie.is_empty()
                and self.running_trie.is_empty())
