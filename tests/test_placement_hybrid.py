"""Hybrid-model placement evaluation: per-length placements, state/KV bytes, prefill time, baselines.

No trained model is needed: layouts come from config objects, prefill models from coefficients.
"""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_placement import assert_close, problems
from test_placement_cli import last_json

from cache_core.hybrid.layout import HybridCacheLayout
from cache_core.hybrid.placement import PlacementProblem, solve, solve_brute_force, solve_oracle
from cache_core.hybrid.placement_eval import evaluate_placements
from cache_core.hybrid.recompute_cost import PrefillTime
from feather_cli.main import main

#: A Qwen3-Next-style config: 3 Gated DeltaNet layers and 1 attention layer.
CONFIG = SimpleNamespace(
    layer_types=["linear_attention"] * 3 + ["full_attention"], hidden_size=128, num_attention_heads=2,
    num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4)
LAYOUT = HybridCacheLayout.from_hf_config(CONFIG, state_dtype="float32")   # fixed: the sizes below are in float32
PREFILL = PrefillTime(fixed_ms=5.0, ms_per_token=0.05, ms_per_token_squared=2e-5)


def truncated(problem: PlacementProblem, horizon: int) -> PlacementProblem | None:
    """The problem restricted to depths ``0..horizon`` (None when that has no mass or no block)."""
    p = problem.depth_probs[: horizon + 1]
    if horizon < 1 or p.sum() == 0:
        return None
    costs = None if problem.block_costs is None else problem.block_costs[:horizon]
    return PlacementProblem.from_counts(p, costs)


@settings(max_examples=150, deadline=None)
@given(problems(max_positions=9), st.integers(0, 10), st.integers(0, 12))
def test_per_length_backtrack_matches_brute_force_on_the_truncated_distribution(problem, budget, horizon):
    chosen = solve(problem, budget).checkpoints(budget, horizon)
    assert chosen.size <= budget and np.all(chosen <= horizon)
    sub = truncated(problem, min(horizon, problem.num_positions))
    if sub is None:
        assert chosen.size == 0
        return
    assert_close(sub.cost(chosen), solve_brute_force(sub, budget)[1])


@settings(max_examples=25, deadline=None)
@given(problems(max_positions=30), st.integers(0, 12))
def test_per_length_backtrack_matches_oracle_for_every_horizon(problem, budget):
    fast, oracle = solve(problem, budget), solve_oracle(problem, budget)
    for horizon in range(1, problem.num_positions + 1):
        sub = truncated(problem, horizon)
        if sub is not None:
            best = solve_oracle(sub, budget).costs[budget]
            assert_close(sub.cost(fast.checkpoints(budget, horizon)), best)
            assert_close(sub.cost(oracle.checkpoints(budget, horizon)), best)
    np.testing.assert_array_equal(fast.checkpoints(budget, 10**6), fast.checkpoints(budget))


def test_bad_horizon_is_rejected():
    with pytest.raises(ValueError, match="horizon"):
        solve(PlacementProblem(np.array([0.5, 0.5])), 1).checkpoints(1, -1)


def workload(seed: int = 0, num_requests: int = 300):
    """Depths (blocks) and prompt lengths (tokens) with no full-prompt hit: each prompt runs
    1..40 tokens past its match, so the TTFT estimate is exactly prefill.ms(resume, length)."""
    rng = np.random.default_rng(seed)
    depths = np.minimum(rng.geometric(0.05, num_requests), 120) * (rng.random(num_requests) < 0.8)
    return depths, depths * 16 + rng.integers(1, 41, num_requests)


def hybrid_report(prefill=PREFILL, budgets=(0, 1, 2, 4, 16)) -> dict:
    depths, prompts = workload()
    return evaluate_placements(depths, block_size=16, budgets=list(budgets), prompt_tokens=prompts,
                               layout=LAYOUT, prefill=prefill)


def test_baselines_recompute_the_budget_zero_amount_and_hold_the_right_bytes():
    report = hybrid_report()
    methods = report["methods"]
    assert {"no_cache", "kv_only", "dp_per_length", "dp_time"} <= set(methods)
    zero = methods["dp"]["expected_recompute_tokens"][0]
    assert zero == pytest.approx(report["mean_overlap_tokens"])
    kv = report["mean_overlap_tokens"] * LAYOUT.kv_bytes_per_token
    for name, holds_kv in (("kv_only", True), ("no_cache", False)):
        row = methods[name]
        assert row["expected_recompute_tokens"] == pytest.approx([zero] * 5)
        assert row["ttft_est_ms"] == pytest.approx([methods["dp"]["ttft_est_ms"][0]] * 5)
        assert row["states_stored"] == [0] * 5 and row["state_bytes"] == [0] * 5
        assert row["kv_bytes"] == pytest.approx([kv if holds_kv else 0.0] * 5)
    assert report["layout"] == LAYOUT.as_dict() and report["prefill"] == PREFILL.to_dict()


def test_state_bytes_are_states_times_the_layout_checkpoint():
    report = hybrid_report()
    assert LAYOUT.state_bytes == 3 * (4 * 64 * 64 * 4 + (2 * 2 * 64 + 4 * 64) * 3 * 2)
    for name, row in report["methods"].items():
        assert row["state_bytes"] == [s * LAYOUT.state_bytes for s in row["states_stored"]], name
        assert np.all(np.array(row["states_stored"]) <= report["budgets"]), name


def test_linear_prefill_ttft_is_monotone_in_recomputed_tokens():
    """With T linear (c = 0) and no full-prompt hit, TTFT = a + b (mean prompt - mean overlap +
    recompute) exactly, so fewer recomputed tokens always means a lower TTFT estimate."""
    linear = PrefillTime(fixed_ms=3.0, ms_per_token=0.1, ms_per_token_squared=0.0)
    report = hybrid_report(linear)
    recompute = np.concatenate([m["expected_recompute_tokens"] for m in report["methods"].values()])
    ttft = np.concatenate([m["ttft_est_ms"] for m in report["methods"].values()])
    expected = 3.0 + 0.1 * (report["mean_prompt_tokens"] - report["mean_overlap_tokens"] + recompute)
    np.testing.assert_allclose(ttft, expected, rtol=1e-9)
    order = np.argsort(recompute, kind="stable")
    assert np.all(np.diff(ttft[order]) >= -1e-9)


def test_time_optimal_dp_has_the_lowest_ttft_of_static_placements():
    report = hybrid_report()
    methods = report["methods"]
    dp_time = np.array(methods["dp_time"]["ttft_est_ms"])
    for name in ("dp", "every_16", "balanced", "sqrt", "dyadic", "end_of_prompt", "kv_only"):
        assert np.all(dp_time <= np.array(methods[name]["ttft_est_ms"]) + 1e-9), name
    # Per request: TTFT never rises when resuming deeper.
    lengths = np.full(50, 2000)
    assert np.all(np.diff(PREFILL.ms(np.arange(0, 2000, 40), lengths)) <= 0)


def test_per_length_placement_serves_short_requests_within_their_length():
    # Budget 1: the global DP keeps block 10 (3 requests); the two short prompts (2 blocks long)
    # get their own placement {2} when re-derived for their length, so nothing is recomputed.
    depths = np.array([2, 2, 10, 10, 10])
    prompts = np.array([40, 40, 200, 200, 200])
    report = evaluate_placements(depths, block_size=16, budgets=[1], prompt_tokens=prompts)
    assert report["methods"]["dp"]["expected_recompute_tokens"] == [pytest.approx(2 * 2 * 16 / 5)]
    assert report["methods"]["dp_per_length"]["expected_recompute_tokens"] == [0.0]
    assert report["methods"]["dp_per_length"]["states_stored"] == [1]
    assert "state_bytes" not in report["methods"]["dp"] and "ttft_est_ms" not in report["methods"]["dp"]


def test_prefill_needs_prompt_lengths_and_lengths_must_cover_depths():
    with pytest.raises(ValueError, match="prompt_tokens"):
        evaluate_placements([1, 2], block_size=16, budgets=[1], prefill=PREFILL)
    with pytest.raises(ValueError, match="prompt_tokens"):
        evaluate_placements([1, 2], block_size=16, budgets=[1], prompt_tokens=[16, 31])


def test_prefill_time_fit_recovers_known_coefficients():
    lengths = np.array([128, 256, 512, 1024, 2048, 4096])
    points = np.stack([lengths, PREFILL.ms(0, lengths)], axis=1)
    fitted = PrefillTime.fit(points)
    np.testing.assert_allclose(list(fitted.to_dict().values()), list(PREFILL.to_dict().values()), rtol=1e-6)
    # Noisy decreasing data cannot give negative coefficients.
    assert PrefillTime.fit([(100, 10.0), (200, 9.0), (400, 8.0)]).ms_per_token >= 0


def test_prefill_time_model():
    p = PREFILL
    assert p.ms(100, 100) == 0 and p.ms(200, 100) == 0
    assert p.ms(100, 300) == pytest.approx(5.0 + 0.05 * 200 + 2e-5 * (300**2 - 100**2))
    w = p.block_costs(16, 10)
    assert w.shape == (10,) and np.all(np.diff(w) > 0)
    assert w.sum() == pytest.approx(p.ms(0, 160) - p.fixed_ms)
    assert w[3:7].sum() == pytest.approx(p.ms(48, 112) - p.fixed_ms)
    assert PrefillTime.from_dict({**p.to_dict(), "points": []}) == p
    with pytest.raises(ValueError, match="non-negative"):
        PrefillTime(1.0, -0.1, 0.0)
    with pytest.raises(ValueError, match="per-token"):
        PrefillTime(1.0, 0.0, 0.0).block_costs(16, 4)


@pytest.fixture
def model_dir(tmp_path):
    """A folder with only a Qwen3-Next config.json: enough for the layout."""
    from transformers import Qwen3NextConfig

    folder = tmp_path / "model"
    Qwen3NextConfig(**vars(CONFIG), num_hidden_layers=4, vocab_size=512).save_pretrained(folder)
    return folder


def test_eval_cli_with_layout_and_prefill_profile(tmp_path, capsys, model_dir):
    profile = tmp_path / "prefill.json"
    profile.write_text(json.dumps({**PREFILL.to_dict(), "backend": "torch"}))
    plot = tmp_path / "frontier.png"
    assert main(["placement", "eval", "--workload", "multi-turn-chat:num_requests=60", "--budgets", "0,1,4,16",
                 "--model", str(model_dir), "--prefill-profile", str(profile), "--plot", str(plot), "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["layout"] == HybridCacheLayout.from_hf_config(CONFIG).as_dict()   # this machine's state dtype
    assert report["model"] == str(model_dir)
    assert {"dp", "dp_online", "dp_per_length", "dp_time", "kv_only", "no_cache"} <= set(report["methods"])
    for name, row in report["methods"].items():
        assert len(row["ttft_est_ms"]) == len(row["state_bytes"]) == len(row["kv_bytes"]) == 4, name
        assert row["expected_recompute_tokens"][0] == pytest.approx(report["mean_overlap_tokens"]), name
    assert "estimated time to first token" in out and "recurrent state MiB" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_cli_missing_hybrid_model_is_a_clear_error(tmp_path, capsys, monkeypatch):
    import feather_gym.hybrid.model as hybrid_model

    monkeypatch.setattr(hybrid_model, "hybrid_dir", lambda kind="trained": tmp_path / "absent")
    assert main(["placement", "eval", "--workload", "multi-turn-chat:num_requests=10", "--model", "hybrid"]) == 2
    assert "feather hybrid build" in capsys.readouterr().err


def test_profile_prefill_cli_writes_a_profile_eval_reads(tmp_path, capsys, monkeypatch, model_dir):
    from feather_gym.costmodel import prefill_profiler

    calls = []

    def fake_profile(model, lengths, dtype, *, repeats, threads):
        calls.append((model, lengths, dtype, repeats, threads))
        return [(n, PREFILL.ms(0, n)) for n in lengths]

    monkeypatch.setattr(prefill_profiler, "profile_torch", fake_profile)
    out = tmp_path / "prefill.json"
    assert main(["profile", "prefill", "--model", str(model_dir), "--lengths", "128,512,2048",
                 "--out", str(out), "--json"]) == 0
    assert calls == [(str(model_dir), [128, 512, 2048], "bfloat16", 3, 1)]
    report = last_json(capsys)
    assert report["backend"] == "torch" and len(report["points"]) == 3
    from feather_gym.hybrid.placement_inputs import load_prefill

    fitted = load_prefill(str(out))
    assert fitted.ms(0, 1000) == pytest.approx(PREFILL.ms(0, 1000), rel=1e-6)
