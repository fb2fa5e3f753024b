"""PPO with semi-MDP advantages (:mod:`trainer.semi_mdp`): RLlib's torch PPO learner whose
constant-gamma GAE connector piece is replaced by one that discounts every step by the simulated
time it took (``TrainConfig.discount_half_life_s``)."""

from __future__ import annotations

import numpy as np
import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.connectors.connector_v2 import ConnectorV2
from ray.rllib.connectors.learner import GeneralAdvantageEstimation
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.evaluation.postprocessing import Postprocessing
from ray.rllib.utils.numpy import convert_to_numpy

from feather_gym.envs.batch_formation import ELAPSED_INFO
from trainer.semi_mdp import step_discounts, value_targets

#: ``config.learner_config_dict`` key through which the learner gets the half-life.
HALF_LIFE_KEY = "discount_half_life_s"


def chunk_discounts(episode, half_life_s: float) -> np.ndarray:
    """The discount after each row of an episode chunk as the learner sees it (one bootstrap row
    appended): the elapsed time of step ``t`` came in the info with observation ``t + 1``; the
    bootstrap row's discount is never used (its row is masked out) and is 1."""
    infos = episode.get_infos()[1:len(episode)]
    return np.append(step_discounts([info[ELAPSED_INFO] for info in infos], half_life_s), 1.0)


class SemiMDPAdvantageEstimation(ConnectorV2):
    """Learner connector piece in place of RLlib's ``GeneralAdvantageEstimation``: the same
    advantages (standardised over the batch) and value targets, with every step's semi-MDP
    discount instead of one ``gamma``. Single agent, stateless module (the trainer's)."""

    def __init__(self, input_observation_space=None, input_action_space=None, *, half_life_s: float,
                 lambda_: float) -> None:
        super().__init__(input_observation_space, input_action_space)
        self.half_life_s, self.lambda_ = half_life_s, lambda_

    def __call__(self, *, rl_module, episodes, batch, **kwargs):
        module_batch = batch[DEFAULT_MODULE_ID]
        values = rl_module[DEFAULT_MODULE_ID].compute_values(module_batch)
        device, values = values.device, convert_to_numpy(values)
        discounts = np.concatenate([chunk_discounts(episode, self.half_life_s) for episode in
                                    self.single_agent_episode_iterator(episodes, agents_that_stepped_only=False)])
        if len(discounts) != len(values):
            raise RuntimeError(f"semi-MDP discounts: {len(discounts)} rows for {len(values)} value predictions")
        rewards, terminateds, truncateds = (convert_to_numpy(module_batch[column]) for column in
                                            (Columns.REWARDS, Columns.TERMINATEDS, Columns.TRUNCATEDS))
        targets = value_targets(values, rewards, discounts, terminateds, truncateds, self.lambda_)
        advantages = targets - values
        advantages = (advantages - advantages.mean()) / max(1e-4, advantages.std())
        module_batch[Postprocessing.ADVANTAGES] = torch.from_numpy(advantages.astype(np.float32)).to(device)
        module_batch[Postprocessing.VALUE_TARGETS] = torch.from_numpy(targets).to(device)
        return batch


class SemiMDPPPOLearner(PPOTorchLearner):
    """PPO's torch learner with :class:`SemiMDPAdvantageEstimation` in place of its GAE piece; the
    half-life comes from ``config.learner_config_dict[HALF_LIFE_KEY]``."""

    def build(self) -> None:
        super().build()
        self._learner_connector.remove(GeneralAdvantageEstimation)
        self._learner_connector.append(SemiMDPAdvantageEstimation(
            half_life_s=self.config.learner_config_dict[HALF_LIFE_KEY], lambda_=self.config.lambda_))
