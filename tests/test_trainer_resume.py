"""``feather-train --resume RUN_DIR --profile NEW``: fine-tune a finished run on another profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from feather_cli.train import main
from trainer.config import TrainConfig, build_config, resumed_run
from trainer.train import train

WORKLOADS = ("prefix-groups:num_requests=48,groups=3,rate=100", "no-sharing:num_requests=48")
TINY = dict(workloads=WORKLOADS, num_env_runners=0, envs_per_env_runner=2, window_requests=32, train_batch_size=256,
            minibatch_size=128, num_epochs=1, hidden_sizes=(16,), eval_seeds=(10_001,), validation_seeds=(20_001,),
            validate_every=1, improve_warm_start=None)


def fake_run(root: Path, **config) -> Path:
    """A run folder as feather-train leaves it, with a checkpoint that cannot be read."""
    module = root / "checkpoint" / "learner_group" / "learner" / "rl_module" / "default_policy"
    module.mkdir(parents=True)
    (module / "class_and_ctor_args.pkl").write_bytes(b"\x80\x05trunc")
    summary = {"config": TrainConfig(**config).to_json() | {"output_dir": str(root), "time_budget_s": 600.0}}
    (root / "summary.json").write_text(json.dumps(summary))
    return root


def test_a_run_folder_resumes_its_checkpoint_with_its_settings_but_not_its_budget(tmp_path):
    run = fake_run(tmp_path / "run", workloads=WORKLOADS, kv_capacity_tokens=5760, hidden_sizes=(16,), seed=3)
    checkpoint, settings = resumed_run(run)
    assert checkpoint == run / "checkpoint"
    assert settings["workloads"] == list(WORKLOADS) and settings["kv_capacity_tokens"] == 5760
    assert settings["hidden_sizes"] == [16] and settings["seed"] == 3
    assert not {"output_dir", "time_budget_s", "iterations", "resume", "warm_start"} & set(settings)
    assert resumed_run(run / "checkpoint") == (run / "checkpoint", {})        # a bare checkpoint: no settings


def test_an_older_runs_settings_this_build_no_longer_has_are_left_out(tmp_path):
    run = fake_run(tmp_path / "run", workloads=WORKLOADS, seed=3)
    summary = json.loads((run / "summary.json").read_text())
    removed = {"discount_half_life_s": None, "dagger_rounds": 0, "improve_actions": "stop", "reward_baseline": "fcfs",
               "loss_aversion": 1.0, "wait_penalty": 0.0}
    (run / "summary.json").write_text(json.dumps({"config": summary["config"] | removed}))
    _, settings = resumed_run(run)
    assert not set(removed) & set(settings) and settings["seed"] == 3
    assert build_config(settings, {}).workloads == WORKLOADS


def test_resuming_a_run_folder_checks_its_checkpoint_before_training(tmp_path, capsys):
    run = fake_run(tmp_path / "run", workloads=WORKLOADS)
    assert main(["--resume", str(run), "--profile", "vllm-cpu", "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {run / 'checkpoint'}" in err and "not a readable RLlib checkpoint" in err
    assert not (tmp_path / "out").exists()


def test_a_run_of_another_observation_contract_is_neither_resumed_nor_exported(tmp_path, capsys):
    """Its network reads its inputs with other meanings (``feather-obs-3``: waiting in seconds;
    ``feather-obs-4``: no KV residency)."""
    run = fake_run(tmp_path / "run", workloads=WORKLOADS)
    label = {"profile": "vllm-cpu", "workloads": list(WORKLOADS), "trained_at": "2026-12-01T00:00:00+00:00"}
    (run / "checkpoint" / "feather_training.json").write_text(json.dumps(label))   # written before feather-obs-4
    assert main(["--resume", str(run), "--output", str(tmp_path / "out")]) == 2
    assert "observation version 'feather-obs-3 or earlier', this feather-gym builds 'feather-obs-5'" \
        in capsys.readouterr().err
    (run / "checkpoint" / "feather_training.json").write_text(json.dumps(label | {"obs_version": "feather-obs-4"}))
    assert main(["export", str(run / "checkpoint"), "-o", str(tmp_path / "p.onnx")]) == 2
    assert "'feather-obs-4', this feather-gym builds 'feather-obs-5'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "p.onnx").exists()


@pytest.mark.train
@pytest.mark.timeout(420)
def test_fine_tune_a_tiny_run_on_another_profile(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    first = train(TrainConfig(**TINY, profile="h100", iterations=2, output_dir=tmp_path / "first"), progress=print)
    assert main(["--resume", str(tmp_path / "first"), "--profile", "a100", "--iterations", "1",
                 "--output", str(tmp_path / "tuned"), "--json"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert f"resumed from {tmp_path / 'first' / 'checkpoint'}" in out and "warm start" not in out.split("resumed")[1]
    assert summary["config"]["profile"] == "a100" and summary["config"]["hidden_sizes"] == [16]
    assert summary["config"]["workloads"] == first["config"]["workloads"]
    # the restored network is validated first (the one to beat), then after the one iteration
    history = [v["iteration"] for v in summary["validation"]["history"]]
    assert len(history) == 2 and history[1] == history[0] + 1
    assert (tmp_path / "tuned" / "policy.onnx").stat().st_size > 0


@pytest.mark.train
@pytest.mark.timeout(420)
def test_the_online_loop_fine_tunes_through_the_trainers_api_in_its_own_process(tmp_path, monkeypatch):
    from deploy.bench.loop import fine_tune

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    train(TrainConfig(**TINY, profile="h100", iterations=1, output_dir=tmp_path / "first"), progress=print)
    policy = fine_tune(tmp_path / "first", "a100", tmp_path / "tuned", time_budget_s=5)
    assert policy == tmp_path / "tuned" / "policy.onnx" and policy.stat().st_size > 0
    summary = json.loads((tmp_path / "tuned" / "summary.json").read_text())
    assert summary["config"]["profile"] == "a100" and summary["config"]["time_budget_s"] == 5
    with pytest.raises(RuntimeError, match="fine-tuning"):
        fine_tune(tmp_path / "nowhere", "a100", tmp_path / "never", time_budget_s=5)
