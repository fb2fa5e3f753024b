"""How a trained policy is judged: the targets per workload and the validation score."""

import math

import numpy as np
import pytest

import traces
from feather_gym.policies import BASELINES, make_policy
from trainer.evaluate import (
    POLICY_LABEL,
    TARGET_TOLERANCE,
    TIE_TOLERANCE,
    Benchmark,
    fewer_within_slo,
    format_table,
    paired_ratio,
    paired_sign,
    paired_signs,
    scores_higher,
    slo_share,
    validation_score,
)
from trainer.train import beyond

WORKLOADS = ("prefix-groups:num_requests=120,groups=3,rate=100", "no-sharing:num_requests=120")


@pytest.fixture(scope="module")
def bench():
    return Benchmark(workloads=WORKLOADS, profile="cpu", seeds=(10_001,))


def test_targets_are_the_best_heuristic_or_near_fcfs(bench):
    sharing, control = WORKLOADS
    best = max((n for n in bench.baselines[sharing] if n != "group-label"), key=bench.baselines[sharing].get)
    at_best = bench.judge(sharing, bench.baselines[sharing][best])
    assert at_best["target"] == f">= best heuristic ({best})" and at_best["target_met"] and at_best["margin"] == 1.0
    assert not bench.judge(sharing, 0.99 * bench.baselines[sharing][best])["target_met"]
    fcfs = bench.baselines[control]["fcfs"]
    assert bench.judge(control, 0.981 * fcfs)["target_met"] and not bench.judge(control, 0.979 * fcfs)["target_met"]
    assert bench.judge(control, fcfs)["margin"] == pytest.approx(1 / 0.98)


def test_a_baseline_judged_as_the_trained_policy_scores_its_own_throughput(bench):
    evaluation = bench.evaluate(make_policy("fcfs"))
    for result in evaluation["workloads"]:
        assert result["throughput_tok_s"]["trained"] == result["throughput_tok_s"]["fcfs"]


def test_a_reference_runs_beside_the_policy_and_is_never_the_target(bench):
    """The warm-start clone is judged beside the trained policy: its own throughput, the
    trained one over it, and never the best heuristic the target names."""
    evaluation = bench.evaluate(make_policy("fcfs"), {"clone": make_policy("feather-rule")})
    for result in evaluation["workloads"]:
        throughput = result["throughput_tok_s"]
        assert throughput["clone"] == throughput["feather-rule"] and "clone" in result["load"]
        assert result["trained_over_reference"] == {"clone": throughput["trained"] / throughput["clone"]}
        assert "clone" not in result["target"]
    assert "clone" in format_table(evaluation)


def test_paired_ratio_compares_run_by_run():
    pair = paired_ratio([10.0, 20.0, 30.0], [10.0, 10.0, 40.0])
    assert pair["ratio_mean"] == pytest.approx((1 + 2 + 0.75) / 3)
    assert pair["ratio_sem"] == pytest.approx(np.std([1, 2, 0.75], ddof=1) / np.sqrt(3))
    assert (pair["runs_faster"], pair["runs_slower"]) == (1, 1)
    assert paired_ratio([5.0], [4.0]) == {"ratio_mean": 1.25, "ratio_sem": 0.0, "runs_faster": 1, "runs_slower": 0}


@pytest.fixture(scope="module")
def heavy_bench():
    """The CPU mix's prefix-heavy on three seeds: it overflows 5,760 KV tokens, so FCFS, which
    evicts the shared prefixes, is slower than the Feather rule on every seed."""
    from feather_gym.simulator import EngineConfig
    from traces.workload import ENGINE_SIZED_WORKLOADS

    return Benchmark(workloads=(ENGINE_SIZED_WORKLOADS["prefix-heavy"],), profile="vllm-cpu",
                     seeds=(10_001, 10_002, 10_003), engine=EngineConfig(kv_capacity_tokens=5760))


def test_the_reference_is_compared_on_the_same_runs(heavy_bench):
    """The paired ratio is taken seed by seed: the per-run throughputs of the two policies."""
    (heavy,) = heavy_bench.baselines
    trained, clone = make_policy("fcfs"), make_policy("feather-rule")
    result = heavy_bench.evaluate(trained, {"clone": clone})["workloads"][0]
    runs = heavy_bench.runs(heavy, trained)["throughput_tok_s"]
    expected = paired_ratio(runs, heavy_bench.runs(heavy, clone)["throughput_tok_s"])
    assert result["trained_over_reference_paired"] == {"clone": expected}
    assert result["trained_runs"] == runs.tolist()
    assert expected["runs_slower"] == 3 and expected["ratio_mean"] < 1


def test_paired_sign_counts_only_differences_beyond_the_tolerance_and_two_standard_errors():
    def pair(mean, sem):
        return {"ratio_mean": mean, "ratio_sem": sem}

    assert paired_sign(pair(1.01, 0.004)) == 1 and paired_sign(pair(0.99, 0.004)) == -1
    assert paired_sign(pair(1.01, 0.006)) == 0                   # within two standard errors
    assert paired_sign(pair(1 - TIE_TOLERANCE / 2, 0.0)) == 0    # within the tie tolerance


def test_paired_signs_pair_two_evaluations_of_one_benchmark(heavy_bench):
    """What keeps a validated checkpoint from trading one workload for another, and from replacing
    its start without a gain: FCFS is significantly slower than the rule it would replace, the
    rule significantly faster than FCFS, and a policy neither slower nor faster than itself."""
    fcfs, rule = (heavy_bench.evaluate(make_policy(name)) for name in ("fcfs", "feather-rule"))
    (heavy,) = heavy_bench.baselines
    assert paired_signs(fcfs, rule) == {heavy: -1}
    assert paired_signs(rule, fcfs) == {heavy: 1}
    assert paired_signs(rule, rule) == {heavy: 0}


def _within_slo_scaled(evaluation, factor):
    """``evaluation`` with the evaluated policy's share within the SLO times ``factor`` on every workload."""
    def scaled(result):
        figures = result["load"][POLICY_LABEL]
        return {**result, "load": {**result["load"],
                                   POLICY_LABEL: {**figures, "slo_met_fraction": factor * figures["slo_met_fraction"]}}}
    return {**evaluation, "workloads": [scaled(result) for result in evaluation["workloads"]]}


def test_fewer_within_slo_compares_the_mean_share_within_the_slo_over_the_workloads(heavy_bench):
    """What keeps a validated checkpoint from buying throughput with latency: the share of requests
    within the SLO, each workload's mean over its runs, averaged over the workloads."""
    rule = heavy_bench.evaluate(make_policy("feather-rule"))
    expected = np.mean([heavy_bench.runs(spec, make_policy("feather-rule"))["slo_met_fraction"].mean()
                        for spec in heavy_bench.baselines])
    assert slo_share(rule) == pytest.approx(expected) and 0 < slo_share(rule) <= 1
    assert not fewer_within_slo(rule, rule)
    lower = _within_slo_scaled(rule, 0.99)
    assert fewer_within_slo(lower, rule) and not fewer_within_slo(rule, lower)
    assert not fewer_within_slo(_within_slo_scaled(rule, 1 - TIE_TOLERANCE / 2), rule)   # within the tie tolerance


def test_beyond_a_reference_counts_only_differences_beyond_noise():
    def result(spec, mean, sem, runs=((1.0, 1.0),)):
        pair = {"ratio_mean": mean, "ratio_sem": sem, "runs_faster": 0, "runs_slower": 0}
        return {"workload": spec, "trained_over_reference": {"clone": mean},
                "trained_over_reference_paired": {"clone": pair}, "trained_runs": [run[0] for run in runs],
                "reference_runs": {"clone": [run[1] for run in runs]}}

    clone = beyond({"workloads": [result("learned", 1.01, 0.004), result("noise", 1.01, 0.006),
                                  result("lost", 0.99, 0.001), result("tie", 1 + TIE_TOLERANCE / 2, 0.0)]}, "clone")
    assert clone["better_on"] == ["learned"] and clone["worse_on"] == ["lost"]
    assert clone["ratio_by_workload"]["noise"] == 1.01 and clone["paired_by_workload"]["tie"]["ratio_sem"] == 0.0
    # Per load, every run of the load's workloads is paired; a workload at its own rate is "recorded".
    loads = beyond({"workloads": [result("a@load=0.9", 1.0, 0.1, ((11.0, 10.0), (9.0, 10.0))),
                                  result("b@load=0.9", 1.2, 0.0, ((12.0, 10.0),)), result("lost", 0.99, 0.001)]},
                   "clone")["by_load"]
    assert list(loads) == ["0.9", "recorded"]
    assert loads["0.9"]["ratio_mean"] == pytest.approx((1.1 + 0.9 + 1.2) / 3)
    assert (loads["0.9"]["runs_faster"], loads["0.9"]["runs_slower"]) == (2, 1)
    assert loads["0.9"]["better_on"] == ["b@load=0.9"] and loads["recorded"]["worse_on"] == ["lost"]


def test_by_load_sums_an_evaluation_up_per_load(bench):
    from trainer.evaluate import RECORDED_RATE, by_load

    loaded = Benchmark(workloads=(f"{WORKLOADS[1]}@load=1.3", f"{WORKLOADS[0]}@load=0.6", WORKLOADS[0]),
                       profile="cpu", seeds=(10_001, 10_002))
    evaluation = loaded.evaluate(make_policy("lpm"), {"clone": make_policy("lpm")})
    summary = by_load(evaluation)
    assert list(summary) == ["0.6", "1.3", RECORDED_RATE]                     # loads in order, then the own rate
    for load in summary.values():
        assert load["workloads"] == 1 and load["throughput_over_fcfs"]["trained"] == pytest.approx(
            load["throughput_over_fcfs"]["lpm"])
        assert load["best_heuristic_throughput_over_fcfs"] >= load["throughput_over_fcfs"]["fcfs"] == 1.0
        assert 0 <= load["slo_met_fraction"]["fcfs"] <= 1
        assert load["trained_over_reference_paired"]["clone"]["ratio_mean"] == 1.0   # the same policy
    assert "by load" in format_table(evaluation) and "over clone" in format_table(evaluation)


def test_validation_score_ranks_the_worst_workload_first_at_the_selection_tolerance(bench):
    """A workload within 1% of the best heuristic meets the target (``target_met`` is
    judged at the tie tolerance); once every workload meets it, the mean margin decides."""
    shared, control = WORKLOADS
    best = max(value for name, value in bench.baselines[shared].items() if name != "group-label")
    fcfs = bench.baselines[control]["fcfs"]

    def evaluation(shared_ratio, control_ratio):
        return {"workloads": [bench.judge(shared, shared_ratio * best), bench.judge(control, control_ratio * fcfs)]}

    just_within = evaluation(1 - TARGET_TOLERANCE / 2, 1.00)
    assert not just_within["workloads"][0]["target_met"]                 # below the tie tolerance ...
    assert validation_score(just_within)[0] == 1.0                       # ... but within the 1% tolerance
    # Within the target everywhere: the mean decides, so a gain on one workload may pay
    # for a loss within 1% on another.
    assert validation_score(evaluation(1 - TARGET_TOLERANCE / 2, 1.03)) > validation_score(evaluation(1.00, 1.00))
    # Beyond it on one workload, the worst decides whatever the mean.
    assert validation_score(evaluation(0.97, 1.30)) < validation_score(evaluation(0.985, 1.00)) \
        < validation_score(evaluation(1.00, 1.00))
    # No sharing: the target is 0.98 x FCFS itself, with no further tolerance.
    assert validation_score(evaluation(1.00, 0.975))[0] < 1.0 <= validation_score(evaluation(1.00, 0.981))[0]


def test_worst_margins_within_the_tie_tolerance_tie_and_the_mean_decides():
    start = (0.9874, 1.0010)
    assert not scores_higher((0.9874 + TIE_TOLERANCE / 2, 1.0008), start)   # a negligible gain on the worst
    assert scores_higher((0.9874 - TIE_TOLERANCE / 2, 1.0012), start)       # a negligible loss on it
    assert scores_higher((0.9874 + 2 * TIE_TOLERANCE, 0.99), start)
    assert not scores_higher((0.9874 - 2 * TIE_TOLERANCE, 1.05), start)
    assert scores_higher(start, (-math.inf, -math.inf))                      # the first validation is kept


def test_every_result_reports_its_load_regime(bench):
    evaluation = bench.evaluate(make_policy("fcfs"))
    for result in evaluation["workloads"]:
        assert set(result["load"]) == {*BASELINES, POLICY_LABEL}
        assert result["load"][POLICY_LABEL] == result["load"]["fcfs"]
        span = result["arrival_span_s"]
        assert span > 0
        for load in result["load"].values():
            assert load["makespan_s"] >= span                 # every request finishes after the last arrival
            assert 0 <= load["queue_delay_mean_s"] <= load["queue_delay_p99_s"] <= load["makespan_s"]
    table = format_table(evaluation)
    assert "load regime (s)" in table and "group-label" in table and "arrival span" in table


def test_a_trace_file_is_run_once_and_generators_once_per_seed(tmp_path):
    path = tmp_path / "recorded.jsonl"
    traces.write_trace(traces.resolve_workload(WORKLOADS[1], seed=3), path)
    spec = f"{path}@0.7-1"
    bench = Benchmark(workloads=(spec, WORKLOADS[1]), profile="cpu", seeds=(10_001, 10_002))
    runs = {result["workload"]: result["runs"] for result in bench.evaluate(make_policy("fcfs"))["workloads"]}
    assert runs == {spec: 1, WORKLOADS[1]: 2}


def test_sharing_is_judged_at_the_engines_block_size():
    """384-token prefixes share no 512-token block but three of vllm-cpu's 128-token ones: the
    workload is judged as prefix-sharing, against the best heuristic."""
    from traces.workload import ENGINE_SIZED_WORKLOADS

    spec = ENGINE_SIZED_WORKLOADS["prefix-sharing"]
    bench = Benchmark(workloads=(spec,), profile="vllm-cpu", seeds=(10_001,))
    assert bench.engine.block_size == 128 and bench.sharing_ratio[spec] > 0.05
    assert bench.judge(spec, 1.0)["target"].startswith(">= best heuristic")
