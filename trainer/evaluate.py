"""Evaluate a trained ONNX policy against every baseline on held-out seeds, and judge the targets.

For each workload of the mix and each held-out seed, the gym's comparison runs the same trace
under every baseline (:data:`feather_gym.policies.BASELINES`) and the trained policy; throughput
is then averaged over the seeds. Targets (the issue's): on a prefix-sharing workload the policy
must reach the best *heuristic* (every baseline but the label-reading oracle); on a workload
without sharing it must stay within ``NO_SHARING_TOLERANCE`` of FCFS. Throughputs within
``TIE_TOLERANCE`` (relative) of the best heuristic count as reaching it (arrival-bound traces
finish within a fraction of a token per second of each other under every policy). A workload counts as
prefix-sharing when its ``prefix_sharing_ratio`` (:func:`traces.stats.trace_stats`) is at least
``SHARING_RATIO_MIN``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

POLICY_LABEL = "trained"
REFERENCE_ONLY = ("oracle",)        # knows the true group labels: shown, never a target
NO_SHARING_TOLERANCE = 0.02
TIE_TOLERANCE = 0.001
SHARING_RATIO_MIN = 0.05


def evaluate_policy(policy_path: str | Path, *, workloads: Sequence[str], profile: str,
                    seeds: Sequence[int]) -> dict:
    """``{"profile", "seeds", "workloads": [per-workload result]}``; each result holds the mean
    ``throughput_tok_s`` and ``ratio_to_fcfs`` per policy, the target and whether it is met."""
    return {
        "profile": profile,
        "seeds": list(seeds),
        "workloads": [_evaluate_workload(str(policy_path), spec, profile, seeds) for spec in workloads],
    }


def _evaluate_workload(policy_path: str, spec: str, profile: str, seeds: Sequence[int]) -> dict:
    import traces
    from feather_gym.costmodel import load_cost_model
    from feather_gym.policies import BASELINES
    from feather_gym.sim_cli import compare_policies
    from traces.stats import trace_stats

    cost_model = load_cost_model(profile)
    names = [*BASELINES, policy_path]
    throughput = {name: [] for name in names}
    sharing_ratio = []
    for seed in seeds:
        trace = traces.resolve_workload(spec, seed=seed)
        sharing_ratio.append(trace_stats(trace)["prefix_sharing_ratio"])
        for name, metrics in compare_policies(trace, cost_model, names).items():
            throughput[name].append(metrics["throughput_tok_s"])
    mean = {(POLICY_LABEL if name == policy_path else name): float(np.mean(v)) for name, v in throughput.items()}
    fcfs, trained = mean["fcfs"], mean[POLICY_LABEL]
    sharing = float(np.mean(sharing_ratio)) >= SHARING_RATIO_MIN
    if sharing:
        best = max((n for n in mean if n not in (POLICY_LABEL, *REFERENCE_ONLY)), key=mean.get)
        target, met = f">= best heuristic ({best})", trained >= (1 - TIE_TOLERANCE) * mean[best]
    else:
        target, met = f">= {1 - NO_SHARING_TOLERANCE:.2f} x fcfs", trained >= (1 - NO_SHARING_TOLERANCE) * fcfs
    return {
        "workload": spec,
        "prefix_sharing_ratio": float(np.mean(sharing_ratio)),
        "throughput_tok_s": mean,
        "ratio_to_fcfs": {name: value / fcfs for name, value in mean.items()},
        "target": target,
        "target_met": bool(met),
    }


def format_table(evaluation: dict) -> str:
    """The comparison as a fixed-width table: throughput (tok/s) and ratio to FCFS per policy."""
    results = evaluation["workloads"]
    names = list(results[0]["throughput_tok_s"])
    width = max(len(r["workload"]) for r in results)
    lines = [f"held-out evaluation, profile {evaluation['profile']}, seeds {evaluation['seeds']} "
             f"(mean output tok/s; x = ratio to fcfs)",
             f"{'workload':<{width}}  " + "  ".join(f"{n:>18}" for n in names) + "  target"]
    for r in results:
        cells = "  ".join(f"{r['throughput_tok_s'][n]:>10.1f} {r['ratio_to_fcfs'][n]:>5.3f}x" for n in names)
        lines.append(f"{r['workload']:<{width}}  {cells}  {r['target']}: {'met' if r['target_met'] else 'NOT met'}")
    return "\n".join(lines)
