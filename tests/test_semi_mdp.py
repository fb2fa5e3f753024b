"""Semi-MDP discounting: the env's step durations, the one return recursion, and PPO's learner using it."""

from __future__ import annotations

import numpy as np
import pytest

from feather_gym.envs import BatchFormationEnv
from feather_gym.envs.batch_formation import ELAPSED_INFO
from trainer.semi_mdp import discounted_returns, step_discounts, value_targets

CONFIG = {"workloads": ["prefix-groups:groups=3,num_requests=64,rate=50", "no-sharing:num_requests=64"],
          "profile": "h200", "seed": 0, "window_requests": 24, "max_decisions": 0, "num_candidates": 2,
          "wait_penalty": 0.0}


def episode(env, seed):
    """One whole episode of always-ADD: per step, the reward and the info."""
    env.reset(seed=seed)
    steps, done = [], False
    while not done:
        _, reward, done, _, info = env.step(1)
        steps.append((reward, info))
    return steps


def test_the_steps_elapsed_times_add_up_to_the_makespan_and_admissions_of_one_step_take_none():
    env = BatchFormationEnv(CONFIG)
    steps = episode(env, 3)
    elapsed = np.array([info[ELAPSED_INFO] for _, info in steps])
    # From the start of the window (the first step also covers the run-up to the first decision).
    assert (elapsed >= 0).all() and elapsed.sum() == pytest.approx(steps[-1][1]["makespan_s"])
    # Several admissions in one engine step: no time between them, and nothing emitted.
    same_step = elapsed == 0
    assert same_step.any() and not same_step.all()
    assert all(reward == 0 for (reward, _), zero in zip(steps, same_step) if zero)


def test_discounts_halve_per_half_life_and_none_is_undiscounted():
    np.testing.assert_allclose(step_discounts([0.0, 2.0, 4.0], 2.0), [1.0, 0.5, 0.25])
    np.testing.assert_array_equal(step_discounts([0.0, 2.0, 4.0], None), [1.0, 1.0, 1.0])


def test_returns_discount_each_later_reward_by_the_time_between():
    rewards, elapsed = np.array([1.0, 0.0, 2.0, -1.0]), np.array([1.0, 0.0, 2.0, 3.0])
    returns = discounted_returns(rewards, step_discounts(elapsed, 1.0))
    # The reward of step j counts 0.5 ** (time from the end of step t to the end of step j - 1).
    expected = [sum(rewards[j] * 0.5 ** elapsed[t:j].sum() for j in range(t, 4)) for t in range(4)]
    np.testing.assert_allclose(returns, expected)
    np.testing.assert_allclose(discounted_returns(rewards, step_discounts(elapsed, None)), np.cumsum(rewards[::-1])[::-1])


def test_value_targets_with_one_discount_everywhere_are_rllibs():
    from ray.rllib.utils.postprocessing.value_predictions import compute_value_targets

    rng = np.random.default_rng(0)
    n = 60
    values, rewards = rng.normal(size=n), rng.normal(size=n)
    terminateds, truncateds = np.zeros(n), np.zeros(n)
    terminateds[20], truncateds[45] = 1.0, 1.0
    for gamma, lambda_ in ((1.0, 1.0), (0.97, 0.9)):
        np.testing.assert_allclose(
            value_targets(values, rewards, np.full(n, gamma), terminateds, truncateds, lambda_),
            compute_value_targets(values, rewards, terminateds, truncateds, gamma=gamma, lambda_=lambda_), atol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ppo_with_a_half_life_learns_from_time_discounted_returns(monkeypatch):
    """The learner's pipeline has the semi-MDP piece instead of RLlib's GAE, and on whole episodes
    sampled from the env (lambda 1: no bootstrap) its value targets are the returns discounted by
    the elapsed times the env reported, computed here step by step."""
    from ray.rllib.core import DEFAULT_MODULE_ID
    from ray.rllib.evaluation.postprocessing import Postprocessing

    from trainer.config import TrainConfig
    from trainer.semi_mdp_learner import SemiMDPAdvantageEstimation
    from trainer.train import build_algorithm, ray_session

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    half_life_s = 0.5
    config = TrainConfig(workloads=tuple(CONFIG["workloads"]), profile="h200", num_env_runners=0, envs_per_env_runner=1,
                         window_requests=24, train_batch_size=64, minibatch_size=64, num_candidates=2,
                         discount_half_life_s=half_life_s).resolved()
    with ray_session(None):
        algo = build_algorithm(config)
        try:
            learner = algo.learner_group._learner
            pieces = [type(piece).__name__ for piece in learner._learner_connector.connectors]
            assert pieces[-1] == SemiMDPAdvantageEstimation.__name__ and "GeneralAdvantageEstimation" not in pieces
            episodes = algo.env_runner.sample(num_episodes=2, random_actions=True)
            batch = learner._learner_connector(rl_module=learner.module, batch={}, episodes=episodes, shared_data={})
        finally:
            algo.stop()
    targets = batch[DEFAULT_MODULE_ID][Postprocessing.VALUE_TARGETS].numpy()
    expected = []
    for chunk in episodes:      # each now ends with the learner's bootstrap row
        rewards = chunk.get_rewards()[:-1]
        elapsed = [info[ELAPSED_INFO] for info in chunk.get_infos()[1:-1]]
        returns, running = [], 0.0
        for reward, seconds in zip(reversed(rewards), reversed(elapsed)):
            running = reward + 0.5 ** (seconds / half_life_s) * running
            returns.append(running)
        expected += returns[::-1] + [0.0]    # the bootstrap row of a terminated episode: no return
    assert len(targets) == len(expected) and all(chunk.is_terminated for chunk in episodes)
    mask = batch[DEFAULT_MODULE_ID]["loss_mask"].numpy()
    np.testing.assert_allclose(targets[mask], np.asarray(expected)[mask], rtol=1e-4, atol=1e-5)
    assert not np.allclose(targets[mask], [sum(chunk.get_rewards()[t:-1]) for chunk in episodes
                                           for t in range(len(chunk) - 1)], atol=1e-3)
