"""``feather placement eval`` and ``feather bench placement`` end to end."""

import json

import numpy as np
import pytest

from cache_core.hybrid.placement_eval import evaluate_placements
from feather_cli.main import main
from traces import shared_trace_path
from traces.workload import SHARED_TRACES


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def assert_dp_dominates(report):
    """The hindsight DP beats every static heuristic; the online replay (time-varying) may not."""
    dp = np.array(report["methods"]["dp"]["expected_recompute_tokens"])
    for name, method in report["methods"].items():
        recompute = np.array(method["expected_recompute_tokens"])
        assert len(method["states_stored"]) == len(report["budgets"])
        assert np.all(np.array(method["states_stored"]) <= report["budgets"]), name
        assert np.all(recompute <= report["mean_overlap_tokens"] + 1e-6), name
        if name != "dp_online":
            assert np.all(dp <= recompute + 1e-6), name
    assert np.all(np.diff(dp) <= 1e-6)


def test_eval_generator_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "frontier.png"
    code = main(["placement", "eval", "--workload", "multi-turn-chat:num_requests=60", "--budgets", "0,1,2,8,64",
                 "--block-size", "16", "--json", "--plot", str(plot)])
    assert code == 0
    report = last_json(capsys)
    assert report["budgets"] == [0, 1, 2, 8, 64]
    assert report["block_size_tokens"] == 16 and report["num_requests"] == 60
    assert set(report["methods"]) == {"dp", "dp_online", "every_16", "balanced", "sqrt", "dyadic", "end_of_prompt"}
    assert_dp_dominates(report)
    # Budget 0: nothing stored, everything matched is recomputed.
    assert report["methods"]["dp"]["expected_recompute_tokens"][0] == pytest.approx(report["mean_overlap_tokens"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_with_lru_cache_recomputes_no_more_than_matched(capsys):
    assert main(["placement", "eval", "--workload", "tool-agent:num_requests=40", "--cache-blocks", "64",
                 "--block-size", "32", "--budgets", "1,4", "--json"]) == 0
    report = last_json(capsys)
    assert report["cache_blocks"] == 64
    assert_dp_dominates(report)


@pytest.mark.skipif(shared_trace_path(SHARED_TRACES["mooncake"]) is None, reason="shared Mooncake trace absent")
def test_eval_mooncake_uses_its_block_size(capsys):
    assert main(["placement", "eval", "--workload", "mooncake", "--budgets", "1,16", "--json"]) == 0
    report = last_json(capsys)
    assert report["block_size_tokens"] == 512 and report["num_requests"] > 1000
    assert_dp_dominates(report)


def test_evaluate_placements_counts_states_and_gain():
    depths = np.array([0, 10, 10, 10, 20])
    report = evaluate_placements(depths, block_size=2, budgets=[0, 1, 2, 3])
    dp = report["methods"]["dp"]
    assert dp["states_stored"] == [0, 1, 2, 2]
    assert dp["expected_recompute_tokens"] == pytest.approx([2 * 50 / 5, 2 * 10 / 5, 0, 0])
    assert report["methods"]["end_of_prompt"]["states_stored"] == [0, 1, 1, 1]
    assert report["dp_gain_vs_best_heuristic_pct"][0] == 0


def test_online_replay_serves_each_chunk_with_the_previous_solve():
    # Stationary traffic: after the first chunk (no placement yet) every request hits a state.
    depths = np.array([5] * 8 + [3] * 8)
    report = evaluate_placements(depths, block_size=1, budgets=[2], decay=1.0, resolve_every=4)
    online = report["methods"]["dp_online"]
    assert online["states_stored"] == [2]
    # Chunk 1 (four 5s) recomputes 5 each; chunks 2 and 3 are served by {5}; chunk 4 (3s) by {3, 5}.
    assert online["expected_recompute_tokens"] == [pytest.approx((4 * 5 + 4 * 0 + 4 * 3 + 0) / 16)]


def test_bench_compares_with_oracle(capsys):
    assert main(["bench", "placement", "--positions", "120", "--budget", "8", "--repeats", "1",
                 "--oracle-budget", "4", "--json"]) == 0
    report = last_json(capsys)
    assert "oracle_ms_extrapolated" in report and "oracle_cpu_ms_extrapolated" in report
    assert "oracle_ms" not in report
    assert report["oracle_budget_timed"] == 4
    assert report["max_cost_rel_diff"] < 1e-9
    assert report["speedup_x"] > 0
    assert set(report["fast_ms_by_shape"]) == {"geometric", "zipf", "two_modes", "dirichlet_weighted"}


@pytest.mark.parametrize("argv, message", [
    (["placement", "eval", "--workload", "long-doc-qa", "--budgets", "1,x"], "comma-separated"),
    (["placement", "eval", "--workload", "long-doc-qa", "--budgets", "-1"], "non-negative"),
    (["placement", "eval", "--workload", "no-such-kind"], "unknown workload"),
    (["placement", "eval", "--workload", "long-doc-qa", "--block-size", "0"], "--block-size"),
    (["bench", "placement", "--positions", "0"], ">= 1"),
])
def test_user_errors_exit_2(argv, message, capsys):
    try:                                 # an argument argparse refuses exits; a bad input otherwise returns 2
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err
