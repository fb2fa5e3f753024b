"""The report of ``feather profile fit``: held-out error, coefficients and the homogeneity check
of a profile's fitted cost model, per attention variant, and optionally how a second profile of
the same model (a GPU's analytic one beside its measured one) predicts the measured steps."""

from __future__ import annotations

#: (batch size, groups, prefix tokens, own tokens) of the homogeneity comparison, unless the
#: profile's ``settings.homogeneity_point`` names the one its grid measured; the torch backend's
#: grids always measure it (:data:`~feather_gym.costmodel.profiler_torch.HOMOGENEITY_POINTS`).
CPU_HOMOGENEITY = (32, 8, 8192, 256)


def fit_report(profile: dict, against: dict | None = None) -> dict:
    """Held-out error, fitted coefficients and the homogeneity comparison for each attention variant.

    ``homogeneity`` is the model's prediction at the profile's homogeneity point and, for a
    measured profile, ``homogeneity_measured`` the measured steps there; a Llama-3-8B profile also
    gets ``paper_point`` (:func:`~feather_gym.costmodel.homogeneity.paper_check`). With
    ``against`` (a validated profile of the same model) each variant of a measured profile that
    ``against`` also has gets ``against``: :func:`prediction_error` of that profile's model on
    these measurements.
    """
    from feather_gym.costmodel.fit import attention_variants, cross_validate
    from feather_gym.costmodel.homogeneity import homogeneity_comparison, measured_comparison, paper_check
    from feather_gym.costmodel.model import cost_model_from_profile

    if against is not None:
        _check_comparable(profile, against)
    report = {"profile": profile["name"], "kind": profile["kind"], "backend": profile["backend"],
              "model": profile["model"]["name"], "hardware": profile["hardware"]["name"], "variants": {}}
    homogeneity_point = tuple(profile["settings"].get("homogeneity_point", CPU_HOMOGENEITY))
    measured = profile["kind"] == "measured"
    for variant in attention_variants(profile):
        cascade = variant == "cascade"
        model = cost_model_from_profile(profile, cascade=cascade)
        entry = {"coefficients": model.describe(), "homogeneity": homogeneity_comparison(model, *homogeneity_point)}
        if measured:
            entry["held_out"] = cross_validate(profile, cascade=cascade)
            entry["homogeneity_measured"] = measured_comparison(profile, variant, *homogeneity_point)
        if profile["model"]["name"] == "llama3-8b":
            entry["paper_point"] = paper_check(model)
        if measured and against is not None and variant in attention_variants(against):
            entry["against"] = prediction_error(profile, cost_model_from_profile(against, cascade=cascade),
                                                homogeneity_point)
        report["variants"][variant] = entry
    if against is not None:
        report["against"] = {"profile": against["name"], "kind": against["kind"]}
    return report


def prediction_error(profile: dict, model, homogeneity_point: tuple[int, int, int, int]) -> dict:
    """How ``model`` predicts ``profile``'s measured steps of the model's attention variant:
    MAPE, worst error and the median of predicted ÷ measured (above 1: the model is slow),
    overall and per phase, and its homogeneity comparison at ``homogeneity_point``."""
    import numpy as np

    from feather_gym.costmodel.fit import (
        absolute_percentage_errors,
        measurement_rows,
        phase_masks,
        predict_rows,
        relative_errors,
    )
    from feather_gym.costmodel.homogeneity import homogeneity_comparison

    rows = measurement_rows(profile, model.cascade)
    measured = np.array([row["median_s"] for row in rows])
    predicted = predict_rows(rows, model.coefficients, model.model_shape, model.cache_bytes, model.cascade)
    report = {"profile": model.name, **relative_errors(rows, absolute_percentage_errors(measured, predicted))}
    for prefix, mask in phase_masks(rows).items():
        report[f"{prefix}predicted_over_measured_median"] = float(np.median(predicted[mask] / measured[mask]))
    report["homogeneity"] = homogeneity_comparison(model, *homogeneity_point)
    return report


def _check_comparable(profile: dict, against: dict) -> None:
    """``ValueError`` unless ``profile`` is measured and ``against`` describes the same model."""
    if profile["kind"] != "measured":
        raise ValueError(f"--against compares with measurements; profile {profile['name']!r} is {profile['kind']}")
    if profile["model"]["name"] != against["model"]["name"]:
        raise ValueError(f"--against: profile {against['name']!r} is of {against['model']['name']}, "
                         f"{profile['name']!r} of {profile['model']['name']}")
