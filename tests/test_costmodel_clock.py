"""Clock calibration (feather_gym.costmodel.clock): two factors (prefill, the rest) fitted on timed
live steps, and the scaled cost model they give (no engine: the steps are made here)."""

from __future__ import annotations

import numpy as np
import pytest

from feather_gym.costmodel import DecodeBatch, load_cost_model
from feather_gym.costmodel.clock import clock_error, fit_clock, predicted_step_s, step_factors
from feather_gym.costmodel.features import PREFILL_COLUMNS
from feather_gym.costmodel.refit import LiveStep

#: Compositions as the engine logs them: prefill bursts of unlike chunks, mixed and decode steps.
COMPOSITIONS = [
    {"decode_requests": 0, "decode_kv_tokens": 0, "decode_unique_kv_tokens": 0, "decode_groups": 0,
     "prefill_chunks": [[400, 0], [420, 0], [3276, 0]]},
    {"decode_requests": 0, "decode_kv_tokens": 0, "decode_unique_kv_tokens": 0, "decode_groups": 0,
     "prefill_chunks": [[60, 384], [90, 384]]},
    {"decode_requests": 8, "decode_kv_tokens": 8 * 450, "decode_unique_kv_tokens": 2 * 384 + 8 * 66,
     "decode_groups": 2, "prefill_chunks": [[40, 384]]},
    {"decode_requests": 16, "decode_kv_tokens": 16 * 480, "decode_unique_kv_tokens": 4 * 384 + 16 * 96,
     "decode_groups": 4, "prefill_chunks": []},
    {"decode_requests": 1, "decode_kv_tokens": 500, "decode_unique_kv_tokens": 500, "decode_groups": 1,
     "prefill_chunks": []},
]
NOTHING = {"decode_requests": 0, "decode_kv_tokens": 0, "decode_unique_kv_tokens": 0, "decode_groups": 0,
           "prefill_chunks": []}


def timed(model, factor_per_step: list[float], extra: list[dict] = ()) -> list[LiveStep]:
    """LiveSteps of :data:`COMPOSITIONS` whose wall time is ``factor`` times ``model``'s prediction."""
    steps = []
    for i, (composition, factor) in enumerate(zip(COMPOSITIONS, factor_per_step)):
        probe = LiveStep(step=i, time_unix_s=float(i), step_wall_s=0.0, step_cpu_s=0.0, **composition)
        seconds = factor * predicted_step_s(model, probe)
        steps.append(LiveStep(step=i, time_unix_s=float(i), step_wall_s=seconds, step_cpu_s=seconds / 2,
                              **composition))
    return steps + [LiveStep(step=99, time_unix_s=99.0, step_wall_s=0.01, step_cpu_s=0.01, **c) for c in extra]


def test_a_machine_uniformly_slower_is_one_factor_and_the_scaled_model_predicts_its_steps():
    base = load_cost_model("vllm-cpu")
    steps = timed(base, [1.25] * len(COMPOSITIONS), extra=[NOTHING])     # a step with no work is left out
    calibration = fit_clock(steps, base)
    assert calibration.factor == pytest.approx(1.25) and calibration.prefill_factor == pytest.approx(1.25)
    assert calibration.steps == len(COMPOSITIONS)
    assert calibration.mape_before == pytest.approx(0.2) and calibration.mape_after == pytest.approx(0.0, abs=1e-12)
    assert calibration.measured_s == pytest.approx(1.25 * calibration.predicted_s)
    scaled = base.scaled(calibration.factor)
    assert scaled.name == "vllm-cpu@x1.25" and scaled.block_size == base.block_size
    for step in steps[:-1]:
        assert predicted_step_s(scaled, step) == pytest.approx(step.step_wall_s)
    assert fit_clock(steps, base, clock="cpu").factor == pytest.approx(0.625)          # the CPU clock's times


def test_a_machine_whose_prefill_drifted_apart_is_two_factors_and_the_scaled_model_predicts_its_steps():
    base = load_cost_model("vllm-cpu")
    today = base.scaled(1.2, prefill_factor=0.7)
    assert today.name == "vllm-cpu@x1.2/prefill x0.7"
    assert all(today.coefficients[c] == pytest.approx(v * (0.7 if c in PREFILL_COLUMNS else 1.2))
               for c, v in base.coefficients.items())
    calibration = fit_clock(timed(today, [1.0] * len(COMPOSITIONS)), base)
    assert (calibration.factor, calibration.prefill_factor) == (pytest.approx(1.2), pytest.approx(0.7))
    assert calibration.mape_after == pytest.approx(0.0, abs=1e-9) and calibration.mape_before > 0.05
    assert calibration.scale(base).coefficients == pytest.approx(dict(today.coefficients))
    one = fit_clock(timed(today, [1.0] * len(COMPOSITIONS)), base.scaled(1.0, prefill_factor=1.0))
    assert one.factor == pytest.approx(1.2)                     # a prefill factor of 1 changes nothing


def test_without_prefill_work_one_factor_serves_both_and_what_two_cannot_explain_stays():
    base = load_cost_model("vllm-cpu")
    decode_only = [s for s in timed(base, [1.5] * len(COMPOSITIONS)) if not s.prefill_chunks]
    calibration = fit_clock(decode_only, base)
    assert calibration.factor == calibration.prefill_factor == pytest.approx(1.5)
    uneven = fit_clock(timed(base, [1.0, 2.0, 1.0, 2.0, 1.0]), base)
    assert uneven.factor > 0 and uneven.prefill_factor > 0 and uneven.mape_after > 0.05


def test_steps_compose_chunks_as_the_simulator_does():
    model = load_cost_model("vllm-cpu")
    batch = DecodeBatch(8, 8 * 450, 2 * 384 + 8 * 66, 2)
    fixed = model.coefficients["fixed"]
    assert model.chunked_step_s(batch, []) == model.step_s(batch)
    assert model.chunked_step_s(batch, [(40, 384), (100, 0)]) == pytest.approx(
        model.step_s(batch, 40, 384) + model.prefill_s(100, 0) - fixed)


def test_a_scaled_profile_has_its_capacity_divided_by_the_factor():
    """No admission reads the clock, so k times slower steps sustain exactly 1/k of the arrival rate."""
    from feather_gym.load import find_capacity
    from traces import resolve_workload

    trace = resolve_workload("prefix-groups:num_requests=40,groups=4,prefix_tokens=384,output_tokens_max=32,rate=2",
                             seed=0)
    base = load_cost_model("vllm-cpu")
    fast, slow = find_capacity(trace, base), find_capacity(trace, base.scaled(2.0))
    assert slow.requests_per_s == pytest.approx(fast.requests_per_s / 2, rel=0.03)


@pytest.mark.parametrize("factor", [0.0, -1.0, float("inf"), float("nan")])
def test_scaled_refuses_a_factor_that_is_not_a_positive_number(factor):
    with pytest.raises(ValueError, match="clock factor"):
        load_cost_model("vllm-cpu").scaled(factor)
    with pytest.raises(ValueError, match="clock factor"):
        load_cost_model("vllm-cpu").scaled(1.0, prefill_factor=factor)


def test_the_clock_error_of_a_model_is_how_much_longer_the_steps_took_than_it_predicts():
    base = load_cost_model("vllm-cpu")
    steps = timed(base, [1.25, 1.0, 1.0, 1.0, 1.0], extra=[NOTHING])          # a step with no work is left out
    predicted = sum(predicted_step_s(base, step) for step in steps[:-1])
    assert clock_error(steps, base) == pytest.approx(sum(step.step_wall_s for step in steps[:-1]) / predicted - 1)
    assert clock_error(steps, base) > 0
    assert clock_error(timed(base, [1.1] * 5), base.scaled(1.1)) == pytest.approx(0.0, abs=1e-12)
    assert clock_error(timed(base, [0.8] * 5), base) == pytest.approx(-0.2)
    assert clock_error(timed(base, [1.0] * 5), base, clock="cpu") == pytest.approx(-0.5)   # the CPU clock's times
    with pytest.raises(ValueError, match="no clock to calibrate"):
        clock_error(timed(base, [], extra=[NOTHING]), base)


def test_step_factors_are_each_steps_error_in_order_scaled_to_a_mean_of_one():
    base = load_cost_model("vllm-cpu")
    errors = [1.1, 0.8, 1.5, 1.0, 1.1]
    steps = timed(base.scaled(2.0), errors, extra=[NOTHING])       # a step with no work is left out
    factors = step_factors(steps, base)
    np.testing.assert_allclose(factors, np.array(errors) / np.mean(errors), rtol=1e-12)
    np.testing.assert_allclose(step_factors(steps, base.scaled(2.0)), factors, rtol=1e-12)   # the clock's mean apart
    with pytest.raises(ValueError, match="computed anything"):
        step_factors(timed(base, [], extra=[NOTHING]), base)


def test_fit_clock_refuses_steps_without_work_and_an_unknown_clock():
    base = load_cost_model("vllm-cpu")
    nothing = [LiveStep(step=0, time_unix_s=0.0, step_wall_s=0.01, step_cpu_s=0.01, **NOTHING)]
    with pytest.raises(ValueError, match="no clock to calibrate"):
        fit_clock(nothing, base)
    with pytest.raises(ValueError, match="clock must be one of"):
        fit_clock(timed(base, [1.0] * 5), base, clock="gpu")


def test_timed_steps_written_as_a_step_log_read_back_equal(tmp_path):
    from feather_gym.costmodel.refit import read_step_logs, write_step_log

    steps = timed(load_cost_model("vllm-cpu"), [1.0, 1.1, 0.9, 1.3, 0.7], extra=[NOTHING])
    write_step_log(tmp_path / "steps.jsonl", steps)
    assert read_step_logs([tmp_path / "steps.jsonl"]) == (steps, 0)
    write_step_log(tmp_path / "steps.jsonl", steps[:2])               # a file written again holds only its steps
    assert read_step_logs([tmp_path / "steps.jsonl"]) == (steps[:2], 0)


def test_feather_profile_clock_fits_logged_steps_and_says_how_far_off_it_is_on_others(tmp_path, capsys):
    import json

    from feather_cli.main import main
    from feather_gym.costmodel.refit import write_step_log

    base = load_cost_model("vllm-cpu")
    today, later = base.scaled(1.2, prefill_factor=0.7), base.scaled(1.32, prefill_factor=0.77)
    write_step_log(tmp_path / "calibration.jsonl", timed(today, [1.0] * len(COMPOSITIONS), extra=[NOTHING]))
    (tmp_path / "later.jsonl").write_text("not a step\n")
    write_step_log(tmp_path / "later.1.jsonl", timed(later, [1.0] * len(COMPOSITIONS)))
    assert main(["profile", "clock", "--from-logs", str(tmp_path / "calibration.jsonl"), "--profile", "vllm-cpu",
                 "--against", str(tmp_path / "later.jsonl"), str(tmp_path / "later.1.jsonl"), "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert (report["clock_factor"], report["clock_prefill_factor"]) == (pytest.approx(1.2), pytest.approx(0.7))
    assert report["calibrated_profile"] == "vllm-cpu@x1.2/prefill x0.7" and report["clock"] == "wall"
    assert (report["logged_steps"], report["calibration_steps"], report["skipped_lines"]) == (6, 5, 0)
    assert report["calibration_mape_after"] == pytest.approx(0.0, abs=1e-9)
    assert report["step_factor_cv"] == pytest.approx(0.0, abs=1e-9)              # the clock explains every step
    assert (report["against_logged_steps"], report["against_skipped_lines"]) == (5, 1)
    assert report["against_clock_error_fraction"] == pytest.approx(0.1)           # 10% slower than calibrated
    assert report["against_base_clock_error_fraction"] == pytest.approx(
        clock_error(timed(later, [1.0] * len(COMPOSITIONS)), base))
    assert "+10.0% longer than vllm-cpu@x1.2/prefill x0.7 predicts" in " ".join(lines[:-1])


def test_feather_profile_clock_refuses_a_log_without_records_naming_it(tmp_path, capsys):
    from feather_cli.main import main
    from feather_gym.costmodel.refit import write_step_log

    (tmp_path / "cut.jsonl").write_text('{"step": 1, "time_unix_s"\n')
    assert main(["profile", "clock", "--from-logs", str(tmp_path / "cut.jsonl"), "--profile", "vllm-cpu"]) == 2
    assert f"{tmp_path / 'cut.jsonl'}: no step-log records (1 unreadable lines)" in capsys.readouterr().err
    write_step_log(tmp_path / "good.jsonl", timed(load_cost_model("vllm-cpu"), [1.0] * len(COMPOSITIONS)))
    assert main(["profile", "clock", "--from-logs", str(tmp_path / "good.jsonl"), "--profile", "vllm-cpu",
                 "--against", str(tmp_path / "cut.jsonl")]) == 2
    assert f"{tmp_path / 'cut.jsonl'}: no step-log records (1 unreadable lines)" in capsys.readouterr().err
