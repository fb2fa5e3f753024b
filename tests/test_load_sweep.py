"""Load as a workload parameter (traces.rate, feather_gym.load) and ``feather sim sweep``."""

from __future__ import annotations

import json

import numpy as np
import pytest

SPEC = "prefix-groups:num_requests=80,groups=4,prefix_tokens=512,output_tokens_min=8,output_tokens_max=64,rate=20"


def trace():
    from traces import resolve_workload

    return resolve_workload(SPEC, seed=0)


def h200():
    from feather_gym.costmodel import load_cost_model

    return load_cost_model("h200")


def test_at_rate_keeps_the_requests_and_divides_every_gap():
    from traces.rate import at_rate

    source = trace()
    fast = at_rate(source, 4.0)
    assert [r.request_id for r in fast] == [r.request_id for r in source]
    assert [r.input_len for r in fast] == [r.input_len for r in source]
    gaps, fast_gaps = np.diff([r.arrival_s for r in source]), np.diff([r.arrival_s for r in fast])
    np.testing.assert_allclose(fast_gaps, gaps / 4.0)
    assert fast[0].arrival_s == 0.0
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="rate factor"):
            at_rate(source, bad)


@pytest.mark.parametrize(("spec", "expected"), [
    ("mooncake@load=0.9", ("mooncake", 0.9)), ("mooncake@0.7-1@load=1.1", ("mooncake@0.7-1", 1.1)),
    ("prefix-groups:groups=8", ("prefix-groups:groups=8", None))])
def test_split_load(spec, expected):
    from feather_gym.load import split_load

    assert split_load(spec) == expected


@pytest.mark.parametrize("spec", ["mooncake@load=0", "mooncake@load=-1", "mooncake@load=fast"])
def test_split_load_refuses_what_is_not_a_positive_load(spec):
    from feather_gym.load import split_load

    with pytest.raises(ValueError, match="load"):
        split_load(spec)


def test_fcfs_sustains_below_its_capacity_and_not_well_above_it():
    from feather_gym.load import at_load, find_capacity, sustains
    from feather_gym.policies import make_policy
    from feather_gym.simulator import simulate

    source, cost_model = trace(), h200()
    capacity = find_capacity(source, cost_model)
    assert capacity.requests_per_s == pytest.approx(len(source) * capacity.rate_factor / source.duration_s)

    def run(load):
        return simulate(at_load(source, capacity, load), cost_model, make_policy("fcfs"))

    assert sustains(run(0.9)) and sustains(run(1.0))
    overloaded = run(3.0)
    assert not sustains(overloaded)
    assert overloaded.metrics()["queue_delay_p99_s"] > run(0.5).metrics()["queue_delay_p99_s"]


def test_goodput_counts_the_requests_within_the_slo():
    from feather_gym.policies import make_policy
    from feather_gym.simulator import simulate
    from feather_gym.slo import SLO, latency_and_goodput

    result = simulate(trace(), h200(), make_policy("fcfs"))
    makespan_s = result.metrics()["makespan_s"]
    lenient = latency_and_goodput(result, SLO(ttft_s=1e9, tpot_s=1e9), makespan_s)
    assert lenient["slo_met_requests"] == len(trace()) and lenient["slo_met_fraction"] == 1.0
    ttft = result.first_token_s - result.arrival_s
    strict = latency_and_goodput(result, SLO(ttft_s=float(np.median(ttft)), tpot_s=1e9), makespan_s)
    assert strict["slo_met_requests"] == int((ttft <= np.median(ttft)).sum()) < len(trace())
    assert strict["goodput_req_s"] < lenient["goodput_req_s"]


@pytest.mark.parametrize(("text", "ttft", "tpot"), [("", 2.0, 0.1), ("ttft=5s", 5.0, 0.1), ("tpot=50ms", 2.0, 0.05),
                                                    ("ttft=500ms,tpot=0.2s", 0.5, 0.2)])
def test_parse_slo(text, ttft, tpot):
    from feather_gym.slo import DEFAULT_SLOS, parse_slo

    slo = parse_slo(text, DEFAULT_SLOS["cuda"])
    assert (slo.ttft_s, slo.tpot_s) == pytest.approx((ttft, tpot))


@pytest.mark.parametrize("text", ["ttft=2", "latency=2s", "ttft=0s"])
def test_parse_slo_refuses_malformed_items(text):
    from feather_gym.slo import DEFAULT_SLOS, parse_slo

    with pytest.raises(ValueError):
        parse_slo(text, DEFAULT_SLOS["cuda"])


def test_sim_sweep_json_is_one_object_on_the_last_line(capsys, tmp_path):
    from feather_cli.main import main

    plot = tmp_path / "sweep.png"
    assert main(["sim", "sweep", "--workload", SPEC, "--profile", "h200", "--loads", "0.5,1.2",
                 "--policies", "fcfs,feather-rule", "--slo", "ttft=1s", "--plot", str(plot), "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert [(row["load"], row["policy"]) for row in report["rows"]] == [
        (0.5, "fcfs"), (0.5, "feather-rule"), (1.2, "fcfs"), (1.2, "feather-rule")]
    assert report["slo_ttft_s"] == 1.0 and report["capacity_requests_per_s"] > 0
    assert all(len(line) <= 120 for line in lines[:-1])
    assert plot.stat().st_size > 0
    low, high = report["rows"][0], report["rows"][2]
    assert high["arrival_rate_req_s"] == pytest.approx(low["arrival_rate_req_s"] * 1.2 / 0.5)


def test_a_policy_file_is_labelled_by_its_run_and_name_in_the_table_and_the_legend():
    from feather_gym.sweep import policy_label

    assert policy_label("/tmp/runs/default/policy.onnx") == "default/policy.onnx"
    assert policy_label("runs/hold/policy.onnx") != policy_label("runs/default/policy.onnx")
    assert policy_label("feather-rule") == "feather-rule"
    assert policy_label("policy.onnx") == "policy.onnx"
    assert policy_label("runs/resident-1206/policy.onnx") == "resident-1206/policy.onnx"   # whole in a legend
    assert policy_label("/x/" + "p" * 30 + ".onnx", 24) == "..." + "p" * 16 + ".onnx"        # a table's column
    assert policy_label("feather-resident", 16) == "feather-resident"
