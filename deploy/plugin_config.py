"""Reading a plug-in's settings from vLLM's ``additional_config`` (one rule for every plug-in)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields


def config_section(settings_cls, additional_config: Mapping | None, key: str) -> dict:
    """``additional_config[key]`` as keyword arguments of the dataclass ``settings_cls``.

    A missing section is ``{}``; unknown keys raise ``ValueError`` listing the valid ones.
    """
    section = dict((additional_config or {}).get(key) or {})
    valid = {f.name for f in fields(settings_cls)}
    unknown = sorted(set(section) - valid)
    if unknown:
        raise ValueError(f"unknown additional_config['{key}'] keys {unknown}; valid keys: {sorted(valid)}")
    return section
