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


def test_sim_sweep_and_compare_run_under_the_waiting_bound_given(capsys):
    """--max-wait-steps reaches the simulator and is reported: with a bound of 0 every waiting request is
    overdue at once, so the earliest-arrived is admitted unasked and `cht` serves in FCFS's order."""
    from feather_cli.main import main

    spec = "prefix-groups:num_requests=80,groups=16,prefix_tokens=512,output_tokens_min=8,output_tokens_max=32,rate=20"
    engine = ["--profile", "vllm-cpu", "--kv-tokens", "5760", "--policies", "fcfs,cht"]

    def sweep(*bound):
        assert main(["sim", "sweep", "--workload", spec, *engine, "--loads", "1.1", *bound, "--json"]) == 0
        out = capsys.readouterr().out.strip().splitlines()
        return json.loads(out[-1]), out[0]

    (default, _), (bound, first_line) = sweep(), sweep("--max-wait-steps", "0")
    assert default["max_wait_steps"] == 32 and bound["max_wait_steps"] == 0
    assert "waiting bound 0 engine steps" in first_line
    fcfs, cht = bound["rows"]
    assert cht["forced_wait_admissions"] > 0 == default["rows"][1]["forced_wait_admissions"]
    assert cht["ttft_mean_s"] == pytest.approx(fcfs["ttft_mean_s"])
    assert default["rows"][1]["ttft_mean_s"] < 0.9 * fcfs["ttft_mean_s"]

    assert main(["sim", "compare", "--workload", f"{spec}@load=1.1", *engine, "--max-wait-steps", "0", "--json"]) == 0
    compared = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert compared["max_wait_steps"] == 0
    assert compared["policies"]["cht"]["ttft_mean_s"] == pytest.approx(compared["policies"]["fcfs"]["ttft_mean_s"])


def test_a_policy_file_is_labelled_by_its_run_and_name_in_the_table_and_the_legend():
    from feather_gym.sweep import policy_label

    assert policy_label("/tmp/runs/default/policy.onnx") == "default/policy.onnx"
    assert policy_label("runs/hold/policy.onnx") != policy_label("runs/default/policy.onnx")
    assert policy_label("feather-rule") == "feather-rule"
    assert policy_label("policy.onnx") == "policy.onnx"
    assert policy_label("runs/resident-1206/policy.onnx") == "resident-1206/policy.onnx"   # whole in a legend
    assert policy_label("/x/" + "p" * 30 + ".onnx", 24) == "..." + "p" * 16 + ".onnx"        # a table's column
    assert policy_label("feather-resident", 16) == "feather-resident"
    assert policy_label("runs/resident-1206/policy.onnx", 16) == "resident-1206"       # the run, in a narrow column
    assert policy_label("runs/resident-1206/clone.onnx", 16) == "...06/clone.onnx"


def _sweep_rows(load, goodput, ttft_p99):
    return [{"load": load, "policy": policy, "goodput_req_s": goodput[policy], "ttft_p99_s": ttft_p99[policy],
             "slo_met_fraction": 0.5} for policy in goodput]


def test_summarise_sweeps_judges_every_policy_against_the_heuristic_best_on_average():
    from feather_gym.sweep import format_summary, summarise_sweeps

    seed_0 = _sweep_rows(0.9, {"fcfs": 1.0, "lpm": 2.0, "dfs": 1.5, "trained": 2.2},
                         {"fcfs": 10.0, "lpm": 4.0, "dfs": 4.0, "trained": 5.0})
    seed_1 = _sweep_rows(0.9, {"fcfs": 1.0, "lpm": 1.0, "dfs": 2.0, "trained": 1.8},
                         {"fcfs": 6.0, "lpm": 4.0, "dfs": 4.0, "trained": 3.0})
    seed_2 = _sweep_rows(0.9, {"fcfs": 0.0, "lpm": 0.0, "dfs": 0.0, "trained": 0.0},
                         {"fcfs": 8.0, "lpm": 4.0, "dfs": 4.0, "trained": 4.0})
    summary = {row["policy"]: row for row in summarise_sweeps([{"rows": seed_0}, {"rows": seed_1}, {"rows": seed_2}])}
    trained = summary["trained"]
    # dfs: mean 3.5/3 beats lpm's 3/3 although lpm wins seed 0; the same heuristic at every seed
    assert {row["best_heuristic"] for row in summary.values()} == {"dfs"}
    assert trained["goodput_mean_req_s"] == pytest.approx(4.0 / 3)
    assert (trained["goodput_min_req_s"], trained["goodput_max_req_s"]) == (0.0, 2.2)
    assert trained["goodput_vs_best_heuristic"] == pytest.approx(4.0 / 3.5)
    # per seed: 2.2/1.5 and 1.8/2.0; seed 2, where dfs serves none within the SLO, left out
    assert trained["goodput_vs_best_heuristic_min"] == pytest.approx(0.9)
    assert trained["goodput_vs_best_heuristic_max"] == pytest.approx(2.2 / 1.5)
    # paired differences 0.7, -0.2, 0: mean 0.1667, sd 0.4726, t(2) 4.303; over dfs's mean 3.5/3
    half = 4.303 * 0.4726 / np.sqrt(3)
    assert trained["goodput_vs_best_heuristic_ci95"] == pytest.approx(
        [1 + (0.5 / 3 - half) / (3.5 / 3), 1 + (0.5 / 3 + half) / (3.5 / 3)], abs=1e-3)
    assert summary["dfs"]["goodput_vs_best_heuristic_ci95"] == [1.0, 1.0]
    assert trained["ttft_p99_vs_fcfs"] == pytest.approx(4.0 / 8.0)
    # TTFT p99 5, 3, 4 against FCFS's 10, 6, 8: differences -5, -3, -4 (sd 1), over FCFS's mean 8
    half = 4.303 / np.sqrt(3)
    assert trained["ttft_p99_vs_fcfs_ci95"] == pytest.approx([1 + (-4 - half) / 8, 1 + (-4 + half) / 8], abs=1e-3)
    assert trained["ttft_p99_vs_fcfs_min"] == trained["ttft_p99_vs_fcfs_max"] == pytest.approx(0.5)
    assert trained["instances"] == 3 and summary["fcfs"]["ttft_p99_vs_fcfs"] == 1.0
    table = format_summary(list(summary.values()), "seeds 0-2")
    low, high = trained["goodput_vs_best_heuristic_ci95"]
    assert f"1.143 [{low:.3f}-{high:.3f}] dfs" in table and "1.333 (0-2.2)" in table
    assert all(len(line) <= 120 for line in table.splitlines())


def test_the_summary_table_fits_120_columns_with_goodputs_of_many_digits():
    from feather_gym.sweep import format_summary, summarise_sweeps

    reports = [{"rows": _sweep_rows(1.1, {"runs/resident-1206/policy.onnx": g, "feather-rule": 2.5 * g / 1.2345,
                                          "fcfs": g / 3}, {p: 391.2 for p in ("runs/resident-1206/policy.onnx",
                                                                             "feather-rule", "fcfs")})}
               for g in (0.0029571, 0.0041371, 0.0008472)]
    table = format_summary(summarise_sweeps(reports), "3 time windows")
    assert "0.002647 (0.0008472-0.004137)" in table
    assert all(len(line) <= 120 for line in table.splitlines())


def test_summarise_sweeps_without_a_heuristic_or_fcfs_judges_nothing():
    from feather_gym.sweep import summarise_sweeps

    (row,) = summarise_sweeps([{"rows": _sweep_rows(1.1, {"trained": 1.0}, {"trained": 2.0})}])
    assert "best_heuristic" not in row and "ttft_p99_vs_fcfs" not in row
    assert row["goodput_mean_req_s"] == row["goodput_min_req_s"] == row["goodput_max_req_s"] == 1.0


def test_sim_sweep_over_seeds_reports_each_seed_and_their_summary(capsys, tmp_path):
    from feather_cli.main import main

    plot = tmp_path / "sweep.png"
    assert main(["sim", "sweep", "--workload", SPEC, "--profile", "h200", "--loads", "0.9", "--seed", "3",
                 "--seeds", "2", "--policies", "fcfs,lpm,feather-resident", "--plot", str(plot), "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert [(run["spec"], run["seed"]) for run in report["instances"]] == [(SPEC, 3), (SPEC, 4)]
    assert report["instances"][0]["rows"] != report["instances"][1]["rows"]   # two traces
    summary = {row["policy"]: row for row in report["summary"]}
    assert summary.keys() == {"fcfs", "lpm", "feather-resident"} and summary["fcfs"]["instances"] == 2
    goodputs = [run["rows"][2]["goodput_req_s"] for run in report["instances"]]
    assert summary["feather-resident"]["goodput_mean_req_s"] == pytest.approx(np.mean(goodputs))
    assert summary["lpm"]["best_heuristic"] in ("fcfs", "lpm")
    assert "over 2 instances (seeds 3-4)" in "\n".join(lines)
    assert all(len(line) <= 120 for line in lines[:-1]) and plot.stat().st_size > 0


def _recorded_trace(tmp_path):
    """A generated trace written as a file: a recording, the same at every seed."""
    import traces
    from traces import resolve_workload

    path = tmp_path / "recorded.jsonl"
    traces.write_trace(resolve_workload(SPEC, seed=5), path)
    return str(path)


def test_sim_sweep_over_time_windows_of_a_recorded_trace(capsys, tmp_path):
    from feather_cli.main import main
    from traces import resolve_workload

    trace_file = _recorded_trace(tmp_path)
    assert main(["sim", "sweep", "--workload", f"{trace_file}@0.5-1", "--windows", "2", "--profile", "h200",
                 "--loads", "0.9", "--policies", "fcfs,feather-rule", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [run["spec"] for run in report["instances"]] == [f"{trace_file}@0.5-0.75", f"{trace_file}@0.75-1"]
    assert sum(run["requests"] for run in report["instances"]) == len(resolve_workload(f"{trace_file}@0.5-1"))
    assert {row["instances"] for row in report["summary"]} == {2}


def test_time_windows_cover_a_trace_or_its_window_and_refuse_a_generator():
    from traces.workload import time_windows

    assert time_windows("mooncake", 4) == ["mooncake@0-0.25", "mooncake@0.25-0.5", "mooncake@0.5-0.75",
                                           "mooncake@0.75-1"]
    assert time_windows("mooncake@0.5-1", 5)[1] == "mooncake@0.6-0.7"
    assert time_windows("t.jsonl@0.1-0.4", 3) == ["t.jsonl@0.1-0.2", "t.jsonl@0.2-0.3", "t.jsonl@0.3-0.4"]
    with pytest.raises(ValueError, match="seeds"):
        time_windows(SPEC, 2)


@pytest.mark.parametrize("flags, message", [
    (["--seeds", "2"], "not a generator"),
    (["--seeds", "2", "--windows", "2"], "give one"),
])
def test_sim_sweep_refuses_instances_a_workload_does_not_have(tmp_path, flags, message):
    from feather_cli.main import main

    with pytest.raises(SystemExit, match=message):
        main(["sim", "sweep", "--workload", _recorded_trace(tmp_path), *flags, "--profile", "h200"])


def test_sim_sweep_refuses_time_windows_of_a_generator():
    from feather_cli.main import main

    with pytest.raises(SystemExit, match="--windows 2: .*seeds"):
        main(["sim", "sweep", "--workload", SPEC, "--windows", "2", "--profile", "h200"])


def test_sim_sweep_over_several_workloads_sets_them_side_by_side(capsys, tmp_path):
    from feather_cli.main import main

    other = "prefix-groups:num_requests=60,groups=8,output_tokens_max=32"
    assert main(["sim", "sweep", "--workload", SPEC, "--workload", f"eight={other}", "--profile", "h200",
                 "--loads", "0.7,1.1", "--policies", "fcfs,lpm,feather-resident", "--plot",
                 str(tmp_path / "sweep.png"), "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    first, second = report["workloads"]
    assert (first["workload"], first["spec"], second["workload"], second["spec"]) == (
        "prefix-groups", SPEC, "eight", other)
    assert first["rows"] != second["rows"] and report["heuristics"][0] == "fcfs"
    resident = {row["load"]: row["goodput_vs_best_heuristic"] for row in second["summary"]
                if row["policy"] == "feather-resident"}
    text = "\n".join(lines[:-1])
    assert "goodput over the best heuristic's, by workload" in text
    block = next(index for index, line in enumerate(lines) if line.startswith("feather-resident "))
    assert lines[block].split()[:2] == ["feather-resident", "prefix-groups"]
    assert lines[block + 1].split() == ["eight", *(f"{ratio:.3f}" for ratio in
                                                   (resident[0.7], resident[1.1], min(resident.values())))]
    assert all(len(line) <= 120 for line in lines[:-1])
    assert (tmp_path / "sweep_prefix-groups.png").stat().st_size > 0 and (tmp_path / "sweep_eight.png").exists()


def test_format_across_marks_what_was_not_judged():
    from feather_gym.sweep import format_across, summarise_sweeps

    judged = summarise_sweeps([{"rows": _sweep_rows(0.9, {"fcfs": 2.0, "trained": 1.0},
                                                    {"fcfs": 1.0, "trained": 1.0})}])
    unjudged = summarise_sweeps([{"rows": _sweep_rows(0.9, {"trained": 1.0}, {"trained": 1.0})}])
    lines = format_across({"a": judged, "b": unjudged}).splitlines()
    assert lines[2].split() == ["fcfs", "a", "1.000", "1.000"] and lines[3].split() == ["b", "-", "-"]
    assert lines[4].split() == ["trained", "a", "0.500", "0.500"]
