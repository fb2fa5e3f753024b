"""Cost model: features, NNLS fit, profile validation, shipped profiles, CLI (no torch needed)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from feather_gym.costmodel import SHIPPED_PROFILES, DecodeBatch, load_cost_model, model_preset
from feather_gym.costmodel.analytic import GPU_SPECS, analytic_profile
from feather_gym.costmodel.features import COLUMNS, step_features
from feather_gym.costmodel.fit import CACHE_SCALES, cross_validate, nnls
from feather_gym.costmodel.homogeneity import PAPER_SPEEDUP_BAND, paper_check
from feather_gym.costmodel.model import PROFILE_DIR, cost_model_from_profile
from feather_gym.costmodel.profile_io import PROFILE_SCHEMA, ProfileError, load_profile, validate_profile

SHAPE = model_preset("smollm2-135m").with_dtype("float32")
CACHE = 32 * 2**20


# ---------------------------------------------------------------- batches and features

def test_decode_batch_from_groups_counts_shared_prefix_once():
    batch = DecodeBatch.from_groups(32, 4, 1000, 50)
    assert batch == DecodeBatch(32, 32 * 1050, 4 * 1000 + 32 * 50, 4)
    assert DecodeBatch.from_groups(8, 8, 100, 10) == DecodeBatch(8, 880, 880, 8)


@pytest.mark.parametrize("args", [(-1, 0, 0, 0), (2, 10, 11, 1), (2, 10, 10, 3), (2, 10, 10, 0), (0, 5, 0, 0)])
def test_decode_batch_rejects_impossible_compositions(args):
    with pytest.raises(ValueError):
        DecodeBatch(*args)


def test_cascade_reads_shared_prefix_once_per_request_reads_it_per_request():
    batch = DecodeBatch.from_groups(16, 2, 4096, 64)
    kv = SHAPE.kv_bytes_per_token
    per_request = dict(zip(COLUMNS, step_features(batch, 0, 0, SHAPE, CACHE, cascade=False)))
    cascade = dict(zip(COLUMNS, step_features(batch, 0, 0, SHAPE, CACHE, cascade=True)))
    assert cascade["kv_dram_bytes"] == batch.unique_kv_tokens * kv and cascade["kv_hit_bytes"] == 0
    assert per_request["kv_dram_bytes"] + per_request["kv_hit_bytes"] == pytest.approx(batch.total_kv_tokens * kv)
    assert (per_request["prefix_passes"], cascade["prefix_passes"]) == (16, 2)


def test_locality_more_groups_means_fewer_cache_hits():
    hits = [dict(zip(COLUMNS, step_features(DecodeBatch.from_groups(32, g, 8192, 64), 0, 0, SHAPE, CACHE, False)))
            for g in (1, 2, 8)]
    hit_fraction = [h["kv_hit_bytes"] / (h["kv_hit_bytes"] + h["kv_dram_bytes"]) for h in hits]
    assert hit_fraction[0] > hit_fraction[1] > hit_fraction[2]


# ---------------------------------------------------------------- fitting

def test_nnls_matches_known_solution_and_kkt():
    rng = np.random.default_rng(1)
    a = rng.random((60, 6)) * np.array([1, 1e3, 1e-3, 1e9, 1, 1e12])
    truth = np.array([2.0, 0.0, 5.0, 1e-9, 0.0, 3e-12])
    x = nnls(a, a @ truth)
    assert np.allclose(x, truth, rtol=1e-6, atol=1e-14)
    b = rng.random(60)  # not in the cone: check KKT instead
    x = nnls(a, b)
    gradient = a.T @ (b - a @ x)
    assert (x >= 0).all()
    scale = np.linalg.norm(a, axis=0) * np.linalg.norm(b)
    assert np.all(gradient / scale <= 1e-8) and np.allclose(gradient[x > 0] / scale[x > 0], 0, atol=1e-8)


TRUE = {"fixed": 0.03, "tokens": 2e-4, "prefix_passes": 5e-5, "kv_dram_bytes": 1e-10, "kv_hit_bytes": 2.5e-11,
        "attn_flops": 1e-11, "prefill_tokens": 1e-3, "prefill_attn_flops": 4e-11}


def synthetic_profile(noise: float = 0.0, seed: int = 0) -> dict:
    """A measured profile whose times follow TRUE exactly (times multiplicative noise)."""
    rng = np.random.default_rng(seed)
    cache = CACHE * CACHE_SCALES[4]
    rows = []
    for cascade in (False, True):
        for b in (1, 4, 16, 64):
            for g, p in [(b, 0)] + [(g, p) for g in (1, 2, 8) if g < b for p in (512, 8192)]:
                for s in (16, 1024):
                    batch = DecodeBatch.from_groups(b, g, p, s)
                    t = np.dot([TRUE[c] for c in COLUMNS], step_features(batch, 0, 0, SHAPE, cache, cascade))
                    rows.append({"phase": "decode", "attention": "cascade" if cascade else "per_request",
                                 "batch_size": b, "num_groups": batch.num_groups, "shared_prefix_tokens": p,
                                 "unique_tokens_per_request": s, "total_kv_tokens": batch.total_kv_tokens,
                                 "unique_kv_tokens": batch.unique_kv_tokens, "t": t})
    for new in (16, 256, 1024):
        for cached in (0, 4096):
            t = np.dot([TRUE[c] for c in COLUMNS], step_features(DecodeBatch(0, 0, 0, 0), new, cached, SHAPE, cache, False))
            rows.append({"phase": "prefill", "new_tokens": new, "cached_tokens": cached, "t": t})
    for row in rows:
        t = row.pop("t") * (1 + noise * rng.standard_normal())
        row.update(median_s=t, mean_s=t, std_s=0.0, min_s=t, max_s=t, repeats=1)
    return {"schema": PROFILE_SCHEMA, "kind": "measured", "name": "synthetic", "created_at": "2026-01-01T00:00:00+00:00",
            "backend": "torch", "hardware": {"device": "cpu", "name": "test", "cores": 1, "memory_bytes": 2**30,
                                             "cache_bytes": CACHE},
            "software": {}, "model": SHAPE.to_dict(), "settings": {}, "kv_cache_bytes": 2**30, "measurements": rows}


@pytest.mark.parametrize("cascade", [False, True])
def test_fit_recovers_known_coefficients(cascade):
    profile = validate_profile(synthetic_profile())
    model = cost_model_from_profile(profile, cascade=cascade)
    for column in COLUMNS:
        if cascade and column == "kv_hit_bytes":
            continue  # cascade never re-reads: the column is identically zero
        assert model.coefficients[column] == pytest.approx(TRUE[column], rel=1e-5), column
    if not cascade:
        assert model.cache_bytes == CACHE * CACHE_SCALES[4]


def test_cross_validation_reports_noise_level():
    exact = cross_validate(synthetic_profile(), cascade=False)
    assert exact["mape"] < 1e-6 and exact["max_ape"] < 1e-6
    noisy = cross_validate(synthetic_profile(noise=0.03, seed=3), cascade=False)
    assert 0.005 < noisy["mape"] < 0.06 and noisy["max_ape"] >= noisy["mape"]
    assert {"decode_mape", "prefill_mape", "rows", "folds"} <= set(noisy)


# ---------------------------------------------------------------- profile validation

def _broken(mutate) -> dict:
    profile = copy.deepcopy(synthetic_profile())
    mutate(profile)
    return profile


@pytest.mark.parametrize("mutate, field", [
    (lambda p: p.pop("model"), "model: missing"),
    (lambda p: p.update(schema="v0"), "schema"),
    (lambda p: p.update(kind="guessed"), "kind"),
    (lambda p: p["model"].update(heads=10), "model"),
    (lambda p: p["measurements"][3].update(median_s=-1.0), "measurements[3].median_s"),
    (lambda p: p["measurements"][2].update(batch_size="8"), "measurements[2].batch_size"),
    (lambda p: p["measurements"][0].update(attention="paged"), "measurements[0].attention"),
    (lambda p: p["measurements"][5].update(unique_kv_tokens=10**9), "measurements[5]"),
    (lambda p: p.update(measurements=[]), "measurements"),
    (lambda p: p["hardware"].pop("cache_bytes"), "hardware.cache_bytes"),
])
def test_validation_names_the_bad_field(mutate, field):
    with pytest.raises(ProfileError, match=r"bad\.json: " + field.replace("[", r"\[").replace("]", r"\]")):
        validate_profile(_broken(mutate), "bad.json")


def test_load_profile_reports_json_syntax_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n "schema": "feather-profile/1",\n oops\n}')
    with pytest.raises(ProfileError, match=r"broken\.json: line 3"):
        load_profile(path)
    with pytest.raises(ValueError, match="not one of cpu"):
        load_cost_model(tmp_path / "absent.json")


# ---------------------------------------------------------------- shipped profiles and the cost model API

@pytest.mark.parametrize("name", SHIPPED_PROFILES)
def test_shipped_profiles_load_and_behave_physically(name):
    for cascade in (False, True):
        model = load_cost_model(name, cascade=cascade)
        assert model.name == name and model.cascade is cascade
        assert model.step_s(DecodeBatch(0, 0, 0, 0)) == 0.0
        times = [model.decode_step_s(DecodeBatch.from_groups(16, 16, 0, s)) for s in (16, 1024, 8192)]
        assert 0 < times[0] <= times[1] <= times[2]
        assert 0 < model.prefill_s(64) <= model.prefill_s(64, 4096) <= model.prefill_s(1024, 4096)
        mixed = model.step_s(DecodeBatch.from_groups(8, 8, 0, 512), 256, 1024)
        assert mixed <= model.decode_step_s(DecodeBatch.from_groups(8, 8, 0, 512)) + model.prefill_s(256, 1024)
        assert model.kv_capacity_tokens == load_profile(PROFILE_DIR / f"{name}.json")["kv_cache_bytes"] \
            // model.model_shape.kv_bytes_per_token


def test_cpu_profile_is_measured_by_the_torch_backend():
    profile = load_profile(PROFILE_DIR / "cpu.json")
    assert profile["kind"] == "measured" and profile["backend"] == "torch"
    assert {row["attention"] for row in profile["measurements"] if row["phase"] == "decode"} == {"per_request", "cascade"}
    assert any(row["phase"] == "prefill" for row in profile["measurements"])


@pytest.mark.parametrize("gpu", GPU_SPECS)
def test_shipped_analytic_profiles_match_their_derivation(gpu):
    shipped = load_profile(PROFILE_DIR / f"{gpu}.json")
    fresh = analytic_profile(gpu)
    for profile in (shipped, fresh):
        profile.pop("created_at")
    assert json.loads(json.dumps(fresh)) == shipped
    assert "ANALYTIC" in shipped["settings"]["note"]


def test_analytic_rtx6000_ada_reproduces_paper_point():
    """Paper: Llama-3-8B, 10K shared prefix, 8 homogeneous batches of 100 vs one mixed 800: ~2x."""
    check = paper_check(load_cost_model("rtx6000-ada"))
    low, high = PAPER_SPEEDUP_BAND
    assert check["within_paper_band"] and low <= check["speedup_split_homogeneous"] <= high


def test_cascade_never_slower_than_per_request_on_analytic_gpu():
    per_request, cascade = load_cost_model("h100"), load_cost_model("h100", cascade=True)
    for groups in (1, 4, 32):
        batch = DecodeBatch.from_groups(128, groups, 4096, 128)
        assert cascade.decode_step_s(batch) <= per_request.decode_step_s(batch)


# ---------------------------------------------------------------- CLI

def test_cli_fit_prints_held_out_error_as_json(capsys):
    from feather_gym.cli import main

    assert main(["profile", "fit", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for variant in ("per_request", "cascade"):
        entry = report["variants"][variant]
        held_out = entry["held_out"]
        assert held_out["mape"] <= held_out["max_ape"]
        assert held_out["mape"] < 0.10  # the target on the shipped CPU profile
        assert entry["homogeneity"]["speedup_same_size_homogeneous"] > 0
        measured = entry["homogeneity_measured"]  # the shipped CPU grid includes the comparison points
        assert measured["mixed_step_s"] > 0 and measured["homogeneous_same_size_step_s"] > 0


def test_cli_fit_rejects_bad_profile(tmp_path, capsys):
    from feather_gym.cli import main

    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"schema": PROFILE_SCHEMA}))
    assert main(["profile", "fit", str(path)]) == 2
    assert "bad.json: kind: missing" in capsys.readouterr().err
