"""Policy files for the deploy tests, all written by the one exporter (trainer.export).

Constant policies are a linear layer with zero weights and a bias favouring one action;
broken files are derived from an exported one (NaN bias, other observation version, garbage).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import torch

from feather_gym.observation import FEATURE_NAMES, OBS_CLIP, observation_size
from trainer.export import export_policy_module

F = len(FEATURE_NAMES)


def _observations(rows: int = 64, k: int = 1) -> np.ndarray:
    return np.random.default_rng(0).uniform(0.0, OBS_CLIP, (rows, observation_size(k))).astype(np.float32)


def export(module: torch.nn.Module, path: Path, k: int = 1) -> Path:
    export_policy_module(module, path, profile="cpu", workload="prefix-groups", observations=_observations(k=k),
                         num_candidates=k)
    return path


def untrained_policy(path: Path, k: int = 1) -> Path:
    """A small untrained MLP over ``k`` candidate slots: STOP or a slot depending on the observation."""
    torch.manual_seed(0)
    size = observation_size(k)
    return export(torch.nn.Sequential(torch.nn.Linear(size, 16), torch.nn.Tanh(), torch.nn.Linear(16, k + 1)), path, k)


def constant_policy(path: Path, action: int) -> Path:
    """Always ``action`` (0 STOP, 1 ADD)."""
    layer = torch.nn.Linear(F, 2)
    with torch.no_grad():
        layer.weight.zero_()
        layer.bias.copy_(torch.tensor([5.0, -5.0] if action == 0 else [-5.0, 5.0]))
    return export(layer, path)


def last_slot_policy(path: Path, k: int) -> Path:
    """Admits candidate slot ``k - 1`` when it is filled, else slot 0; never STOPs (``k >= 2``).
    It reads only the last slot's validity mask (the observation's last entry), so no clock."""
    layer = torch.nn.Linear(observation_size(k), k + 1)
    with torch.no_grad():
        layer.weight.zero_()
        layer.weight[k, -1] = 10.0
        layer.bias.fill_(-5.0)
        layer.bias[1] = 0.0     # ADD slot 0 (0) beats STOP and the rest (-5); a filled last slot (5) beats it
    return export(layer, path, k)


def nan_policy(source: Path, path: Path) -> Path:
    """``source`` (a constant policy) with its bias set to NaN: every decision yields NaN logits."""
    model = onnx.load(source)
    for init in model.graph.initializer:
        if list(init.dims) == [2]:
            init.CopyFrom(onnx.numpy_helper.from_array(np.full(2, np.nan, dtype=np.float32), init.name))
    onnx.save_model(model, path)
    return path


def with_metadata(source: Path, path: Path, **changes: object) -> Path:
    """``source`` with ``feather.<key>`` metadata replaced (JSON-encoded unless a string)."""
    model = onnx.load(source)
    for prop in model.metadata_props:
        key = prop.key.removeprefix("feather.")
        if key in changes:
            value = changes[key]
            prop.value = value if isinstance(value, str) else json.dumps(value)
    onnx.save_model(model, path)
    return path


def corrupt_file(path: Path) -> Path:
    path.write_bytes(b"this is not an onnx model\x00\x01\x02")
    return path
