"""Clock calibration: one factor that rescales a profile's step times to this machine today.

A profile is measured once, on one day's machine; the same engine runs slower or faster on
another day (other jobs on the cores, another host). A live load sweep needs the simulator's
capacity in today's seconds, so before it runs, a few engine steps are timed live
(:class:`~feather_gym.costmodel.refit.LiveStep` records: each step's composition and its wall
time) and :func:`fit_clock` fits one factor on them:

    factor = sum(measured step seconds) / sum(predicted step seconds)

the factor by which ``cost_model.scaled(factor)`` predicts the timed steps' total time exactly
(steps are predicted as the simulator composes them, :meth:`~.model.CostModel.chunked_step_s`).
The per-step mean absolute percentage error before and after the scaling says how much of the
difference one factor explains; what it does not (a composition the profile predicts badly)
stays. Steps that computed nothing are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .features import DecodeBatch
from .model import CostModel
from .refit import CLOCKS


@dataclass(frozen=True)
class ClockCalibration:
    """The fitted factor and what it was fitted on (seconds; ``mape_*`` are fractions)."""

    factor: float
    steps: int
    measured_s: float
    predicted_s: float
    mape_before: float
    mape_after: float

    def as_dict(self) -> dict:
        return {"clock_factor": self.factor, "calibration_steps": self.steps,
                "calibration_measured_s": self.measured_s, "calibration_predicted_s": self.predicted_s,
                "calibration_mape_before": self.mape_before, "calibration_mape_after": self.mape_after}


def predicted_step_s(cost_model: CostModel, step) -> float:
    """``cost_model``'s seconds for a :class:`~.refit.LiveStep`'s composition."""
    batch = DecodeBatch(step.decode_requests, step.decode_kv_tokens, step.decode_unique_kv_tokens, step.decode_groups)
    return cost_model.chunked_step_s(batch, [tuple(chunk) for chunk in step.prefill_chunks])


def fit_clock(steps, cost_model: CostModel, *, clock: str = "wall") -> ClockCalibration:
    """The :class:`ClockCalibration` of ``cost_model`` on timed ``steps`` (``clock``: which of their
    times, :data:`~.refit.CLOCKS`). ``ValueError`` when no step computed anything."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    pairs = [(getattr(step, CLOCKS[clock]), predicted_step_s(cost_model, step)) for step in steps
             if step.decode_requests or step.prefill_chunks]
    if not pairs:
        raise ValueError(f"none of the {len(steps)} timed steps computed anything: no clock to calibrate")
    measured, predicted = np.array(pairs, dtype=np.float64).T
    factor = float(measured.sum() / predicted.sum())
    return ClockCalibration(factor=factor, steps=len(pairs), measured_s=float(measured.sum()),
                            predicted_s=float(predicted.sum()),
                            mape_before=float(np.mean(np.abs(predicted - measured) / measured)),
                            mape_after=float(np.mean(np.abs(factor * predicted - measured) / measured)))
