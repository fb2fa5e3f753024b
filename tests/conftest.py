"""Fixtures shared by test modules."""

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
