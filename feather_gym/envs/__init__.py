"""Gymnasium environments of feather-gym; importing this package registers them.

``feather_gym/BatchFormation-v0``: the Feather ADD/STOP MDP (:class:`BatchFormationEnv`).
"""

from gymnasium.envs.registration import register, registry

from feather_gym.envs.batch_formation import DEFAULT_CONFIG, BatchFormationEnv

ENV_ID = "feather_gym/BatchFormation-v0"

if ENV_ID not in registry:
    register(id=ENV_ID, entry_point="feather_gym.envs.batch_formation:BatchFormationEnv")

__all__ = ["ENV_ID", "DEFAULT_CONFIG", "BatchFormationEnv"]
