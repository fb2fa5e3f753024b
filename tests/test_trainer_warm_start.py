"""Warm start: a baseline recorded in the env and cloned into PPO's default module (no Ray cluster)."""

import gymnasium as gym
import numpy as np
import pytest

from feather_gym.envs import BatchFormationEnv
from feather_gym.observation import NUM_FEATURES, OBS_CLIP
from feather_gym.policies import FeatherRule, playout_futures
from trainer.warm_start import (
    DEMO_LOAD_REQUESTS,
    clone_into,
    demonstrated,
    demonstrator,
    improved_action,
    playout_return,
    record_demonstrations,
    record_episode,
)

ENV_CONFIG = {"workloads": ["prefix-groups:groups=3,num_requests=200,rate=50", "no-sharing:num_requests=100"],
              "profile": "rtx6000-ada", "window_requests": 1000, "max_decisions": 4096}


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
    return record_demonstrations("feather-rule", ENV_CONFIG, seeds=range(2))


def test_demonstrations_are_whole_episodes_of_every_workload(demos):
    assert demos.obs.shape == (len(demos.actions), NUM_FEATURES) and demos.obs.dtype == np.float32
    assert set(np.unique(demos.actions)) == {0, 1}            # the rule both admits and stops here
    # Returns-to-go of the env's reward (in units of the window's output tokens): of order 1.
    assert np.all(np.isfinite(demos.returns)) and np.abs(demos.returns).max() < 2
    assert record_demonstrations("feather-rule", ENV_CONFIG, seeds=range(2)).actions.tolist() == demos.actions.tolist()


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


def test_value_targets_are_the_undiscounted_returns_to_go():
    """The recorded returns are the return-to-go of the same episode's rewards, as PPO's (gamma 1)."""
    from feather_gym.envs import ENV_ID

    workload = ENV_CONFIG["workloads"][0]
    recorded = record_episode("feather-rule", ENV_CONFIG, workload, seed=0)
    env = gym.make(ENV_ID, **{**ENV_CONFIG, "workloads": [workload], "seed": 0, "workload_instances": 1})
    env.reset()
    rule, rewards, done = demonstrator("feather-rule"), [], False
    while not done:
        _, reward, terminated, truncated, _ = env.step(rule.decide(env.unwrapped.admission_point))
        rewards.append(reward)
        done = terminated or truncated
    np.testing.assert_allclose(recorded.returns, np.cumsum(rewards[::-1])[::-1], rtol=1e-5, atol=1e-6)


def test_the_rule_is_recorded_stateless(demos):
    """Its floor starts full, so equal observations always get equal labels (clonable exactly)."""
    rule = demonstrator("feather-rule")
    assert isinstance(rule, FeatherRule) and rule.floor == rule.max_floor
    labels = {}
    for row, action in zip(map(bytes, demos.obs), demos.actions.tolist()):
        assert labels.setdefault(row, action) == action
    assert demonstrator("fcfs").name == "fcfs"
    hold = demonstrator("feather-hold")       # the held rule is recorded in its steady state too, hold kept
    assert hold.name == "feather-hold" and hold.floor == hold.max_floor and hold.hold_steps > 0


#: Short windows and two candidate slots: playouts are cheap, and the rule admits slot 0 only.
IMPROVE_CONFIG = {**ENV_CONFIG, "window_requests": 32, "num_candidates": 2, "seed": 3}
MIN_GAIN = 1e-4   # between the small and the large gains of these windows


def test_a_playout_is_the_return_the_env_then_gets():
    env = BatchFormationEnv(IMPROVE_CONFIG)
    env.reset(seed=0)
    rule = demonstrator("feather-rule")
    action = rule.decide(env.admission_point)
    expected, total = playout_return(env, rule, action), 0.0
    true_lengths = [request.output_len for request in env.admission_point.sim.trace.requests]
    assert playout_return(env, rule, action, true_lengths) == expected    # a fork told the true lengths
    while True:
        _, reward, terminated, truncated, _ = env.step(action)
        total += reward
        if terminated or truncated:
            break
        action = rule.decide(env.admission_point)
    assert total == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.slow
def test_improved_labels_are_stop_where_its_playouts_beat_the_rules_beyond_the_minimum_gain():
    env = BatchFormationEnv(IMPROVE_CONFIG)
    rule = demonstrator("feather-rule")
    gains = []
    env.reset(seed=1)
    while (point := env.admission_point) is not None:
        action = rule.decide(point)
        # At the first decision the true lengths too; then two sampled futures (the default is 4).
        for samples in [None] * (not gains) + [2]:
            runs = playout_futures(point.sim, samples)
            stop, own = (np.mean([playout_return(env, rule, a, run) for run in runs]) for a in (0, action))
            for min_gain in (0.0, MIN_GAIN):
                label = improved_action(env, rule, action, min_gain, samples=samples)
                assert label == (0 if stop > own + min_gain else action)
        gains.append(stop - own)
        _, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            break
    # Every branch ran: STOP gaining above the threshold, below it, and losing.
    assert min(gains) < 0 and any(0 < gain <= MIN_GAIN for gain in gains) and any(gain > MIN_GAIN for gain in gains)
    no_sharing = {**IMPROVE_CONFIG, "workloads": IMPROVE_CONFIG["workloads"][1:]}    # where STOP gains
    improved = record_demonstrations("feather-rule", no_sharing, seeds=range(1), min_gain=0.0)
    plain = record_demonstrations("feather-rule", no_sharing, seeds=range(1))
    np.testing.assert_array_equal(improved.obs, plain.obs)        # the rule's own states, relabelled
    assert improved.relabelled == int((improved.actions != plain.actions).sum()) > 0 and plain.relabelled == 0


@pytest.mark.slow
def test_recording_in_worker_processes_gives_the_same_demonstrations():
    config = {**IMPROVE_CONFIG, "workloads": ["prefix-groups:groups=3,num_requests=48,rate=50"]}
    alone = record_demonstrations("feather-rule", config, seeds=range(2), min_gain=MIN_GAIN)
    pooled = record_demonstrations("feather-rule", config, seeds=range(2), min_gain=MIN_GAIN, workers=2)
    np.testing.assert_array_equal(pooled.obs, alone.obs)
    np.testing.assert_array_equal(pooled.actions, alone.actions)
    np.testing.assert_array_equal(pooled.returns, alone.returns)
    assert pooled.relabelled == alone.relabelled > 0


def test_playouts_stop_at_their_deadline_and_the_later_decisions_keep_the_rules_labels():
    import time

    no_sharing = {**IMPROVE_CONFIG, "workloads": IMPROVE_CONFIG["workloads"][1:]}
    plain = record_demonstrations("feather-rule", no_sharing, seeds=range(1))
    passed = record_demonstrations("feather-rule", no_sharing, seeds=range(1), min_gain=0.0, playout_until=0.0)
    assert passed.played == passed.relabelled == 0 and passed.actions.tolist() == plain.actions.tolist()
    later = record_demonstrations("feather-rule", no_sharing, seeds=range(1), min_gain=0.0,
                                  playout_until=time.time() + 3600)
    assert later.played == int((plain.actions != 0).sum()) > 0 and later.relabelled > 0   # every ADD played out


@pytest.mark.parametrize("workload, expected", [
    ("prefix-groups:num_requests=32,groups=4@load=0.9",
     f"prefix-groups:num_requests={DEMO_LOAD_REQUESTS},groups=4@load=0.9"),
    ("no-sharing:rate=1000@load=1.3", "no-sharing:rate=1000@load=1.3"),      # the generator's default 1,000 requests
    (f"no-sharing:num_requests={DEMO_LOAD_REQUESTS + 1}@load=0.6",
     f"no-sharing:num_requests={DEMO_LOAD_REQUESTS + 1}@load=0.6"),
    ("prefix-groups:num_requests=32,groups=4", "prefix-groups:num_requests=32,groups=4"),   # at its own rate
    ("mooncake@0-0.1@load=0.9", "mooncake@0-0.1@load=0.9"),                    # a trace is what it is
    ("no-sharing:num_requests=32@0-0.5@load=0.9", "no-sharing:num_requests=32@0-0.5@load=0.9"),   # a window
])
def test_a_generator_at_a_load_is_demonstrated_on_a_longer_trace_of_its_shape(workload, expected):
    assert demonstrated(workload) == expected


def test_the_longer_demonstration_is_the_same_shape_at_the_same_load():
    from feather_gym.costmodel import load_cost_model
    from feather_gym.load import resolve_at_load

    short = "prefix-groups:num_requests=32,groups=4,prefix_tokens=384,output_tokens_max=32,rate=1000@load=0.9"
    cost_model = load_cost_model("vllm-cpu")
    trace, report = resolve_at_load(demonstrated(short), seed=3, cost_model=cost_model)
    assert len(trace) == DEMO_LOAD_REQUESTS and report["load"] == 0.9
    first, _ = resolve_at_load(short.partition("@")[0], seed=3, cost_model=cost_model)
    assert {request.group for request in trace} == {request.group for request in first}
