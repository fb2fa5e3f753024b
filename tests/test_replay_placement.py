"""SuffixReplay as a placement (cache_core/hybrid/replay_placement.py): anchor spreading, resume choice,
the four configurations at equal bytes, the replay eval's storage comparison, and the
``feather placement eval --replay`` path. No model is run: layouts come from config objects."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_placement_hybrid import CONFIG, LAYOUT, PREFILL, model_dir  # noqa: F401 (fixture)

from cache_core.hybrid.placement import PlacementProblem, resume_positions, solve
from cache_core.hybrid.placement_eval import evaluate_placements
from cache_core.hybrid.recompute_cost import PrefillTime
from cache_core.hybrid.replay_placement import (
    ReplayCost,
    anchor_entry_bytes,
    compare_at_equal_bytes,
    dp_allocations,
    hit_tree_copies,
    resume_with_anchors,
    spread_anchors,
    storage_on_workload,
)
from feather_cli.main import main

S = LAYOUT.state_bytes
BLOCK = 16
BUDGETS = [0, 1, 2, 3, 5, 8, 40]


def branching(seed: int, num_requests: int = 120):
    """Depths clustered at a few shared-prefix ends (blocks) plus spread ones; prompts cover them."""
    rng = np.random.default_rng(seed)
    ends = rng.integers(1, 40, 4)
    depths = np.where(rng.random(num_requests) < 0.6, rng.choice(ends, num_requests), rng.integers(0, 40, num_requests))
    return depths, depths * BLOCK + rng.integers(1, 60, num_requests)


def replay_cost(entry_bytes: int, rebuild_ms: float = 2.0, kl: float | None = 1e-3) -> ReplayCost:
    return ReplayCost(method="uniform", replay_tokens=4, anchored_layers=(0, 1, 2), entry_bytes=entry_bytes,
                      rebuild_ms=rebuild_ms, kl_nats=kl, ppl_ratio=None if kl is None else 1.01)


def compare(depths, prompts, replay, *, prefill=PREFILL, budgets=BUDGETS, tree=None):
    return compare_at_equal_bytes(depths, block_size=BLOCK, budgets=budgets, state_bytes=S, replay=replay,
                                  prompt_tokens=prompts, prefill=prefill, **dict(zip(("family", "copies"), tree or ())))


def random_tree(depths, seed: int):
    """Three families, each depth held by 1-3 nodes of a family whose requests reach it."""
    rng = np.random.default_rng(seed)
    family = rng.integers(0, 3, depths.size)
    reach = np.array([depths[family == f].max(initial=0) for f in range(3)])
    copies = rng.integers(1, 4, (3, max(int(depths.max()), 1))) * (np.arange(1, depths.max() + 1) <= reach[:, None])
    return family, copies


@pytest.mark.parametrize("count", [0, 1, 3, 7, 24, 25, 100])
def test_spread_anchors_are_evenly_spaced_distinct_depths_and_every_one_when_they_can(count):
    anchors = spread_anchors(25, count)
    assert anchors.size == min(count, 25) and np.all(np.diff(anchors) > 0)
    assert anchors.min(initial=1) >= 1 and anchors.max(initial=25) <= 25
    if 0 < count:
        assert anchors[-1] == 25 and np.diff(anchors, prepend=0).max() <= -(-25 // count)   # the deepest included


def test_resume_takes_the_anchor_only_when_it_is_cheaper():
    depths, prompts = np.array([0, 4, 6, 6, 10]), np.array([5, 70, 100, 200, 200])
    at_exact, at_anchor = resume_positions(np.array([4]), depths), resume_positions(np.array([5, 6]), depths)
    resume, replayed = resume_with_anchors(at_exact, at_anchor, block_size=BLOCK)
    assert resume.tolist() == [0, 4, 6, 6, 6] and replayed.tolist() == [False, False, True, True, True]
    # A rebuild dearer than recomputing two blocks: every request keeps its exact state.
    slow = resume_with_anchors(at_exact, at_anchor, block_size=BLOCK, prompt_tokens=prompts, prefill=PREFILL,
                               rebuild_ms=1e6)
    assert slow[0].tolist() == [0, 4, 4, 4, 4] and not slow[1].any()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("entry", [S // 40, S // 7, S // 2])
def test_path_bytes_never_exceed_the_budget_and_are_counted_per_state_and_anchor(seed, entry):
    depths, prompts = branching(seed)
    report = compare(depths, prompts, replay_cost(entry))
    n = report["horizon_blocks"]
    assert report["budgets_bytes"] == [b * S for b in BUDGETS] and report["accounting"] == "path"
    for name, row in report["configs"].items():
        total = np.array(row["total_bytes"])
        assert np.all(total <= report["budgets_bytes"]), name
        assert row["state_bytes"] == [s * S for s in row["states_stored"]], name
        assert row["anchor_bytes"] == [a * entry for a in row["anchor_copies"]], name
        assert all(c <= a for c, a in zip(row["anchor_copies"], row["anchor_entries"])), name   # not on exact states
        np.testing.assert_allclose(row["bytes_per_cached_token"], total / (n * BLOCK))
    assert report["configs"]["dp"]["anchor_entries"] == report["configs"]["align_grid"]["anchor_entries"] == [0] * 7
    assert report["configs"]["replay"]["states_stored"] == [0] * 7
    assert report["configs"]["dp"]["states_stored"] == [min(b, len(np.unique(depths[depths > 0]))) for b in BUDGETS]
    grid = report["configs"]["align_grid"]["states_stored"]
    assert all(g <= b for g, b in zip(grid, BUDGETS)) and grid[-1] == n          # budget 40 >= N: every block


@pytest.mark.parametrize("seed", range(4))
def test_tree_bytes_count_every_copy_and_never_exceed_the_budget(seed):
    depths, prompts = branching(seed)
    family, copies = random_tree(depths, seed)
    entry = S // 9
    report = compare(depths, prompts, replay_cost(entry), tree=(family, copies))
    assert report["accounting"] == "tree" and report["cached_pages"] == copies.sum()
    for name, row in report["configs"].items():
        assert np.all(np.array(row["total_bytes"]) <= report["budgets_bytes"]), name
        assert row["state_bytes"] == [c * S for c in row["state_copies"]], name
        assert row["anchor_bytes"] == [c * entry for c in row["anchor_copies"]], name
        np.testing.assert_allclose(row["bytes_per_cached_token"], np.array(row["total_bytes"]) / (copies.sum() * BLOCK))
    with pytest.raises(ValueError, match="copies"):
        compare(depths, prompts, replay_cost(entry), tree=(family, copies[:, :-1]))


def test_two_copies_of_every_node_cost_twice_the_bytes_for_the_same_placements():
    depths, prompts = branching(4)
    path = compare(depths, prompts, replay_cost(S // 9), budgets=[1, 2, 4, 8])
    doubled = compare(depths, prompts, replay_cost(S // 9), budgets=[2, 4, 8, 16],
                      tree=(np.zeros(depths.size, dtype=np.int64), np.full((1, depths.max()), 2)))
    for name, row in path["configs"].items():
        twin = doubled["configs"][name]
        assert twin["expected_recompute_tokens"] == row["expected_recompute_tokens"], name
        assert twin["total_bytes"] == [2 * b for b in row["total_bytes"]], name


def test_dp_allocations_per_family_are_each_familys_dp_and_cut_recompute_at_every_step():
    depths = np.array([5, 5, 5, 2, 9, 9, 3, 3, 3, 3])
    family = np.array([0, 0, 0, 0, 0, 0, 1, 1, 1, 1])
    copies = np.ones((2, 9), dtype=np.int64)
    sequence = dp_allocations(depths, family, copies, 10)
    recompute = [(depths - a["at_exact"]).sum() for a in sequence]
    assert recompute[0] == depths.sum() and recompute[-1] == 0 and np.all(np.diff(recompute) < 0)
    assert [a["bytes"] for a in sequence] == [10 * a["copies"] for a in sequence]
    # First the state that removes the most: family 0's depth 5 (3 x 5 + 2 x 5 blocks, against 4 x 3 in family 1).
    assert sequence[1]["placements"][0].tolist() == [5] and sequence[1]["placements"][1].size == 0
    assert sequence[-1]["placements"][0].tolist() == [2, 5, 9]
    # One family, one copy per depth: the DP's budgets in order.
    single = dp_allocations(depths, np.zeros(10, dtype=np.int64), np.ones((1, 9), dtype=np.int64), 1)
    assert [a["states"] for a in single] == list(range(len(np.unique(depths)) + 1))


def test_a_workload_without_hits_stores_nothing_useful_and_recomputes_nothing():
    depths, prompts = np.zeros(5, dtype=np.int64), np.full(5, 100)
    report = compare(depths, prompts, replay_cost(S // 9), budgets=[0, 2],
                     tree=hit_tree_copies([[i] for i in range(5)], depths))
    assert report["cached_pages"] == 0
    for name, row in report["configs"].items():
        assert row["total_bytes"] == [0, 0] and row["expected_recompute_tokens"] == [0.0, 0.0], name
        assert row["bytes_per_cached_token"] == [0.0, 0.0] and row["replay_hit_fraction"] == [0.0, 0.0], name


def test_hit_tree_copies_count_distinct_pages_on_matched_paths_per_family():
    # Families 1.. and 9..; family 1 branches after its first page; the last request has no full page.
    digests = [[1, 2, 3], [1, 2, 4], [1, 5, 6], [9, 9, 9], [1, 5, 7], [9, 9, 8], []]
    depths = np.array([0, 2, 1, 0, 2, 2, 0])
    family, copies = hit_tree_copies(digests, depths)
    assert family.tolist() == [0, 0, 0, 1, 0, 1, 2]
    assert copies.tolist() == [[1, 2], [1, 1], [0, 0]]      # family 1: {1} then {2, 5}; family 9: {9}, {9}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("prefill", [PREFILL, None])
@pytest.mark.parametrize("tree", [False, True])
def test_the_composition_is_never_worse_than_dp_or_replay_at_equal_bytes(seed, prefill, tree):
    depths, prompts = branching(seed)
    configs = compare(depths, prompts, replay_cost(S // 9), prefill=prefill,
                      tree=random_tree(depths, seed) if tree else None)["configs"]
    key = "ttft_est_ms" if prefill else "expected_recompute_tokens"
    both = np.array(configs["dp_replay"][key])
    for part in ("dp", "replay"):
        assert np.all(both <= np.array(configs[part][key]) + 1e-9), part
    if not tree:      # one path: the DP dominates the fixed grid at the same bytes, in recomputed tokens
        assert np.all(np.array(configs["dp"]["expected_recompute_tokens"])
                      <= np.array(configs["align_grid"]["expected_recompute_tokens"]) + 1e-9)


@pytest.mark.parametrize("tree", [False, True])
def test_with_no_affordable_anchor_the_composition_is_the_dp(tree):
    depths, prompts = branching(1)
    report = compare(depths, prompts, replay_cost(max(BUDGETS) * S + 1), tree=random_tree(depths, 1) if tree else None)
    configs = report["configs"]
    assert configs["dp_replay"] == configs["dp"]
    assert configs["replay"]["anchor_entries"] == [0] * 7
    assert configs["replay"]["expected_recompute_tokens"] == pytest.approx([depths.mean() * BLOCK] * 7)


def test_with_anchors_on_every_boundary_every_hit_resumes_at_its_depth():
    depths, prompts = branching(2)
    report = compare(depths, prompts, replay_cost(1, rebuild_ms=0.0), budgets=[1, 4])
    replay, both = report["configs"]["replay"], report["configs"]["dp_replay"]
    assert replay["anchor_entries"] == [report["horizon_blocks"]] * 2
    assert replay["expected_recompute_tokens"] == [0.0, 0.0]
    assert replay["replay_hit_fraction"] == pytest.approx([np.mean(depths > 0)] * 2)
    np.testing.assert_allclose(replay["expected_kl_nats"], np.array(replay["replay_hit_fraction"]) * 1e-3)
    # Exact states take the hits at their own depths; everything else is replayed, nothing recomputed.
    exact = solve(PlacementProblem.from_depths(depths), 4).checkpoints(both["states_stored"][1])
    assert both["expected_recompute_tokens"][1] == 0.0
    assert both["replay_hit_fraction"][1] == pytest.approx(np.mean((depths > 0) & ~np.isin(depths, exact)))


def test_exact_states_take_the_mass_and_anchors_the_rest():
    """Two depths carry almost all the mass: at 3 states' bytes the composition keeps exact states
    at both and spends the third state's bytes on anchors, which serve the two stray depths."""
    depths = np.array([10] * 50 + [30] * 50 + [17, 23])
    prompts = depths * BLOCK + 8
    report = compare(depths, prompts, replay_cost(S // 40, rebuild_ms=1.0), budgets=[3])
    both = report["configs"]["dp_replay"]
    assert both["states_stored"] == [2] and both["anchor_entries"][0] > 0
    assert both["replay_hit_fraction"][0] == pytest.approx(2 / 102)
    assert both["ttft_est_ms"][0] < report["configs"]["replay"]["ttft_est_ms"][0]


def fake_replay_report(dtype: str = "bfloat16") -> dict:
    """The keys of a ``feather replay eval --json`` report that ReplayCost reads."""
    rows = [(m, r, 0.01 * r) for m in ("uniform", "layerwise") for r in (4, 16)]
    return {"anchor_dtype": dtype, "gdn_layers": [0, 1, 2], "layerwise_anchored_layers": [2],
            "timing": {"rebuild": [{"method": m, "replay_tokens": r, "rebuild_s": s} for m, r, s in rows]},
            "quality": [{"prefix_tokens": p, "method": m, "replay_tokens": r, "kl_nats_mean": s / p,
                         "ppl_ratio": 1 + s} for m, r, s in rows for p in (128, 256)]}


def test_replay_cost_reads_the_report_and_counts_bytes_as_the_anchor_store():
    cost = ReplayCost.from_replay_report(fake_replay_report(), method="uniform", replay_tokens=16,
                                         hidden_size=CONFIG.hidden_size)
    assert cost.entry_bytes == 16 * CONFIG.hidden_size * 2 * 3 == anchor_entry_bytes(
        hidden_size=CONFIG.hidden_size, anchored_layers=[0, 1, 2], replay_tokens=16)
    assert cost.rebuild_ms == pytest.approx(160.0) and cost.quality_prefix_tokens == 256
    assert cost.kl_nats == pytest.approx(0.16 / 256)
    layerwise = ReplayCost.from_replay_report(fake_replay_report("float32"), method="layerwise", replay_tokens=4,
                                              hidden_size=CONFIG.hidden_size)
    assert layerwise.entry_bytes == 4 * CONFIG.hidden_size * 4 and layerwise.anchored_layers == (2,)
    with pytest.raises(ValueError, match="R = 64"):
        ReplayCost.from_replay_report(fake_replay_report(), replay_tokens=64, hidden_size=8)
    with pytest.raises(ValueError, match="keep anchors"):
        ReplayCost.from_replay_report(fake_replay_report(), method="suffix", hidden_size=8)


def test_evaluate_placements_adds_equal_bytes_and_its_dp_is_the_reports_dp():
    depths, prompts = branching(3)
    report = evaluate_placements(depths, block_size=BLOCK, budgets=BUDGETS, prompt_tokens=prompts, layout=LAYOUT,
                                 prefill=PREFILL, replay=replay_cost(S // 9))
    dp = report["equal_bytes"]["configs"]["dp"]
    assert dp["expected_recompute_tokens"] == pytest.approx(report["methods"]["dp"]["expected_recompute_tokens"])
    assert dp["ttft_est_ms"] == pytest.approx(report["methods"]["dp"]["ttft_est_ms"])
    with pytest.raises(ValueError, match="layout"):
        evaluate_placements(depths, block_size=BLOCK, budgets=[1], replay=replay_cost(10))


def test_storage_on_workload_compares_anchors_with_grids_and_the_dp_at_equal_bytes():
    depths = np.array([0, 4, 4, 40, 40, 40, 65])           # pages of 256 tokens
    out = storage_on_workload(depths, page_tokens=256, state_bytes=1000, bytes_per_token=[0.0, 1000 / 8192, 100.0])
    assert out["horizon_blocks"] == 65 and out["replay_every_page_recompute_tokens"] == 0.0
    assert out["checkpoint_every_256_recompute_tokens"] == 0.0
    grid = np.array([0, 4, 4, 40 - 32, 40 - 32, 40 - 32, 65 - 64]) * 256
    assert out["checkpoint_every_8192_recompute_tokens"] == pytest.approx(grid.mean())
    none, as_grid, rich = out["dp_at_equal_bytes"]
    assert none == {"states": 0, "state_copies": 0, "expected_recompute_tokens": pytest.approx(depths.mean() * 256)}
    assert as_grid["states"] == 65 * 256 // 8192 and as_grid["expected_recompute_tokens"] <= grid.mean()
    assert rich["states"] == 3 and rich["expected_recompute_tokens"] == 0.0          # a state at 4, 40 and 65
    # Two copies of every page: the same bytes per cached token buy the same depths.
    doubled = storage_on_workload(depths, page_tokens=256, state_bytes=1000, bytes_per_token=[1000 / 8192],
                                  family=np.zeros(7, dtype=np.int64), copies=np.full((1, 65), 2))
    assert doubled["cached_pages"] == 130 and doubled["dp_at_equal_bytes"][0]["states"] == as_grid["states"]
    assert doubled["dp_at_equal_bytes"][0]["state_copies"] == 2 * as_grid["states"]


def test_placement_eval_cli_with_replay(tmp_path, capsys, model_dir):  # noqa: F811
    profile, replay = tmp_path / "prefill.json", tmp_path / "replay.out"
    profile.write_text(json.dumps(PREFILL.to_dict()))
    replay.write_text("replay eval tables...\n" + json.dumps(fake_replay_report()) + "\n")
    assert main(["placement", "eval", "--workload", "tool-agent:num_requests=40", "--block-size", "16",
                 "--budgets", "0,1,4", "--model", str(model_dir), "--prefill-profile", str(profile),
                 "--replay", str(replay), "--replay-tokens", "4", "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    section = report["equal_bytes"]
    assert set(section["configs"]) == {"align_grid", "dp", "replay", "dp_replay"}
    assert section["replay"]["entry_bytes"] == 4 * CONFIG.hidden_size * 2 * 3
    assert "SuffixReplay at equal bytes" in out and "replayed state" in out
    assert main(["placement", "eval", "--workload", "tool-agent:num_requests=5", "--replay", str(replay)]) == 2
    assert "--replay needs --model" in capsys.readouterr().err


def test_ttft_computes_at_least_the_last_prompt_token():
    from cache_core.hybrid.replay_placement import ttft_ms

    linear = PrefillTime(fixed_ms=3.0, ms_per_token=0.1, ms_per_token_squared=0.0)
    np.testing.assert_allclose(ttft_ms(linear, np.array([2, 4]), block_size=16, prompt_tokens=np.array([100, 64])),
                               [3.0 + 0.1 * 68, 3.0 + 0.1 * 1])
