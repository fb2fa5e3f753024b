"""The simulator's hybrid mode: hits resume from kept recurrent states only; states cost KV capacity."""

from __future__ import annotations

import numpy as np
import pytest

from cache_core.hybrid.state_registry import StateRegistry
from feather_gym.costmodel import load_cost_model
from feather_gym.hybrid.state_keeping import HybridSimConfig
from feather_gym.observation import FEATURE_INDEX
from feather_gym.policies import make_policy
from feather_gym.simulator import EngineConfig, Simulator, simulate
from traces import Request, Trace, resolve_workload

BS = 256


@pytest.fixture(scope="module")
def cost_model():
    return load_cost_model("h200")


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(300, 30_000, size=n, dtype=np.int64)


def sequential(prompts: list[np.ndarray]) -> Trace:
    """One request a minute: each finishes before the next arrives, so hits are deterministic."""
    return Trace("t", [Request(str(i), 60.0 * i, len(p), 2, token_ids=p) for i, p in enumerate(prompts)])


def per_request_cached(prompts, cost_model, hybrid) -> list[int]:
    cached = []
    for n in range(1, len(prompts) + 1):
        result = simulate(sequential(prompts[:n]), cost_model, make_policy("fcfs"),
                          config=EngineConfig(block_size=BS, kv_capacity_tokens=200 * BS, hybrid=hybrid))
        cached.append(result.cached_prompt_tokens - sum(cached))
    return cached


def test_vllm_rule_keeps_the_last_prompt_block_and_the_junction(cost_model):
    doc = tokens(0, 3 * BS)
    questions = [tokens(10 + i, BS + 100) for i in range(3)]     # each prompt's last full block is its own
    prompts = [np.concatenate((doc, q)) for q in questions]
    dense = per_request_cached(prompts, cost_model, None)
    assert dense == [0, 3 * BS, 3 * BS]                          # attention KV alone would hit the document
    hybrid = per_request_cached(prompts, cost_model, HybridSimConfig(placement="vllm", state_blocks=1))
    # request 0 keeps its state at block 4 (inside its question); request 1 matches 3 blocks of KV
    # but no state there: it recomputes all and keeps the junction at 3, where request 2 resumes
    assert hybrid == [0, 0, 3 * BS]


def test_a_grid_of_every_block_matches_the_dense_hits_when_nothing_is_evicted(cost_model):
    trace = resolve_workload("prefix-groups:groups=3,prefix_tokens=1000,num_requests=24,rate=50", seed=0)
    config = dict(block_size=BS, kv_capacity_tokens=1000 * BS)
    dense = simulate(trace, cost_model, make_policy("fcfs"), config=EngineConfig(**config))
    grid = simulate(trace, cost_model, make_policy("fcfs"), config=EngineConfig(
        **config, hybrid=HybridSimConfig(placement="grid", grid_blocks=1, max_states=500, state_blocks=1)))
    assert grid.cached_prompt_tokens == dense.cached_prompt_tokens > 0


def test_states_take_their_reserve_of_kv_capacity_and_stay_within_the_budget(cost_model):
    trace = resolve_workload("long-doc-qa:num_requests=40,doc_tokens_min=600,doc_tokens_max=2000,questions_min=3,"
                             "questions_max=5,rate=20", seed=0)
    hybrid = HybridSimConfig(placement="dp", max_states=4, state_blocks=3, resolve_every=4, checkpoints=4)
    config = EngineConfig(block_size=BS, kv_capacity_tokens=100 * BS, hybrid=hybrid)
    sim = Simulator(trace, cost_model, make_policy("fcfs").make_order(), config=config)
    assert sim.kv.capacity_blocks == 100 - 1 - 4 * 3          # less vLLM's null block and the states' reserve
    while sim.next_admission() is not None:
        sim.apply(1)
        assert len(sim.states.registry) <= 4
    metrics = sim.result().metrics()
    assert metrics["dp_solves"] > 0 and 0 < metrics["peak_states"] <= 4 and metrics["states_evicted"] > 0
    assert metrics["cached_prompt_tokens"] > 0
    with pytest.raises(ValueError, match="no KV block is left"):
        EngineConfig(block_size=BS, kv_capacity_tokens=10 * BS, hybrid=hybrid).resolve(cost_model)


def test_cached_fraction_counts_only_resumable_blocks(cost_model):
    doc = tokens(0, 4 * BS)
    prompts = [np.concatenate((doc, tokens(10 + i, 2 * BS + 7))) for i in range(2)]
    trace = Trace("t", [Request(str(i), 0.0, len(p), 50, token_ids=p) for i, p in enumerate(prompts)])

    def cached_fraction(hybrid):
        sim = Simulator(trace, cost_model, make_policy("fcfs").make_order(),
                        config=EngineConfig(block_size=BS, kv_capacity_tokens=200 * BS, hybrid=hybrid))
        point = sim.next_admission()          # request 0 runs (admitted unasked), request 1 is asked
        return point.raw[FEATURE_INDEX["candidate_cached_fraction"]]

    assert cached_fraction(None) == pytest.approx(4 / 6)
    assert cached_fraction(HybridSimConfig(placement="vllm", state_blocks=1)) == 0.0       # no state at block 4
    assert cached_fraction(HybridSimConfig(placement="grid", grid_blocks=2, state_blocks=1)) == pytest.approx(4 / 6)


def test_anchors_resume_a_hit_where_no_state_is_kept_within_their_page_budget(cost_model):
    doc = tokens(0, 3 * BS)
    prompts = [np.concatenate((doc, tokens(10 + i, BS + 100))) for i in range(3)]

    def replay(anchor_pages):
        return HybridSimConfig(placement="vllm", state_blocks=1, max_states=0, anchor_pages=anchor_pages)

    assert per_request_cached(prompts, cost_model, HybridSimConfig(placement="vllm", state_blocks=1, max_states=0)) \
        == [0, 0, 0]                                             # no state kept: every hit recomputes
    assert per_request_cached(prompts, cost_model, replay(64)) == [0, 3 * BS, 3 * BS]
    # one page: request 0's last anchored page is its own question, so nothing is shared
    assert per_request_cached(prompts, cost_model, replay(1)) == [0, 0, 0]
    # two pages: the document's end survives, and the hit that uses it keeps it ahead of the next eviction
    assert per_request_cached(prompts, cost_model, replay(2)) == [0, 3 * BS, 3 * BS]


def test_state_registry_evicts_the_least_recently_used():
    registry = StateRegistry(max_states=2)
    for key, position in (("a", 1), ("b", 2), ("c", 3)):
        registry.keep(key, position)
    registry.touch("a")
    assert registry.enforce() == ["b"]
    registry.keep("d", 4)
    assert registry.enforce() == ["c"]
    assert registry.deepest(["a", "x", "y", "d"], 4) == 4 and registry.deepest(["a", "x", "y", "d"], 3) == 1
    assert registry.peak == 2 and len(registry) == 2
    with pytest.raises(ValueError):
        StateRegistry(-1)


def test_rooted_placement_learns_one_placement_per_prefix_family():
    from cache_core.hybrid.rooted_placement import RootedPlacement

    placement = RootedPlacement(horizon_blocks=16, budget=2, resolve_every=1, max_roots=2)
    for depth in (4, 4, 4):
        placement.observe("doc-a", depth)
    for depth in (9, 9):
        placement.observe("doc-b", depth)
    placement.observe(None, 5)                                    # no full block: no family
    assert placement.chosen("doc-a") == {4} and placement.chosen("doc-b") == {9}
    assert placement.chosen("unseen") == frozenset() and placement.all_chosen() == {4, 9}
    placement.observe("doc-c", 3)                                 # a third family forgets the oldest
    assert len(placement) == 2 and placement.chosen("doc-a") == frozenset()


def test_sim_compare_runs_a_hybrid_model_under_each_placement(capsys):
    import json

    from feather_cli.main import main

    workload = "long-doc-qa:num_requests=12,doc_tokens_min=600,doc_tokens_max=1500,questions_min=3,questions_max=4"
    assert main(["sim", "compare", "--workload", workload, "--policies", "fcfs", "--model", "tiny",
                 "--placements", "vllm,dp", "--max-states", "4", "--kv-tokens", "200000", "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert set(report["policies"]) == {"fcfs@vllm", "fcfs@dp"}
    assert all(m["peak_states"] <= 4 and m["cached_prompt_tokens"] > 0 for m in report["policies"].values())
    assert "1 attention + 3 GDN layers" in out
