"""``feather bench headroom``: the rule against its one-step playout improvements, paired per seed."""

import json

import pytest

from feather_cli.main import main

PREFIX_SHARING = ("prefix-groups:num_requests=32,groups=4,prefix_tokens=384,suffix_tokens_min=16,"
                  "suffix_tokens_max=96,output_tokens_min=16,output_tokens_max=48,rate=1000")
NO_SHARING = "no-sharing:num_requests=32,input_tokens_max=512,output_tokens_max=48,rate=1000"


@pytest.mark.slow
def test_headroom_pairs_the_playout_and_a_policy_with_the_rule(capsys):
    assert main(["bench", "headroom", "--profile", "vllm-cpu", "--seeds", "2", "--policies", "feather-rule",
                 "--workload", PREFIX_SHARING, "--workload", NO_SHARING, "--kv-capacity-tokens", "5760",
                 "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert "rule_playout_sampled" in out.splitlines()[2]                    # a column of the table
    assert report["profile"] == "vllm-cpu" and report["seeds"] == [10_001, 10_002] and report["elapsed_s"] > 0
    assert [row["workload"] for row in report["workloads"]] == [PREFIX_SHARING, NO_SHARING]
    for row in report["workloads"]:
        assert row["runs"] == 2
        # The rule paired with itself: exactly 1; the playout is a different policy.
        assert row["policy_over_rule_paired"] == {"ratio_mean": 1.0, "ratio_sem": 0.0, "runs_faster": 0,
                                                  "runs_slower": 0}
        assert row["policy_over_fcfs"] == pytest.approx(row["feather_rule_over_fcfs"])
    no_sharing = report["workloads"][1]
    assert no_sharing["rule_playout_over_rule_paired"]["ratio_mean"] > 1.005
    # Without foresight of output lengths it still beats the rule under KV pressure (no-sharing).
    assert no_sharing["rule_playout_sampled_over_rule_paired"]["ratio_mean"] > 1.005


def test_headroom_refuses_more_seeds_than_held_out(capsys):
    assert main(["bench", "headroom", "--profile", "vllm-cpu", "--seeds", "31"]) == 2
    assert "--seeds: between 1 and 30" in capsys.readouterr().err
