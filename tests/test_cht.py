"""Chunk hashing and the Chunked Hash Tree: worked examples and misuse errors.

The randomised comparison with the token-trie reference is in test_cht_properties.py.
"""

import json

import numpy as np
import pytest
import xxhash

from cache_core.cht.tree import CandidateStats, ChunkedHashTree, PrefixGroup
from traces.chunk_hash import (
    DEFAULT_CHUNK_SIZE,
    block_hash_digests,
    chained_block_ids,
    chained_chunk_hashes,
    request_chunk_hashes,
)
from traces.request import Request


# ---------------------------------------------------------------- chunk hashing
def test_chained_chunk_hashes_match_a_naive_chain():
    tokens = np.arange(1000, dtype=np.int64) * 7919 % 32000
    digests = chained_chunk_hashes(tokens, 64)
    expected, seed = [], 0
    for i in range(1000 // 64):
        seed = xxhash.xxh3_64_intdigest(tokens[i * 64:(i + 1) * 64].tobytes(), seed)
        expected.append(seed)
    assert digests.dtype == np.uint64 and digests.tolist() == expected


def test_equal_digests_mean_equal_prefixes():
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 32000, 300)
    a = np.concatenate([shared, rng.integers(0, 32000, 200)])
    b = np.concatenate([shared, rng.integers(0, 32000, 200)])
    da, db = chained_chunk_hashes(a, 100), chained_chunk_hashes(b, 100)
    assert da[:3].tolist() == db[:3].tolist()
    assert da[3] != db[3] and da[4] != db[4]
    # A change in chunk 0 changes every later digest (chaining).
    c = a.copy()
    c[5] += 1
    assert not np.any(chained_chunk_hashes(c, 100) == da)


def test_partial_chunk_is_not_hashed_and_bad_size_rejected():
    assert len(chained_chunk_hashes(np.arange(255), 256)) == 0
    assert len(chained_chunk_hashes(np.arange(513), 256)) == 2
    with pytest.raises(ValueError, match="chunk_size"):
        chained_chunk_hashes(np.arange(10), 0)


def test_block_hash_digests_take_each_chunks_last_block():
    ids = np.arange(100, 132)
    digests = block_hash_digests(ids, block_size=16, chunk_size=64)   # 4 blocks per chunk
    assert digests.tolist() == chained_block_ids(ids[3::4]).tolist()
    raw = [bytes(range(i, i + 32)) for i in range(8)]                   # vLLM-style bytes hashes, one width
    assert block_hash_digests(raw, 16, 32).tolist() == [int.from_bytes(raw[j][:8], "little") for j in (1, 3, 5, 7)]
    mixed = [bytes(range(i, i + 8 + i)) for i in range(4)]               # widths 8..11: the first 8 bytes each
    assert block_hash_digests(mixed, 16, 16).tolist() == [int.from_bytes(h[:8], "little") for h in mixed]
    with pytest.raises(ValueError, match="multiple"):
        block_hash_digests(ids, block_size=16, chunk_size=40)


def test_request_chunk_hashes_reuse_block_ids():
    # 1000 tokens in 16-token blocks: 62 full blocks + a partial one; 3 full 256-token chunks.
    request = Request("r", 0.0, 1000, 1, block_ids=np.arange(63), block_size=16)
    assert request_chunk_hashes(request, 256).tolist() == chained_block_ids([15, 31, 47]).tolist()
    assert len(request_chunk_hashes(request, 16)) == 62
    # A chunk size that is not a multiple of the block size hashes the synthesised tokens.
    assert request_chunk_hashes(request, 100).tolist() == chained_chunk_hashes(request.tokens(), 100).tolist()


# ---------------------------------------------------------------- CHT by example
_TOKEN_OF_LABEL: dict = {}


def chain(*labels):
    """Digests of one-token chunks labelled ``labels`` (equal label paths share a prefix)."""
    tokens = [_TOKEN_OF_LABEL.setdefault(label, len(_TOKEN_OF_LABEL)) for label in labels]
    return chained_chunk_hashes(np.array(tokens, dtype=np.int64), 1)


def test_default_chunk_size_is_the_measured_one():
    assert ChunkedHashTree().chunk_size == DEFAULT_CHUNK_SIZE == 256


def test_find_best_prefers_fewest_missing_then_longest_shared_then_arrival():
    cht = ChunkedHashTree(chunk_size=1)
    cht.add("sys-a1", chain("s", "a", "x"))
    cht.add("sys-a2", chain("s", "a", "y"))
    cht.add("sys-b", chain("s", "b"))
    cht.add("other", chain("o", "p", "q", "r"))
    assert cht.find_best() == "sys-b"                 # nothing runs: shortest first
    cht.activate("sys-b")
    # sys-a1, sys-a2: 2 missing (share "s"); other: 4 missing.
    assert cht.find_best() == "sys-a1"                # tie on missing and shared: earlier arrival
    cht.activate("sys-a1")
    assert cht.candidate_stats("sys-a2") == CandidateStats(
        shared_chunks=2, missing_chunks=1, chunk_loss=0, same_prefix_waiting=0, num_chunks=3)
    cht.add("short", chain("z"))                      # 1 missing, 0 shared
    cht.add("long", chain("s", "a", "x", "w"))        # 1 missing, 3 shared: wins the tie
    assert cht.find_best() == "long"
    cht.remove("long")
    assert cht.find_best() == "sys-a2"                # 1 missing, 2 shared beats "short"
    assert cht.running_common_prefix == 1


def test_candidate_stats_chunk_loss_and_groups():
    cht = ChunkedHashTree(chunk_size=1)
    for i in range(3):
        cht.add(f"g{i}", chain("s", "g", "h", f"u{i}"))
    cht.add("solo", chain("s", "t"))
    cht.add("apart", chain("q"))
    stats = cht.candidate_stats("g0")
    assert (stats.shared_chunks, stats.chunk_loss, stats.same_prefix_waiting) == (0, 0, 2)
    assert cht.largest_groups(5) == [PrefixGroup(depth=1, size=4), PrefixGroup(depth=3, size=3)]
    cht.activate("g0")
    assert cht.running_common_prefix == 4
    assert cht.candidate_stats("g1").chunk_loss == 1      # common prefix 4 -> 3
    assert cht.candidate_stats("solo").chunk_loss == 3    # 4 -> 1
    assert cht.candidate_stats("apart").chunk_loss == 4   # 4 -> 0
    assert cht.find_best() == "g1"
    assert cht.largest_groups(1) == [PrefixGroup(depth=1, size=3)]


def test_group_moves_with_one_activation_and_back_on_finish():
    cht = ChunkedHashTree(chunk_size=1)
    for i in range(50):
        cht.add(i, chain("p", "q", "r", i))
    cht.add("short", chain("x", "y"))
    assert cht.find_best() == "short"
    cht.activate(10)
    assert cht.find_best() == 0 and cht.candidate_stats(0).missing_chunks == 1
    cht.finish(10)
    assert cht.find_best() == "short"


def test_finishing_a_longer_running_request_keeps_its_waiting_group_reachable():
    # The waiting group below ("s", "a") is first served by the running prefix ("s", "a");
    # when that one finishes, ("s") still runs and must take over (one entry per chain).
    cht = ChunkedHashTree(chunk_size=1)
    cht.add("r-long", chain("s", "a"))
    cht.add("r-short", chain("s"))
    cht.activate("r-long")
    cht.activate("r-short")
    cht.add("w1", chain("s", "a", "x"))
    cht.add("w2", chain("s", "a", "y"))
    assert cht.find_best() == "w1" and cht.candidate_stats("w1").missing_chunks == 1
    cht.finish("r-long")
    assert cht.find_best() == "w1" and cht.candidate_stats("w1").missing_chunks == 2
    cht.finish("r-short")
    assert cht.find_best() == "w1" and cht.candidate_stats("w1").missing_chunks == 3


def test_ids_are_reusable_and_memory_returns_to_empty():
    cht = ChunkedHashTree(chunk_size=1)
    for round_ in range(3):
        for i in range(40):
            cht.add(i, chain("s", i % 3, i))
        for i in range(0, 40, 2):
            cht.activate(i)
        for i in range(1, 40, 2):
            cht.remove(i)
        for i in range(0, 40, 2):
            cht.finish(i)
        assert cht.num_waiting == cht.num_running == 0
        assert cht.find_best() is None
        assert set(cht.memory_entries().values()) == {0}, round_


@pytest.mark.parametrize("action, setup, message", [
    ("add", "waiting", "already waiting"),
    ("add", "running", "already running"),
    ("remove", "running", "it is running"),
    ("remove", None, "unknown request"),
    ("activate", "running", "it is running"),
    ("activate", None, "unknown request"),
    ("finish", "waiting", "it is waiting"),
    ("finish", None, "unknown request"),
    ("candidate_stats", "running", "it is running"),
])
def test_misuse_is_a_clear_error_and_changes_nothing(action, setup, message):
    cht = ChunkedHashTree(chunk_size=1)
    cht.add("bystander", chain("a", "b"))
    if setup:
        cht.add("r", chain("a", "c"))
        if setup == "running":
            cht.activate("r")
    before = cht.snapshot()
    call = getattr(cht, action)
    with pytest.raises(ValueError, match=message):
        call("r", chain("a")) if action == "add" else call("r")
    assert cht.snapshot() == before


def test_digests_must_be_a_chain_of_integers():
    cht = ChunkedHashTree(chunk_size=1)
    cht.add("a", np.array([5, 6], dtype=np.uint64))
    cht.add("x", np.array([5, 8], dtype=np.uint64))         # the trie branches after 5: 6 starts a run at depth 2
    with pytest.raises(ValueError, match="chained"):
        cht.add("b", np.array([6, 7], dtype=np.uint64))     # 6 is held at depth 2, not 1
    with pytest.raises(ValueError, match="1-D integer"):
        cht.add("c", np.array([[1, 2]]))
    assert cht.num_waiting == 2 and not cht.is_waiting("b")


def test_lpm_baseline_matches_longest_common_prefix():
    from cache_core.cht.lpm import RadixCache, lpm_pass

    rng = np.random.default_rng(3)
    cached = [rng.integers(0, 3, rng.integers(1, 12)).tolist() for _ in range(20)]
    cache = RadixCache()
    for prompt in cached:
        cache.insert(prompt)
    queries = [rng.integers(0, 3, rng.integers(0, 12)).tolist() for _ in range(50)]

    def lcp(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    expected = [max(lcp(q, c) for c in cached) for q in queries]
    for query, length in zip(queries, expected):
        values, _ = cache.match_prefix(list(query))
        assert len(values) == length
    order = lpm_pass(cache, queries)
    assert [expected[i] for i in order] == sorted(expected, reverse=True)


def test_bench_cli_prints_one_json_object_last(capsys):
    from feather_cli.main import main

    assert main(["bench", "cht", "--json", "--waiting", "60", "--lpm-waiting", "60", "--steps", "30",
                 "--batch", "8", "--long-prompts", "12", "--no-trace", "--lpm-round-waiting", "16,32",
                 "--round-repeats", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert [g["waiting"] for g in report["prefix_groups"]] == [60]
    assert report["prefix_groups"][0]["find_best_us_p50"] > 0
    assert {row["running_set"] for row in report["lpm_vs_cht"]} == {"cht_batch", "fcfs_batch"}
    # Per scheduling round at W <= 128 (SGLang's LPM range): both running sets at every W.
    rounds = report["lpm_vs_cht_rounds"]
    assert [(row["waiting"], row["running_set"]) for row in rounds] == [
        (16, "cht_batch"), (16, "fcfs_batch"), (32, "cht_batch"), (32, "fcfs_batch")]
    for row in rounds:
        assert row["running"] == 8 and row["lpm_pass_us_p50"] > 0
        assert 0 < row["cht_round_one_us_p50"] and 0 < row["cht_round_all_us_p50"]
        assert row["speedup_x_all"] == round(row["lpm_pass_us_p50"] / row["cht_round_all_us_p50"], 2)
    assert any(line.startswith("per scheduling round at W <= 128") for line in lines)
    assert report["mooncake"] is None and "add_10k_met" in report["targets"]
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "cht", "--waiting", "1000,x"])
    assert exit_info.value.code == 2 and "comma-separated positive integers" in capsys.readouterr().err
    assert main(["bench", "cht", "--lpm-round-waiting", "64,256"]) == 2
    assert "SGLang runs LPM only up to W=128, got 256" in capsys.readouterr().err


def test_a_round_admits_up_to_its_limit():
    from cache_core.cht.bench import admit

    cht = ChunkedHashTree(chunk_size=4)
    for i in range(5):
        cht.add(i, chained_chunk_hashes(np.arange(8) + 100 * (i % 2), 4))
    admit(cht, 1)
    assert len(cht.running_ids()) == 1 and cht.num_waiting == 4
    admit(cht, 10)
    assert len(cht.running_ids()) == 5 and cht.num_waiting == 0


def test_add_request_hashes_at_the_tree_chunk_size():
    cht = ChunkedHashTree(chunk_size=16)
    request = Request("r", 0.0, 100, 1, block_ids=np.arange(7), block_size=16)
    digests = cht.add_request(request)
    assert digests.tolist() == chained_block_ids(np.arange(6)).tolist()
    assert cht.candidate_stats("r").num_chunks == 6
