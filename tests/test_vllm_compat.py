"""The deploy plug-ins against the installed vLLM's own scheduler classes (0.32 or 0.33).

Every method a plug-in mixin overrides on vLLM's ``Scheduler`` must take whatever vLLM passes
it: each parameter of vLLM's method by name or position, and nothing more without a default.
A signature change in a vLLM release (as ``_get_local_prefix_cache_hit`` gained
``max_cache_hit_length`` in 0.33) fails here before an engine calls the override.
"""

from __future__ import annotations

import inspect

import pytest


def mixins():
    from deploy.hybrid_placement import HybridPlacementMixin
    from deploy.replay_scheduler import SuffixReplayMixin
    from deploy.scheduler import FeatherSchedulingMixin

    return [FeatherSchedulingMixin, HybridPlacementMixin, SuffixReplayMixin]


def overrides():
    from vllm.v1.core.sched.scheduler import Scheduler

    return [(mixin, name) for mixin in mixins() for name, value in vars(mixin).items()
            if inspect.isfunction(value) and name != "__init__" and hasattr(Scheduler, name)]


def test_the_mixins_override_the_methods_the_compat_table_names():
    names = {name for _, name in overrides()}
    assert {"schedule", "update_from_output", "_free_request", "_get_local_prefix_cache_hit",
            "_mamba_block_aligned_split"} <= names


@pytest.mark.parametrize("mixin, name", overrides(), ids=lambda x: getattr(x, "__name__", x))
def test_every_override_takes_what_vllm_passes(mixin, name):
    from vllm.v1.core.sched.scheduler import Scheduler

    base = inspect.signature(getattr(Scheduler, name)).parameters
    override = inspect.signature(getattr(mixin, name)).parameters
    kinds = {p.kind for p in override.values()}
    for param in base.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        assert param.name in override or {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} & kinds, \
            f"{mixin.__name__}.{name} does not take vLLM's {param.name!r}"
    extra = [p.name for p in override.values() if p.name not in base and p.default is p.empty
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert not extra, f"{mixin.__name__}.{name} requires {extra}, which vLLM does not pass"
