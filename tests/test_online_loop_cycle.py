"""``feather serve loop``: collect a step log, refit, fine-tune, and judge before against after, live.

The fine-tune itself (Ray) is ``tests/test_trainer_resume.py``'s subject; here it is replaced by
a copy of the run's policy, so the cycle's other steps run for real on one engine, and a
policy the cycle did not change is reported as such (``decisions_changed`` 0).
"""

from __future__ import annotations

import shutil

import deploy_policies as policies
import pytest

pytestmark = pytest.mark.live

WORKLOAD = ("prefix-groups:num_requests=24,groups=4,prefix_tokens=256,suffix_tokens_min=16,suffix_tokens_max=64,"
            "output_tokens_min=8,output_tokens_max=24")


def test_one_cycle_reports_the_refit_and_the_policy_before_and_after(tmp_path, monkeypatch):
    from deploy.bench import loop as online_loop

    run = tmp_path / "run"
    run.mkdir()
    policies.constant_policy(run / "policy.onnx", 1)          # always ADD: every decision is logged
    tuned = []

    def copy_policy(run_dir, profile, output, *, time_budget_s):
        assert profile.is_file() and time_budget_s == 5
        output.mkdir()
        tuned.append(shutil.copy(run_dir / "policy.onnx", output / "policy.onnx"))
        return output / "policy.onnx"

    monkeypatch.setattr(online_loop, "fine_tune", copy_policy)
    report = online_loop.online_loop(str(run), output=str(tmp_path / "loop"), workloads={"prefix": WORKLOAD},
                                     rounds=1, collect_rounds=2, fine_tune_s=5, kv_cache_gib=0.25,
                                     online=False)
    assert tuned and report["policy_after"] == str(tuned[0])
    assert report["logged_steps"] > 0 and report["refit"]["held_out_steps"] >= 5
    assert 0 < report["refit"]["mape_after"] < 1 and 0 < report["refit"]["mape_before"]
    assert report["decisions_changed"] == 0.0                 # the same network on the same observations
    workload = report["workloads"]["prefix"]
    assert set(workload["sides"]) == {"vllm", "before", "after"}
    assert all(side["requests_lost"] == 0 for side in workload["sides"].values())
    assert workload["identical_outputs"] == 24
    assert workload["after_vs_before"]["per_round"] and workload["after_vs_vllm"]["per_round"]
    assert "online loop on" in online_loop.format_loop_report(report)
