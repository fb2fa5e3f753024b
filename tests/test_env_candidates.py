"""The env, simulator and policies with k > 1 candidate slots (issue 15: a richer action)."""

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from test_env import CONFIG, rollout

from feather_gym.envs import BatchFormationEnv
from feather_gym.observation import (
    ADD,
    NUM_FEATURES,
    STOP,
    DecisionPoint,
    action_meanings,
    chosen_slot,
    observation_size,
)
from feather_gym.policies import HeaviestGroup, make_policy
from feather_gym.simulator import simulate


def test_layout_and_action_helpers():
    assert observation_size(1) == NUM_FEATURES and observation_size(4) == 4 * NUM_FEATURES + 3
    assert action_meanings(1) == ("STOP", "ADD") and action_meanings(3) == ("STOP", "ADD_1", "ADD_2", "ADD_3")
    assert chosen_slot(STOP, 2, 4) is None and chosen_slot(ADD, 2, 4) == 0 and chosen_slot(2, 2, 4) == 1
    assert chosen_slot(3, 2, 4) is None                    # an empty slot is STOP
    for bad in (-1, 5):
        with pytest.raises(ValueError, match="outside 0..4"):
            chosen_slot(bad, 2, 4)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="num_candidates"):
            observation_size(bad)


def test_k4_env_passes_the_checker_and_masks_empty_slots():
    env = BatchFormationEnv({**CONFIG, "num_candidates": 4})
    check_env(env, skip_render_check=True)
    assert env.action_space.n == 5 and env.observation_space.shape == (observation_size(4),)
    obs, _ = env.reset(seed=1)
    seen_filled, seen_empty = set(), 0
    terminated = False
    while not terminated:
        point = env.admission_point
        filled = len(point.candidates)
        mask = obs[4 * NUM_FEATURES:]
        np.testing.assert_array_equal(mask, np.arange(1, 4) < filled)
        rows = obs[:4 * NUM_FEATURES].reshape(4, NUM_FEATURES)
        assert not rows[filled:].any()                      # empty slots are all zeros
        np.testing.assert_array_equal(rows[0], point.observation[:NUM_FEATURES])
        assert len(set(point.candidates)) == filled and point.candidate == env._sim.cht.find_best()
        # Each distinct action admits a different slot (or STOPs); every other action is STOP.
        assert [point.slot(a) for a in point.distinct_actions] == [None, *range(filled)]
        assert all(point.slot(a) is None for a in range(5) if a not in point.distinct_actions)
        seen_filled.add(filled)
        action = 4 if filled < 4 else ADD                   # the last slot: empty unless 4 groups wait
        seen_empty += filled < 4
        obs, _, terminated, _, _ = env.step(action)
    assert seen_empty and max(seen_filled) > 1


def test_an_empty_slot_is_stop_in_the_simulator():
    import traces
    from feather_gym.costmodel import load_cost_model
    from feather_gym.orderings import CHTOrder
    from feather_gym.simulator import Simulator

    trace = traces.resolve_workload("prefix-groups:groups=2,num_requests=40,rate=200", seed=0)
    sim = Simulator(trace, load_cost_model("h200"), CHTOrder(), num_candidates=4)
    while len(sim.next_admission().candidates) == 4:
        sim.apply(ADD)
    running, step = set(sim.running), sim.step
    sim.apply(4)                                            # slot 3 is empty
    assert set(sim.running) == running and sim._stopped
    with pytest.raises(RuntimeError):                       # the point is spent
        sim.apply(ADD)
    assert sim.next_admission().step > step                 # admission ended for that step
    with pytest.raises(ValueError, match="outside 0..4"):
        sim.apply(5)


def test_k1_env_is_todays_add_stop_env():
    """k = 1 gives the same observations and returns as before the candidate slots existed."""
    one = BatchFormationEnv({**CONFIG, "num_candidates": 1})
    default = BatchFormationEnv(CONFIG)
    a = rollout(one, 7, lambda obs: int(obs[1] < 0.5))
    b = rollout(default, 7, lambda obs: int(obs[1] < 0.5))
    np.testing.assert_array_equal(a[0], b[0])
    assert a[1] == b[1] and a[0].shape[1] == NUM_FEATURES


def test_choosing_another_slot_admits_that_candidate():
    env = BatchFormationEnv({**CONFIG, "num_candidates": 3})
    env.reset(seed=2)
    while len(env.admission_point.candidates) < 2:
        env.step(ADD)
    point = env.admission_point
    second = point.candidates[1]
    env.step(ADD + 1)
    assert second in env._sim.running


def test_heaviest_group_is_a_k_way_baseline():
    import traces
    from feather_gym.costmodel import load_cost_model

    trace = traces.resolve_workload("prefix-groups:groups=4,num_requests=120,rate=200", seed=0)
    model = load_cost_model("h200")
    policy = make_policy("cht-dfs")
    assert isinstance(policy, HeaviestGroup) and policy.num_candidates == 4
    result = simulate(trace, model, policy)
    assert result.finished.all()
    point = DecisionPoint.__new__(DecisionPoint)            # its choice on hand-made rows
    point.candidates, point._rows = ("a", "b", "c"), np.zeros((4, NUM_FEATURES))
    point._rows[1, 2] = 5.0
    assert policy.decide(point) == ADD + 1


def test_feather_train_takes_num_candidates_to_the_env():
    from feather_cli.train import build_train_parser, train_flags
    from trainer.config import build_config
    from trainer.train import env_config

    config = build_config({}, train_flags(build_train_parser().parse_args(["--num-candidates", "4", "--workload",
                                                                          "no-sharing"])))
    assert config.num_candidates == 4 and env_config(config.resolved())["num_candidates"] == 4
    with pytest.raises(ValueError, match="num_candidates"):
        build_config({}, {"num_candidates": 0, "workloads": ["no-sharing"]}).validate()
