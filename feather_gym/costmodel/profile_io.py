"""Profile files: one JSON object per profiling run (or analytic derivation), validated on load.

Schema ``feather-profile/1``::

    schema          "feather-profile/1"
    kind            "measured" | "analytic"
    name            str                    e.g. "cpu", "h100"
    created_at      ISO 8601 UTC
    backend         "torch" | "vllm" | "analytic"
    hardware        {device: "cpu"|"cuda", name, cores, memory_bytes, cache_bytes}
    software        {package: version}
    model           ModelShape fields (shapes.py)
    settings        free-form run settings (layers profiled, scaling, repeats, notes)
    kv_cache_bytes  bytes given to the KV cache (CostModel.kv_capacity_tokens derives from it)
    block_size      (optional) the engine's KV block size in tokens
    max_num_batched_tokens  (optional) the engine's token budget per step
                    (both absent: ENGINE_DEFAULTS of hardware.device, vLLM 0.32's defaults)
    measurements    (measured) list of rows, see below
    coefficients    (analytic) {"per_request": {column: value}, "cascade": {...}}, units of features.COLUMNS
    cache_bytes_effective  (analytic) cache bytes the locality term uses

A measurement row is one engine step. Its ``phase`` says what the step holds:

* "decode": a decode batch: ``attention`` "per_request"|"cascade", ``batch_size``,
  ``num_groups``, ``shared_prefix_tokens``, ``unique_tokens_per_request``, ``total_kv_tokens``,
  ``unique_kv_tokens``;
* "prefill": ``prefill_requests`` (optional, default 1) requests each prefilling ``new_tokens``
  after ``cached_tokens`` prefix-cache hits;
* "mixed": a decode batch (the decode fields) and prefill chunks (the prefill fields) in one step.

Every row carries repetition statistics ``median_s``, ``mean_s``, ``std_s``, ``min_s``, ``max_s``,
``repeats``; other fields (e.g. ``wall_median_s``) are kept and not read.
Every error names the file and the field path (``measurements[3].median_s``).
"""

from __future__ import annotations

import json
from numbers import Real
from pathlib import Path

from traces.io import read_text

from .features import COLUMNS
from .shapes import ModelShape

PROFILE_SCHEMA = "feather-profile/1"
#: vLLM 0.32's engine defaults per device: KV block size (tokens) and token budget per step
#: (``max_num_batched_tokens`` of the offline ``LLM`` class; on CUDA the API server's 8192).
#: A profile without its own values takes its device's.
ENGINE_DEFAULTS = {"cpu": {"block_size": 128, "max_num_batched_tokens": 4096},
                   "cuda": {"block_size": 16, "max_num_batched_tokens": 8192}}
ATTENTION_VARIANTS = ("per_request", "cascade")
PHASES = ("decode", "prefill", "mixed")
STAT_FIELDS = ("median_s", "mean_s", "std_s", "min_s", "max_s")
_DECODE_FIELDS = ("batch_size", "num_groups", "shared_prefix_tokens", "unique_tokens_per_request",
                  "total_kv_tokens", "unique_kv_tokens")
#: The fields that say what a row's step holds (the rest are its timing statistics and notes).
COMPOSITION_FIELDS = ("phase", "attention") + _DECODE_FIELDS + ("new_tokens", "cached_tokens", "prefill_requests")


class ProfileError(ValueError):
    """A profile file that does not follow the schema; the message names file and field."""


class _Checker:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, message: str) -> None:
        raise ProfileError(f"{self.source}: {where}: {message}")

    def get(self, obj: dict, key: str, kind: type | tuple, where: str):
        if not isinstance(obj, dict):
            self.fail(where or "<top>", f"expected an object, got {type(obj).__name__}")
        path = f"{where}.{key}" if where else key
        if key not in obj:
            self.fail(path, "missing")
        value = obj[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            self.fail(path, f"expected {names}, got {value!r}")
        return value

    def count(self, obj: dict, key: str, where: str, minimum: int = 0) -> int:
        value = self.get(obj, key, int, where)
        if value < minimum:
            self.fail(f"{where}.{key}", f"must be >= {minimum}, got {value}")
        return value

    def seconds(self, obj: dict, key: str, where: str) -> float:
        value = self.get(obj, key, Real, where)
        if not value >= 0 or value == float("inf"):
            self.fail(f"{where}.{key}", f"must be a finite number >= 0, got {value!r}")
        return value

    def choice(self, obj: dict, key: str, where: str, options: tuple) -> str:
        value = self.get(obj, key, str, where)
        if value not in options:
            self.fail(f"{where}.{key}" if where else key, f"must be one of {list(options)}, got {value!r}")
        return value


def validate_profile(profile: dict, source: str = "<profile>") -> dict:
    """Check ``profile`` against the schema; returns it unchanged or raises :class:`ProfileError`."""
    check = _Checker(source)
    if not isinstance(profile, dict):
        check.fail("<top>", "a profile is a JSON object")
    schema = check.get(profile, "schema", str, "")
    if schema != PROFILE_SCHEMA:
        check.fail("schema", f"expected {PROFILE_SCHEMA!r}, got {schema!r}")
    kind = check.choice(profile, "kind", "", ("measured", "analytic"))
    for key in ("name", "created_at", "backend"):
        check.get(profile, key, str, "")
    hardware = check.get(profile, "hardware", dict, "")
    check.choice(hardware, "device", "hardware", ("cpu", "cuda"))
    check.get(hardware, "name", str, "hardware")
    check.count(hardware, "cache_bytes", "hardware", minimum=1)
    check.get(profile, "software", dict, "")
    check.get(profile, "settings", dict, "")
    check.count(profile, "kv_cache_bytes", "", minimum=1)
    for key in ENGINE_DEFAULTS["cpu"]:
        if key in profile:
            check.count(profile, key, "", minimum=1)
    try:
        ModelShape.from_dict(check.get(profile, "model", dict, ""))
    except (TypeError, ValueError) as exc:
        check.fail("model", str(exc))
    if kind == "analytic":
        coefficients = check.get(profile, "coefficients", dict, "")
        for variant in ATTENTION_VARIANTS:
            values = check.get(coefficients, variant, dict, "coefficients")
            for column in COLUMNS:
                check.seconds(values, column, f"coefficients.{variant}")
        check.seconds(profile, "cache_bytes_effective", "")
        return profile
    rows = check.get(profile, "measurements", list, "")
    if not rows:
        check.fail("measurements", "a measured profile needs at least one measurement")
    for index, row in enumerate(rows):
        where = f"measurements[{index}]"
        phase = check.choice(row, "phase", where, PHASES)
        if phase != "prefill":
            check.choice(row, "attention", where, ATTENTION_VARIANTS)
            values = {field: check.count(row, field, where) for field in _DECODE_FIELDS}
            if values["batch_size"] < 1 or not 1 <= values["num_groups"] <= values["batch_size"]:
                check.fail(where, "needs batch_size >= 1 and 1 <= num_groups <= batch_size")
            if values["unique_kv_tokens"] > values["total_kv_tokens"]:
                check.fail(where, "unique_kv_tokens exceeds total_kv_tokens")
        if phase != "decode":
            check.count(row, "new_tokens", where, minimum=1)
            check.count(row, "cached_tokens", where)
            if "prefill_requests" in row:
                check.count(row, "prefill_requests", where, minimum=1)
        for field in STAT_FIELDS:
            check.seconds(row, field, where)
        if row["median_s"] <= 0:
            check.fail(f"{where}.median_s", "must be > 0")
        check.count(row, "repeats", where, minimum=1)
    return profile


def profile_engine(profile: dict) -> dict[str, int]:
    """``block_size`` and ``max_num_batched_tokens`` of a validated profile: its own, else its device's."""
    defaults = ENGINE_DEFAULTS[profile["hardware"]["device"]]
    return {key: int(profile.get(key, default)) for key, default in defaults.items()}


def load_profile(path: str | Path) -> dict:
    """Read and validate a profile file (``OSError`` if unreadable, :class:`ProfileError` if invalid)."""
    path = Path(path)
    try:
        profile = json.loads(read_text(path, "cost-model profile (JSON)"))
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: line {exc.lineno}: not valid JSON ({exc.msg})") from None
    return validate_profile(profile, str(path))


def save_profile(profile: dict, path: str | Path) -> None:
    """Validate and write ``profile`` as indented JSON."""
    validate_profile(profile, str(path))
    Path(path).write_text(json.dumps(profile, indent=1) + "\n")
