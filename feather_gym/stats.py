"""Confidence intervals shared by the simulated sweeps and the live benchmarks.

Every interval here is a two-sided 95% interval of a mean under Student's t, so a sweep over
seeds and a live bench over rounds state their uncertainty the same way.
"""

from __future__ import annotations

import numpy as np

#: Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (1.96 beyond).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


def mean_interval(values) -> tuple[float, float, float] | None:
    """``(sem, low, high)``: the standard error of the mean of ``values`` and its 95% interval;
    None for fewer than two values."""
    x = np.asarray(values, dtype=np.float64)
    dof = len(x) - 1
    if dof < 1:
        return None
    mean = float(x.mean())
    sem = float(x.std(ddof=1) / np.sqrt(len(x)))
    half = (_T95[dof - 1] if dof <= len(_T95) else 1.96) * sem
    return sem, mean - half, mean + half
