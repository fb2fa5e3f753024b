"""SuffixReplay as a placement: exact checkpoints, replay anchors, or both, at equal bytes.

The model extends :mod:`cache_core.hybrid.placement` (one shared prefix path of ``N`` blocks; a
request's overlap depth ``t`` in blocks; page = block):

* an **exact state** at position ``c`` (``HybridCacheLayout.state_bytes``) lets a request of
  depth ``t >= c`` resume at ``c`` with no rebuild;
* an **anchor entry** at ``c`` (one :class:`~cache_core.hybrid.anchor_store.AnchorStore` entry:
  ``R`` anchors per anchored GDN layer, ``AnchorStore.entry_bytes``) lets it resume at ``c``
  after a replay that takes ``rebuild_ms`` and leaves an approximate state (the quality cost
  that ``feather replay eval`` measures: next-token KL, perplexity ratio);
* a request resumes from the exact or anchored position ``<= t`` whose estimated time to first
  token (prefill of the rest, plus ``rebuild_ms`` when replayed) is least; with no prefill
  model, from the deepest one. It is a **replay hit** when it resumes from an anchor.

Bytes. A placement is a set ``C`` of depths in ``1..N`` per prefix family (a prompt's first
page); an item at depth ``c`` of family ``f`` is stored in ``copies[f, c - 1]`` prefix-tree
nodes, so ``C`` holds ``sum(copies[f, C - 1]) * item bytes``. With one family and one copy per
depth (the path model) this is the bytes of one shared prefix path, as in
:func:`cache_core.hybrid.placement_eval.evaluate_placements`; with the workload's hit tree
(:func:`hit_tree_copies`) it is the bytes of the whole cache, and every request resumes
exactly as in its family's path model. At a budget of ``B`` bytes (``B = m * state_bytes`` for the evaluation's
budget ``m``), :func:`compare_at_equal_bytes` compares four configurations, each taking the
most its rule fits in ``B``:

* ``align_grid``: exact states every ``s`` blocks from the start, ``s`` the finest step that
  fits (``s = 1``, every block, is vLLM's align grid);
* ``dp``: the exact DP of each family (:func:`cache_core.hybrid.placement.solve`), budgets split
  between families greedily by recompute removed per byte (:func:`dp_allocations`);
* ``replay``: no exact state, anchors on every page boundary when they fit, else as many as
  fit spread evenly (:func:`spread_anchors`);
* ``dp_replay``: for every DP allocation that fits, its states plus as many anchors as fit in
  the bytes left, on evenly spread depths, held by the nodes there without an exact state (an
  allocation below ``dp``'s that buys no anchor is skipped: it is the DP with bytes left
  unused); the split of least cost (mean estimated
  TTFT with a prefill model, else mean recomputed tokens; ties go to fewer replay hits, then
  more exact states) is kept.

Invariants (``tests/test_replay_placement.py``): every configuration's bytes are at most ``B``;
``dp_replay``'s candidate splits include ``replay`` (nothing exact, when it buys an anchor; else
``replay`` stores nothing, which no placement is worse than) and ``dp`` plus leftover anchors,
and anchors only add resume options, so its cost is never above either; with no affordable
anchor it equals ``dp``; with anchors on every boundary every hit at a depth ``>= 1`` that has
no exact state there resumes exactly at its depth.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass

import numpy as np

from cache_core.hybrid.placement import PlacementProblem, resume_positions, solve
from cache_core.hybrid.placement_heuristics import EveryBlocks, TokenGrid
from cache_core.hybrid.recompute_cost import PrefillTime
from traces.io import read_text


def anchor_entry_bytes(*, hidden_size: int, anchored_layers, replay_tokens: int, dtype: str = "bfloat16") -> int:
    """Bytes of one page boundary's anchors, as :class:`AnchorStore` accounts them (``R`` per
    anchored layer)."""
    from cache_core.hybrid.anchor_store import AnchorStore

    store = AnchorStore(sys.maxsize, hidden_size=hidden_size, dtype=dtype,
                        replay_tokens=dict.fromkeys(anchored_layers, replay_tokens))
    return store.entry_bytes


@dataclass(frozen=True)
class ReplayCost:
    """What one anchor entry costs: bytes, rebuild time and (when measured) quality.

    ``kl_nats`` and ``ppl_ratio`` are the replay eval's mean next-token KL(exact || replayed)
    and perplexity ratio replayed/exact for this ``method`` and ``replay_tokens``; a replay
    hit pays them, an exact resume does not.
    """

    method: str
    replay_tokens: int
    anchored_layers: tuple[int, ...]
    entry_bytes: int
    rebuild_ms: float
    kl_nats: float | None = None
    ppl_ratio: float | None = None
    quality_prefix_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.entry_bytes < 1 or not np.isfinite(self.rebuild_ms) or self.rebuild_ms < 0:
            raise ValueError(f"need entry_bytes >= 1 and a finite rebuild_ms >= 0, got "
                             f"{self.entry_bytes}, {self.rebuild_ms}")

    @classmethod
    def from_replay_report(cls, report: dict, *, method: str = "uniform", replay_tokens: int = 16,
                           hidden_size: int) -> ReplayCost:
        """The cost of ``method`` at ``replay_tokens`` from a ``feather replay eval --json`` report:
        anchored layers and dtype from it, rebuild time from its timing rows, quality from its
        quality row at the longest prefix measured. ``ValueError`` when the report lacks them."""
        anchored = {"uniform": report["gdn_layers"], "layerwise": report["layerwise_anchored_layers"]}
        if method not in anchored:
            raise ValueError(f"replay method {method!r}: choose from {sorted(anchored)} (methods that keep anchors)")
        rebuild = [row["rebuild_s"] for row in report["timing"]["rebuild"]
                   if row["method"] == method and row["replay_tokens"] == replay_tokens]
        quality = [q for q in report["quality"] if q["method"] == method and q["replay_tokens"] == replay_tokens]
        if not rebuild or not quality:
            measured = sorted({row["replay_tokens"] for row in report["timing"]["rebuild"] if row["method"] == method})
            raise ValueError(f"the replay report has no {method} rows at R = {replay_tokens} (measured R: {measured})")
        q = max(quality, key=lambda row: row["prefix_tokens"])
        layers = tuple(int(layer) for layer in anchored[method])
        return cls(method=method, replay_tokens=replay_tokens, anchored_layers=layers,
                   entry_bytes=anchor_entry_bytes(hidden_size=hidden_size, anchored_layers=layers,
                                                  replay_tokens=replay_tokens, dtype=report["anchor_dtype"]),
                   rebuild_ms=float(rebuild[0]) * 1e3, kl_nats=q["kl_nats_mean"], ppl_ratio=q["ppl_ratio"],
                   quality_prefix_tokens=q["prefix_tokens"])

    def as_dict(self) -> dict:
        return {**asdict(self), "anchored_layers": list(self.anchored_layers)}


def load_replay_report(path: str) -> dict:
    """A ``feather replay eval --json`` report: a file holding the JSON object, or that command's
    whole output (the object is its last line)."""
    text = read_text(path, "`feather replay eval --json` report")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            return json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            raise ValueError(f"{path}: neither a JSON object nor output ending in one "
                             "(write it with `feather replay eval --json`)") from None


def spread_anchors(num_positions: int, count: int) -> np.ndarray:
    """Sorted anchored depths: every boundary in ``1..N`` when ``count >= N``, else ``count`` of
    them evenly spread, the deepest included (none for ``count <= 0``)."""
    if count >= num_positions:
        return np.arange(1, num_positions + 1)
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    return np.unique(num_positions - (np.arange(count) * num_positions) // count)


def resume_with_anchors(at_exact: np.ndarray, at_anchor: np.ndarray, *, block_size: int, prompt_tokens=None,
                        prefill: PrefillTime | None = None, rebuild_ms: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Per request: the resume position (blocks) and whether it is a replay hit, given the
    deepest exact state and the deepest anchor at or below its depth (0: none).

    Each request takes the cheaper of the two: by estimated TTFT when ``prefill`` (and
    ``prompt_tokens``) are given, else the deeper one (an anchor only when strictly deeper).
    """
    replayed = at_anchor > at_exact
    if prefill is not None:
        cost_exact = ttft_ms(prefill, at_exact, block_size=block_size, prompt_tokens=prompt_tokens)
        cost_anchor = ttft_ms(prefill, at_anchor, block_size=block_size, prompt_tokens=prompt_tokens) + rebuild_ms
        replayed &= cost_anchor < cost_exact
    return np.where(replayed, at_anchor, at_exact), replayed


def ttft_ms(prefill: PrefillTime, resume: np.ndarray, *, block_size: int, prompt_tokens) -> np.ndarray:
    """Estimated prefill ms per request resuming at ``resume`` blocks: at least the last prompt
    token is computed (an engine needs its logits for the first output token)."""
    resume_tokens = np.minimum(np.asarray(resume) * block_size, prompt_tokens - 1)
    return prefill.ms(resume_tokens, prompt_tokens)


def hit_tree_copies(digests: list[list[int]], depths) -> tuple[np.ndarray, np.ndarray]:
    """The workload's hit tree by prefix family: ``(family, copies)``.

    ``family[i]`` indexes request ``i``'s family (its first page; requests without a full page
    form the last family, which holds no node). ``copies[f, c - 1]`` counts the distinct tree
    nodes (chained page digests) of family ``f`` at depth ``c`` that some request matches to
    depth ``>= c``, for ``c = 1..N`` (``N = max(depths)``, at least 1). A placement that stores
    an item at depth ``c`` of family ``f`` serves that family's requests exactly as the path
    model does when each such node holds it, so it occupies ``copies[f, c - 1]`` nodes
    (hindsight: only nodes some request hits, as the path model stops at ``N``).
    """
    depths = np.asarray(depths, dtype=np.int64)
    keys = [d[0] if d else None for d in digests]
    roots = {k: f for f, k in enumerate(dict.fromkeys(k for k in keys if k is not None))}
    family = np.array([roots.get(k, len(roots)) for k in keys], dtype=np.int64)
    copies = np.zeros((len(roots) + 1, max(int(depths.max()), 1)), dtype=np.int64)
    for c in range(1, int(depths.max()) + 1):
        for f, digest in {(family[i], digests[i][c - 1]) for i in np.flatnonzero(depths >= c)}:
            copies[f, c - 1] += 1
    return family, copies


def dp_allocations(depths, family: np.ndarray, copies: np.ndarray, state_bytes: int) -> list[dict]:
    """Exact DP placements per family under one byte budget, as a greedy sequence.

    Each family ``f`` gets the exact DP of its own depths (:func:`cache_core.hybrid.placement.solve`),
    whose budget ``k`` costs ``copies[f, C_f(k) - 1].sum() * state_bytes``. From nothing stored,
    each step raises one family's budget to the one that removes the most recomputed tokens per
    added byte (a ratio tie goes to the smaller budget); the sequence ends when no raise removes
    anything. Entries: ``bytes``, ``states`` (depths placed, summed over families), ``copies``
    (tree nodes holding a state), ``at_exact`` (per request, the deepest state at or below its
    depth, blocks) and ``placements`` (per family, the sorted depths). With one family and one
    copy per depth the steps are the DP's budgets 0, 1, 2, ... while its cost is convex in the
    budget (it is, up to float rounding: :mod:`cache_core.hybrid.placement`).
    """
    depths = np.asarray(depths, dtype=np.int64)
    members = [np.flatnonzero(family == f) for f in range(copies.shape[0])]
    options = []                                   # per family: (placements, bytes, recomputed blocks)
    for f, idx in enumerate(members):
        d = depths[idx]
        if d.size == 0 or d.max() == 0:
            options.append(([np.zeros(0, dtype=np.int64)], np.zeros(1), np.zeros(1)))
            continue
        solution = solve(PlacementProblem.from_depths(d), int(d.max()))
        sets = [solution.checkpoints(k) for k in range(int(d.max()) + 1)]
        options.append((sets, np.array([copies[f, c - 1].sum() * state_bytes for c in sets], dtype=np.float64),
                        np.array([(d - resume_positions(c, d)).sum() for c in sets], dtype=np.float64)))
    chosen = np.zeros(len(members), dtype=np.int64)
    at_exact = np.zeros(depths.size, dtype=np.int64)

    def entry() -> dict:
        placements = [options[f][0][k] for f, k in enumerate(chosen)]
        return {"bytes": int(sum(options[f][1][k] for f, k in enumerate(chosen))),
                "states": int(sum(c.size for c in placements)),
                "copies": int(sum(copies[f, c - 1].sum() for f, c in enumerate(placements))),
                "at_exact": at_exact.copy(), "placements": placements}

    sequence = [entry()]
    while True:
        best = None
        for f, (sets, cost_bytes, blocks) in enumerate(options):
            k = chosen[f]
            drop, extra = blocks[k] - blocks[k + 1:], cost_bytes[k + 1:] - cost_bytes[k]
            if not np.any(drop > 0):
                continue
            ratio = np.where(drop > 0, drop / np.maximum(extra, 1e-9), -np.inf)
            step = int(np.flatnonzero(ratio >= ratio.max() * (1 - 1e-9))[0])
            if best is None or ratio[step] > best[0]:
                best = (ratio[step], f, k + 1 + step)
        if best is None:
            return sequence
        _, f, chosen[f] = best
        at_exact[members[f]] = resume_positions(options[f][0][chosen[f]], depths[members[f]])
        sequence.append(entry())


def compare_at_equal_bytes(depths, *, block_size: int, budgets: list[int], state_bytes: int,
                           replay: ReplayCost, prompt_tokens=None, prefill: PrefillTime | None = None,
                           family=None, copies=None) -> dict:
    """The four configurations of the module docstring at byte budgets ``budgets[i] * state_bytes``.

    ``family`` and ``copies`` (:func:`hit_tree_copies`) make the bytes those of the workload's
    whole prefix tree, with one DP per family; without them (the path model) every request is
    in one family with one copy per depth. Bytes: exact states ``copies`` of their family's
    depths; the grid and the anchors are placed at the same depths in every family and held by
    every node there that has no exact state. Each configuration takes the most its rule fits
    in the budget: the finest grid step; the last :func:`dp_allocations` entry that fits; the
    most evenly spread anchors (bisection on the count; what it returns always fits).
    Per configuration and budget: ``states_stored`` (depths placed, summed over families),
    ``state_copies`` and ``anchor_copies`` (tree nodes holding them), ``anchor_entries`` (depths
    where some node holds an anchor),
    ``state_bytes``, ``anchor_bytes``, ``total_bytes`` (<= the budget), ``bytes_per_cached_token``
    (over ``copies.sum() * block_size`` tokens, 0 when nothing is hit), ``expected_recompute_tokens`` (matched prefix
    recomputed, mean over requests), ``replay_hit_fraction``, with a prefill model
    ``ttft_est_ms`` (mean, rebuild included), and with a measured replay quality
    ``expected_kl_nats`` (replay hits x KL: the mean over requests of the next-token KL their
    continuation pays).
    """
    if prefill is not None and prompt_tokens is None:
        raise ValueError("prefill needs prompt_tokens")
    prompt_tokens = None if prompt_tokens is None else np.asarray(prompt_tokens, dtype=np.int64)
    depths = np.asarray(depths, dtype=np.int64)
    n = max(int(depths.max()), 1)
    if (family is None) != (copies is None):
        raise ValueError("family and copies go together (hit_tree_copies)")
    tree = family is not None
    family = np.zeros(depths.size, dtype=np.int64) if family is None else np.asarray(family, dtype=np.int64)
    copies = np.ones((1, n), dtype=np.int64) if copies is None else np.asarray(copies, dtype=np.int64)
    if copies.shape[1] != n or family.shape != depths.shape or family.max() >= copies.shape[0]:
        raise ValueError(f"copies must have one column per depth 1..{n} and a row per family")
    allocations = dp_allocations(depths, family, copies, state_bytes)
    grids = [EveryBlocks(step).place(n, n) for step in range(1, n + 1)]
    none = np.zeros(0, dtype=np.int64)

    def held_by_depth(anchors: np.ndarray, placements) -> np.ndarray:
        """Per anchored depth, the nodes holding its anchor: those there without an exact state."""
        return sum((copies[f, anchors - 1] * ~np.isin(anchors, c) for f, c in enumerate(placements)),
                   np.zeros(anchors.size, dtype=np.int64))

    def held(anchors: np.ndarray, placements) -> int:
        return int(held_by_depth(anchors, placements).sum())

    def spread_within(placements, budget_bytes: int) -> np.ndarray:
        low, high = 0, n
        while low < high:
            mid = (low + high + 1) // 2
            if held(spread_anchors(n, mid), placements) * replay.entry_bytes <= budget_bytes:
                low = mid
            else:
                high = mid - 1
        return spread_anchors(n, low)

    def evaluate(allocation: dict, anchors: np.ndarray) -> dict:
        resume, replayed = resume_with_anchors(allocation["at_exact"], resume_positions(anchors, depths),
                                               block_size=block_size, prompt_tokens=prompt_tokens,
                                               prefill=prefill, rebuild_ms=replay.rebuild_ms)
        by_depth = held_by_depth(anchors, allocation["placements"])
        anchor_copies = int(by_depth.sum())
        stored, anchored = allocation["bytes"], anchor_copies * replay.entry_bytes
        out = {"states_stored": allocation["states"], "state_copies": allocation["copies"],
               "anchor_entries": int(np.count_nonzero(by_depth)), "anchor_copies": anchor_copies, "state_bytes": stored,
               "anchor_bytes": anchored, "total_bytes": stored + anchored,
               "bytes_per_cached_token": (stored + anchored) / (max(int(copies.sum()), 1) * block_size),
               "expected_recompute_tokens": float((depths - resume).mean() * block_size),
               "replay_hit_fraction": float(replayed.mean())}
        if prefill is not None:
            per_request = ttft_ms(prefill, resume, block_size=block_size, prompt_tokens=prompt_tokens)
            out["ttft_est_ms"] = float((per_request + replayed * replay.rebuild_ms).mean())
        if replay.kl_nats is not None:
            out["expected_kl_nats"] = out["replay_hit_fraction"] * replay.kl_nats
        return out

    def on_grid(positions: np.ndarray) -> dict:
        """A fixed grid as an allocation: the same depths in every family."""
        placements = [positions] * copies.shape[0]
        return {"bytes": int(copies[:, positions - 1].sum()) * state_bytes, "states": int(positions.size),
                "copies": int(copies[:, positions - 1].sum()), "placements": placements,
                "at_exact": resume_positions(positions, depths)}

    def cost(row: dict) -> tuple:
        return (row.get("ttft_est_ms", row["expected_recompute_tokens"]), row["replay_hit_fraction"],
                -row["states_stored"])

    configs = {name: {} for name in ("align_grid", "dp", "replay", "dp_replay")}
    for budget in budgets:
        budget_bytes = budget * state_bytes
        grid = next((on_grid(g) for g in grids if on_grid(g)["bytes"] <= budget_bytes), allocations[0])
        fitting = [a for a in allocations if a["bytes"] <= budget_bytes]
        splits = []
        for i, allocation in enumerate(fitting):
            anchors = spread_within(allocation["placements"], budget_bytes - allocation["bytes"])
            if i == len(fitting) - 1 or held(anchors, allocation["placements"]):
                splits.append(evaluate(allocation, anchors))
        replay_only = splits[0] if splits[0]["anchor_entries"] else evaluate(allocations[0], none)
        rows = {"align_grid": evaluate(grid, none), "dp": evaluate(fitting[-1], none),
                "replay": replay_only, "dp_replay": min(splits, key=cost)}
        for name, row in rows.items():
            for key, value in row.items():
                configs[name].setdefault(key, []).append(value)
    return {"budgets_bytes": [b * state_bytes for b in budgets], "horizon_blocks": n,
            "accounting": "tree" if tree else "path", "families": int(copies.shape[0]) - tree,
            "cached_pages": int(copies.sum()), "replay": replay.as_dict(), "configs": configs}


def storage_on_workload(depths, *, page_tokens: int, state_bytes: int, bytes_per_token: list[float],
                        family=None, copies=None) -> dict:
    """``feather replay eval``'s storage comparison on a workload's overlap depths (pages).

    Anchors on every page boundary resume every hit exactly at its depth (0 tokens recomputed).
    Against them: exact checkpoints every 8,192 and every 256 tokens (:class:`TokenGrid`, with
    every state they place; nominally ``state_bytes / tokens`` per cached token), and per entry
    of ``bytes_per_token`` the exact DP per family given those bytes on the cached tokens
    (``copies.sum() * page_tokens``, :func:`hit_tree_copies`; one path of ``N`` pages without
    them): the last :func:`dp_allocations` entry that fits, its depths, states and recomputed tokens.
    """
    depths = np.asarray(depths, dtype=np.int64)
    n = max(int(depths.max()), 1)
    family = np.zeros(depths.size, dtype=np.int64) if family is None else np.asarray(family, dtype=np.int64)
    copies = np.ones((1, n), dtype=np.int64) if copies is None else np.asarray(copies, dtype=np.int64)
    allocations = dp_allocations(depths, family, copies, state_bytes)

    def recompute(at: np.ndarray) -> float:
        return float((depths - at).mean() * page_tokens)

    def dp_at(per_token: float) -> dict:
        a = [a for a in allocations if a["bytes"] <= per_token * copies.sum() * page_tokens][-1]
        return {"states": a["states"], "state_copies": a["copies"],
                "expected_recompute_tokens": recompute(a["at_exact"])}

    return {"horizon_blocks": n, "cached_pages": int(copies.sum()),
            "mean_overlap_tokens": float(depths.mean() * page_tokens),
            "hit_fraction": float(np.mean(depths > 0)), "replay_every_page_recompute_tokens": 0.0,
            **{f"checkpoint_every_{t}_recompute_tokens":
               recompute(resume_positions(TokenGrid(t, page_tokens).place(n, n), depths)) for t in (8192, 256)},
            "dp_at_equal_bytes": [dp_at(b) for b in bytes_per_token]}
