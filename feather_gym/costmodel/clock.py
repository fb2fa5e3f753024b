"""Clock calibration: two factors that rescale a profile's step times to this machine today.

A profile is measured once, on one day's machine; the same engine runs slower or faster on
another day (other jobs on the cores, another host), and not alike for every kind of work: on
a loaded or differently clocked machine a prefill token's cost and a step's fixed and decode
costs drift apart. A live load sweep needs the simulator's capacity in today's seconds, so before
it runs, a few engine steps are timed live (:class:`~feather_gym.costmodel.refit.LiveStep`
records: each step's composition and its wall time) and :func:`fit_clock` fits two factors on
them by least squares:

    measured step seconds ~ factor x predicted(rest) + prefill_factor x predicted(prefill)

where ``predicted(prefill)`` is the part of the prediction priced by
:data:`~.features.PREFILL_COLUMNS` and ``predicted(rest)`` the remainder (steps are predicted as
the simulator composes them, :meth:`~.model.CostModel.chunked_step_s`);
``cost_model.scaled(factor, prefill_factor)`` is the calibrated model. When the steps hold no
prefill work, or the fit gives a factor that is not positive, one factor is fitted instead
(``sum(measured) / sum(predicted)``) and used for both. The per-step mean absolute percentage
error before and after says how much of the difference the factors explain; what they do not
(a composition the profile predicts badly) stays. Steps that computed nothing are left out.

:func:`clock_error` says how far a calibrated model is off on other timed steps (a later round,
another load): their summed measured time over its summed prediction, less one.

What the factors leave is each step's own error: :func:`step_factors` gives it per step, as the
factor by which the step ran longer than the calibrated model predicts, scaled to a mean of one.
Drawn for a simulated run's steps (``Simulator(step_factors=...)``), they make steps that err as
the timed ones did, without moving the clock's mean.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .features import PREFILL_COLUMNS, DecodeBatch
from .fit import absolute_percentage_errors
from .model import CostModel
from .refit import CLOCKS


@dataclass(frozen=True)
class ClockCalibration:
    """The fitted factors and what they were fitted on (seconds; ``mape_*`` are fractions)."""

    factor: float
    prefill_factor: float
    steps: int
    measured_s: float
    predicted_s: float
    mape_before: float
    mape_after: float

    def scale(self, cost_model: CostModel) -> CostModel:
        """``cost_model`` on this machine's clock."""
        return cost_model.scaled(self.factor, self.prefill_factor)

    def as_dict(self) -> dict:
        return {"clock_factor": self.factor, "clock_prefill_factor": self.prefill_factor,
                "calibration_steps": self.steps,
                "calibration_measured_s": self.measured_s, "calibration_predicted_s": self.predicted_s,
                "calibration_mape_before": self.mape_before, "calibration_mape_after": self.mape_after}


def predicted_step_s(cost_model: CostModel, step) -> float:
    """``cost_model``'s seconds for a :class:`~.refit.LiveStep`'s composition."""
    batch = DecodeBatch(step.decode_requests, step.decode_kv_tokens, step.decode_unique_kv_tokens, step.decode_groups)
    return cost_model.chunked_step_s(batch, [tuple(chunk) for chunk in step.prefill_chunks])


def _part(cost_model: CostModel, prefill: bool) -> CostModel:
    """``cost_model`` with only its prefill coefficients (``prefill``) or only the others."""
    return replace(cost_model, coefficients={c: v if (c in PREFILL_COLUMNS) == prefill else 0.0
                                             for c, v in cost_model.coefficients.items()})


def _timed_parts(steps, cost_model: CostModel, clock: str) -> tuple[np.ndarray, np.ndarray]:
    """The measured seconds of the ``steps`` that computed something (``clock``: which of their times),
    and per step ``cost_model``'s predicted seconds of the rest and of the prefill. ``ValueError`` for
    an unknown clock or no step that computed anything."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    rest, prefill = _part(cost_model, False), _part(cost_model, True)
    rows = [(getattr(step, CLOCKS[clock]), predicted_step_s(rest, step), predicted_step_s(prefill, step))
            for step in steps if step.decode_requests or step.prefill_chunks]
    if not rows:
        raise ValueError(f"none of the {len(steps)} timed steps computed anything: no clock to calibrate")
    return np.array([row[0] for row in rows]), np.array([row[1:] for row in rows])


def clock_error(steps, cost_model: CostModel, *, clock: str = "wall") -> float:
    """How much longer the timed ``steps`` took than ``cost_model`` predicts, as a fraction
    (``0.05``: 5% longer, negative: shorter): summed measured over summed predicted seconds, less one."""
    measured, parts = _timed_parts(steps, cost_model, clock)
    return float(measured.sum() / parts.sum() - 1)


def fit_clock(steps, cost_model: CostModel, *, clock: str = "wall") -> ClockCalibration:
    """The :class:`ClockCalibration` of ``cost_model`` on timed ``steps`` (``clock``: which of their
    times, :data:`~.refit.CLOCKS`). ``ValueError`` when no step computed anything."""
    measured, parts = _timed_parts(steps, cost_model, clock)
    predicted = parts.sum(axis=1)
    factors = np.linalg.lstsq(parts, measured, rcond=None)[0] if parts[:, 1].any() else np.zeros(2)
    if not (factors > 0).all():
        factors = np.full(2, measured.sum() / predicted.sum())
    after = parts @ factors
    return ClockCalibration(factor=float(factors[0]), prefill_factor=float(factors[1]), steps=len(measured),
                            measured_s=float(measured.sum()), predicted_s=float(predicted.sum()),
                            mape_before=float(absolute_percentage_errors(measured, predicted).mean()),
                            mape_after=float(absolute_percentage_errors(measured, after).mean()))


def step_factors(steps, cost_model: CostModel, *, clock: str = "wall") -> np.ndarray:
    """Per timed step that computed something, in order: its measured seconds over
    ``cost_model``'s prediction, divided by the mean of these ratios (so their mean is 1).
    ``ValueError`` when no step computed anything."""
    measured, parts = _timed_parts(steps, cost_model, clock)
    ratios = measured / parts.sum(axis=1)
    return ratios / ratios.mean()
