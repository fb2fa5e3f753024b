"""A tiny real training run: RLlib PPO -> checkpoint -> policy.onnx (contract + parity) -> evaluation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch

from feather_cli.main import main as feather
from feather_gym.observation import FEATURE_NAMES, OBS_VERSION
from feather_gym.policies import DEFAULT_MAX_WAIT_STEPS
from trainer.config import TrainConfig
from trainer.train import NetworkPolicy, ppo_config, train

WORKLOADS = ("prefix-groups:num_requests=48,groups=3,rate=100", "no-sharing:num_requests=48@load=0.9")


@pytest.fixture(autouse=True)
def private_ray(monkeypatch):
    """Local Ray without auth; trainer.train.ray_session gives it a fresh temp dir and removes it."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")


def default_module(k: int):
    """PPO's default module of ``feather-train``'s network settings, untrained (no Ray needed)."""
    from gymnasium.spaces import Box, Discrete

    from feather_gym.observation import OBS_CLIP, observation_size

    algo_config = ppo_config(TrainConfig(workloads=WORKLOADS, profile="h100", num_candidates=k))
    spec = algo_config.get_default_rl_module_spec()
    spec.observation_space = Box(0.0, OBS_CLIP, (observation_size(k),), np.float32)
    spec.action_space, spec.model_config = Discrete(k + 1), algo_config.model_config
    torch.manual_seed(k)
    return spec.build()


@pytest.mark.parametrize("k", [1, 4])
def test_validation_acts_as_the_modules_greedy_policy(k):
    from types import SimpleNamespace

    from ray.rllib.core.columns import Columns

    module = default_module(k)
    policy = NetworkPolicy(module)
    rows = np.random.default_rng(k).uniform(0, 2, (200, module.observation_space.shape[0])).astype(np.float32)
    with torch.no_grad():
        logits = module.forward_inference({Columns.OBS: torch.from_numpy(rows)})[Columns.ACTION_DIST_INPUTS]
    assert policy.num_candidates == k
    assert [policy.decide(SimpleNamespace(observation=row)) for row in rows] == logits.argmax(-1).tolist()


@pytest.mark.train
@pytest.mark.timeout(240)
def test_tiny_training_run_exports_a_valid_policy(tmp_path, capsys, monkeypatch):
    # A relative output folder, like the default runs/feather-<time>: RLlib needs absolute paths.
    monkeypatch.chdir(tmp_path)
    config = TrainConfig(workloads=WORKLOADS, profile="h100", iterations=2, num_env_runners=0,
                         envs_per_env_runner=2, window_requests=32, train_batch_size=256, minibatch_size=128,
                         num_epochs=1, hidden_sizes=(16,), eval_seeds=(10_001,), validation_seeds=(20_001,),
                         validate_every=1, num_candidates=1, improve_warm_start=None, output_dir=Path("run"))
    summary = train(config, progress=print)
    out = tmp_path / "run"

    progress = capsys.readouterr().out
    assert "iter    1 | env steps" in progress and "iter    2 |" in progress and "left ~" in progress
    assert summary["iterations"] == 2 and summary["env_steps"] >= 2 * 256
    # The sampling policy's entropy is logged per iteration (ADD/STOP: at most ln 2; the smoothed clone is not greedy).
    assert "| entropy " in progress
    assert all(0 < record["policy_entropy"] <= math.log(2) + 1e-6 for record in summary["history"])
    # Warm start from the Feather rule, then the greedy network validated before and after each iteration;
    # the checkpoint is the best-validated one.
    assert "warm start: cloned feather-rule" in progress and summary["warm_start"]["decisions"] > 0
    # Cloned as it is (improve_warm_start off: playouts cost minutes), then evaluated beside the clone and
    # the demonstrator it was recorded from.
    assert "improved by playouts" not in progress and summary["warm_start"]["min_gain"] is None
    assert "trained over the demonstrator (feather-rule as recorded)" in progress
    assert set(summary["beyond_demonstrator"]["paired_by_workload"]) == set(WORKLOADS)
    assert [v["iteration"] for v in summary["validation"]["history"]] == [0, 1, 2]
    assert "validation after iteration 2" in progress
    # Validation and the comparison with the clone report per load (a workload at its own rate is "recorded").
    assert set(summary["validation"]["history"][-1]["by_load"]) == {"0.9", "recorded"}
    assert set(summary["beyond_clone"]["by_load"]) == {"0.9", "recorded"} and "by load" in progress
    # How the time went: the budget's parts and the rest, adding up to the whole run.
    spent = summary["time_spent"]
    parts = ("ray_and_envs_s", "warm_start_record_s", "warm_start_fit_s", "validation_benchmark_s", "validation_s",
             "ppo_s", "evaluation_s", "other_s")
    assert all(spent[part] >= 0 for part in parts) and spent["ppo_s"] > 0 and spent["validation_s"] > 0
    assert sum(spent[part] for part in parts) == pytest.approx(spent["total_s"], abs=0.05)
    assert "time: " in progress and "of the budget: " in progress
    assert summary["validation"]["best_iteration"] in (0, 1, 2)
    # The first validation is the start; a later network kept is significantly faster than it on some
    # workload and slower on none.
    slower = {v["iteration"]: v["slower_than_start"] for v in summary["validation"]["history"]}
    faster = {v["iteration"]: v["faster_than_start"] for v in summary["validation"]["history"]}
    best = summary["validation"]["best_iteration"]
    assert slower[0] == faster[0] == [] and slower[best] == []
    assert best == 0 or faster[best]
    # ... and serves no smaller share of requests within the SLO than the start.
    within = {v["iteration"]: v["slo_met_fraction"] for v in summary["validation"]["history"]}
    assert within[best] >= (1 - 0.001) * within[0]
    assert all(0 <= share <= 1 for share in within.values())

    model = onnx.load(out / "policy.onnx")
    onnx.checker.check_model(model, full_check=True)
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["feather.obs_version"] == OBS_VERSION
    assert json.loads(meta["feather.feature_names"]) == list(FEATURE_NAMES)
    assert meta["feather.profile"] == "h100" and json.loads(meta["feather.workload"]) == list(WORKLOADS)
    assert meta["feather.max_wait_steps"] == str(DEFAULT_MAX_WAIT_STEPS)     # the bound it was trained with
    parity = summary["export_parity"]
    assert parity["max_abs_diff_random"] < 1e-4 and parity["max_abs_diff_real"] < 1e-4

    for name in ("learning_curve.png", "summary.json"):
        assert (out / name).stat().st_size > 0
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((out / "summary.json").read_text())["iterations"] == 2

    (result_a, result_b) = summary["evaluation"]["workloads"]
    for result in (result_a, result_b):
        assert {"fcfs", "lpm", "dfs", "feather-rule", "group-label", "clone", "demonstrator",
                "trained"} <= set(result["throughput_tok_s"])
        assert result["ratio_to_fcfs"]["fcfs"] == 1.0 and result["throughput_tok_s"]["trained"] > 0
    assert result_a["target"].startswith(">= best heuristic") and result_b["target"].endswith("x fcfs")

    # `feather export` of the checkpoint writes the same network with the run's labels.
    assert feather(["export", "run/checkpoint", "-o", "again.onnx"]) == 0
    again = onnx.load(tmp_path / "again.onnx")
    assert {p.key: p.value for p in again.metadata_props} == meta
    obs = np.random.default_rng(1).uniform(0, 2, (33, len(FEATURE_NAMES))).astype(np.float32)
    outputs = [onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"obs": obs})[0]
               for path in (out / "policy.onnx", tmp_path / "again.onnx")]
    assert outputs[0].shape == (33, 2) and np.allclose(*outputs, atol=1e-6)
