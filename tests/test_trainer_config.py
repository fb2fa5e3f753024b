"""trainer.config and the feather-train CLI: settings precedence and clear errors before Ray starts."""

from __future__ import annotations

import pytest

from trainer.cli import build_train_parser, main
from feather_gym.costmodel import hardware_profile
from trainer.config import TrainConfig, build_config, load_config_file


def flags(argv: list[str]) -> dict:
    args = vars(build_train_parser().parse_args(argv))
    return {k: v for k, v in args.items() if k not in ("config", "json")}


def test_defaults_mix_sharing_and_no_sharing():
    config = build_config({}, flags([]))
    assert config == TrainConfig()
    assert any(spec.startswith("no-sharing") for spec in config.workloads)
    assert any(spec.startswith(("prefix-groups", "tool-agent", "long-doc-qa")) for spec in config.workloads)
    resolved = config.resolved()
    assert resolved.profile == hardware_profile() and resolved.output_dir is not None


@pytest.mark.parametrize("suffix,text", [
    (".yaml", "workloads: [no-sharing, 'prefix-groups:groups=3']\niterations: 4\nseed: 7\nhidden_sizes: [32, 32]\n"),
    (".toml", "workloads = ['no-sharing', 'prefix-groups:groups=3']\niterations = 4\nseed = 7\nhidden_sizes = [32, 32]\n"),
])
def test_config_file_then_flags(tmp_path, suffix, text):
    path = tmp_path / f"train{suffix}"
    path.write_text(text)
    config = build_config(load_config_file(path), flags(["--seed", "9", "--output", str(tmp_path / "out")]))
    assert config.workloads == ("no-sharing", "prefix-groups:groups=3")
    assert config.iterations == 4 and config.seed == 9 and config.hidden_sizes == (32, 32)
    assert config.output_dir == tmp_path / "out"


def test_config_file_errors_name_the_file_and_setting(tmp_path):
    bad_key = tmp_path / "a.yaml"
    bad_key.write_text("iteratoins: 3\n")
    with pytest.raises(ValueError, match=r"a\.yaml: unknown setting\(s\) iteratoins; valid: workloads"):
        load_config_file(bad_key)
    bad_type = tmp_path / "b.toml"
    bad_type.write_text("iterations = 'many'\n")
    with pytest.raises(ValueError, match=r"b\.toml: iterations must be an integer"):
        load_config_file(bad_type)
    with pytest.raises(ValueError, match="must end in .yaml, .yml or .toml"):
        load_config_file(tmp_path / "c.json")


@pytest.mark.parametrize("argv,message", [
    (["--workload", "prefix-grups"], "unknown workload 'prefix-grups'"),
    (["--workload", "prefix-groups:groupz=3"], "valid keys"),
    (["--profile", "tpu-v9"], "no profile 'tpu-v9'"),
    (["--profile", "/nonexistent/profile.json"], "profile.json"),
    (["--iterations", "0"], "iterations: must be >= 1"),
    (["--resume", "/nonexistent/checkpoint"], "checkpoint directory /nonexistent/checkpoint does not exist"),
    (["--warm-start", "fifo"], "warm_start: 'fifo' is not a baseline"),
])
def test_bad_input_fails_fast_with_a_clear_error(tmp_path, capsys, argv, message):
    assert main(argv + ["--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("feather-train: error: ") and message in err
    assert not (tmp_path / "out").exists()          # nothing started, nothing written


def test_resume_from_a_corrupted_checkpoint_fails_before_training(tmp_path, capsys):
    checkpoint = tmp_path / "checkpoint"
    (checkpoint / "learner_group" / "learner" / "rl_module" / "default_policy").mkdir(parents=True)
    (checkpoint / "learner_group" / "learner" / "rl_module" / "default_policy" / "class_and_ctor_args.pkl").write_bytes(b"\x80\x05trunc")
    assert main(["--resume", str(checkpoint), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "feather-train: error: checkpoint" in err and "not a readable RLlib checkpoint" in err
    assert not (tmp_path / "out").exists()


def test_export_needs_checkpoint_and_output(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["export"])
    assert exit_info.value.code == 2 and "checkpoint" in capsys.readouterr().err


def test_validation_and_evaluation_seeds_must_differ():
    with pytest.raises(ValueError, match="disjoint"):
        TrainConfig(eval_seeds=(1, 2), validation_seeds=(2, 3)).validate()
