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


class Benchmark:
    """The baselines' mean throughputs on ``workloads`` x ``seeds`` under ``profile``, computed
    once, against which any number of policies are then judged (the final evaluation judges the
    exported file; training judges its current network on validation seeds to keep the best)."""

    def __init__(self, *, workloads: Sequence[str], profile: str, seeds: Sequence[int]) -> None:
        import traces
        from feather_gym.costmodel import load_cost_model
        from feather_gym.policies import BASELINES, make_policy
        from feather_gym.simulator import EngineConfig, trace_digests
        from traces.stats import trace_stats

        self.profile, self.seeds = profile, list(seeds)
        self.cost_model = load_cost_model(profile)
        self._runs = {}          # spec -> [(trace, digests)] per seed
        self.baselines = {}      # spec -> {baseline: mean throughput}
        self.sharing_ratio = {}  # spec -> mean prefix sharing ratio
        for spec in workloads:
            runs = []
            for seed in self.seeds:
                trace = traces.resolve_workload(spec, seed=seed)
                runs.append((trace, trace_digests(trace, EngineConfig.block_size)))
            self._runs[spec] = runs
            self.sharing_ratio[spec] = float(np.mean([trace_stats(trace)["prefix_sharing_ratio"] for trace, _ in runs]))
            self.baselines[spec] = {name: self.throughput(spec, make_policy(name)) for name in BASELINES}

    def throughput(self, spec: str, policy) -> float:
        """Mean throughput (output tok/s) of ``policy`` (a :class:`feather_gym.policies.Policy`) on ``spec``."""
        from feather_gym.simulator import simulate

        return float(np.mean([simulate(trace, self.cost_model, policy, digests=digests).metrics()["throughput_tok_s"]
                              for trace, digests in self._runs[spec]]))

    def judge(self, spec: str, trained: float) -> dict:
        """The per-workload result for a trained policy reaching ``trained`` tok/s on ``spec``.

        ``margin`` is trained over the target's throughput: >= 1 (less the tie tolerance) meets it.
        """
        mean = {**self.baselines[spec], POLICY_LABEL: trained}
        fcfs = mean["fcfs"]
        sharing = self.sharing_ratio[spec] >= SHARING_RATIO_MIN
        if sharing:
            best = max((n for n in self.baselines[spec] if n not in REFERENCE_ONLY), key=mean.get)
            target, needed, tolerance = f">= best heuristic ({best})", mean[best], TIE_TOLERANCE
        else:
            target, needed, tolerance = f">= {1 - NO_SHARING_TOLERANCE:.2f} x fcfs", (1 - NO_SHARING_TOLERANCE) * fcfs, 0.0
        return {
            "workload": spec,
            "prefix_sharing_ratio": self.sharing_ratio[spec],
            "throughput_tok_s": mean,
            "ratio_to_fcfs": {name: value / fcfs for name, value in mean.items()},
            "target": target,
            "margin": trained / needed,
            "target_met": bool(trained >= (1 - tolerance) * needed),
        }

    def evaluate(self, policy) -> dict:
        """``{"profile", "seeds", "workloads": [judge(...) per workload]}`` for ``policy``."""
        return {"profile": self.profile, "seeds": self.seeds,
                "workloads": [self.judge(spec, self.throughput(spec, policy)) for spec in self._runs]}


def validation_score(evaluation: dict) -> tuple[float, float]:
    """How close an evaluation comes to meeting every target, for ranking checkpoints:
    ``(worst margin, mean margin)`` compared in that order, the worst margin capped at 1 less
    the tie tolerance (once every target is met, the mean margin decides)."""
    margins = [result["margin"] for result in evaluation["workloads"]]
    return min(min(margins), 1 - TIE_TOLERANCE), float(np.mean(margins))


def evaluate_policy(policy_path: str | Path, *, workloads: Sequence[str], profile: str,
                    seeds: Sequence[int]) -> dict:
    """:meth:`Benchmark.evaluate` of the ONNX policy file ``policy_path``."""
    from feather_gym.policies import make_policy

    return Benchmark(workloads=workloads, profile=profile, seeds=seeds).evaluate(make_policy(str(policy_path)))


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
