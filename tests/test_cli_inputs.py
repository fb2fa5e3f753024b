"""Inputs mean what they say: a bad value is refused with one line naming its flag or file and
exit status 2 (never silently replaced by a default), and printed tables keep within 120 columns.
Fast: nothing here starts an engine, Ray or a simulation."""

from __future__ import annotations

import dataclasses

import pytest

from feather_cli import main as feather
from feather_cli import train as feather_train
from traces.table import WIDTH, format_table


def run(entry, argv: list[str], capsys) -> tuple[int, str, str]:
    """``(exit status, stdout, stderr)`` of ``entry.main(argv)``, whether it returns or exits."""
    try:
        code = entry.main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def error_line(err: str) -> str:
    """The one error line of a refused command (argparse prints its usage line above it)."""
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.parametrize("argv, flag", [
    (["sim", "compare", "--workload", "prefix-groups", "--kv-tokens", "0"], "--kv-tokens"),
    (["sim", "compare", "--workload", "prefix-groups", "--seed", "-1"], "--seed"),
    (["sim", "compare", "--workload", "prefix-groups", "--max-requests", "0"], "--max-requests"),
    (["bench", "env", "--steps", "0"], "--steps"),
    (["bench", "env", "--steps", "-5"], "--steps"),
    (["bench", "cht", "--batch", "0"], "--batch"),
    (["trace", "gen", "prefix-groups", "--num-requests", "0", "-o", "t.jsonl"], "--num-requests"),
    (["trace", "stats", "prefix-groups", "--block-size", "0"], "--block-size"),
    (["placement", "eval", "--workload", "prefix-groups", "--decay", "0"], "--decay"),
    (["sim", "validate", "--rounds", "0"], "--rounds"),
    (["bench", "serve", "--policies", "feather-rule", "--time-scale", "-1"], "--time-scale"),
    (["profile", "prefill", "--lengths", "0,256", "-o", "p.json"], "--lengths"),
])
def test_an_out_of_range_number_is_refused_naming_its_flag(argv, flag, capsys):
    code, _, err = run(feather, argv, capsys)
    assert code == 2
    line = error_line(err)
    assert line.startswith(f"feather {argv[0]} {argv[1]}: error: argument {flag}: ")
    assert "must be" in line or "positive integers" in line


@pytest.mark.parametrize("argv, flag", [
    (["--kv-capacity-tokens", "0"], "--kv-capacity-tokens"),
    (["--iterations", "-1"], "--iterations"),
    (["--seed", "-1"], "--seed"),
    (["--lr", "0"], "--lr"),
    (["--hidden-sizes", "64", "0"], "--hidden-sizes"),
    (["--env-runners", "-1"], "--env-runners"),
])
def test_feather_train_refuses_a_setting_out_of_range_before_anything_starts(tmp_path, argv, flag, capsys):
    code, _, err = run(feather_train, argv + ["--output", str(tmp_path / "out")], capsys)
    assert code == 2
    assert error_line(err).startswith(f"feather-train: error: argument {flag}: must be")
    assert not (tmp_path / "out").exists()


def test_a_config_file_setting_out_of_range_is_named_as_the_setting(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("kv_capacity_tokens: 0\n")
    code, _, err = run(feather_train, ["--config", str(config), "--output", str(tmp_path / "out")], capsys)
    assert code == 2 and error_line(err) == "feather-train: error: kv_capacity_tokens: must be >= 1, got 0"


def test_none_is_the_only_default():
    """0 is a value: the config classes refuse it where it is out of range instead of replacing it."""
    from feather_gym.simulator import EngineConfig
    from trainer.config import TrainConfig

    with pytest.raises(ValueError, match="^kv_capacity_tokens: must be >= 1, got 0$"):
        EngineConfig(kv_capacity_tokens=0)
    with pytest.raises(ValueError, match="^kv_capacity_tokens: must be >= 1, got 0$"):
        TrainConfig(kv_capacity_tokens=0)
    with pytest.raises(ValueError, match="^gamma: must be > 0 and <= 1, got nan$"):
        TrainConfig(gamma=float("nan"))
    given = dataclasses.replace(TrainConfig(profile="vllm-cpu"), kv_capacity_tokens=128, workload_instances=3)
    assert (given.resolved().kv_capacity_tokens, given.resolved().workload_instances) == (128, 3)
    assert TrainConfig(profile="vllm-cpu").resolved().kv_capacity_tokens == 5760      # the CPU mix's


def test_a_binary_trace_file_is_refused_with_its_name(tmp_path, capsys):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 4)
    for argv in (["trace", "stats", str(path)], ["sim", "compare", "--workload", str(path)]):
        code, _, err = run(feather, argv, capsys)
        assert code == 2
        assert error_line(err) == f"feather: error: {path}: not a trace file (JSONL or CSV): not UTF-8 text"


def test_a_binary_profile_is_refused_with_its_name(tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_bytes(b"\xff\xfe\x00binary")
    code, _, err = run(feather, ["profile", "fit", str(path)], capsys)
    assert code == 2 and error_line(err) == f"feather: error: {path}: not a cost-model profile (JSON): not UTF-8 text"


@pytest.mark.parametrize("argv, names", [
    (["placement", "eval", "--workload", "prefix-groups", "--prefill-profile", "bogus"],
     ("--prefill-profile bogus", "hybrid-vllm-cpu", "hybrid-torch-cpu")),
    (["sim", "compare", "--workload", "prefix-groups", "--profile", "bogus"], ("'bogus'", "vllm-cpu", "h200")),
    (["sim", "compare", "--workload", "bogus"], ("'bogus'", "mooncake", "prefix-groups")),
    (["sim", "compare", "--workload", "prefix-groups", "--policies", "bogus"], ("'bogus'", "feather-rule")),
    (["trace", "kinds", "bogus"], ("'bogus'", "prefix-groups", "no-sharing")),
])
def test_a_name_not_found_lists_the_shipped_choices(argv, names, capsys):
    code, _, err = run(feather, argv, capsys)
    line = error_line(err)
    assert code == 2 and all(name in line for name in names), line


def test_a_missing_model_folder_is_refused_naming_the_flag_without_a_download(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    missing = tmp_path / "no-such-model"
    code, _, err = run(feather, ["sim", "compare", "--workload", "prefix-groups", "--model", str(missing)], capsys)
    line = error_line(err)
    assert code == 2 and line.startswith(f"feather: error: --model {missing}: not a model folder")
    assert "trained, hybrid, remember, tiny" in line and "huggingface" not in err


def test_trace_kinds_lists_every_parameter_with_its_default_and_range(capsys):
    from traces.generators import GENERATOR_KINDS, parameters

    code, out, _ = run(feather, ["trace", "kinds"], capsys)
    assert code == 0 and all(f"{kind}: " in out for kind in GENERATOR_KINDS)
    assert max(map(len, out.splitlines())) <= WIDTH
    homogeneity = next(row for row in parameters("prefix-groups") if row["name"] == "homogeneity")
    assert homogeneity == {"name": "homogeneity", "type": "float", "default": 0.0, "range": "in [0, 1]"}
    assert any(line.split() == ["homogeneity", "float", "0.0", "in", "[0,", "1]"] for line in out.splitlines())
    assert "need tools_per_task <= tool_pool" not in out and "tools_per_task <= tool_pool" in out
    with pytest.raises(SystemExit):
        feather.main(["trace", "gen", "--help"])
    assert "feather trace kinds" in capsys.readouterr().out


@pytest.mark.parametrize("entry", [feather, feather_train])
def test_version(entry, capsys):
    code, out, _ = run(entry, ["--version"], capsys)
    assert code == 0 and out.startswith("feather-gym ") and out.split()[1] not in ("", "None")


LONG_SPEC = "prefix-groups:" + ",".join(f"suffix_tokens_min={16 + i}" for i in range(12)) + ",rate=1000"


def test_the_shared_table_keeps_within_120_columns():
    assert len(LONG_SPEC) > 250
    rows = [[LONG_SPEC, *(f"{1234.5 + i:.1f} {1.0 + i / 100:.3f}x" for i in range(12))]]
    text = format_table(["workload", *(f"policy-{i}" for i in range(12))], rows)
    assert max(map(len, text.splitlines())) <= WIDTH
    assert "policy-11" in text and text.count("\n\n") >= 1          # columns that do not fit continue below


def test_the_held_out_table_names_workloads_by_label_within_120_columns():
    from trainer.evaluate import format_table as held_out_table

    names = ["fcfs", "lpm", "dfs", "cht", "feather-rule", "cht-dfs", "group-label", "warm-start", "trained"]
    specs = [LONG_SPEC, "prefix-groups", "/data/recordings/chat_trace.jsonl@0.7-1",
             "no-sharing:num_requests=32"]
    results = [{"workload": spec, "throughput_tok_s": dict.fromkeys(names, 1234.5),
                "ratio_to_fcfs": dict.fromkeys(names, 1.0123), "target": ">= best heuristic (feather-rule)",
                "target_met": True, "arrival_span_s": 0.1, "margin": 1.0, "trained_runs": [1234.5],
                "reference_runs": {"warm-start": [1234.5]},
                "load": {n: {"makespan_s": 12.3, "queue_delay_mean_s": 1.2, "queue_delay_p99_s": 3.4,
                             "slo_met_fraction": 0.5} for n in names}}
               for spec in specs]
    text = held_out_table({"profile": "vllm-cpu", "seeds": list(range(10_001, 10_031)), "workloads": results})
    assert max(map(len, text.splitlines())) <= WIDTH
    assert LONG_SPEC[:40] not in text and "suffix_tokens_min" not in text
    rows = {line.split()[0] for line in text.splitlines() if line.endswith("met") or line.endswith("0.1")}
    assert rows == {"prefix-groups#1", "prefix-groups#2", "chat_trace@0.7-1", "no-sharing"}
    assert "over warm-start" in text and text.splitlines()[-1].startswith("recorded ")     # the summary per load
