"""Workload specs: one string names any workload the project can run.

=============================================== =========================================
spec                                            meaning
=============================================== =========================================
``mooncake``, ``azure-conv``                    a shared real trace (:data:`SHARED_TRACES`)
``KIND`` or ``KIND:key=value,...``              a generator (:data:`GENERATOR_KINDS`), e.g.
                                                ``prefix-groups:groups=5,prefix_tokens=5000``
any other string                                a trace file path (:func:`traces.load_trace`)
=============================================== =========================================

Shared traces live in ``<repo>/../shared/traces/``; the environment variable
``FEATHER_SHARED_DIR`` replaces ``<repo>/../shared``. They are read in place, never copied.
"""

from __future__ import annotations

import os
import typing
from dataclasses import fields
from pathlib import Path

from traces.generators import GENERATOR_KINDS, generator_class, make_generator
from traces.io import load_trace
from traces.request import Trace

#: Short names of the shared real traces -> file names in the shared traces folder.
SHARED_TRACES = {
    "mooncake": "mooncake_conversation_trace.jsonl",
    "azure-conv": "azure_llm_2023_conv.csv",
}

_REPO_ROOT = Path(__file__).resolve().parent.parent


def shared_traces_dir() -> Path:
    """The folder of the shared traces (it may not exist)."""
    shared = os.environ.get("FEATHER_SHARED_DIR")
    return (Path(shared) if shared else _REPO_ROOT.parent / "shared") / "traces"


def shared_trace_path(filename: str) -> Path | None:
    """The path of a shared trace file, or None when it is absent."""
    path = shared_traces_dir() / filename
    return path if path.is_file() else None


def parse_params(kind: str, text: str) -> dict:
    """``key=value,...`` -> typed generator parameters (types from the generator's fields).

    ``None``/``null`` is accepted where a parameter may be None. Unknown keys and bad values
    raise ``ValueError`` naming the valid keys or the expected type.
    """
    cls = generator_class(kind)
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in fields(cls)]
    params = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in valid:
            raise ValueError(f"{kind}: bad parameter {item!r}; valid keys: {', '.join(valid)}")
        types = [t for t in typing.get_args(hints[key]) or (hints[key],) if t is not type(None)]
        if len(types) < len(typing.get_args(hints[key])) and value.lower() in ("none", "null"):
            params[key] = None
            continue
        try:
            params[key] = types[0](value)
        except ValueError:
            raise ValueError(f"{kind}: parameter {key} expects {types[0].__name__}, got {value!r}") from None
    return params


def resolve_workload(spec: str, *, seed: int = 0, skip_bad: bool = False) -> Trace:
    """The trace a workload spec names (see the module docstring).

    ``seed`` seeds generators; ``skip_bad`` is passed to :func:`traces.load_trace` for files.
    """
    if spec in SHARED_TRACES:
        path = shared_trace_path(SHARED_TRACES[spec])
        if path is None:
            raise FileNotFoundError(f"shared trace {spec!r} not found: expected "
                                    f"{shared_traces_dir() / SHARED_TRACES[spec]} (set FEATHER_SHARED_DIR)")
        return load_trace(path, skip_bad=skip_bad)
    kind, _, params = spec.partition(":")
    if kind in GENERATOR_KINDS:
        return make_generator(kind, **parse_params(kind, params)).generate(seed)
    if Path(spec).expanduser().is_file():
        return load_trace(Path(spec).expanduser(), skip_bad=skip_bad)
    raise ValueError(f"unknown workload {spec!r}: not a file, a shared trace ({', '.join(SHARED_TRACES)}) "
                     f"or a generator kind ({', '.join(GENERATOR_KINDS)}; KIND:key=value,...)")
