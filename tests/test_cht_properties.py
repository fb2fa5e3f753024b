"""Both CHTs (compiled and pure Python) against a plain token trie over thousands of random
operation sequences.

After every operation the CHT's answers (find_best, candidate_stats of every waiting
request, largest_groups, running_common_prefix) equal the reference's, and for the Python CHT
its heap bounds hold; at the end the index equals a from-scratch rebuild and, once everything
has finished or been removed, every container is empty.
"""

from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_core.cht import python_tree as cht_module
from cache_core.cht.python_tree import PythonChunkedHashTree
from cache_core.cht.reference import ReferenceScheduler
from cache_core.cht.tree import ChunkedHashTree

TREES = [ChunkedHashTree, PythonChunkedHashTree]

# A 3-token alphabet and short prompts make shared prefixes, ties and groups common.
prompts = st.lists(st.integers(0, 2), max_size=12)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), prompts),
        st.tuples(st.sampled_from(["remove", "activate", "activate", "finish"]), st.integers(0, 99)),
        st.tuples(st.sampled_from(["misuse-activate", "misuse-finish", "misuse-add"]), st.integers(0, 99)),
    ),
    max_size=40,
)


def apply(cht, ref: ReferenceScheduler, digests: dict, op, next_id: int) -> int:
    """Apply one operation to both; returns the next fresh request id."""
    kind, arg = op
    waiting, running = list(ref.waiting), list(ref.running)
    if kind == "add":
        # Reuse a finished/removed id now and then: ids are only unique while in the tree.
        gone = sorted(set(digests) - set(waiting) - set(running))
        request_id = gone[0] if gone and len(arg) % 4 == 0 else next_id
        digests[request_id] = cht.digests_of(np.array(arg, dtype=np.int64))
        cht.add(request_id, digests[request_id])
        ref.add(request_id, arg)
        return next_id + (request_id == next_id)
    if kind in ("remove", "activate") and waiting:
        request_id = waiting[arg % len(waiting)]
    elif kind == "finish" and running:
        request_id = running[arg % len(running)]
    elif kind.startswith("misuse") and (waiting or running):
        # Activate a running one, finish a waiting one, add one that is already there.
        request_id = (running + waiting)[arg % (len(running) + len(waiting))]
        action = kind.removeprefix("misuse-")
        expect_error = (action == "add" or (action == "activate" and request_id in running)
                        or (action == "finish" and request_id in waiting))
        if expect_error:
            for model in (cht, ref):
                args = (request_id, digests[request_id]) if action == "add" else (request_id,)
                with pytest.raises(ValueError):
                    getattr(model, action)(*args)
            return next_id
        kind = action
    else:
        return next_id
    getattr(cht, kind)(request_id)
    getattr(ref, kind)(request_id)
    return next_id


def assert_same_answers(cht, ref: ReferenceScheduler) -> None:
    assert (cht.num_waiting, cht.num_running) == (len(ref.waiting), len(ref.running))
    assert cht.find_best() == ref.find_best()
    assert cht.running_common_prefix == ref.running_common_prefix
    for request_id in ref.waiting:
        assert cht.candidate_stats(request_id) == ref.candidate_stats(request_id), request_id
    assert cht.largest_groups(3) == ref.largest_groups(3)
    if isinstance(cht, PythonChunkedHashTree):
        assert_heap_bounds(cht)


def assert_heap_bounds(cht: PythonChunkedHashTree) -> None:
    """Invariants 2 and 3 of cache_core.cht.python_tree, read from its internals.

    Stale entries stay bounded; working-set prefix tops are live; every working-set prefix
    (and the root) with waiting requests has a valid global entry for its best request at
    its own depth or deeper on that request's chain.
    """
    slack, mask, bits = cht_module._COMPACT_SLACK, cht_module._SEQ_MASK, cht_module._SEQ_BITS
    for prefix in [cht._root, *cht._index.values()]:
        assert len(prefix.heap) <= 2 * prefix.waiting + slack
    assert len(cht._global) <= 2 * (len(cht._working_set) + 1) + slack
    deepest_entry: dict[int, int] = {}       # seq -> deepest valid entry depth
    for _, minus_depth, seq, digest in cht._global:
        if seq in cht._waiting_by_seq and (digest == cht_module._ROOT or digest in cht._working_set):
            deepest_entry[seq] = max(deepest_entry.get(seq, -1), -minus_depth)
    running_prefixes = [cht._root] + [cht._index[d] for d in cht._working_set if d in cht._index]
    for prefix in running_prefixes:
        if prefix.waiting:
            live = [k for k in prefix.heap if k & mask in cht._waiting_by_seq]
            assert len(live) == prefix.waiting and prefix.heap[0] == min(live)
            best_seq = min(live) & mask
            assert deepest_entry.get(best_seq, -1) >= prefix.depth, (prefix.depth, best_seq, bits)


def rebuild(cht, digests: dict):
    fresh = type(cht)(cht.chunk_size)
    snapshot = cht.snapshot()
    for request_id in [*snapshot["running"], *snapshot["waiting"]]:
        fresh.add(request_id, digests[request_id])
    for request_id in snapshot["running"]:
        fresh.activate(request_id)
    return fresh


@pytest.mark.parametrize("tree", TREES)
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunk_size=st.integers(1, 3), ops=operations, drain_order=st.randoms(use_true_random=False))
def test_cht_equals_token_trie_and_rebuild_and_drains_to_empty(tree, chunk_size, ops, drain_order):
    cht, ref, digests, next_id = tree(chunk_size), ReferenceScheduler(chunk_size), {}, 0
    for op in ops:
        next_id = apply(cht, ref, digests, op, next_id)
        assert_same_answers(cht, ref)
    assert cht.snapshot() == rebuild(cht, digests).snapshot()

    leftovers = [("remove", r) for r in ref.waiting] + [("finish", r) for r in ref.running]
    drain_order.shuffle(leftovers)
    for action, request_id in leftovers:
        getattr(cht, action)(request_id)
        getattr(ref, action)(request_id)
        assert_same_answers(cht, ref)
    assert ref.is_empty()
    assert set(cht.memory_entries().values()) == {0}


@pytest.mark.parametrize("slack", [0, cht_module._COMPACT_SLACK])
@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "activate", "finish", "remove"]), st.integers(0, 99)),
                    min_size=100, max_size=300))
def test_long_scheduling_runs_keep_heaps_bounded(slack, ops):
    """Many requests of few prefix groups: stale entries pile up and must be compacted
    (slack 0 compacts as early as possible, so compaction itself is exercised)."""
    with mock.patch.object(cht_module, "_COMPACT_SLACK", slack):
        run_long_schedule(ops)


def run_long_schedule(ops, tree=PythonChunkedHashTree) -> None:
    cht, ref, digests, next_id = tree(1), ReferenceScheduler(1), {}, 0
    for kind, arg in ops:
        if kind == "add":
            op = ("add", [arg % 2, arg // 2 % 2, arg // 4 % 2, 0][: 1 + arg // 8 % 4])   # nested prefixes too
        elif kind == "activate" and ref.waiting:      # schedule like a server: take the best
            op = ("activate", list(ref.waiting).index(ref.find_best()))
        else:
            op = (kind, arg)
        next_id = apply(cht, ref, digests, op, next_id)
        assert cht.find_best() == ref.find_best()
        if isinstance(cht, PythonChunkedHashTree):
            assert_heap_bounds(cht)
    assert cht.snapshot() == rebuild(cht, digests).snapshot()


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "activate", "finish", "remove"]), st.integers(0, 99)),
                    min_size=100, max_size=300))
def test_long_scheduling_runs_on_the_compiled_cht(ops):
    run_long_schedule(ops, ChunkedHashTree)
