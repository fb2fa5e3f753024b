"""How a trained policy is judged: the targets per workload and the validation score."""

import pytest

from feather_gym.policies import make_policy
from trainer.evaluate import Benchmark, validation_score

WORKLOADS = ("prefix-groups:num_requests=120,groups=3,rate=100", "no-sharing:num_requests=120")


@pytest.fixture(scope="module")
def bench():
    return Benchmark(workloads=WORKLOADS, profile="cpu", seeds=(10_001,))


def test_targets_follow_the_issue(bench):
    sharing, control = WORKLOADS
    best = max((n for n in bench.baselines[sharing] if n != "oracle"), key=bench.baselines[sharing].get)
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


def test_validation_score_ranks_the_worst_workload_first():
    def evaluation(*margins):
        return {"workloads": [{"margin": m} for m in margins]}

    assert validation_score(evaluation(0.95, 1.30)) < validation_score(evaluation(0.97, 1.00))
    # Once every target is met the worst margin is capped and the mean decides.
    assert validation_score(evaluation(1.00, 1.30)) > validation_score(evaluation(1.10, 1.10))
