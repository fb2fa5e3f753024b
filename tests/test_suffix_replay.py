"""SuffixReplay on the tiny hybrid model (exactness, error vs R, continuation, layer-wise), the
replay-budget allocation, the anchor sidecar and ``feather replay eval --json``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cache_core.hybrid.anchor_store import AnchorStore
from feather_gym.hybrid import suffix_replay as sr
from feather_gym.hybrid.model import load_model
from traces.chunk_hash import chained_chunk_hashes

PAGE = 64


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return load_model("tiny")          # builds it first (~20 s) on a clean machine


@pytest.fixture(scope="module")
def text(model):
    """Real held-out text (the model's zero-embedding rows make random ids a poor probe)."""
    from transformers import AutoTokenizer

    from feather_gym.hybrid.agreement import heldout_prompts

    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    return np.array(heldout_prompts(tokenizer, num_prompts=1, min_tokens=4 * PAGE + 32, max_tokens=4 * PAGE + 32)[0])


@pytest.fixture(scope="module")
def run(model, text):
    return sr.run_prefix(model, text[:4 * PAGE], [2 * PAGE, 4 * PAGE])


def errors(states, exact):
    return {l: (sr.relative_error(s.recurrent, exact[l].recurrent), sr.relative_error(s.conv, exact[l].conv))
            for l, s in states.items()}


@pytest.mark.parametrize("p", [2 * PAGE, 4 * PAGE])
def test_replaying_the_whole_prefix_reproduces_the_exact_state(model, run, p):
    states = sr.replay_states(model, run.anchors(p, p))
    assert sorted(states) == sorted(sr.gdn_modules(model))
    for layer, (recurrent, conv) in errors(states, run.states[p]).items():
        assert recurrent < 1e-5 and conv < 1e-6, (layer, recurrent, conv)


def test_state_error_does_not_grow_with_the_replayed_suffix(model, run):
    p = 4 * PAGE
    lengths = [2, 4, 8, 16, 32, PAGE, p]
    mean = [np.mean([e[0] for e in errors(sr.replay_states(model, run.anchors(p, r)), run.states[p]).values()])
            for r in lengths]
    assert all(b <= a + 1e-6 for a, b in zip(mean, mean[1:])), mean
    assert mean[0] > 1e-3 > 1e-5 > mean[-1]        # a 2-token suffix is visibly wrong, the full one exact


def test_the_conv_state_is_exact_once_the_suffix_covers_the_kernel(model, run):
    p, kernel = 4 * PAGE, model.config.linear_conv_kernel_dim
    for _, conv in errors(sr.replay_states(model, run.anchors(p, kernel)), run.states[p]).values():
        assert conv < 1e-6


def test_continuation_from_exact_states_matches_a_full_forward(model, text):
    run = sr.run_prefix(model, text[:2 * PAGE], [PAGE, 2 * PAGE])
    with torch.no_grad():
        full = model(torch.as_tensor(text[:2 * PAGE + 32])[None]).logits[0]
    for p in (PAGE, 2 * PAGE):
        logits = sr.continuation_logits(model, run.cache, p, run.states[p], text[p:p + 32])
        assert torch.allclose(logits, full[p:p + 32], atol=1e-4), (logits - full[p:p + 32]).abs().max()
    replayed = sr.replay_states(model, run.anchors(2 * PAGE, 2 * PAGE))
    logits = sr.continuation_logits(model, run.cache, 2 * PAGE, replayed, text[2 * PAGE:2 * PAGE + 32])
    assert torch.allclose(logits, full[2 * PAGE:2 * PAGE + 32], atol=1e-4)
    with pytest.raises(ValueError, match="no GDN state"):
        sr.cache_at(model, run.cache, PAGE, {})


def test_layerwise_replay_from_the_bottom_layer_is_exact_over_the_whole_prefix(model, run, text):
    p = 4 * PAGE
    gdn = sorted(sr.gdn_modules(model))
    states = sr.replay_layerwise(model, run.anchors(p, p, residual=True, layers=[gdn[0]]), p)
    assert sorted(states) == gdn
    assert max(e[0] for e in errors(states, run.states[p]).values()) < 1e-5
    from_tokens = sr.replay_layerwise(model, {}, p, suffix_tokens=text[:p])      # layer 0 from embeddings
    assert max(e[0] for e in errors(from_tokens, run.states[p]).values()) < 1e-5
    with pytest.raises(ValueError, match="no anchored layer below"):
        sr.replay_layerwise(model, run.anchors(p, 16, residual=True, layers=[gdn[-1]]), p)


def test_anchors_are_the_inputs_before_the_boundary(run):
    a = run.anchors(2 * PAGE, {0: 8, 1: 3})
    assert a[0].shape == (8, run.gdn_inputs[0].shape[1]) and torch.equal(a[1], run.gdn_inputs[1][2 * PAGE - 3:2 * PAGE])
    with pytest.raises(ValueError, match="R"):
        run.anchors(PAGE, PAGE + 1)
    with pytest.raises(ValueError, match="no captured inputs"):
        run.anchors(PAGE, 4, layers=[99])


def test_memory_lengths_are_positive_per_gdn_layer(model, run):
    lengths = sr.memory_lengths(model, run.gdn_inputs)
    assert sorted(lengths) == sorted(sr.gdn_modules(model)) and all(v > 0 for v in lengths.values())


def test_allocation_splits_the_budget_by_weight_within_bounds():
    assert sr.allocate_replay_tokens(96, dict.fromkeys([0, 1, 2], 1.0)) == {0: 32, 1: 32, 2: 32}
    split = sr.allocate_replay_tokens(100, {0: 1.0, 1: 3.0}, minimum=4)
    assert split == {0: 25, 1: 75}
    capped = sr.allocate_replay_tokens(100, {0: 1.0, 1: 100.0, 2: 1.0}, minimum=4, maximum=60)
    assert sum(capped.values()) == 100 and capped[1] == 60 and capped[0] == capped[2] == 20
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, low = int(rng.integers(1, 7)), int(rng.integers(1, 5))
        high = int(rng.integers(low, 200))
        budget = int(rng.integers(n * low, n * high + 1))
        weights = {i: float(w) for i, w in enumerate(rng.exponential(size=n))}
        out = sr.allocate_replay_tokens(budget, weights, minimum=low, maximum=high)
        assert sum(out.values()) == budget and all(low <= v <= high for v in out.values())
        by_weight = sorted(weights, key=weights.get)
        assert [out[i] for i in by_weight] == sorted(out.values())      # a longer memory never gets fewer
    with pytest.raises(ValueError, match="budget"):
        sr.allocate_replay_tokens(5, {0: 1.0, 1: 1.0}, minimum=4)


def test_gate_memory_is_the_slowest_heads_decay_to_eps():
    # head 0 halves every 10 tokens, head 1 every token: head 0 reaches 1e-3 after log2(1000) * 10 tokens
    g = torch.tensor([[np.log(0.5) / 10, np.log(0.5)]] * 5)
    assert sr.gate_memory_tokens(g) == pytest.approx(10 * np.log2(1000), rel=1e-6)
    assert sr.gate_memory_tokens(g, eps=0.5) == pytest.approx(10, rel=1e-6)
    decay = sr.gdn_log_decay(torch.zeros(3, 2), torch.log(torch.tensor([1.0, 2.0])), torch.zeros(2))
    assert torch.allclose(decay, -torch.tensor([1.0, 2.0]) * np.log(2.0))       # softplus(0) = ln 2


def test_anchor_store_with_split_rows_keeps_each_entrys_total_and_counts_bytes_per_layer():
    store = _store(2, split_rows=True)
    g = torch.Generator().manual_seed(0)
    store.put(1, {0: torch.randn(11, 16, generator=g), 2: torch.randn(1, 16, generator=g)})
    store.put(2, {0: torch.randn(2, 16, generator=g), 2: torch.randn(10, 16, generator=g)})
    assert store.used_bytes == 2 * store.entry_bytes == 768
    assert store.layer_bytes == {0: (11 + 2) * 32, 2: (1 + 10) * 32}
    assert store.mean_replay_tokens() == {0: 6.5, 2: 5.5}
    assert [a.shape[0] for a in store.get(1).values()] == [11, 1]
    store.put(3, _anchors(3))                                   # the uniform shape is one split; 2 is evicted
    assert store.layer_bytes == {0: (11 + 8) * 32, 2: (1 + 4) * 32} and sum(store.layer_bytes.values()) == 768
    with pytest.raises(ValueError, match="13 rows in all, an entry holds 12"):
        store.put(4, {0: torch.zeros(12, 16), 2: torch.zeros(1, 16)})
    with pytest.raises(ValueError, match="R_l >= 1"):
        store.put(4, {0: torch.zeros(12, 16), 2: torch.zeros(0, 16)})
    fixed = _store(1)
    with pytest.raises(ValueError, match="expected \\(8, 16\\)"):
        fixed.put(1, {0: torch.zeros(11, 16), 2: torch.zeros(1, 16)})
    assert fixed.mean_replay_tokens() == {0: 0.0, 2: 0.0} and len(store) == 2


def _store(entries: int, **kwargs) -> AnchorStore:
    per_entry = (8 + 4) * 16 * 2                      # R = 8 and 4 anchors of 16 bfloat16 values
    return AnchorStore(entries * per_entry, hidden_size=16, replay_tokens={0: 8, 2: 4}, page_tokens=64, **kwargs)


def _anchors(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {0: torch.randn(8, 16, generator=g), 2: torch.randn(4, 16, generator=g)}


def test_anchor_store_accounts_bytes_exactly_and_evicts_least_recent():
    store = _store(2)
    assert store.entry_bytes == 384 and store.bytes_per_cached_token == 384 / 64 and store.capacity_entries == 2
    assert store.put(1, _anchors(1)) == [] and store.put(2, _anchors(2)) == []
    assert store.used_bytes == 768
    assert torch.equal(store.get(1)[0], _anchors(1)[0].to(torch.bfloat16))   # 1 becomes most recent
    assert store.put(3, _anchors(3)) == [2]
    assert 2 not in store and 1 in store and 3 in store and len(store) == 2 and store.used_bytes == 768
    assert store.put(3, _anchors(4)) == [] and store.used_bytes == 768       # refresh in place
    assert store.evictions == 1
    assert store.get(3)[2].dtype == torch.bfloat16
    f32 = AnchorStore(768, hidden_size=16, replay_tokens={0: 8, 2: 4}, page_tokens=64, dtype="float32")
    assert f32.entry_bytes == 768 and f32.put(1, _anchors(1)) == [] and f32.used_bytes == 768


def test_utility_eviction_keeps_what_saves_most_per_expected_use():
    lru, utility = _store(2), _store(2, eviction="utility")
    for store in (lru, utility):
        store.put(1, _anchors(1), saved=1000.0)             # a deep page
        store.put(2, _anchors(2), saved=10.0)               # a shallow one, then used
        store.get(2)
    assert lru.put(3, _anchors(3), saved=10.0) == [1]       # the least recent
    assert utility.put(3, _anchors(3), saved=10.0) == [2]   # the least expected reuse x saved per byte
    # uses decay by half over a store's worth (2) of operations: page 1's one use at clock 1, now 4
    assert utility.decay == pytest.approx(0.5 ** 0.5)
    assert utility.utility(1) == pytest.approx(0.5 ** 1.5 * 1000.0 / utility.entry_bytes)
    # used often enough, a shallow page outweighs an idle deep one
    for _ in range(40):
        utility.get(3)
    assert utility.put(4, _anchors(4), saved=10.0) == [1]
    with pytest.raises(ValueError, match="saved must be > 0"):
        utility.put(5, _anchors(5), saved=0.0)
    with pytest.raises(ValueError, match="eviction"):
        _store(1, eviction="lfu")


def test_anchor_store_refuses_what_it_cannot_serve():
    store = _store(1)
    with pytest.raises(KeyError, match="without anchors"):
        store.get(7)
    with pytest.raises(ValueError, match="too small for one entry"):
        AnchorStore(100, hidden_size=16, replay_tokens={0: 8}, page_tokens=64)
    with pytest.raises(ValueError, match="expected \\(8, 16\\)"):
        store.put(1, {0: torch.zeros(8, 15), 2: torch.zeros(4, 16)})
    with pytest.raises(ValueError, match="layers"):
        store.put(1, {0: torch.zeros(8, 16)})
    with pytest.raises(ValueError, match="dtype"):
        _store(1, dtype="int8")
    assert len(store) == 0 and store.used_bytes == 0


def test_anchor_store_is_keyed_by_the_chained_page_digests():
    store = _store(4)
    tokens = np.arange(64 * 3, dtype=np.int64)
    keys = store.keys_for(tokens)
    assert np.array_equal(keys, chained_chunk_hashes(tokens, 64)) and len(keys) == 3
    store.put(keys[0], _anchors(0))
    store.put(keys[1], _anchors(1))
    assert store.deepest_hit(keys) == 1 and store.deepest_hit(keys[2:]) == -1


def test_replay_eval_json_last_line(capsys):
    from feather_cli.main import main

    assert main(["replay", "eval", "--model", "tiny", "--page", "64", "--prefix-tokens", "128",
                 "--replay-tokens", "4,16", "--continuation-tokens", "16", "--samples", "1", "--needles", "1",
                 "--time-prefix-tokens", "256", "--threads", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"quality", "storage", "timing", "needle"} <= set(report)
    methods = {(q["method"], q["replay_tokens"]) for q in report["quality"]}
    assert methods == {(m, r) for m in ("uniform", "decay", "layerwise", "suffix") for r in (4, 16)} | {("zero", 0)}
    assert all(q["kl_nats_mean"] < 1e-3 and q["ppl_ratio"] > 0 for q in report["quality"] if q["method"] != "zero")
    assert report["timing"]["prefix_recompute"][0]["recompute_s"] > 0
