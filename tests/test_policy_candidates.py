"""ONNX policies over k candidate slots: the contract carries k; files of an earlier contract are refused."""

from __future__ import annotations

import json

import deploy_policies as policies
import numpy as np
import pytest

from feather_gym.costmodel import load_cost_model
from feather_gym.observation import OBS_VERSION, STOP, observation_size
from feather_gym.policies import make_policy
from feather_gym.policy_runtime import OnnxPolicy, PolicyLoadError
from feather_gym.simulator import simulate


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("k-policies")
    one = policies.untrained_policy(root / "k1.onnx")
    four = policies.untrained_policy(root / "k4.onnx", k=4)
    return {"k1": one, "k4": four,
            "obs-3": policies.with_metadata(one, root / "obs-3.onnx", obs_version="feather-obs-3"),
            "obs-4": policies.with_metadata(one, root / "obs-4.onnx", obs_version="feather-obs-4"),
            "k4-says-2": policies.with_metadata(four, root / "k4-says-2.onnx", num_candidates=2),
            "k1-no-k": policies.with_metadata(one, root / "k1-bad-k.onnx", num_candidates="four")}


def test_a_k4_policy_acts_greedily_over_five_actions(files):
    policy = OnnxPolicy(files["k4"])
    assert (policy.num_candidates, policy.num_features, policy.num_actions) == (4, observation_size(4), 5)
    assert json.loads(policy.metadata["feather.num_candidates"]) == 4
    assert json.loads(policy.metadata["feather.action_meanings"]) == ["STOP", "ADD_1", "ADD_2", "ADD_3", "ADD_4"]
    rows = np.random.default_rng(1).uniform(0, 3, (100, observation_size(4))).astype(np.float32)
    actions = np.array([policy.act(row) for row in rows])
    np.testing.assert_array_equal(actions, policy.logits(rows).argmax(1))
    np.testing.assert_array_equal([policy.decide(row) for row in rows], actions != STOP)


def test_a_policy_of_an_earlier_contract_is_refused_naming_both_versions(files):
    """``feather-obs-3`` read waiting time in seconds and ``feather-obs-4`` had no KV residency:
    their inputs mean something else to this build."""
    assert OBS_VERSION == "feather-obs-5"
    for version in ("feather-obs-3", "feather-obs-4"):
        with pytest.raises(PolicyLoadError, match=f"'{version}', this feather-gym builds 'feather-obs-5'"):
            OnnxPolicy(files[version.removeprefix("feather-")])


@pytest.mark.parametrize("name, message", [
    ("k4-says-2", "feather.action_meanings"),          # metadata of k = 2, a network of k = 4
    ("k1-no-k", "'feather.num_candidates' is 'four', not an integer"),
])
def test_inconsistent_candidate_counts_are_refused(files, name, message):
    with pytest.raises(PolicyLoadError, match=message) as error:
        OnnxPolicy(files[name])
    if name == "k4-says-2":
        assert OBS_VERSION in str(error.value)


def test_a_k4_policy_file_runs_in_the_simulator(files):
    import traces

    policy = make_policy(str(files["k4"]))
    assert policy.num_candidates == 4
    trace = traces.resolve_workload("prefix-groups:groups=4,num_requests=80,rate=200", seed=0)
    result = simulate(trace, load_cost_model("h200"), policy)
    assert result.finished.all() and result.num_decisions > 0
