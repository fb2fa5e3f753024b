"""``feather bench serve --loads``: the load sweep live beside the simulated one, on a calibrated clock.

The pieces that need no engine first (the comparison of one load, the refusals of the command
line); then, marked live, one small sweep end to end: every request finishes on every side.
"""

from __future__ import annotations

import itertools
import json
import re

import numpy as np
import pytest

from deploy.bench.live_sweep import (
    FIGURES,
    GOODPUT_TOLERANCE,
    SPREAD_DRAWS,
    StepLogs,
    clock_sensitivity,
    clock_tolerance,
    compare_load,
    format_live_sweep,
    goodput_clock_elasticity,
    spread_verdict,
)

#: Eight requests in two prefix groups, Poisson arrivals (the load rescales their rate).
WORKLOAD = ("prefix-groups:num_requests=8,groups=2,prefix_tokens=256,suffix_tokens_min=16,suffix_tokens_max=64,"
            "output_tokens_min=8,output_tokens_max=16,rate=1")


def sim_row(goodput: float, policy: str = "feather-rule") -> dict:
    return {"policy": policy, "throughput_tok_s": 100.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.5, "tpot_p50_ms": 40.0,
            "tpot_p99_ms": 80.0, "goodput_req_s": goodput, "slo_met_fraction": 1.0, "steps": 60,
            "step_ms_mean": 40.0, "decisions": 30, "forced_wait_admissions": 2, "requests": 12, "rejected": 0,
            "queue_delay_p99_s": 0.2}


def live_side(goodput: float, per_round=None) -> dict:
    return {"per_round": {"goodput_req_s": per_round or [goodput]},
            "output_tok_s": 90.0, "ttft_p50_s": 0.12, "ttft_p99_s": 0.6, "tpot_p50_ms": 45.0, "tpot_p99_ms": 90.0,
            "goodput_req_s": goodput, "slo_met_fraction": 1.0, "steps": 50.0, "step_ms_mean": 45.0,
            "decisions": 28.0, "forced_wait_admissions": 1.0,
            "requests_finished": 24, "requests_lost": 0, "schedule_cpu_us_per_step": 300.0,
            "update_cpu_us_per_step": 100.0}


def test_one_load_compares_the_same_figures_and_ranks_by_goodput():
    agree = compare_load({"fcfs": sim_row(2.0, "fcfs"), "feather-rule": sim_row(2.5)},
                         {"fcfs": live_side(1.8), "feather-rule": live_side(2.0)})
    rule = agree["policies"]["feather-rule"]
    assert set(rule["sim"]) == set(rule["live"]) == set(FIGURES)
    assert (rule["sim"]["throughput_tok_s"], rule["live"]["throughput_tok_s"]) == (100.0, 90.0)
    assert rule["sim"]["requests_finished"] == 12 and rule["live"]["requests_finished"] == 24
    assert rule["goodput_live_over_sim"] == pytest.approx(0.8) and rule["live_scheduler_cpu_us_per_step"] == 400.0
    assert (rule["sim"]["steps"], rule["live"]["steps"]) == (60, 50.0)
    assert (rule["sim"]["decisions"], rule["live"]["decisions"]) == (30, 28.0)
    assert agree["policies"]["fcfs"]["sim"]["decisions"] is None                # vLLM's scheduler asks no policy
    assert agree["sim_ranking"] == agree["live_ranking"] == ["feather-rule", "fcfs"] and agree["same_ranking"]
    disagree = compare_load({"fcfs": sim_row(2.0), "feather-rule": sim_row(2.5)},
                            {"fcfs": live_side(2.1), "feather-rule": live_side(2.0)})
    assert disagree["live_ranking"] == ["fcfs", "feather-rule"] and not disagree["same_ranking"]
    # A tie in the simulator makes no claim on the live order; no simulated goodput, no ratio.
    tied = compare_load({"fcfs": sim_row(0.0), "feather-rule": sim_row(0.0)},
                        {"fcfs": live_side(0.1), "feather-rule": live_side(0.0)})
    assert tied["same_ranking"] and tied["policies"]["fcfs"]["goodput_live_over_sim"] is None


def test_a_load_meets_the_live_target_only_ranked_alike_with_every_goodput_within_ten_percent():
    def compared(live_fcfs: float, live_rule: float) -> dict:
        return compare_load({"fcfs": sim_row(2.0, "fcfs"), "feather-rule": sim_row(2.5)},
                            {"fcfs": live_side(live_fcfs), "feather-rule": live_side(live_rule)})

    assert compared(1.81, 2.74)["meets_live_target"]                  # 0.905 and 1.096 of simulated
    assert not compared(1.79, 2.5)["meets_live_target"]               # fcfs 0.895: too far
    assert not compared(2.0, 2.76)["meets_live_target"]               # the rule 1.104: too far
    swapped = compare_load({"fcfs": sim_row(2.0, "fcfs"), "feather-rule": sim_row(2.1)},   # each within 10%,
                           {"fcfs": live_side(2.1), "feather-rule": live_side(2.0)})        # the order reversed
    assert not swapped["same_ranking"] and not swapped["meets_live_target"]
    # A simulated tie with live goodputs far apart: the ranking makes no claim, the ratio does.
    tied = compare_load({"fcfs": sim_row(2.0, "fcfs"), "feather-rule": sim_row(2.0)},
                        {"fcfs": live_side(1.4), "feather-rule": live_side(2.0)})
    assert tied["same_ranking"] and not tied["meets_live_target"]
    assert not compare_load({"fcfs": sim_row(0.0, "fcfs"), "feather-rule": sim_row(2.5)},
                            {"fcfs": live_side(0.0), "feather-rule": live_side(2.5)})["meets_live_target"]


def test_with_rounds_the_ranking_is_also_checked_on_the_pairs_every_round_orders_alike():
    sim = {"fcfs": sim_row(1.0, "fcfs"), "feather-rule": sim_row(2.0), "feather-hold": sim_row(2.02)}
    # The hold 1% above the rule simulated; live below it in one round and above in the other.
    live = {"fcfs": live_side(1.0, [1.1, 0.9]), "feather-rule": live_side(2.0, [2.04, 1.96]),
            "feather-hold": live_side(1.98, [1.98, 1.98])}
    compared = compare_load(sim, live)
    assert compared["live_unsettled_pairs"] == [["feather-rule", "feather-hold"]]
    assert not compared["same_ranking"] and compared["same_ranking_where_rounds_agree"]
    assert not compared["meets_live_target"]                              # the target stays the strict ranking
    assert compared["policies"]["feather-rule"]["live_goodput_per_round_req_s"] == [2.04, 1.96]
    # FCFS above the rule in every round: an order the rounds settle, against the simulator's.
    live["fcfs"] = live_side(2.5, [2.5, 2.6])
    assert not compare_load(sim, live)["same_ranking_where_rounds_agree"]
    # A tie in one round and an order in the other is not settled.
    live["fcfs"] = live_side(2.0, [2.04, 1.9])
    assert ["fcfs", "feather-rule"] in compare_load(sim, live)["live_unsettled_pairs"]
    # One round: nothing to compare rounds on, no second verdict.
    single = compare_load(sim, {name: live_side(side["goodput_req_s"]) for name, side in live.items()})
    assert single["live_unsettled_pairs"] is None and single["same_ranking_where_rounds_agree"] is None


def test_the_clock_tolerance_is_the_goodput_tolerance_over_the_steepest_elasticity():
    # 2% faster steps: goodput 0.77; as forecast 0.61; 2% slower 0.63 -> about 5.9% per 1%.
    steep = goodput_clock_elasticity(0.77, 0.61, 0.63, step=0.02)
    assert steep == pytest.approx((0.77 - 0.63) / (0.04 * 0.61))
    assert goodput_clock_elasticity(0.5, 0.5, 0.5) == 0.0 and goodput_clock_elasticity(0.1, 0.0, 0.0) is None
    assert goodput_clock_elasticity(0.4, 0.5, 0.6, step=0.1) == pytest.approx(-2.0)   # sign kept: it rose
    assert clock_tolerance({"fcfs": steep, "feather-rule": 1.0, "idle": None}) == pytest.approx(0.10 / steep)
    assert clock_tolerance({"fcfs": -4.0, "feather-rule": 1.0}) == pytest.approx(0.025)
    assert clock_tolerance({"fcfs": 0.0, "feather-rule": None}) is None                 # nothing moves
    outside = clock_sensitivity({"fcfs": steep, "feather-rule": 1.0}, -0.032)
    assert outside["clock_tolerance_fraction"] == pytest.approx(0.10 / steep)
    assert outside["forecast_clock_error_fraction"] == -0.032 and not outside["forecast_clock_within_tolerance"]
    assert clock_sensitivity({"fcfs": steep}, 0.01)["forecast_clock_within_tolerance"]
    assert clock_sensitivity({"fcfs": 0.0}, 0.5)["forecast_clock_within_tolerance"]     # no goodput to move


@pytest.mark.parametrize("more", [{}, {"feather-hold": 2.01, "runs/another-long-run/policy.onnx": 2.03,
                                      "feather-resident": 2.04}])
def test_the_table_of_a_sweep_of_two_rounds_names_the_check_on_settled_pairs_within_120_columns(more):
    sim = {"fcfs": sim_row(1.0, "fcfs"), "feather-rule": sim_row(2.0),
           "runs/a-long-run-name/policy.onnx": sim_row(2.02)} | {name: sim_row(g) for name, g in more.items()}
    live = {"fcfs": live_side(1.0, [1.1, 0.9]), "feather-rule": live_side(2.0, [2.04, 1.96]),
            "runs/a-long-run-name/policy.onnx": live_side(1.98, [1.98, 1.98])} | {
        name: live_side(g, [g, g]) for name, g in more.items()}
    compared = compare_load(sim, live)
    clock = {"clock_factor": 1.0, "clock_prefill_factor": 1.0, "calibration_steps": 100}
    band = {n: [0.7, 1.2] if n == "fcfs" else [1.9, 2.1] for n in sim}
    network = "runs/a-long-run-name/policy.onnx"              # its orders are not held: live reverses one
    goodput = {name: row["goodput_req_s"] for name, row in sim.items()}
    orders = [{"ahead": a, "behind": b, "draw_share": 0.5 if network in (a, b) else 1.0}
              for a, b in itertools.permutations(sim, 2) if goodput[a] > 1.001 * goodput[b]]
    spread = spread_verdict({"draws": 20, "rounds_per_draw": 2, "goodput_median_req_s": {n: 1.0 for n in sim},
                             "goodput_band_req_s": band, "forecast_orders": orders}, compared)
    report = {"workload": "small", "requests": 12, "rounds": 2, "slo_ttft_s": 10.0, "slo_tpot_s": 0.5, "wall_s": 60.0,
              "profile": "vllm-cpu", **clock, "calibration_load": 1.0, "calibration_measured_s": 10.0,
              "calibration_predicted_s": 11.0, "calibration_mape_before": 0.2, "calibration_mape_after": 0.05,
              "burst_clock_factor": 1.0, "burst_clock_prefill_factor": 1.0, "burst_capacity_requests_per_s": 1.5,
              "step_factor_cv": 0.18, "capacity_requests_per_s": 1.5, "capacity_simulations": 8,
              "loads": [{"load": 0.9, "arrival_rate_req_s": 1.35, "capacity_requests_per_s": 1.5, **compared,
                         "clock_sensitivity": clock_sensitivity({name: 5.9 for name in sim}, -0.032),
                         "forecast_spread": spread, "load_clock": clock, "at_load_clock": compared}]}
    lines = format_live_sweep(report).splitlines()
    assert sum("on the pairs every live round orders alike (" in line for line in lines) == 2
    assert sum("target" in line for line in lines) == 3
    text = " ".join(" ".join(lines).split())
    assert "clock: live FCFS steps -3.2% off the forecast's; goodput moves 5.9% per 1% of step time" in text
    assert "the target needs the clock within 1.7%: OUTSIDE" in text
    assert "factors of mean 1, standard deviation 18%" in text
    assert ("spread: goodput 5-95% of 20 draws of 2 rounds with the steps' own errors: "
            "fcfs 0.700-1.200 (live 1.000 in)") in text
    assert "feather-rule 1.900-2.100 (live 2.000 in)" in text and "wider than 10% of the forecast for fcfs" in text
    held = sum(o["draw_share"] == 1.0 for o in orders)
    assert f"{held} of the forecast's {len(orders)} orders held in 90% of draws, live agrees on them" in text
    assert not compared["same_ranking"]                          # the strict ranking is not met
    report["loads"][0]["clock_sensitivity"] = clock_sensitivity({name: 0.002 for name in sim}, 0.01)  # far below
    text = " ".join(" ".join(format_live_sweep(report).splitlines()).split())                       # capacity
    assert "goodput moves 0.0% per 1% of step time" in text and "within more than 100%: within" in text
    assert not more or "another-long-run" in "\n".join(lines)
    assert all(len(line) <= 120 for line in lines)


def test_the_forecast_band_says_whether_live_lies_in_it_and_whether_it_fits_the_target():
    compared = compare_load({"fcfs": sim_row(1.0, "fcfs"), "feather-rule": sim_row(2.0), "dfs": sim_row(2.0, "dfs")},
                            {"fcfs": live_side(1.25), "feather-rule": live_side(2.1), "dfs": live_side(1.79)})
    band = {"fcfs": [0.8, 1.3], "feather-rule": [1.8, 2.2], "dfs": [1.8, 2.21]}
    orders = [{"ahead": "feather-rule", "behind": "fcfs", "draw_share": 0.9},   # held, to the edge
              {"ahead": "dfs", "behind": "fcfs", "draw_share": 0.89}]
    spread = spread_verdict({"draws": 20, "rounds_per_draw": 1, "goodput_band_req_s": band,
                             "goodput_median_req_s": {n: 1.0 for n in band}, "forecast_orders": orders}, compared)
    assert spread["goodput_band_req_s"] == band and spread["draws"] == 20
    assert spread["live_within_band"] == {"fcfs": True, "feather-rule": True, "dfs": False}
    # The rule's band is ±10% of its forecast, to the edge; FCFS's and DFS's reach past it.
    assert spread["band_within_tolerance"] == {"fcfs": False, "feather-rule": True, "dfs": False}
    assert GOODPUT_TOLERANCE == 0.1
    # DFS stays ahead of FCFS live, so the strict ranking holds as well; the order the draws do not
    # hold is left unchecked.
    assert spread["orders_not_held"] == [["dfs", "fcfs"]] and spread["same_ranking_where_orders_hold"]
    reversed_live = compare_load({"fcfs": sim_row(1.0, "fcfs"), "feather-rule": sim_row(2.0)},
                                 {"fcfs": live_side(2.5), "feather-rule": live_side(2.1)})
    for share, agrees in ((0.95, False), (0.5, True)):    # a held order reversed live; one not held
        verdict = spread_verdict({**spread, "forecast_orders": [
            {"ahead": "feather-rule", "behind": "fcfs", "draw_share": share}]}, reversed_live)
        assert verdict["same_ranking_where_orders_hold"] is agrees and not reversed_live["same_ranking"]


def test_the_forecast_spread_of_steps_without_error_is_the_forecast_and_errors_widen_it():
    pytest.importorskip("vllm")
    from deploy.bench.live_sweep import forecast_spread
    from deploy.bench.validate import as_deployed
    from feather_gym.costmodel import load_cost_model
    from feather_gym.load import at_load, find_capacity
    from feather_gym.simulator import EngineConfig, trace_digests
    from feather_gym.slo import SLO
    from feather_gym.sweep import simulate_policies
    from traces import resolve_workload

    base, config, slo = load_cost_model("vllm-cpu"), EngineConfig(kv_capacity_tokens=1536), SLO(ttft_s=2.0, tpot_s=0.2)
    trace = resolve_workload(WORKLOAD.replace("num_requests=8", "num_requests=24"), seed=0)
    digests = trace_digests(trace, base.block_size)
    loaded = at_load(trace, find_capacity(trace, base, config, digests=digests), 1.1)
    names = ["fcfs", "feather-rule"]
    common = {"rounds": 2, "slo": slo, "config": config, "digests": digests}

    rows = simulate_policies(loaded, base, names, slo=slo, config=config, digests=digests, policy_factory=as_deployed)
    forecast = {row["policy"]: row["goodput_req_s"] for row in rows}

    def spread(factors, seed=0):
        return forecast_spread(loaded, base, rows, factors, rng=np.random.default_rng(seed), **common)

    flat = spread(np.ones(40))
    assert (flat["draws"], flat["rounds_per_draw"]) == (SPREAD_DRAWS, 2)
    for name in names:
        assert flat["goodput_band_req_s"][name] == pytest.approx([forecast[name]] * 2, rel=1e-12)
        assert flat["goodput_median_req_s"][name] == pytest.approx(forecast[name], rel=1e-12)
    # Every draw is the forecast, so every order the forecast claims is kept by every pair of draws.
    claimed = [[a, b] for a, b in (names, names[::-1]) if forecast[a] > 1.001 * forecast[b]]
    assert [[o["ahead"], o["behind"]] for o in flat["forecast_orders"]] == claimed
    assert all(o["draw_share"] == 1.0 for o in flat["forecast_orders"])
    factors = np.exp(0.4 * np.random.default_rng(1).standard_normal(40))
    noisy = spread(factors / factors.mean())
    assert noisy == spread(factors / factors.mean())                              # seeded: the same draws
    for name in names:
        low, high = noisy["goodput_band_req_s"][name]
        assert low <= noisy["goodput_median_req_s"][name] <= high
    assert any(high > low for low, high in noisy["goodput_band_req_s"].values())


def test_a_step_log_name_kept_again_gets_a_numbered_file_and_overwrites_none(tmp_path):
    from feather_gym.costmodel.refit import LiveStep, read_step_logs

    def steps(first: int, count: int) -> list:
        return [LiveStep(step=i, time_unix_s=float(i), step_wall_s=0.01 * i, step_cpu_s=0.005 * i, decode_requests=1,
                         decode_kv_tokens=100 + i, decode_unique_kv_tokens=100 + i, decode_groups=1)
                for i in range(first, first + count)]

    logs = StepLogs(tmp_path / "steps")
    rounds = {"load-0.9-fcfs": steps(1, 3), "calibration-online": steps(10, 2)}
    again = steps(20, 4)
    for name, kept in rounds.items():
        logs.keep(name, kept)
    assert logs.keep("load-0.9-fcfs", again) == str(tmp_path / "steps" / "load-0.9-fcfs-2.jsonl")
    assert [p.rsplit("/", 1)[1] for p in logs.paths] == ["load-0.9-fcfs.jsonl", "calibration-online.jsonl",
                                                          "load-0.9-fcfs-2.jsonl"]
    for path, kept in zip(logs.paths, [*rounds.values(), again]):
        assert read_step_logs([path]) == (kept, 0)


@pytest.mark.parametrize("argv, message", [
    (["bench", "serve"], "--policies is required"),
    (["bench", "serve", "--policies", "feather-rule", "--slo", "ttft=1s"], "give --loads"),
    (["bench", "serve", "--policies", "feather-rule", "--timed-steps", "steps"], "give --loads"),
    (["bench", "serve", "--loads", "0.9", "--all-at-once"], "no --all-at-once"),
    (["bench", "serve", "--loads", "0.9", "--workload", "no-sharing", "--workload", "prefix-groups"], "one workload"),
    (["bench", "serve", "--loads", "0.9", "--slo", "ttft=fast"], "SLO item"),
    (["bench", "serve", "--loads", "0.9", "--policies", "lpm"], "cannot run in the Feather scheduler"),
])
def test_the_sweep_refuses_what_it_cannot_run_before_starting_an_engine(argv, message, capsys):
    from feather_cli.main import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("loads", ["0,1", "fast", "0.9,-1", ""])
def test_a_load_that_is_not_a_positive_number_is_refused_naming_the_flag(loads, capsys):
    from feather_cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", "--loads", loads])
    assert exc.value.code == 2
    assert "argument --loads: expected comma-separated positive numbers" in capsys.readouterr().err


def test_the_clock_records_busy_step_cycles_and_not_an_idle_wait_before_the_next_arrival():
    """Model-free: two requests served one after the other with an idle pause between; every
    cycle but the last of each busy period is recorded (so none spans the pause)."""
    pytest.importorskip("vllm")
    import time

    from deploy.bench.clock import StepTimedScheduler
    from deploy.model_free import ModelFreeEngine, model_free_scheduler, vllm_requests
    from traces import resolve_workload

    steps, pause_s = [], 0.3
    scheduler = model_free_scheduler(StepTimedScheduler, block_size=16, num_blocks=256, max_num_seqs=8,
                                     max_num_batched_tokens=512, max_model_len=1024, timed_steps=steps)
    engine = ModelFreeEngine(scheduler)
    requests = vllm_requests(resolve_workload(WORKLOAD), block_size=16)
    busy_periods = []
    for request in requests[:2]:
        engine.add_requests([request])
        stepped = 0
        while scheduler.has_unfinished_requests():
            engine.step()
            stepped += 1
        busy_periods.append(stepped)
        time.sleep(pause_s)
    assert min(busy_periods) > 2
    assert len(steps) == sum(busy_periods) - len(busy_periods)
    assert all(step.decode_requests + len(step.prefill_chunks) == 1 for step in steps)


@pytest.mark.live
def test_a_small_live_sweep_reports_every_figure_and_every_request_finishes(capsys, tmp_path):
    pytest.importorskip("vllm")
    from feather_cli.main import main

    loads, rounds = (0.8, 1.2), 1
    assert main(["bench", "serve", "--loads", ",".join(map(str, loads)), "--workload", f"small={WORKLOAD}",
                 "--rounds", str(rounds), "--timed-steps", str(tmp_path / "steps"), "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert sum("goodput ranking sim" in line for line in lines[:-1]) == len(loads)
    assert all(len(line) <= 120 for line in format_live_sweep(report).splitlines())

    def keys(value):
        if isinstance(value, dict):
            for key, item in value.items():
                yield key
                yield from keys(item)
        elif isinstance(value, list):
            for item in value:
                yield from keys(item)

    named = {key for key in keys(report) if key not in report["policies"]}
    assert all(re.fullmatch(r"[a-z0-9_]+", key) for key in named), named
    assert report["policies"] == ["fcfs", "feather-rule"] and report["requests"] == 8
    assert report["profile"] == "vllm-cpu" and report["calibrated_profile"].startswith("vllm-cpu@x")
    assert report["calibration_steps"] > 10 and report["clock_factor"] > 0 and report["burst_clock_factor"] > 0
    assert report["calibration_load"] == 1.0 and report["burst_capacity_requests_per_s"] > 0
    assert report["calibrated_profile"] == (f"vllm-cpu@x{report['clock_factor']:.4g}"
                                            f"/prefill x{report['clock_prefill_factor']:.4g}")
    assert (report["slo_ttft_s"], report["slo_tpot_s"]) == (10.0, 0.5)                  # the CPU SLO
    assert report["capacity_requests_per_s"] > 0
    assert [entry["load"] for entry in report["loads"]] == list(loads)
    # The first load's capacity is the calibrated profile's; each later one's comes from the clock
    # fitted on the load before it, so it moves with that clock.
    assert report["loads"][0]["capacity_requests_per_s"] == report["capacity_requests_per_s"]
    assert all(entry["capacity_requests_per_s"] > 0 for entry in report["loads"])
    for entry in report["loads"]:
        assert entry["arrival_rate_req_s"] == pytest.approx(entry["capacity_requests_per_s"] * entry["load"])
        assert sorted(entry["sim_ranking"]) == sorted(entry["live_ranking"]) == sorted(report["policies"])
        assert isinstance(entry["same_ranking"], bool)
        for name in report["policies"]:
            sides = entry["policies"][name]
            assert set(sides["sim"]) == set(sides["live"]) == set(FIGURES)
            assert (sides["sim"]["requests_finished"], sides["sim"]["requests_lost"]) == (8, 0)
            assert (sides["live"]["requests_finished"], sides["live"]["requests_lost"]) == (8 * rounds, 0)
            for side in ("sim", "live"):
                figures = sides[side]
                assert figures["throughput_tok_s"] > 0 and 0 < figures["ttft_p50_s"] <= figures["ttft_p99_s"]
                assert 0 < figures["tpot_p50_ms"] <= figures["tpot_p99_ms"]
                assert 0 <= figures["slo_met_fraction"] <= 1 and figures["steps"] > 0
            assert sides["live_scheduler_cpu_us_per_step"] > 0
            assert (sides["sim"]["decisions"] is None) == (sides["live"]["decisions"] is None) == (name == "fcfs")
            assert sides["goodput_live_over_sim"] == pytest.approx(
                sides["live"]["goodput_req_s"] / sides["sim"]["goodput_req_s"])
    assert report["loads_same_ranking"] == sum(entry["same_ranking"] for entry in report["loads"])
    for entry in report["loads"]:                  # the clock fitted again on each load's live FCFS steps
        clock, refit = entry["load_clock"], entry["at_load_clock"]
        assert clock["calibration_steps"] > 0 and clock["clock_factor"] > 0 and clock["clock_prefill_factor"] > 0
        assert clock["calibration_measured_s"] > 0 and 0 <= clock["calibration_mape_after"]
        for name in report["policies"]:
            same, other = entry["policies"][name], refit["policies"][name]
            assert other["live"] == same["live"]                           # the same live rounds
            assert (other["sim"]["requests_finished"], other["sim"]["requests_lost"]) == (8, 0)
            assert other["goodput_live_over_sim"] == pytest.approx(
                other["live"]["goodput_req_s"] / other["sim"]["goodput_req_s"])
        assert isinstance(refit["meets_live_target"], bool)
    for entry in report["loads"]:                  # how right the forecast's clock had to be, and was
        sensitivity = entry["clock_sensitivity"]
        assert set(sensitivity["goodput_clock_elasticity"]) == set(report["policies"])
        assert abs(sensitivity["forecast_clock_error_fraction"]) < 1
        tolerance = sensitivity["clock_tolerance_fraction"]
        assert tolerance is None or tolerance > 0
        assert sensitivity["forecast_clock_within_tolerance"] == (
            tolerance is None or abs(sensitivity["forecast_clock_error_fraction"]) <= tolerance)
    assert report["loads_forecast_clock_within_tolerance"] == sum(
        entry["clock_sensitivity"]["forecast_clock_within_tolerance"] for entry in report["loads"])
    assert report["step_factor_cv"] > 0             # the calibration's steps err around its clock
    for entry in report["loads"]:
        spread = entry["forecast_spread"]
        assert (spread["draws"], spread["rounds_per_draw"]) == (SPREAD_DRAWS, rounds)
        for name in report["policies"]:
            low, high = spread["goodput_band_req_s"][name]
            assert low <= spread["goodput_median_req_s"][name] <= high
            assert spread["live_within_band"][name] == (low <= entry["policies"][name]["live"]["goodput_req_s"] <= high)
    assert report["loads_live_within_forecast_band"] == sum(
        all(entry["forecast_spread"]["live_within_band"].values()) for entry in report["loads"])
    for entry in report["loads"]:
        spread = entry["forecast_spread"]
        assert all(0 <= o["draw_share"] <= 1 for o in spread["forecast_orders"])
        assert spread["orders_not_held"] == [[o["ahead"], o["behind"]] for o in spread["forecast_orders"]
                                             if o["draw_share"] < 0.9]
    assert report["loads_same_ranking_where_orders_hold"] == sum(
        entry["forecast_spread"]["same_ranking_where_orders_hold"] for entry in report["loads"])
    for key in ("same_ranking", "meets_live_target"):
        assert report[f"loads_{key}"] == sum(entry[key] for entry in report["loads"])
        assert report[f"loads_{key}_at_load_clock"] == sum(entry["at_load_clock"][key] for entry in report["loads"])
    # The timed steps kept: fitting them again gives the report's clocks, and the calibration's clock
    # on the first load's steps is off by that load's forecast clock error.
    assert report["timed_step_logs"] == [str(tmp_path / "steps" / f"{name}.jsonl") for name in (
        "calibration-all-at-once", "calibration-online", "load-0.8-fcfs", "load-1.2-fcfs")]
    capsys.readouterr()
    fits = {}
    for log in report["timed_step_logs"]:
        argv = ["profile", "clock", "--from-logs", log, "--profile", "vllm-cpu", "--json"]
        assert main(argv + (["--against", report["timed_step_logs"][2]] if "online" in log else [])) == 0
        fits[log] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    burst, calibration, *at_loads = fits.values()
    assert (burst["clock_factor"], burst["clock_prefill_factor"]) == pytest.approx(
        (report["burst_clock_factor"], report["burst_clock_prefill_factor"]), rel=1e-9)
    assert {key: calibration[key] for key in ("clock_factor", "clock_prefill_factor", "calibration_steps",
                                              "step_factor_cv")} == (
        pytest.approx({key: report[key] for key in ("clock_factor", "clock_prefill_factor", "calibration_steps",
                                                    "step_factor_cv")}, rel=1e-9))
    assert calibration["against_clock_error_fraction"] == pytest.approx(
        report["loads"][0]["clock_sensitivity"]["forecast_clock_error_fraction"], rel=1e-9)
    for fit, entry in zip(at_loads, report["loads"]):
        assert {key: fit[key] for key in entry["load_clock"]} == pytest.approx(entry["load_clock"], rel=1e-9)


def test_rounds_whose_goodputs_differ_past_any_rounding_keep_their_order():
    from types import SimpleNamespace

    from deploy.bench.harness import summarise
    from deploy.engine_rounds import RoundResult
    from feather_gym.slo import SLO

    def one_round(wall_s):
        meter = SimpleNamespace(steps=5, schedule_ns=1_000, update_ns=1_000, scheduled_tokens=30, preemptions=0)
        return RoundResult(label="x", wall_s=wall_s, output_tokens=30, cached_tokens=0, ttft_s=np.full(3, 0.1),
                           tpot_s=np.full(3, 0.01), finished=3, lost=0, meter=meter,
                           first_scheduled_step=np.ones(3, dtype=int), outputs={})

    faster, slower = summarise([one_round(100.0), one_round(100.001)], SLO(ttft_s=10.0, tpot_s=0.5))[
        "per_round"]["goodput_req_s"]
    assert faster > slower   # 0.03 against 0.0299997 requests/s: a tie to four decimals
