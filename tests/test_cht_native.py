"""The compiled CHT against its oracle, the pure-Python CHT, answer for answer.

Random operation sequences (shared and nested prefixes, reused ids, scheduling by the CHT's own
choice, copies taken mid-run) drive both; after every operation every query agrees exactly,
tie-breaks and order included, and so do the canonical snapshots. Once everything has left,
the compiled tree holds nothing.
"""

import copy

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_core.cht.python_tree import PythonChunkedHashTree
from cache_core.cht.tree import CANDIDATE_COLUMNS, CandidateStats, ChunkedHashTree

# A common stem and a 2-token alphabet make nested groups, branch points inside runs and ties common.
prompts = st.tuples(st.integers(0, 3), st.integers(0, 4), st.lists(st.integers(0, 1), max_size=10))
steps = st.lists(st.one_of(
    st.tuples(st.just("add"), prompts),
    st.tuples(st.sampled_from(["remove", "activate", "activate", "best", "finish", "finish", "copy"]),
              st.integers(0, 10**6)),
), max_size=120)


def assert_same(native: ChunkedHashTree, oracle: PythonChunkedHashTree) -> None:
    waiting = oracle.waiting_ids()
    assert native.waiting_ids() == waiting and native.running_ids() == oracle.running_ids()
    assert (native.num_waiting, native.num_running, native.num_prefixes) == \
           (oracle.num_waiting, oracle.num_running, oracle.num_prefixes)
    assert native.find_best() == oracle.find_best()
    for k in (1, 2, 3, 4, 7):
        assert native.top_candidates(k) == oracle.top_candidates(k), k
    assert native.running_common_prefix == oracle.running_common_prefix
    stats = [oracle.candidate_stats(request_id) for request_id in waiting]
    assert [native.candidate_stats(request_id) for request_id in waiting] == stats
    rows = native.candidate_rows(waiting)
    assert rows.shape == (len(waiting), len(CANDIDATE_COLUMNS)) and rows.dtype == np.int64
    assert [CandidateStats(*row) for row in rows.tolist()] == stats
    for request_id in waiting + oracle.running_ids():
        assert native.shared_chunks(request_id) == oracle.shared_chunks(request_id)
    assert native.largest_groups(4) == oracle.largest_groups(4)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunk_size=st.integers(1, 2), ops=steps)
def test_compiled_cht_answers_as_the_python_one(chunk_size, ops):
    native, oracle = ChunkedHashTree(chunk_size), PythonChunkedHashTree(chunk_size)
    fresh = 0
    for kind, arg in ops:
        waiting, running = oracle.waiting_ids(), oracle.running_ids()
        if kind == "add":
            stem, stem_length, tail = arg
            tokens = np.array([stem] * stem_length + tail, dtype=np.int64)
            request_id = f"r{fresh % 40}"            # ids come back once their request has left
            if request_id in waiting or request_id in running:
                request_id = f"u{fresh}"
            fresh += 1
            digests = native.digests_of(tokens)
            native.add(request_id, digests)
            oracle.add(request_id, digests)
        elif kind == "copy":
            native = copy.deepcopy(native)
        elif kind == "best" and waiting:
            request_id = oracle.find_best()
            native.activate(request_id)
            oracle.activate(request_id)
        elif kind in ("remove", "activate") and waiting:
            request_id = waiting[arg % len(waiting)]
            getattr(native, kind)(request_id)
            getattr(oracle, kind)(request_id)
        elif kind == "finish" and running:
            request_id = running[arg % len(running)]
            native.finish(request_id)
            oracle.finish(request_id)
        assert_same(native, oracle)
    assert native.snapshot() == oracle.snapshot()
    for request_id in oracle.waiting_ids():
        native.remove(request_id)
    for request_id in oracle.running_ids():
        native.finish(request_id)
    assert set(native.memory_entries().values()) == {0}


def test_a_copy_is_independent():
    tree = ChunkedHashTree(chunk_size=1)
    for i, tokens in enumerate([[1, 2, 3], [1, 2, 4], [5]]):
        tree.add(i, tree.digests_of(np.array(tokens)))
    tree.activate(0)
    twin = copy.deepcopy(tree)
    twin.activate(1)
    twin.finish(0)
    assert (tree.num_waiting, tree.running_ids()) == (2, [0])
    assert (twin.num_waiting, twin.running_ids()) == (1, [1])
    assert tree.candidate_stats(1).shared_chunks == 2 and twin.candidate_stats(2).shared_chunks == 0
    tree.activate(1)                    # what the copy did is not done here: 1 waits, 0 runs
    tree.finish(0)
    assert tree.running_ids() == [1] and twin.is_running(1) and not twin.is_running(0)


def test_candidate_rows_refuse_what_is_not_waiting():
    tree = ChunkedHashTree(chunk_size=1)
    tree.add("w", tree.digests_of(np.array([1, 2])))
    tree.add("r", tree.digests_of(np.array([1, 3])))
    tree.activate("r")
    assert tree.candidate_rows(["w"]).tolist() == [[1, 1, 1, 0, 2]]
    with pytest.raises(ValueError, match="it is running"):
        tree.candidate_rows(["w", "r"])
    with pytest.raises(ValueError, match="unknown request"):
        tree.candidate_rows(["nobody"])
