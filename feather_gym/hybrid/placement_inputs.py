"""The hybrid-model inputs of ``feather placement eval``: a model's cache layout, a SuffixReplay
report's costs and a prefill-time profile, each found by the name a user gives."""

from __future__ import annotations

import json

from traces.io import read_text


def model_folder(model: str):
    """The folder of ``--model`` (:func:`~feather_gym.hybrid.model.resolve_model`): a built-in
    hybrid (not built here) or a model folder; ``ValueError`` unless it holds a ``config.json``."""
    from feather_gym.hybrid.model import resolve_model

    kind, folder = resolve_model(model)
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model {model}: no model config at {folder / 'config.json'}; build it with "
                         f"`feather hybrid build --model {kind}` or pass --model DIR")
    return folder


def load_layout(model: str):
    """The :class:`~cache_core.hybrid.layout.HybridCacheLayout` of ``--model`` (:func:`model_folder`)."""
    from cache_core.hybrid.layout import HybridCacheLayout

    return HybridCacheLayout.from_model_dir(model_folder(model))


def load_replay(path: str, model: str | None, *, method: str, replay_tokens: int):
    """The :class:`~cache_core.hybrid.replay_placement.ReplayCost` of a ``feather replay eval --json``
    report for ``method`` and ``replay_tokens``, with the anchor width (hidden size) of ``model``."""
    from transformers import AutoConfig

    from cache_core.hybrid.replay_placement import ReplayCost, load_replay_report

    if model is None:
        raise ValueError("--replay needs --model (anchor bytes depend on the model's hidden size)")
    hidden = AutoConfig.from_pretrained(model_folder(model)).hidden_size
    return ReplayCost.from_replay_report(load_replay_report(path), method=method, replay_tokens=replay_tokens,
                                         hidden_size=hidden)


#: Prefill-time profiles shipped with the package (``--prefill-profile NAME``), measured on the
#: trained hybrid model on the development machine (see the README).
SHIPPED_PREFILL = {"hybrid-vllm-cpu": "prefill-hybrid-vllm-cpu.json",
                   "hybrid-torch-cpu": "prefill-hybrid-torch-cpu.json"}


def load_prefill(path: str):
    """The :class:`~cache_core.hybrid.recompute_cost.PrefillTime` of a ``feather profile prefill`` JSON
    file, or of a shipped profile named in :data:`SHIPPED_PREFILL`; a name that is neither is a
    ``FileNotFoundError`` listing the shipped ones."""
    from importlib.resources import files
    from pathlib import Path

    from cache_core.hybrid.recompute_cost import PrefillTime

    if path in SHIPPED_PREFILL and not Path(path).exists():
        path = str(files("feather_gym.costmodel") / "profiles" / SHIPPED_PREFILL[path])
    elif not Path(path).is_file():
        raise FileNotFoundError(f"--prefill-profile {path}: not a file and not one of the shipped "
                                f"{', '.join(SHIPPED_PREFILL)}")
    data = json.loads(read_text(path, "prefill-time profile (JSON of `feather profile prefill`)"))
    try:
        return PrefillTime.from_dict(data)
    except KeyError as exc:
        raise ValueError(f"--prefill-profile {path}: missing key {exc}; "
                         "write it with `feather profile prefill`") from None
