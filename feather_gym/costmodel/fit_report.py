"""The report of ``feather profile fit``: held-out error, coefficients and the homogeneity check
of a profile's fitted cost model, per attention variant."""

from __future__ import annotations

#: (batch size, groups, prefix tokens, own tokens) of the homogeneity comparison on small models,
#: unless the profile's ``settings.homogeneity_point`` names the one its grid measured.
CPU_HOMOGENEITY = (32, 8, 8192, 256)


def fit_report(profile: dict) -> dict:
    """Held-out error, fitted coefficients and the homogeneity comparison for each attention variant."""
    from feather_gym.costmodel.fit import attention_variants, cross_validate
    from feather_gym.costmodel.homogeneity import homogeneity_comparison, measured_comparison, paper_check
    from feather_gym.costmodel.model import cost_model_from_profile

    report = {"profile": profile["name"], "kind": profile["kind"], "backend": profile["backend"],
              "model": profile["model"]["name"], "hardware": profile["hardware"]["name"], "variants": {}}
    homogeneity_point = tuple(profile["settings"].get("homogeneity_point", CPU_HOMOGENEITY))
    for variant in attention_variants(profile):
        model = cost_model_from_profile(profile, cascade=variant == "cascade")
        entry = {"coefficients": model.describe()}
        if profile["kind"] == "measured":
            entry["held_out"] = cross_validate(profile, cascade=variant == "cascade")
        if profile["model"]["name"] == "llama3-8b":
            entry["homogeneity"] = paper_check(model)
        else:  # the points the CPU grids always measure (HOMOGENEITY_POINTS, VLLM_HOMOGENEITY)
            entry["homogeneity"] = homogeneity_comparison(model, *homogeneity_point)
            if profile["kind"] == "measured":
                entry["homogeneity_measured"] = measured_comparison(profile, variant, *homogeneity_point)
        report["variants"][variant] = entry
    return report
