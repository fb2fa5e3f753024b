"""Refit a step-time profile on engine steps logged live, and measure the gain on held-out steps.

The live engine's step log (:mod:`deploy.step_log`) holds one :class:`LiveStep` per engine
step: what the step computed (its decode batch and prefill chunks) and how long it took. A
step becomes a profile measurement row (:mod:`profile_io` schema, one repetition) when its
prefill chunks are alike (none, one, or k equal ones): those are the compositions a row
describes and :func:`fit.row_features` turns into features, the same way the simulator composes
a step. A step with unlike chunks is counted and left out (its features would need another
composition rule).

:func:`refit_profile` holds out ``held_out_fraction`` of the usable steps: a random draw
(``split="random"``, seeded: steps of the workloads the fit sees) or the latest ones in log time
order across all logs (``split="time"``: the future, which may be another workload). It fits
:func:`fit.fit_rows` on the earlier live steps (plus the base profile's rows with ``with_base``:
they cover compositions the live run may not have seen, but pull the fit toward the base where the
engine differs), and reports the mean absolute percentage error on the held-out steps before (the
base profile's model) and after (the refit). The profile it returns holds exactly the rows of that
fit, so loading it (``--profile NEW.json``) gives the model the report describes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

import numpy as np

from traces.io import read_text

from .fit import absolute_percentage_errors, fit_rows, measurement_rows, predict_rows
from .model import cost_model_from_profile
from .profile_io import validate_profile
from .shapes import ModelShape

STEP_LOG_SCHEMA = "feather-step-log/1"
#: What a step's time is read from: the wall clock, or the engine thread's CPU time.
CLOCKS = {"wall": "step_wall_s", "cpu": "step_cpu_s"}
SPLITS = ("random", "time")


def profile_clock(profile: dict) -> str:
    """The :data:`CLOCKS` entry a profile's steps were timed on (``settings.clock``): the vllm
    profiler's ``thread_time`` is the engine thread's CPU time, anything else the wall clock."""
    return "cpu" if profile["settings"].get("clock") == "thread_time" else "wall"


@dataclass
class LiveStep:
    """One engine step as the Feather scheduler logs it (one JSON object per line).

    Composition (tokens): ``decode_requests`` requests decode one token each, attending to
    ``decode_kv_tokens`` tokens in all, ``decode_unique_kv_tokens`` distinct (a shared prefix
    block counted once), in ``decode_groups`` groups (requests sharing their first block);
    ``prefill_chunks`` lists ``[new, cached]`` per prefilling request (new tokens computed this
    step after ``cached`` already computed or hit). Times: ``step_wall_s`` (wall clock) and
    ``step_cpu_s`` (the scheduling thread's CPU time), from the start of ``schedule()`` to the
    end of ``update_from_output()`` of this step. ``decisions``: ``[observation, action]`` of
    each policy decision of the step, in order (the observation a float32 array in the scheduler's
    ring, a list once written or read back). Invariants: ``0 <= unique <= total``;
    ``decode_requests >= 1`` implies ``1 <= decode_groups <= decode_requests``.
    """

    step: int
    time_unix_s: float
    step_wall_s: float
    step_cpu_s: float
    decode_requests: int
    decode_kv_tokens: int
    decode_unique_kv_tokens: int
    decode_groups: int
    prefill_chunks: list = field(default_factory=list)
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    policy_version: int = 0
    decisions: list = field(default_factory=list)
    schema: str = STEP_LOG_SCHEMA

    def to_json(self) -> str:
        """One JSON line; array values (a decision's observation) become lists."""
        return json.dumps(asdict(self), separators=(",", ":"), default=_as_list)

    @classmethod
    def from_dict(cls, data: dict) -> LiveStep:
        if data.get("schema") != STEP_LOG_SCHEMA:
            raise ValueError(f"not a {STEP_LOG_SCHEMA} record (schema {data.get('schema')!r})")
        return cls(**data)

    def profile_row(self, clock: str = "wall") -> dict | None:
        """This step as a ``feather-profile/1`` measurement row timed by ``clock``, or None
        when no row describes it (no work, or prefill chunks of different sizes)."""
        chunks = {tuple(chunk) for chunk in self.prefill_chunks}
        seconds = getattr(self, CLOCKS[clock])
        if len(chunks) > 1 or not (self.decode_requests or chunks) or not seconds > 0:
            return None
        row: dict = {"phase": "prefill" if not self.decode_requests else "mixed" if chunks else "decode"}
        if self.decode_requests:
            b, g = self.decode_requests, self.decode_groups
            shared = (self.decode_kv_tokens - self.decode_unique_kv_tokens) // (b - g) if b > g else 0
            row.update(attention="per_request", batch_size=b, num_groups=g, shared_prefix_tokens=shared,
                       unique_tokens_per_request=max(0, self.decode_unique_kv_tokens - g * shared) // b,
                       total_kv_tokens=self.decode_kv_tokens, unique_kv_tokens=self.decode_unique_kv_tokens)
        if chunks:
            (new, cached), = chunks
            row.update(new_tokens=new, cached_tokens=cached, prefill_requests=len(self.prefill_chunks))
        row.update(median_s=seconds, mean_s=seconds, std_s=0.0, min_s=seconds, max_s=seconds, repeats=1,
                   source="live", time_unix_s=self.time_unix_s)
        return row


def _as_list(value):
    """JSON for what ``json`` cannot write itself: arrays (``tolist``), or a TypeError as ``json`` raises."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def write_step_log(path, steps) -> None:
    """Write ``steps`` to ``path`` as a step log, one :meth:`LiveStep.to_json` line each (what the
    Feather scheduler's log writes); :func:`read_step_logs` reads them back equal."""
    with open(path, "w") as file:
        file.writelines(step.to_json() + "\n" for step in steps)


def read_step_logs(paths) -> tuple[list[LiveStep], int]:
    """The :class:`LiveStep` records of JSONL files, in time order, and the count of lines that
    are not records (a line cut by a full disk, another schema); ``OSError`` for an unreadable file."""
    steps, skipped = [], 0
    for path in paths:
        for line in read_text(path, "step log (JSONL)").splitlines():
            try:
                steps.append(LiveStep.from_dict(json.loads(line)))
            except (ValueError, TypeError):
                skipped += 1
    steps.sort(key=lambda s: s.time_unix_s)
    return steps, skipped


def _errors(rows: list[dict], coefficients: dict, shape: ModelShape, cache_bytes: float) -> dict:
    measured = np.array([row["median_s"] for row in rows])
    predicted = predict_rows(rows, coefficients, shape, cache_bytes, cascade=False)
    ape = absolute_percentage_errors(measured, predicted)
    return {"mape": float(ape.mean()), "p90_ape": float(np.percentile(ape, 90)),
            "total_time_bias": float(predicted.sum() / measured.sum() - 1.0)}


def refit_profile(base: dict, steps: list[LiveStep], *, clock: str | None = None, held_out_fraction: float = 0.3,
                  split: str = "random", seed: int = 0, with_base: bool = False,
                  name: str | None = None) -> tuple[dict, dict]:
    """(the refit profile, the report) for ``steps`` (time-ordered) on the validated ``base`` profile.

    ``clock`` defaults to the base profile's (:func:`profile_clock`), so both are timed alike.

    Report keys carry their units: ``mape_before``/``mape_after`` (fractions, on the held-out
    steps), ``p90_ape_*``, ``total_time_bias_*`` (predicted over measured total time, minus 1),
    step counts. ``ValueError`` when too few usable steps remain to fit and to hold out.
    """
    clock = clock or profile_clock(base)
    if clock not in CLOCKS or split not in SPLITS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)} and split one of {SPLITS}, got {clock!r}, {split!r}")
    if not 0 < held_out_fraction < 1:
        raise ValueError(f"held_out_fraction must lie in (0, 1), got {held_out_fraction}")
    rows = [row for row in (step.profile_row(clock) for step in steps) if row is not None]
    order = np.random.default_rng(seed).permutation(len(rows)) if split == "random" else np.arange(len(rows))
    held = set(order[len(rows) - int(round(len(rows) * held_out_fraction)):].tolist())
    train = [row for i, row in enumerate(rows) if i not in held]
    test = [row for i, row in enumerate(rows) if i in held]
    if len(train) < 10 or len(test) < 5:
        raise ValueError(f"{len(rows)} usable live steps of {len(steps)} are too few to fit and hold out "
                         f"(need >= 10 to fit and >= 5 held out)")
    shape = ModelShape.from_dict(base["model"])
    base_rows = [] if not with_base or base["kind"] != "measured" else measurement_rows(base, cascade=False)
    coefficients, cache_bytes = fit_rows(base_rows + train, shape, base["hardware"]["cache_bytes"], cascade=False)
    before = cost_model_from_profile(base)
    report = {"base_profile": base["name"], "clock": clock, "split": split,
              "logged_steps": len(steps), "usable_steps": len(rows),
              "unlike_chunk_steps": len(steps) - len(rows), "fit_live_steps": len(train),
              "fit_base_rows": len(base_rows), "held_out_steps": len(test)}
    for when, (coef, cache) in {"before": (dict(before.coefficients), before.cache_bytes),
                                "after": (coefficients, cache_bytes)}.items():
        report.update({f"{key}_{when}": value for key, value in _errors(test, coef, shape, cache).items()})
    report["coefficients_after"] = coefficients
    profile = {**base, "kind": "measured", "name": name or f"{base['name']}-refit",
               "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
               "settings": {**base["settings"],
                                                   "refit": {k: v for k, v in report.items()
                                                             if k != "coefficients_after"}},
               "measurements": base_rows + train}
    for key in ("coefficients", "cache_bytes_effective"):   # an analytic base's: the rows replace them
        profile.pop(key, None)
    return validate_profile(profile, profile["name"]), report
