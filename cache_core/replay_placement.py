"""SuffixReplay as a placement: exact checkpoints, replay anchors, or both, at equal bytes.

The model extends :mod:`cache_core.placement` (one shared prefix path of ``N`` blocks; a
request's overlap depth ``t`` in blocks; page = block):

* an **exact state** at position ``c`` (``HybridCacheLayout.state_bytes``) lets a request of
  depth ``t >= c`` resume at ``c`` with no rebuild;
* an **anchor entry** at ``c`` (one :class:`~cache_core.anchor_store.AnchorStore` entry:
  ``R`` anchors per anchored GDN layer, ``AnchorStore.entry_bytes``) lets it resume at ``c``
  after a replay that takes ``rebuild_ms`` and leaves an approximate state (the quality cost
  that ``feather replay eval`` measures: next-token KL, perplexity ratio);
* a request resumes from the exact or anchored position ``<= t`` whose estimated time to first
  token (prefill of the rest, plus ``rebuild_ms`` when replayed) is least; with no prefill
  model, from the deepest one. It is a **replay hit** when it resumes from an anchor.

Bytes are counted per shared prefix path, as in :func:`cache_core.placement_eval.evaluate_placements`:
``states * state_bytes + anchors * entry_bytes``; per cached token they are divided by the
path's ``N * block_size`` tokens. At a budget of ``B`` bytes (``B = m * state_bytes`` for the
evaluation's budget ``m``), :func:`compare_at_equal_bytes` compares four configurations:

* ``align_grid``: ``M = B // state_bytes`` exact states on a fixed grid, every ``N // M``
  blocks from the start (the shallowest ``M`` when more fit; every block, vLLM's align
  grid, once ``M >= N``);
* ``dp``: the exact DP's ``M`` states (:func:`cache_core.placement.solve`);
* ``replay``: ``K = B // entry_bytes`` anchor entries and no exact state, on every page
  boundary when ``K >= N``, else spread evenly (:func:`spread_anchors`);
* ``dp_replay``: for every split ``M' = 0..M``, the DP's ``M'`` states plus ``(B - M'
  state_bytes) // entry_bytes`` anchors spread over the other boundaries (a split ``M' < M``
  that buys no anchor is skipped: it is the DP with states left unbought); the split of least
  cost (mean estimated TTFT with a prefill model, else mean recomputed tokens; ties go to
  fewer replay hits, then more exact states) is kept.

Invariants (``tests/test_replay_placement.py``): every configuration's bytes are at most ``B``;
``dp_replay``'s candidate splits include ``replay`` (``M' = 0``, when it buys an anchor; else
``replay`` stores nothing, which no placement is worse than) and ``dp`` plus leftover anchors
(``M' = M``), and anchors only add resume options, so its cost is never above either; with
no affordable anchor it equals ``dp``; with anchors on every boundary every hit at a depth
``>= 1`` that has no exact state there resumes exactly at its depth.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass

import numpy as np

from cache_core.placement import PlacementProblem, PlacementSolution, resume_positions, solve
from cache_core.placement_heuristics import EveryBlocks, TokenGrid
from cache_core.recompute_cost import PrefillTime


def anchor_entry_bytes(*, hidden_size: int, anchored_layers, replay_tokens: int, dtype: str = "bfloat16") -> int:
    """Bytes of one page boundary's anchors, as :class:`AnchorStore` accounts them (``R`` per
    anchored layer)."""
    from cache_core.anchor_store import AnchorStore

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
    with open(path) as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            return json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            raise ValueError(f"{path}: neither a JSON object nor output ending in one "
                             "(write it with `feather replay eval --json`)") from None


def spread_anchors(num_positions: int, exact: np.ndarray, count: int) -> np.ndarray:
    """Sorted anchor positions: every boundary in ``1..N`` without an exact state when ``count``
    covers them all, else ``count`` of them evenly spread (the deepest free boundary included)."""
    free = np.setdiff1d(np.arange(1, num_positions + 1), exact)
    if count >= free.size:
        return free
    if count <= 0:
        return free[:0]
    return free[np.unique(free.size - 1 - (np.arange(count) * free.size) // count)]


def resume_with_anchors(exact: np.ndarray, anchors: np.ndarray, depths: np.ndarray, *, block_size: int,
                        prompt_tokens=None, prefill: PrefillTime | None = None,
                        rebuild_ms: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Per request: the resume position (blocks) and whether it is a replay hit.

    Each request takes the cheaper of the deepest exact state and the deepest anchor at or
    below its depth: by estimated TTFT when ``prefill`` (and ``prompt_tokens``) are given,
    else the deeper one (an anchor only when strictly deeper).
    """
    at_exact = resume_positions(exact, depths)
    at_anchor = resume_positions(anchors, depths)
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


def compare_at_equal_bytes(depths, *, block_size: int, budgets: list[int], state_bytes: int,
                           replay: ReplayCost, solution: PlacementSolution, prompt_tokens=None,
                           prefill: PrefillTime | None = None) -> dict:
    """The four configurations of the module docstring at byte budgets ``budgets[i] * state_bytes``.

    ``solution`` is the DP solved on ``depths`` (clipped to its horizon ``N = depths.max()``)
    up to at least ``max(budgets)``. Per configuration and budget: ``states_stored``,
    ``anchor_entries``, ``state_bytes``, ``anchor_bytes``, ``total_bytes`` (<= the budget),
    ``bytes_per_cached_token``, ``expected_recompute_tokens`` (matched prefix recomputed, mean
    over requests), ``replay_hit_fraction``, with a prefill model ``ttft_est_ms`` (mean, rebuild
    included), and with a measured replay quality ``expected_kl_nats`` (replay hits x KL: the
    mean over requests of the next-token KL their continuation pays).
    """
    depths = np.asarray(depths, dtype=np.int64)
    n = max(int(depths.max()), 1)
    if prefill is not None and prompt_tokens is None:
        raise ValueError("prefill needs prompt_tokens")
    prompt_tokens = None if prompt_tokens is None else np.asarray(prompt_tokens, dtype=np.int64)

    def evaluate(exact: np.ndarray, anchors: np.ndarray) -> dict:
        resume, replayed = resume_with_anchors(exact, anchors, depths, block_size=block_size,
                                               prompt_tokens=prompt_tokens, prefill=prefill,
                                               rebuild_ms=replay.rebuild_ms)
        total = exact.size * state_bytes + anchors.size * replay.entry_bytes
        out = {"states_stored": int(exact.size), "anchor_entries": int(anchors.size),
               "state_bytes": int(exact.size * state_bytes), "anchor_bytes": int(anchors.size * replay.entry_bytes),
               "total_bytes": int(total), "bytes_per_cached_token": total / (n * block_size),
               "expected_recompute_tokens": float((depths - resume).mean() * block_size),
               "replay_hit_fraction": float(replayed.mean())}
        if prefill is not None:
            per_request = ttft_ms(prefill, resume, block_size=block_size, prompt_tokens=prompt_tokens)
            out["ttft_est_ms"] = float((per_request + replayed * replay.rebuild_ms).mean())
        if replay.kl_nats is not None:
            out["expected_kl_nats"] = out["replay_hit_fraction"] * replay.kl_nats
        return out

    def cost(row: dict) -> tuple:
        return (row.get("ttft_est_ms", row["expected_recompute_tokens"]), row["replay_hit_fraction"],
                -row["states_stored"])

    none = np.zeros(0, dtype=np.int64)
    configs = {name: {} for name in ("align_grid", "dp", "replay", "dp_replay")}
    for budget in budgets:
        budget_bytes = budget * state_bytes
        m = min(budget, solution.max_budget)
        grid = EveryBlocks(max(1, n // m)).place(n, m) if m else none
        anchors = [(budget_bytes - k * state_bytes) // replay.entry_bytes for k in range(m + 1)]
        splits = {k: evaluate(solution.checkpoints(k), spread_anchors(n, solution.checkpoints(k), anchors[k]))
                  for k in range(m + 1) if k == m or anchors[k] > 0}
        rows = {"align_grid": evaluate(grid, none), "dp": evaluate(solution.checkpoints(m), none),
                "replay": splits.get(0) or evaluate(none, none), "dp_replay": min(splits.values(), key=cost)}
        for name, row in rows.items():
            for key, value in row.items():
                configs[name].setdefault(key, []).append(value)
    return {"budgets_bytes": [b * state_bytes for b in budgets], "horizon_blocks": n,
            "replay": replay.as_dict(), "configs": configs}


def storage_on_workload(depths, *, page_tokens: int, state_bytes: int, bytes_per_token: list[float]) -> dict:
    """``feather replay eval``'s storage comparison on a workload's overlap depths (pages).

    Anchors on every page boundary resume every hit exactly at its depth (0 tokens recomputed).
    Against them: exact checkpoints every 8,192 and every 256 tokens (:class:`TokenGrid`, with
    every state they place; their bytes per cached token are ``state_bytes / tokens``), and per
    entry of ``bytes_per_token`` the exact DP with the states those bytes buy on the path
    (``bytes_per_token * N * page_tokens // state_bytes``) and its recomputed tokens.
    """
    depths = np.asarray(depths, dtype=np.int64)
    n = max(int(depths.max()), 1)
    budgets = [min(int(b * n * page_tokens // state_bytes), n) for b in bytes_per_token]
    solution = solve(PlacementProblem.from_depths(depths), max(budgets, default=0))

    def recompute(checkpoints) -> float:
        return float((depths - resume_positions(checkpoints, depths)).mean() * page_tokens)

    return {"horizon_blocks": n, "mean_overlap_tokens": float(depths.mean() * page_tokens),
            "hit_fraction": float(np.mean(depths > 0)), "replay_every_page_recompute_tokens": 0.0,
            **{f"checkpoint_every_{t}_recompute_tokens": recompute(TokenGrid(t, page_tokens).place(n, n))
               for t in (8192, 256)},
            "dp_at_equal_bytes": [{"states": m, "expected_recompute_tokens": recompute(solution.checkpoints(m))}
                                  for m in budgets]}
