"""``ChunkedHashTree.top_candidates`` against a brute force over random operation sequences.

The brute force sorts every waiting request by the selection key ``(missing, -shared,
arrival)`` and keeps the first request of each prefix group (the first chunk it is missing; a
request missing nothing is a group of its own).
"""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_core.cht import ChunkedHashTree
from cache_core.cht_reference import ReferenceScheduler
from test_cht_properties import apply, operations


def brute_force(cht: ChunkedHashTree, digests: dict, k: int) -> list:
    ranked = []
    for arrival, request_id in enumerate(cht.waiting_ids()):      # arrival order = add order
        chain, shared = digests[request_id], cht.shared_chunks(request_id)
        group = int(chain[shared]) if shared < len(chain) else ("alone", request_id)
        ranked.append(((len(chain) - shared, -shared, arrival), group, request_id))
    taken, out = set(), []
    for _, group, request_id in sorted(ranked, key=lambda row: row[0]):
        if group not in taken and len(out) < k:
            taken.add(group)
            out.append(request_id)
    return out


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, chunk_size=st.sampled_from([1, 2]))
def test_top_candidates_equal_the_brute_force(ops, chunk_size):
    cht, ref, digests, next_id = ChunkedHashTree(chunk_size), ReferenceScheduler(chunk_size), {}, 0
    for op in ops:
        next_id = apply(cht, ref, digests, op, next_id)
        for k in (1, 2, 3, 5):
            assert cht.top_candidates(k) == brute_force(cht, digests, k), (k, op)
        assert cht.top_candidates(1) == ([cht.find_best()] if cht.num_waiting else [])


def test_top_candidates_on_groups_extending_a_running_prefix():
    """Running: prefix P. Waiting: two groups below P (next chunks A and B), one loner."""
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
