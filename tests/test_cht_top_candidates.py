"""``ChunkedHashTree.top_candidates`` against a brute force over random operation sequences.

The brute force sorts every waiting request by the selection key ``(missing, -shared,
arrival)`` and keeps the first request of each prefix group (its deepest prefix shared with
another waiting request; a request sharing none is a group of its own).
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cht_properties import apply, operations

from cache_core.cht.python_tree import PythonChunkedHashTree
from cache_core.cht.reference import ReferenceScheduler
from cache_core.cht.tree import ChunkedHashTree

TREES = [ChunkedHashTree, PythonChunkedHashTree]


def brute_force(cht, digests: dict, k: int) -> list:
    waiting = cht.waiting_ids()                                    # arrival order = add order
    ranked = []
    for arrival, request_id in enumerate(waiting):
        chain, shared = [int(d) for d in digests[request_id]], cht.shared_chunks(request_id)
        depth = max((d for d in range(1, len(chain) + 1)
                     if any(other != request_id and len(digests[other]) >= d
                             and int(digests[other][d - 1]) == chain[d - 1]
                            for other in waiting)), default=0)
        group = chain[depth - 1] if depth else ("alone", request_id)
        ranked.append(((len(chain) - shared, -shared, arrival), group, request_id))
    taken, out = set(), []
    for _, group, request_id in sorted(ranked, key=lambda row: row[0]):
        if group not in taken and len(out) < k:
            taken.add(group)
            out.append(request_id)
    return out


def assert_shared_children(cht: PythonChunkedHashTree) -> None:
    """Invariant 4 of cache_core.cht.python_tree: each prefix counts its children shared by >= 2 waiting requests."""
    index = cht._index
    counts = {id(prefix): 0 for prefix in [cht._root, *index.values()]}
    for prefix in index.values():
        if prefix.waiting >= 2:
            counts[id(cht._root if prefix.parent is None else index[prefix.parent])] += 1
    assert all(prefix.shared_children == counts[id(prefix)] for prefix in [cht._root, *index.values()])


@pytest.mark.parametrize("tree", TREES)
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, chunk_size=st.sampled_from([1, 2]))
def test_top_candidates_equal_the_brute_force(tree, ops, chunk_size):
    cht, ref, digests, next_id = tree(chunk_size), ReferenceScheduler(chunk_size), {}, 0
    for op in ops:
        next_id = apply(cht, ref, digests, op, next_id)
        for k in (1, 2, 3, 5):
            assert cht.top_candidates(k) == brute_force(cht, digests, k), (k, op)
        if isinstance(cht, PythonChunkedHashTree):
            assert_shared_children(cht)
        assert cht.top_candidates(1) == ([cht.find_best()] if cht.num_waiting else [])


def test_top_candidates_on_groups_extending_a_running_prefix():
    """Running: prefix P. Waiting: a1 and a2 share P + 3 (a group), b1 shares only P with them
    (a group of its own at P), x shares nothing."""
    cht = ChunkedHashTree(chunk_size=1)
    chains = {"run": [1, 2], "a1": [1, 2, 3, 4], "a2": [1, 2, 3], "b1": [1, 2, 5, 6, 7], "x": [9]}
    for request_id, tokens in chains.items():
        cht.add(request_id, cht.digests_of(np.array(tokens)))
    cht.activate("run")
    assert cht.top_candidates(4) == ["a2", "x", "b1"]    # keys (1,-2), (1,0), (3,-2); a1 is a2's group
    assert cht.top_candidates(2) == ["a2", "x"]
    assert cht.find_best() == "a2"
    try:
        cht.top_candidates(0)
    except ValueError:
        pass
    else:
        raise AssertionError("k = 0 must be refused")


def test_one_candidate_per_family_while_a_family_runs():
    """Four families of a shared 3-chunk prefix and distinct suffixes, family 0 running: the four
    candidates are one request of each family, family 0's first (it misses only its suffix)."""
    cht = ChunkedHashTree(chunk_size=1)
    family = {}
    for member in range(6):
        for f in range(4):
            request_id = f"{f}-{member}"
            family[request_id] = f
            cht.add(request_id, cht.digests_of(np.array([10 * f + 1, 10 * f + 2, 10 * f + 3, 1000 + 10 * member + f])))
    cht.activate("0-0")
    candidates = cht.top_candidates(4)
    assert [family[c] for c in candidates][0] == 0 and sorted(family[c] for c in candidates) == [0, 1, 2, 3]
    assert candidates[0] == cht.find_best()
