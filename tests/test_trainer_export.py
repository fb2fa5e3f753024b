"""trainer.export: the ONNX policy contract, parity with torch, and clear checkpoint errors."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import numpy as np
import onnx
import onnxruntime
import pytest
import torch

from feather_cli.train import main
from feather_gym.observation import ACTION_MEANINGS, FEATURE_NAMES, OBS_NORMALIZATION, OBS_VERSION
from trainer.export import export_policy_module, load_policy_network, sample_observations

F = len(FEATURE_NAMES)


def small_network() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(F, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


@pytest.fixture(scope="module")
def real_observations() -> np.ndarray:
    return sample_observations(profile="h100", workload="prefix-groups:num_requests=60", rows=128)


def test_export_writes_the_contract(tmp_path, real_observations):
    path = tmp_path / "policy.onnx"
    trained_at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    report = export_policy_module(small_network(), path, profile="h100", workload=["prefix-groups", "no-sharing"],
                                  trained_at=trained_at, observations=real_observations)

    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17
    (inp,), (out,) = model.graph.input, model.graph.output
    assert (inp.name, out.name) == ("obs", "action_logits")
    in_dims = inp.type.tensor_type.shape.dim
    assert in_dims[0].dim_param and not in_dims[0].HasField("dim_value")      # dynamic batch
    assert in_dims[1].dim_value == F
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["feather.obs_version"] == OBS_VERSION
    assert json.loads(meta["feather.feature_names"]) == list(FEATURE_NAMES)
    assert json.loads(meta["feather.obs_normalization"]) == {k: list(v) for k, v in OBS_NORMALIZATION.items()}
    assert json.loads(meta["feather.action_meanings"]) == list(ACTION_MEANINGS) == ["STOP", "ADD"]
    assert meta["feather.env_id"] == "feather_gym/BatchFormation-v0"
    assert meta["feather.profile"] == "h100"
    assert "feather.max_wait_steps" not in meta           # not given: not recorded (feather-train records it)
    assert json.loads(meta["feather.workload"]) == ["prefix-groups", "no-sharing"]
    assert datetime.fromisoformat(meta["feather.trained_at"]) == trained_at

    assert report["num_real_observations"] == len(real_observations) and report["num_random_observations"] > 0
    assert report["max_abs_diff_random"] < 1e-4 and report["max_abs_diff_real"] < 1e-4
    assert report["action_agreement_real"] == 1.0

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for n in (1, 37):
        obs = real_observations[:n]
        (logits,) = session.run(["action_logits"], {"obs": obs})
        expected = small_network()(torch.from_numpy(obs)).detach().numpy()
        assert logits.shape == (n, 2) and np.allclose(logits, expected, atol=1e-5)


def test_export_samples_real_observations_itself(tmp_path):
    report = export_policy_module(small_network(), tmp_path / "p.onnx", profile="h100",
                                  workload="prefix-groups:num_requests=40")
    meta = {p.key: p.value for p in onnx.load(tmp_path / "p.onnx").metadata_props}
    assert meta["feather.workload"] == "prefix-groups:num_requests=40"
    assert report["num_real_observations"] > 0 and report["max_abs_diff_real"] < 1e-4


def test_export_rejects_a_network_of_the_wrong_shape(tmp_path, real_observations):
    with pytest.raises(ValueError, match="expected \\[3, 2\\]"):
        export_policy_module(torch.nn.Linear(F, 3), tmp_path / "p.onnx", profile="h100", workload="no-sharing",
                             observations=real_observations)


@pytest.mark.parametrize("damage", ["empty", "garbage"])
def test_corrupted_checkpoint_is_a_clear_error(tmp_path, damage, capsys):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    if damage == "garbage":
        (checkpoint / "class_and_ctor_args.pkl").write_bytes(b"not a pickle at all")
    with pytest.raises(ValueError, match="not a readable RLlib checkpoint"):
        load_policy_network(checkpoint)
    assert main(["export", str(checkpoint), "-o", str(tmp_path / "p.onnx")]) == 2
    assert "feather-train: error: checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "p.onnx").exists()


def test_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nowhere"), "-o", str(tmp_path / "p.onnx")]) == 2
    assert "does not exist" in capsys.readouterr().err
