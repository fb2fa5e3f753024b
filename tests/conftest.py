"""Fixtures shared by test modules, and how pytest-xdist spreads the tests over workers.

Markers (pyproject.toml): ``live`` (starts a vLLM engine or an OpenAI server), ``train`` (starts
Ray), ``slow`` (over ~20 s without either). Under ``-n N --dist loadgroup`` the live tests of
one module stay on one worker (its module-scoped engine or server starts once), and every Ray
test runs on the same worker (one local Ray cluster at a time).
"""

from __future__ import annotations

import warnings

import pytest


@pytest.fixture(scope="session")
def hybrid_model_dir() -> str:
    """The trained hybrid model when ``feather hybrid build`` has made it, else the tiny config
    (trained for seconds here; the warning says so)."""
    from feather_gym.hybrid.model import ensure_hybrid_hf, is_built

    if is_built("trained"):
        return str(ensure_hybrid_hf("trained"))
    warnings.warn("trained hybrid model absent (feather hybrid build): the live hybrid tests use the tiny config")
    return str(ensure_hybrid_hf("tiny"))


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.get_closest_marker("train"):
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif item.get_closest_marker("live"):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
