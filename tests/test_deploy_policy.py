"""deploy: the ONNX policy runtime, its validation of policy files, and the vLLM version guard."""

from __future__ import annotations

import logging

import deploy_policies as policies
import numpy as np
import pytest

from deploy.vllm_compat import require_supported_vllm
from feather_gym.observation import FEATURE_NAMES, OBS_VERSION
from feather_gym.policy_runtime import OnnxPolicy, PolicyLoadError, PolicyOutputError


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("policies")
    add = policies.constant_policy(root / "add.onnx", 1)
    return {
        "untrained": policies.untrained_policy(root / "untrained.onnx"),
        "add": add,
        "stop": policies.constant_policy(root / "stop.onnx", 0),
        "nan": policies.nan_policy(add, root / "nan.onnx"),
        "old_version": policies.with_metadata(add, root / "old.onnx", obs_version="feather-obs-0"),
        "reordered": policies.with_metadata(add, root / "reordered.onnx", feature_names=list(FEATURE_NAMES)[::-1]),
        "corrupt": policies.corrupt_file(root / "corrupt.onnx"),
        "missing": root / "missing.onnx",
    }


def test_decide_is_the_greedy_action_of_the_logits(files):
    policy = OnnxPolicy(files["untrained"])
    assert policy.provider == "CPUExecutionProvider"
    rows = np.random.default_rng(1).uniform(0, 3, (200, len(FEATURE_NAMES))).astype(np.float32)
    logits = policy.logits(rows)
    assert logits.shape == (200, 2)
    decisions = np.array([policy.decide(row) for row in rows])
    np.testing.assert_array_equal(decisions, logits[:, 1] > logits[:, 0])
    assert 0 < decisions.sum() < len(rows)            # this network does both


def test_constant_policies(files):
    row = np.zeros(len(FEATURE_NAMES), dtype=np.float32)
    assert OnnxPolicy(files["add"]).decide(row) is True
    assert OnnxPolicy(files["stop"]).decide(row) is False


def test_nan_logits_raise(files):
    with pytest.raises(PolicyOutputError, match="non-finite"):
        OnnxPolicy(files["nan"]).decide(np.zeros(len(FEATURE_NAMES), dtype=np.float32))


@pytest.mark.parametrize("name, error, message", [
    ("missing", FileNotFoundError, "does not exist"),
    ("corrupt", PolicyLoadError, "not a loadable ONNX model"),
    ("old_version", PolicyLoadError, f"'feather-obs-0', this feather-gym builds '{OBS_VERSION}'"),
    ("reordered", PolicyLoadError, "feather.feature_names"),
])
def test_unusable_policy_files_are_refused(files, name, error, message):
    with pytest.raises(error, match=message):
        OnnxPolicy(files[name])


def test_cuda_only_when_available(files, caplog):
    with caplog.at_level(logging.WARNING, logger="feather_gym.policy_runtime"):
        policy = OnnxPolicy(files["add"], device="cuda")
    if policy.provider != "CUDAExecutionProvider":       # no usable GPU here: CPU, with a warning
        assert policy.provider == "CPUExecutionProvider"
        assert "not available" in caplog.text
    with pytest.raises(ValueError, match="unknown policy device"):
        OnnxPolicy(files["add"], device="tpu")


@pytest.mark.parametrize("version, ok", [("0.32.0", True), ("0.32.4+cpu", True), ("0.33.0", True),
                                         ("0.33.1.post1", True), ("0.31.9", False), ("0.34.0", False),
                                         ("0.34.0rc1", False), ("1.0.0", False)])
def test_vllm_version_guard(version, ok):
    if ok:
        assert require_supported_vllm(version) == version
    else:
        with pytest.raises(RuntimeError, match=rf"supports vLLM >=0\.32\.0,<0\.34\.0, found vLLM {version}"):
            require_supported_vllm(version)


@pytest.mark.parametrize("release, cap, called_with", [("0.32.0", None, ("req",)), ("0.33.0", None, ("req", None)),
                                                       ("0.33.0", 48, ("req", 48))])
def test_local_prefix_cache_hit_passes_vllms_cap_from_033(monkeypatch, release, cap, called_with):
    from packaging.version import Version

    from deploy import vllm_compat

    monkeypatch.setattr(vllm_compat, "_installed_release", lambda: Version(release))
    assert vllm_compat.local_prefix_cache_hit(lambda *args: args, "req", cap) == called_with


def test_prefix_cache_hit_limit_defaults_to_all_tokens_but_the_last():
    from types import SimpleNamespace

    from deploy.vllm_compat import prefix_cache_hit_limit

    request = SimpleNamespace(num_tokens=100)
    assert prefix_cache_hit_limit(request) == 99
    assert prefix_cache_hit_limit(request, 64) == 64
