"""Evaluate a trained ONNX policy against every baseline on held-out seeds, and judge the targets.

For each workload of the mix and each held-out seed, the gym's comparison runs the same trace
under every baseline (:data:`feather_gym.policies.BASELINES`) and the trained policy; throughput
is then averaged over the seeds. A trace file ignores the seed, so it is run once (its held-out
part is a time window, :func:`traces.workload.split_spec`). A ``SPEC@load=X`` runs each trace at
``X`` times its own FCFS capacity (:mod:`feather_gym.load`). Each result carries its load regime
(``SimResult.metrics``: arrival span, makespan, queueing delay per policy) and its latency
figures under the SLO of the profile's device (:data:`feather_gym.slo.DEFAULT_SLOS`): goodput
and the share of requests within the SLO.
Targets: on a prefix-sharing workload the policy must reach the best *heuristic*
(every baseline but ``group-label``, which reads the generators' group labels); on a workload
without sharing it must stay within ``NO_SHARING_TOLERANCE`` of FCFS. Throughputs within
``TIE_TOLERANCE`` (relative) of the best heuristic count as reaching it (arrival-bound traces
finish within a fraction of a token per second of each other under every policy). A workload counts as
prefix-sharing when its ``prefix_sharing_ratio`` (:func:`traces.stats.trace_stats`, at the
engine's block size: the sharing the engine can hit) is at least ``SHARING_RATIO_MIN``.
:func:`by_load` sums an evaluation up per load factor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

POLICY_LABEL = "trained"
REFERENCE_ONLY = ("group-label",)   # reads the generators' group labels: shown, never a target
#: The per-policy figures of :meth:`Benchmark.run`, each a mean over a workload's runs.
RUN_FIGURES = ("throughput_tok_s", "goodput_req_s", "slo_met_fraction", "makespan_s", "queue_delay_mean_s",
               "queue_delay_p99_s")
#: The load label of a workload run at its own (recorded or generated) arrival rate.
RECORDED_RATE = "recorded"
NO_SHARING_TOLERANCE = 0.02
TIE_TOLERANCE = 0.001
#: The tolerance of "reaches the best heuristic" in checkpoint selection: within 1% of it. ``target_met`` judges
#: at the stricter ``TIE_TOLERANCE``; checkpoint selection (:func:`validation_score`) at this one.
TARGET_TOLERANCE = 0.01
SIGNIFICANT_SEM = 2.0   # a paired mean ratio this many standard errors from 1 is a difference, not noise
SHARING_RATIO_MIN = 0.05


class Benchmark:
    """The baselines' mean throughputs on ``workloads`` x ``seeds`` under ``profile``, computed
    once, against which any number of policies are then judged (the final evaluation judges the
    exported file; training judges its current network on validation seeds to keep the best)."""

    def __init__(self, *, workloads: Sequence[str], profile: str, seeds: Sequence[int], engine=None) -> None:
        from feather_gym.costmodel import load_cost_model
        from feather_gym.load import LoadedWorkloads
        from feather_gym.policies import BASELINES, make_policy
        from feather_gym.simulator import EngineConfig
        from feather_gym.slo import DEFAULT_SLOS
        from traces.stats import trace_stats
        from traces.workload import is_generated

        self.profile, self.seeds = profile, list(seeds)
        self.cost_model = load_cost_model(profile)
        self.slo = DEFAULT_SLOS[self.cost_model.device]
        self.engine = (engine or EngineConfig()).resolve(self.cost_model)
        self._runs = {}          # spec -> [(trace, digests)]: one per seed, or one for a trace file
        self.baselines = {}      # spec -> {baseline: mean throughput}
        self.loads = {}          # spec -> {baseline: mean makespan, queueing delays and the other figures}
        self.sharing_ratio = {}  # spec -> mean prefix sharing ratio
        self.arrival_span = {}   # spec -> mean arrival span (s)
        loaded = LoadedWorkloads(self.cost_model, self.engine)   # the loads of one trace share its capacity
        for spec in workloads:
            runs = [loaded.get(spec, seed) for seed in (self.seeds if is_generated(spec) else self.seeds[:1])]
            self._runs[spec] = runs
            self.sharing_ratio[spec] = float(np.mean([trace_stats(trace, block_size=self.engine.block_size)
                                                      ["prefix_sharing_ratio"] for trace, _ in runs]))
            self.arrival_span[spec] = float(np.mean([trace.duration_s for trace, _ in runs]))
            figures = {name: self.run(spec, make_policy(name)) for name in BASELINES}
            self.baselines[spec] = {name: run.pop("throughput_tok_s") for name, run in figures.items()}
            self.loads[spec] = figures

    def runs(self, spec: str, policy) -> dict[str, np.ndarray]:
        """:data:`RUN_FIGURES` of ``policy`` (a :class:`feather_gym.policies.Policy`) on each of
        ``spec``'s runs, in seed order: throughput (output tok/s), goodput (requests within the SLO
        per second) and their share, makespan and queueing delays (s)."""
        from feather_gym.simulator import simulate
        from feather_gym.slo import latency_and_goodput

        runs = []
        for trace, digests in self._runs[spec]:
            result = simulate(trace, self.cost_model, policy, config=self.engine, digests=digests)
            metrics = result.metrics()
            runs.append({**metrics, **latency_and_goodput(result, self.slo, metrics["makespan_s"])})
        return {key: np.array([metrics[key] for metrics in runs]) for key in RUN_FIGURES}

    def run(self, spec: str, policy) -> dict:
        """:meth:`runs`, each figure the mean over the runs."""
        return _means(self.runs(spec, policy))

    def judge(self, spec: str, trained: float, references: Mapping[str, float] | None = None) -> dict:
        """The per-workload result for a trained policy reaching ``trained`` tok/s on ``spec``.

        ``margin`` is trained over the target's throughput: >= 1 (less the tie tolerance) meets it;
        ``target_margin`` >= 1 meets the target within the tolerance (within ``TARGET_TOLERANCE``).
        ``load`` holds the baselines' other figures: makespan, queueing delays, the SLO's
        (:meth:`evaluate` adds the trained policy's).
        """
        references = dict(references or {})
        mean = {**self.baselines[spec], **references, POLICY_LABEL: trained}
        fcfs = mean["fcfs"]
        sharing = self.sharing_ratio[spec] >= SHARING_RATIO_MIN
        if sharing:
            best = max((n for n in self.baselines[spec] if n not in REFERENCE_ONLY), key=mean.get)
            target, needed, tolerance = f">= best heuristic ({best})", mean[best], TIE_TOLERANCE
        else:
            target, needed, tolerance = f">= {1 - NO_SHARING_TOLERANCE:.2f} x fcfs", \
                (1 - NO_SHARING_TOLERANCE) * fcfs, 0.0
        target_tolerance = TARGET_TOLERANCE if sharing else 0.0    # no sharing: the FCFS bound is the target itself
        return {
            "workload": spec,
            "runs": len(self._runs[spec]),
            "prefix_sharing_ratio": self.sharing_ratio[spec],
            "arrival_span_s": self.arrival_span[spec],
            "load": {name: dict(figures) for name, figures in self.loads[spec].items()},
            "throughput_tok_s": mean,
            "ratio_to_fcfs": {name: value / fcfs for name, value in mean.items()},
            "target": target,
            "margin": trained / needed,
            "trained_over_reference": {label: trained / value for label, value in references.items()},
            "target_met": bool(trained >= (1 - tolerance) * needed),
            "target_margin": trained / ((1 - target_tolerance) * needed),
        }

    def evaluate(self, policy, references: Mapping[str, object] | None = None) -> dict:
        """``{"profile", "seeds", "workloads": [judge(...) per workload]}`` for ``policy``.

        ``references`` (label -> policy, e.g. the warm-start clone) run beside it: shown in every
        table, in ``trained_over_reference`` (ratio of the mean throughputs) and in
        ``trained_over_reference_paired`` (:func:`paired_ratio`), never a target. Each result also
        holds the throughput on every run, in seed order, of the policy (``trained_runs``) and of
        each reference (``reference_runs``), so a later evaluation on the same benchmark can be
        paired with this one, and runs can be pooled per load (:func:`by_load`)."""
        results = []
        for spec in self._runs:
            per_run = {label: self.runs(spec, other)
                       for label, other in {**(references or {}), POLICY_LABEL: policy}.items()}
            figures = {label: _means(runs) for label, runs in per_run.items()}
            throughput = {label: run.pop("throughput_tok_s") for label, run in figures.items()}
            trained = throughput.pop(POLICY_LABEL)
            result = self.judge(spec, trained, throughput)
            result["load"].update(figures)
            runs = {label: figures_of["throughput_tok_s"] for label, figures_of in per_run.items()}
            result["trained_over_reference_paired"] = {label: paired_ratio(runs[POLICY_LABEL], runs[label])
                                                       for label in references or {}}
            result["trained_runs"] = runs[POLICY_LABEL].tolist()
            result["reference_runs"] = {label: runs[label].tolist() for label in references or {}}
            results.append(result)
        return {"profile": self.profile, "seeds": self.seeds, "workloads": results}


def _means(runs: Mapping[str, np.ndarray]) -> dict:
    return {key: float(values.mean()) for key, values in runs.items()}


def paired_ratio(trained: np.ndarray, reference: np.ndarray) -> dict:
    """The per-run throughput ratios ``trained / reference`` (each run one trace under both
    policies, so trace-to-trace variation cancels): their mean, its standard error (0 for a
    single run), and the runs on which the trained policy is faster and slower (equal: neither).
    A difference smaller than ``SIGNIFICANT_SEM`` standard errors is not evidence of one."""
    ratio = np.asarray(trained, dtype=float) / np.asarray(reference, dtype=float)
    sem = float(ratio.std(ddof=1) / np.sqrt(ratio.size)) if ratio.size > 1 else 0.0
    return {"ratio_mean": float(ratio.mean()), "ratio_sem": sem,
            "runs_faster": int((ratio > 1).sum()), "runs_slower": int((ratio < 1).sum())}


def paired_sign(pair: dict) -> int:
    """+1 or -1 when a :func:`paired_ratio` is above or below 1 by more than both the tie
    tolerance and ``SIGNIFICANT_SEM`` standard errors (a difference), else 0 (noise)."""
    distance = abs(pair["ratio_mean"] - 1) - max(TIE_TOLERANCE, SIGNIFICANT_SEM * pair["ratio_sem"])
    return int(np.sign(pair["ratio_mean"] - 1)) if distance > 0 else 0


def paired_signs(evaluation: dict, reference: dict) -> dict[str, int]:
    """Per workload, :func:`paired_sign` of the policy of ``evaluation`` against that of
    ``reference``, paired run by run (two :meth:`Benchmark.evaluate` results of one benchmark):
    -1 significantly slower, +1 significantly faster, 0 neither."""
    start = {result["workload"]: result["trained_runs"] for result in reference["workloads"]}
    return {result["workload"]: paired_sign(paired_ratio(np.array(result["trained_runs"]),
                                                         np.array(start[result["workload"]])))
            for result in evaluation["workloads"]}


def slo_share(evaluation: dict) -> float:
    """The evaluated policy's share of requests within the SLO: the mean over the evaluation's
    workloads of each one's mean over its runs."""
    return float(np.mean([figure(result, POLICY_LABEL, "slo_met_fraction") for result in evaluation["workloads"]]))


def fewer_within_slo(evaluation: dict, reference: dict) -> bool:
    """Whether the policy of ``evaluation`` serves a smaller share of requests within the SLO than
    that of ``reference`` (:func:`slo_share`, two evaluations of one benchmark), by more than the
    tie tolerance (relative)."""
    return slo_share(evaluation) < (1 - TIE_TOLERANCE) * slo_share(reference)


def validation_score(evaluation: dict) -> tuple[float, float]:
    """How close an evaluation comes to meeting every target within its tolerance, for ranking
    checkpoints: ``(worst target margin, mean margin)`` compared in that order
    (:func:`scores_higher`), the worst capped at 1 (once every workload is within its target,
    ``TARGET_TOLERANCE`` of the best heuristic or ``NO_SHARING_TOLERANCE`` of FCFS, the mean
    margin decides)."""
    results = evaluation["workloads"]
    return (min(min(result["target_margin"] for result in results), 1.0),
            float(np.mean([result["margin"] for result in results])))


def scores_higher(score: tuple[float, float], best: tuple[float, float]) -> bool:
    """Whether :func:`validation_score` ``score`` ranks above ``best``: a worst target margin higher
    by more than ``TIE_TOLERANCE``, or one within it and a higher mean margin. Margins are ratios
    to a target, so worst margins that close tie, as throughputs do in the targets; otherwise a
    negligible change on the worst workload would outrank any change on all the others."""
    if abs(score[0] - best[0]) > TIE_TOLERANCE:
        return score[0] > best[0]
    return score[1] > best[1]


def evaluate_policy(policy_path: str | Path, *, workloads: Sequence[str], profile: str,
                    seeds: Sequence[int], engine=None, references: Mapping[str, object] | None = None) -> dict:
    """:meth:`Benchmark.evaluate` of the ONNX policy file ``policy_path`` (``engine``: an
    ``EngineConfig``, default the profile's), beside the ``references`` (label -> ONNX file or
    :class:`~feather_gym.policies.Policy`)."""
    from feather_gym.policies import Policy, make_policy

    return Benchmark(workloads=workloads, profile=profile, seeds=seeds, engine=engine).evaluate(
        make_policy(str(policy_path)),
        {label: ref if isinstance(ref, Policy) else make_policy(str(ref)) for label, ref in (references or {}).items()})


def load_label(spec: str) -> str:
    """The load factor of workload ``spec`` as a label (``"0.9"`` of ``SPEC@load=0.9``), or
    :data:`RECORDED_RATE` for a workload at its own arrival rate."""
    from feather_gym.load import split_load

    load = split_load(spec)[1]
    return RECORDED_RATE if load is None else f"{load:g}"


def figure(result: dict, policy: str, name: str) -> float:
    """Figure ``name`` (of :data:`RUN_FIGURES`) of ``policy`` in a per-workload result: the mean
    throughput, or one of the other figures of its ``load``."""
    return result[name][policy] if name in result else result["load"][policy][name]


def by_load(evaluation: dict) -> dict[str, dict]:
    """An evaluation summed up per load (:func:`load_label`; loads in increasing order, then the
    recorded rate), over the workloads at that load: how many, how many meet their target, the
    worst and mean margin; per policy the geometric mean of its throughput over FCFS's and the mean
    share of requests within the SLO; and per reference the trained policy's throughput over it,
    paired run by run over every run of those workloads (:func:`paired_ratio`)."""
    groups: dict[str, list[dict]] = {}
    for result in evaluation["workloads"]:
        groups.setdefault(load_label(result["workload"]), []).append(result)
    order = sorted(groups, key=lambda load: (load == RECORDED_RATE, float(load) if load != RECORDED_RATE else 0.0))
    summary = {}
    for load in order:
        results = groups[load]
        policies = list(results[0]["throughput_tok_s"])
        not_heuristics = (*REFERENCE_ONLY, POLICY_LABEL, *results[0]["reference_runs"])
        heuristics = [name for name in policies if name not in not_heuristics]
        summary[load] = {
            "workloads": len(results),
            "targets_met": sum(result["target_met"] for result in results),
            "margin_worst": min(result["margin"] for result in results),
            "margin_mean": float(np.mean([result["margin"] for result in results])),
            "throughput_over_fcfs": {name: _geometric_mean([figure(r, name, "throughput_tok_s")
                                                            / figure(r, "fcfs", "throughput_tok_s") for r in results])
                                     for name in policies},
            "best_heuristic_throughput_over_fcfs": _geometric_mean(
                [max(figure(r, name, "throughput_tok_s") for name in heuristics) / figure(r, "fcfs", "throughput_tok_s")
                 for r in results]),
            "slo_met_fraction": {name: float(np.mean([figure(r, name, "slo_met_fraction") for r in results]))
                                 for name in policies},
            "trained_over_reference_paired": {
                label: paired_ratio(np.concatenate([r["trained_runs"] for r in results]),
                                    np.concatenate([r["reference_runs"][label] for r in results]))
                for label in results[0]["reference_runs"]},
        }
    return summary


def _geometric_mean(values) -> float:
    return float(np.exp(np.mean(np.log(values))))


def format_table(evaluation: dict) -> str:
    """The comparison as fixed-width tables: throughput (tok/s) and ratio to FCFS per policy,
    then the load regime: arrival span, and per policy makespan and queueing delay mean/p99 (s),
    then the summary per load (:func:`by_load`).

    A workload's row is named by its short label (:func:`traces.workload.workload_labels`), its
    spec stays in the evaluation's JSON; every line is within :data:`traces.table.WIDTH`."""
    import textwrap

    from traces.table import WIDTH, cut
    from traces.table import format_table as text_table
    from traces.workload import workload_labels

    results = evaluation["workloads"]
    names = list(results[0]["throughput_tok_s"])
    labels = workload_labels(r["workload"] for r in results)
    means = [[label, *(f"{r['throughput_tok_s'][n]:.1f} {r['ratio_to_fcfs'][n]:.3f}x" for n in names),
              f"{r['target']}: {'met' if r['target_met'] else 'NOT met'}"] for label, r in zip(labels, results)]
    loads = [[label, *(f"{r['load'][n]['makespan_s']:.1f} {r['load'][n]['queue_delay_mean_s']:.1f}/"
                       f"{r['load'][n]['queue_delay_p99_s']:.1f}" for n in names), f"{r['arrival_span_s']:.1f}"]
             for label, r in zip(labels, results)]
    summary = by_load(evaluation)
    references = list(results[0]["reference_runs"])
    per_load = [[load, f"{s['targets_met']}/{s['workloads']}", f"{s['margin_worst']:.4f} {s['margin_mean']:.4f}",
                 f"{s['throughput_over_fcfs'][POLICY_LABEL]:.3f}x", f"{s['best_heuristic_throughput_over_fcfs']:.3f}x",
                 f"{s['slo_met_fraction']['fcfs']:.3f}", f"{s['slo_met_fraction'][POLICY_LABEL]:.3f}",
                 *(f"{pair['ratio_mean']:.4f}+-{pair['ratio_sem']:.4f}"
                   for pair in s["trained_over_reference_paired"].values())]
                for load, s in summary.items()]
    return "\n".join([
        cut(f"held-out evaluation, profile {evaluation['profile']}, seeds {_seed_range(evaluation['seeds'])} "
            "(trace files: one run)", WIDTH),
        "mean output tok/s, x = ratio to fcfs",
        text_table(["workload", *names, "target"], means, align="l" + "r" * len(names) + "l"),
        "load regime (s): makespan, then queueing delay (arrival to first scheduling) mean/p99",
        text_table(["workload", *names, "arrival span"], loads),
        textwrap.fill("by load: targets met; margin worst, mean; throughput over fcfs (geometric mean) of the trained "
                      "policy and of each workload's best heuristic; share of requests within the SLO; the trained "
                      "policy's throughput over each reference, paired run by run (mean +- standard error)", WIDTH),
        text_table(["load", "targets", "margin", "trained tok/s", "best heuristic", "SLO fcfs", "SLO trained",
                    *(f"over {label}" for label in references)], per_load)])


def _seed_range(seeds) -> str:
    """``first..last`` for consecutive seeds, else the seeds comma-separated."""
    seeds = list(seeds)
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"{seeds[0]}..{seeds[-1]}"
    return ",".join(map(str, seeds))
