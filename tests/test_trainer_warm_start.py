"""Warm start: a baseline recorded in the env and cloned into PPO's default module (no Ray cluster)."""

import gymnasium as gym
import numpy as np
import pytest

from feather_gym.observation import NUM_FEATURES, OBS_CLIP
from feather_gym.policies import FeatherRule
from trainer.warm_start import clone_into, demonstrator, record_demonstrations

ENV_CONFIG = {"workloads": ["prefix-groups:groups=3,num_requests=200,rate=50", "no-sharing:num_requests=100"],
              "profile": "rtx6000-ada", "window_requests": 1000, "max_decisions": 4096, "wait_penalty": 0.0}


def ppo_module(hidden=(32,)):
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    model_config = DefaultModelConfig(fcnet_hiddens=list(hidden), fcnet_activation="tanh", vf_share_layers=False)
    spec = PPOConfig().get_default_rl_module_spec()
    spec.observation_space = gym.spaces.Box(0.0, OBS_CLIP, (NUM_FEATURES,), np.float32)
    spec.action_space = gym.spaces.Discrete(2)
    spec.model_config = model_config
    return spec.build()


@pytest.fixture(scope="module")
def demos():
    return record_demonstrations("feather-rule", ENV_CONFIG, seeds=2)


def test_demonstrations_are_whole_episodes_of_every_workload(demos):
    assert demos.obs.shape == (len(demos.actions), NUM_FEATURES) and demos.obs.dtype == np.float32
    assert set(np.unique(demos.actions)) == {0, 1}            # the rule both admits and stops here
    # Returns-to-go of the env's reward (in units of the window's output tokens): of order 1.
    assert np.all(np.isfinite(demos.returns)) and np.abs(demos.returns).max() < 2
    assert record_demonstrations("feather-rule", ENV_CONFIG, seeds=2).actions.tolist() == demos.actions.tolist()


def test_cloning_reproduces_the_rule(demos):
    module = ppo_module()
    fit = clone_into(module, demos, epochs=40)
    # Always-ADD would score the ADD share; the clone must do clearly better than that.
    assert fit["accuracy"] >= 0.97 > demos.add_fraction
    import torch
    from ray.rllib.core.columns import Columns

    with torch.no_grad():
        logits = module.forward_inference({Columns.OBS: torch.from_numpy(demos.obs)})[Columns.ACTION_DIST_INPUTS]
    assert float((logits.argmax(-1).numpy() == demos.actions).mean()) == pytest.approx(fit["accuracy"])


def test_the_rule_is_recorded_stateless(demos):
    """Its floor starts full, so equal observations always get equal labels (clonable exactly)."""
    rule = demonstrator("feather-rule")
    assert isinstance(rule, FeatherRule) and rule.floor == rule.max_floor
    labels = {}
    for row, action in zip(map(bytes, demos.obs), demos.actions.tolist()):
        assert labels.setdefault(row, action) == action
    assert demonstrator("fcfs").name == "fcfs"
