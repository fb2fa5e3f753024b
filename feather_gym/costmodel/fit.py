"""Fitting a :class:`~feather_gym.costmodel.model.CostModel` to a measured profile.

The model is linear in non-negative coefficients over the physical features of
:mod:`features`, so fitting is non-negative least squares on relative error (rows divided
by the measured time: MAPE-like, a 1 ms step counts as much as a 1 s step). The one
non-linear parameter, the effective cache size of the locality term, is chosen by a line
search over powers of two around the hardware's cache size. Held-out error is k-fold
cross-validation over the measurements of the fitted attention variant.
"""

from __future__ import annotations

import numpy as np

from .features import COLUMNS, DecodeBatch, step_features
from .profile_io import ATTENTION_VARIANTS, COMPOSITION_FIELDS, PHASES
from .shapes import ModelShape

#: Effective cache sizes tried, as multiples of the hardware's (last-level) cache size.
CACHE_SCALES = tuple(2.0 ** e for e in np.arange(-6.0, 3.5, 0.5))


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Lawson-Hanson non-negative least squares: ``argmin ||a x - b||`` s.t. ``x >= 0``.

    Columns are scaled to unit norm internally (features span 1 to 1e15); all-zero columns
    get coefficient 0. O(max_iter * m n^2) for an m x n problem; n is small here.
    """
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    m, n = a.shape
    norms = np.linalg.norm(a, axis=0)
    usable = norms > 0
    scaled = np.zeros_like(a)
    scaled[:, usable] = a[:, usable] / norms[usable]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(m, n) * max(1.0, np.abs(scaled).sum(axis=0).max())
    for _ in range(3 * n if max_iter is None else max_iter):
        gradient = scaled.T @ (b - scaled @ x)
        candidates = ~passive & usable & (gradient > tol)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, gradient, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(scaled[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            blocking = passive & (z <= 0)
            alpha = np.min(x[blocking] / (x[blocking] - z[blocking]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    coefficients = np.zeros(n)
    coefficients[usable] = x[usable] / norms[usable]
    return coefficients


def attention_variants(profile: dict) -> tuple[str, ...]:
    """The attention variants a validated profile can be loaded with: both for an analytic
    profile, those its decode rows measured for a measured one (the vllm backend measures
    the engine's own attention only)."""
    if profile["kind"] == "analytic":
        return ATTENTION_VARIANTS
    measured = {row["attention"] for row in profile["measurements"] if row["phase"] == "decode"}
    return tuple(v for v in ATTENTION_VARIANTS if v in measured)


def measurement_rows(profile: dict, cascade: bool) -> list[dict]:
    """The profile's prefill rows and the decode and mixed rows of the requested attention variant."""
    variant = "cascade" if cascade else "per_request"
    return [row for row in profile["measurements"]
            if row["phase"] == "prefill" or row["attention"] == variant]


_EMPTY = DecodeBatch(0, 0, 0, 0)
_FIXED = COLUMNS.index("fixed")


def row_features(row: dict, shape: ModelShape, cache_bytes: float, cascade: bool) -> np.ndarray:
    """The :data:`COLUMNS` row of a measured step.

    A step of ``prefill_requests`` = k chunks is composed as the simulator composes it: the
    decode batch with the first chunk (``step_features``), plus k - 1 further chunks without
    their fixed cost (one fixed cost per step).
    """
    batch = _EMPTY if row["phase"] == "prefill" else DecodeBatch(
        row["batch_size"], row["total_kv_tokens"], row["unique_kv_tokens"], row["num_groups"])
    new, cached = row.get("new_tokens", 0), row.get("cached_tokens", 0)
    features = np.array(step_features(batch, new, cached, shape, cache_bytes, cascade))
    further = row.get("prefill_requests", 1) - 1
    if further:
        chunk = np.array(step_features(_EMPTY, new, cached, shape, cache_bytes, cascade))
        chunk[_FIXED] = 0.0
        features += further * chunk
    return features


def _solve(rows: list[dict], shape: ModelShape, cache_bytes: float, cascade: bool) -> tuple[np.ndarray, float]:
    """Coefficients minimising the squared relative error, and that error."""
    times = np.array([row["median_s"] for row in rows])
    design = np.array([row_features(row, shape, cache_bytes, cascade) for row in rows]) / times[:, None]
    coefficients = nnls(design, np.ones(len(rows)))
    return coefficients, float(np.sum((design @ coefficients - 1.0) ** 2))


def fit_rows(rows: list[dict], shape: ModelShape, hardware_cache_bytes: float,
             cascade: bool) -> tuple[dict[str, float], float]:
    """Fit coefficients (by column name) and the effective cache size to ``rows``."""
    if cascade:  # no re-reads, the cache size does not enter
        scales = (1.0,)
    else:
        scales = CACHE_SCALES
    best = min(((_solve(rows, shape, hardware_cache_bytes * s, cascade), hardware_cache_bytes * s)
                for s in scales), key=lambda item: item[0][1])
    (coefficients, _), cache_bytes = best
    return dict(zip(COLUMNS, map(float, coefficients))), cache_bytes


def predict_rows(rows: list[dict], coefficients: dict[str, float], shape: ModelShape,
                 cache_bytes: float, cascade: bool) -> np.ndarray:
    vector = np.array([coefficients[column] for column in COLUMNS])
    return np.array([row_features(row, shape, cache_bytes, cascade) for row in rows]) @ vector


def phase_masks(rows: list[dict]) -> dict[str, np.ndarray]:
    """Row masks by report-key prefix: ``""`` for every row, ``"<phase>_"`` for each phase present."""
    masks = {"": np.ones(len(rows), dtype=bool)}
    for phase in PHASES:
        mask = np.array([row["phase"] == phase for row in rows], dtype=bool)
        if mask.any():
            masks[f"{phase}_"] = mask
    return masks


def absolute_percentage_errors(measured: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    """Per element, ``|predicted - measured| / measured``: fractions (0.05 = 5%), never negative."""
    return np.abs(predicted - measured) / measured


def relative_errors(rows: list[dict], errors: np.ndarray) -> dict:
    """``rows``, ``mape`` and ``max_ape`` (fractions) of ``rows``' :func:`absolute_percentage_errors`
    ``errors``, overall and per phase (keys prefixed as :func:`phase_masks`)."""
    report = {}
    for prefix, mask in phase_masks(rows).items():
        report.update({f"{prefix}rows": int(mask.sum()), f"{prefix}mape": float(errors[mask].mean()),
                       f"{prefix}max_ape": float(errors[mask].max())})
    return report


def cross_validate(profile: dict, cascade: bool, folds: int = 5, seed: int = 0) -> dict:
    """k-fold held-out error of the fit: MAPE and worst case, overall and per phase, and the worst row.

    Each row is predicted by a model fitted without its fold. Returns fractions
    (``mape`` 0.05 = 5%), the row count, and ``worst``: the composition of the row with the
    largest error, its measured and predicted seconds and that error (``ape``).
    """
    rows = measurement_rows(profile, cascade)
    if len(rows) < 2 * folds:
        raise ValueError(f"profile {profile['name']!r}: {len(rows)} "
                         f"measurements are too few for {folds}-fold validation")
    shape = ModelShape.from_dict(profile["model"])
    cache = profile["hardware"]["cache_bytes"]
    fold_of = np.random.default_rng(seed).permutation(len(rows)) % folds
    measured = np.array([row["median_s"] for row in rows])
    predicted = np.zeros(len(rows))
    for fold in range(folds):
        train = [row for row, f in zip(rows, fold_of) if f != fold]
        test = [row for row, f in zip(rows, fold_of) if f == fold]
        coefficients, cache_bytes = fit_rows(train, shape, cache, cascade)
        predicted[fold_of == fold] = predict_rows(test, coefficients, shape, cache_bytes, cascade)
    errors = absolute_percentage_errors(measured, predicted)
    report = {"folds": folds, **relative_errors(rows, errors)}
    worst = int(np.argmax(errors))
    composition = {k: v for k, v in rows[worst].items() if k in COMPOSITION_FIELDS}
    report["worst"] = {**composition, "measured_s": float(measured[worst]), "predicted_s": float(predicted[worst]),
                       "ape": float(errors[worst])}
    return report
