"""The Feather observation: one fixed-size, normalised feature vector per admission point.

The single source of truth for the simulator, the gym env, the trainer's ONNX export
metadata and the deploy scheduler inside vLLM. Every producer builds the vector with
:func:`build_observation` (one row) or :func:`normalise` (rows of raw features), so a
policy trained in the gym sees the same numbers in the engine.

Features (raw unit -> normalised value ``clip((raw - offset) / scale, 0, OBS_CLIP)``):

====  =========================  ==========================================================  =======
idx   name                       raw meaning                                                 scale
====  =========================  ==========================================================  =======
0     batch_size                 requests running now, including those admitted this step    32
1     chunk_loss                 chunks the running batch's common prefix shrinks by if the  8
                                 candidate is added (CHT ``chunk_loss``)
2     same_prefix_waiting        waiting requests sharing the candidate's prefix (CHT)       32
3     running_common_prefix      chunks common to every running request (0 when none run)    32
4     candidate_context_tokens   candidate's prompt length in tokens                         8192
5     candidate_cached_fraction  share of the candidate's chunks already in the running set  1
6     kv_utilisation             fraction of KV-cache blocks referenced by running requests  1
7     num_waiting                waiting-queue length (candidate included)                   128
8     oldest_wait_s              seconds the longest-waiting request has waited              10
====  =========================  ==========================================================  =======

Features 0-2 are the Feather paper's; 3-8 are the extras the issue suggests. All raw values
are non-negative, so every offset is 0 and the normalised range is ``[0, OBS_CLIP]``.
Changing a feature, its order or its normalisation requires bumping :data:`OBS_VERSION`;
ONNX policies carry the version they were trained with and are refused on mismatch.
"""

from __future__ import annotations

import numpy as np

OBS_VERSION = "feather-obs-1"

FEATURE_NAMES: tuple[str, ...] = (
    "batch_size",
    "chunk_loss",
    "same_prefix_waiting",
    "running_common_prefix",
    "candidate_context_tokens",
    "candidate_cached_fraction",
    "kv_utilisation",
    "num_waiting",
    "oldest_wait_s",
)

#: name -> (offset, scale): ``obs = clip((raw - offset) / scale, 0, OBS_CLIP)``.
OBS_NORMALIZATION: dict[str, tuple[float, float]] = {
    "batch_size": (0.0, 32.0),
    "chunk_loss": (0.0, 8.0),
    "same_prefix_waiting": (0.0, 32.0),
    "running_common_prefix": (0.0, 32.0),
    "candidate_context_tokens": (0.0, 8192.0),
    "candidate_cached_fraction": (0.0, 1.0),
    "kv_utilisation": (0.0, 1.0),
    "num_waiting": (0.0, 128.0),
    "oldest_wait_s": (0.0, 10.0),
}

#: Upper clip of every normalised feature (the lower clip is 0).
OBS_CLIP = 8.0

#: Action ids: STOP = 0 ends admission for this engine step, ADD = 1 admits the candidate.
ACTION_MEANINGS: tuple[str, ...] = ("STOP", "ADD")
STOP, ADD = 0, 1

NUM_FEATURES = len(FEATURE_NAMES)
_OFFSET = np.array([OBS_NORMALIZATION[n][0] for n in FEATURE_NAMES], dtype=np.float32)
_INV_SCALE = np.array([1.0 / OBS_NORMALIZATION[n][1] for n in FEATURE_NAMES], dtype=np.float32)


def normalise(raw: np.ndarray) -> np.ndarray:
    """Normalise raw feature rows (shape ``[..., NUM_FEATURES]``, order :data:`FEATURE_NAMES`).

    Returns a new float32 array of the same shape in ``[0, OBS_CLIP]``. O(size), vectorised.
    """
    out = np.subtract(raw, _OFFSET, dtype=np.float32)
    np.multiply(out, _INV_SCALE, out=out)
    np.minimum(out, OBS_CLIP, out=out)
    return np.maximum(out, 0.0, out=out)   # ufuncs with out=: a few microseconds per row


def build_observation(
    *,
    batch_size: float,
    chunk_loss: float,
    same_prefix_waiting: float,
    running_common_prefix: float,
    candidate_context_tokens: float,
    candidate_cached_fraction: float,
    kv_utilisation: float,
    num_waiting: float,
    oldest_wait_s: float,
) -> np.ndarray:
    """One normalised observation (float32, shape ``[NUM_FEATURES]``) from raw feature values.

    Arguments are the raw features of the module table, by name (keyword-only, so a
    reordering of :data:`FEATURE_NAMES` cannot silently permute them).
    """
    raw = np.array(
        (batch_size, chunk_loss, same_prefix_waiting, running_common_prefix, candidate_context_tokens,
         candidate_cached_fraction, kv_utilisation, num_waiting, oldest_wait_s),
        dtype=np.float32,
    )
    return normalise(raw)


def observation_contract() -> dict[str, object]:
    """This version's observation contract, keyed like an ONNX policy's ``feather.*`` metadata.

    Values are decoded (lists and dicts); the exporter stores them JSON-encoded and the policy
    runtime refuses a policy whose stored values differ from these.
    """
    return {
        "feather.obs_version": OBS_VERSION,
        "feather.feature_names": list(FEATURE_NAMES),
        "feather.obs_normalization": {name: [float(o), float(s)] for name, (o, s) in OBS_NORMALIZATION.items()},
        "feather.action_meanings": list(ACTION_MEANINGS),
    }
