"""Cost model of an LLM engine step: profile real decode steps, fit a physically shaped model.

Public API: :class:`DecodeBatch`, :class:`CostModel`, :func:`load_cost_model`,
:data:`SHIPPED_PROFILES`, :func:`hardware_profile`. The profiling backends (torch, vllm) import
torch and vllm lazily.
"""

from .features import DecodeBatch
from .model import SHIPPED_PROFILES, CostModel, hardware_profile, load_cost_model
from .shapes import MODEL_PRESETS, ModelShape, model_preset

__all__ = ["DecodeBatch", "CostModel", "load_cost_model", "hardware_profile", "SHIPPED_PROFILES", "ModelShape",
           "MODEL_PRESETS", "model_preset"]
