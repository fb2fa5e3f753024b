"""Semi-MDP discounting: returns discounted by simulated time, not by decisions.

The Feather env's decisions are unevenly spaced in time: several admissions of one engine step
take no time between them, and a STOP lets a whole step run. A per-decision discount ``gamma``
therefore discounts a batch that admits many requests more than one that admits few. A
semi-MDP discount (Bradtke and Duff, 1995) discounts by the time that passes instead: the
reward of step ``t`` (everything between decision ``t`` and the next) is followed by the
discount ``d_t = 0.5 ** (elapsed_s_t / half_life_s)``, so a reward ``half_life_s`` simulated
seconds later counts half. The env reports ``elapsed_s_t`` in every step's info
(:data:`feather_gym.envs.batch_formation.ELAPSED_INFO`).

One definition serves both places that compute returns: the warm start's value targets
(:func:`discounted_returns`) and PPO's advantages (:func:`value_targets`, used by
:mod:`trainer.semi_mdp_learner` in place of RLlib's constant-gamma GAE). With
``half_life_s=None`` every discount is 1: the undiscounted returns the trainer uses by default.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def step_discounts(elapsed_s: Sequence[float] | np.ndarray, half_life_s: float | None) -> np.ndarray:
    """The discount after each step: ``0.5 ** (elapsed_s / half_life_s)``, all 1 for None."""
    elapsed = np.asarray(elapsed_s, dtype=np.float64)
    if half_life_s is None:
        return np.ones_like(elapsed)
    return np.exp2(-elapsed / half_life_s)


def discounted_returns(rewards: Sequence[float] | np.ndarray, discounts: np.ndarray) -> np.ndarray:
    """Return-to-go of every step of one episode that ends after its last step:
    ``G_t = r_t + d_t G_{t+1}`` (:func:`value_targets` with lambda 1 and no values to bootstrap)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    ends = np.zeros(len(rewards))
    ends[-1:] = 1.0
    return value_targets(np.zeros(len(rewards)), rewards, discounts, ends, np.zeros(len(rewards)), 1.0)


def value_targets(values: np.ndarray, rewards: np.ndarray, discounts: np.ndarray, terminateds: np.ndarray,
                  truncateds: np.ndarray, lambda_: float) -> np.ndarray:
    """GAE(lambda) value targets with a discount per step, in RLlib's layout (episode chunks
    one after another, each followed by its bootstrap row, :mod:`ray.rllib.connectors.learner.
    add_one_ts_to_episodes_and_truncate`): ``delta_t = r_t + d_t (1 - terminated_t) V_{t+1} - V_t``,
    ``A_t = delta_t + d_t lambda A_{t+1}`` within a chunk; target ``A_t + V_t``. With every
    ``d_t = gamma`` this is RLlib's ``compute_value_targets``."""
    non_terminal = 1.0 - terminateds
    propagate = non_terminal * (1.0 - truncateds)
    next_values = np.append(values[1:], 0.0)
    deltas = rewards + discounts * non_terminal * next_values - values
    advantages = np.zeros(len(rewards), dtype=np.float64)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = deltas[t] + discounts[t] * lambda_ * propagate[t] * running
        advantages[t] = running
    return (advantages + values).astype(np.float32)
