"""The Feather gym env: Gymnasium API, registration, determinism, and what the return means."""

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from feather_gym.envs import ENV_ID, BatchFormationEnv
from feather_gym.observation import FEATURE_NAMES
from feather_gym.policies import make_policy
from feather_gym.simulator import simulate

CONFIG = {"workloads": ["prefix-groups:groups=3,num_requests=200,rate=50", "no-sharing:num_requests=200"],
          "profile": "h200", "seed": 0, "window_requests": 24, "max_decisions": 0}


@pytest.fixture(scope="module")
def env():
    return BatchFormationEnv(CONFIG)


def test_check_env_passes(env):
    check_env(env, skip_render_check=True)


def test_registered_and_built_with_keyword_config():
    made = gym.make(ENV_ID, **CONFIG)
    obs, info = made.reset(seed=1)
    assert made.observation_space.contains(obs)
    assert made.action_space == gym.spaces.Discrete(2)
    assert made.observation_space.shape == (len(FEATURE_NAMES),)


def test_unknown_config_key_is_an_error():
    with pytest.raises(ValueError, match="window_request"):
        BatchFormationEnv({**CONFIG, "window_request": 3})


def rollout(env, seed, action_of):
    obs, _ = env.reset(seed=seed)
    trajectory, total = [obs], 0.0
    while True:
        obs, reward, terminated, truncated, info = env.step(action_of(obs))
        assert np.isfinite(reward) and not truncated
        trajectory.append(obs)
        total += reward
        if terminated:
            return np.array(trajectory), total, info


def test_episodes_are_deterministic_under_a_seed(env):
    first = rollout(env, 7, lambda obs: int(obs[1] < 0.5))
    second = rollout(env, 7, lambda obs: int(obs[1] < 0.5))
    np.testing.assert_array_equal(first[0], second[0])
    assert first[1] == second[1]


def test_always_stop_still_terminates(env):
    trajectory, _, info = rollout(env, 3, lambda obs: 0)
    assert info["decisions"] == len(trajectory) - 1


def test_return_is_throughput_relative_to_fcfs():
    """The return is 1 - makespan / fcfs_makespan: positive iff faster than FCFS on the same window."""
    env = BatchFormationEnv(CONFIG)
    for seed, policy in ((0, lambda obs: 1), (1, lambda obs: int(obs[0] < 0.1))):
        _, total, info = rollout(env, seed, policy)
        window = env._sim.trace
        tokens = sum(r.output_len for r in window)
        rate = info["baseline_throughput_tok_s"]
        assert rate == pytest.approx(simulate(window, env.cost_model, make_policy("fcfs"), config=env.engine)
                                     .metrics()["throughput_tok_s"])
        expected = (tokens - rate * info["makespan_s"]) / tokens
        assert expected == pytest.approx(1 - info["makespan_s"] / (tokens / rate))
        assert total == pytest.approx(expected, rel=1e-6, abs=1e-6)
        assert (total > 1e-9) == (info["throughput_tok_s"] > rate * (1 + 1e-9))


def test_a_fork_plays_on_alone():
    """A fork mid-episode continues exactly as its env would, and playing it out leaves the env as it was."""
    env = BatchFormationEnv({**CONFIG, "num_candidates": 2})
    obs, _ = env.reset(seed=4)
    for _ in range(3):
        obs, *_ = env.step(1)
    fork = env.fork()
    assert fork._sim is not env._sim and fork._sim.trace is env._sim.trace and fork._windows is env._windows
    clock, observation = env._sim.now_s, env.admission_point.observation.copy()

    def play_out(played, obs):
        rewards = []
        while True:
            obs, reward, terminated, truncated, info = played.step(int(obs[0] < 0.2) + int(obs[-1] > 0))
            rewards.append(reward)
            if terminated or truncated:
                return rewards, info

    forked = play_out(fork, obs)
    assert env._sim.now_s == clock and np.array_equal(env.admission_point.observation, observation)
    assert play_out(env, obs) == forked and len(forked[0]) > 1


def test_workload_instances_seed_several_traces_of_a_generator():
    env = BatchFormationEnv({**CONFIG, "workload_instances": 3})
    assert len(env.workloads) == 3 * len(CONFIG["workloads"])
    assert len({tuple(trace.requests[0].token_ids[:8]) for trace in env.workloads}) == len(env.workloads)
    with pytest.raises(ValueError, match="workload_instances"):
        BatchFormationEnv({**CONFIG, "workload_instances": 0})


def test_envs_of_one_configuration_share_their_traces_and_windows():
    """RLlib builds a runner's sub-envs with one config: they build the traces and each window's
    baseline run once between them; a setting the windows depend on gives a set of its own."""
    first, second = BatchFormationEnv(CONFIG), BatchFormationEnv(CONFIG)
    assert first.workloads is second.workloads and first._windows is second._windows
    first.reset(seed=5)
    second.reset(seed=5)
    assert second._sim.trace is first._sim.trace   # the window the first env built
    for setting in ({"seed": 1}, {"profile": "cpu"}):
        assert BatchFormationEnv({**CONFIG, **setting})._windows is not first._windows
    shorter = BatchFormationEnv({**CONFIG, "window_requests": 12})   # the same set: windows are keyed by size
    shorter.reset(seed=5)
    assert len(shorter._sim.trace) == 12


def test_max_decisions_truncates_and_zero_means_no_limit():
    limited = BatchFormationEnv({**CONFIG, "max_decisions": 5})
    limited.reset(seed=3)
    ends = [limited.step(0)[2:4] for _ in range(4)]          # decisions 2..5 of an always-STOP episode
    assert ends[:3] == [(False, False)] * 3 and ends[3] == (False, True)
    with pytest.raises(ValueError, match="max_decisions"):
        BatchFormationEnv({**CONFIG, "max_decisions": -1})
    trajectory, _, _ = rollout(BatchFormationEnv(CONFIG), 3, lambda obs: 0)   # rollout asserts never truncated
    assert len(trajectory) > 5


def test_admission_point_lets_a_baseline_act_in_the_env():
    """The pending admission point is what the observation describes; None once the episode ends."""
    from feather_gym.policies import make_policy

    env = BatchFormationEnv(CONFIG)
    assert env.admission_point is None
    obs, _ = env.reset(seed=5)
    rule = make_policy("feather-rule")
    terminated = False
    while not terminated:
        point = env.admission_point
        np.testing.assert_array_equal(point.observation, obs)
        obs, _, terminated, _, _ = env.step(rule.decide(point))
    assert env.admission_point is None
