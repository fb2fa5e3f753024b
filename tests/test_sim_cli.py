"""``feather sim compare`` reports the load regime: arrival span against makespan, and queueing delay."""

from __future__ import annotations

import json

import numpy as np
import pytest

import traces
from feather_cli.main import main
from feather_gym.costmodel import load_cost_model
from feather_gym.policies import make_policy
from feather_gym.simulator import simulate


@pytest.fixture(scope="module")
def h200():
    return load_cost_model("h200")


def regime(spec: str, cost_model) -> dict:
    return simulate(traces.resolve_workload(spec, seed=1), cost_model, make_policy("fcfs")).metrics()


def test_load_regime_is_computed_from_the_per_request_records(h200):
    trace = traces.resolve_workload("prefix-groups:groups=3,num_requests=80,rate=200", seed=2)
    result = simulate(trace, h200, make_policy("fcfs"))
    figures = result.metrics()
    delay = result.first_scheduled_s - result.arrival_s
    assert figures["arrival_span_s"] == pytest.approx(trace.duration_s)
    assert figures["queue_delay_mean_s"] == pytest.approx(delay.mean())
    assert figures["queue_delay_p99_s"] == pytest.approx(np.percentile(delay, 99))
    assert figures["queue_delay_p99_s"] <= result.metrics()["longest_wait_s"]


def test_the_regime_tells_an_arrival_bound_trace_from_an_overloaded_one(h200):
    light = regime("no-sharing:num_requests=200", h200)
    heavy = regime("prefix-groups:groups=5,prefix_tokens=5000,rate=1000,num_requests=200", h200)
    # Light: the engine keeps up, so it finishes soon after the last arrival and nothing queues long.
    assert light["makespan_s"] < 1.2 * light["arrival_span_s"] and light["queue_delay_mean_s"] < 0.1
    # Overloaded: work queues, the makespan far exceeds the arrival span.
    assert heavy["makespan_s"] > 3 * heavy["arrival_span_s"] and heavy["queue_delay_mean_s"] > heavy["arrival_span_s"]


def test_sim_compare_prints_and_reports_the_regime(capsys):
    assert main(["sim", "compare", "--workload", "prefix-groups:groups=3,num_requests=40,rate=50", "--profile", "h200",
                 "--policies", "fcfs,group-label", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert "arriving over" in lines[0] and "makespan s" in lines[1] and "queue p99 s" in lines[1]
    assert out["arrival_span_s"] > 0 and list(out["policies"]) == ["fcfs", "group-label"]
    for metrics in out["policies"].values():
        assert metrics["makespan_s"] >= out["arrival_span_s"]
        assert 0 <= metrics["queue_delay_mean_s"] <= metrics["queue_delay_p99_s"] <= metrics["longest_wait_s"]


def test_sim_compare_runs_in_the_kv_capacity_given(capsys):
    """--kv-tokens sizes the KV cache of every run (it was once read only with --model)."""
    spec = "no-sharing:num_requests=32,input_tokens_max=512,output_tokens_max=48,rate=1000"

    def makespan(*kv):
        assert main(["sim", "compare", "--workload", spec, "--profile", "vllm-cpu", "--seed", "10001",
                     "--policies", "feather-rule", *kv, "--json"]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["policies"]["feather-rule"]["makespan_s"]

    assert makespan("--kv-tokens", "2048") > 1.05 * makespan()


def test_bench_env_defaults_to_the_training_mix_of_the_profiles_device(capsys):
    """Its default workload follows the profile's device (feather-train's mix), so the episodes have
    decisions on a CPU engine too (the generators' own sizes give a CPU engine none, which the env refuses)."""
    assert main(["bench", "env", "--profile", "vllm-cpu", "--steps", "300", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["profile"] == "vllm-cpu" and report["kv_capacity_tokens"] == 5760
    assert report["workload"].startswith("prefix-groups:") and report["steps_per_s_warm"] > 0
