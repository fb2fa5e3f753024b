"""Policies against load in the simulator: latency percentiles and goodput under a latency SLO.

:func:`load_sweep` finds the workload's capacity (:func:`feather_gym.load.find_capacity`), replays
it at each load factor and runs every policy there. Per load and policy it reports
``SimResult.metrics()`` plus the TPOT percentiles and the goodput: the requests that meet the SLO
(TTFT and TPOT both within it) per second of makespan, and their share of all requests.

Over several instances of a workload (seeds of a generator, time windows of a recorded trace),
:func:`summarise_sweeps` gives each load and policy its mean, least and greatest goodput, and
judges every policy against the best of :data:`HEURISTICS` at that load: the heuristic with the
highest mean goodput, the same policy in every instance, with a 95% interval of the ratio paired
by instance (:mod:`feather_gym.stats`). Over several workloads,
:func:`format_across` sets those judgements side by side.

The SLO, its defaults per device and the goodput figures are :mod:`feather_gym.slo`'s.
"""

from __future__ import annotations

import os
from collections import defaultdict

import numpy as np

from feather_gym.load import at_load, check_load, find_capacity
from feather_gym.slo import SLO, latency_and_goodput
from feather_gym.stats import mean_interval

#: The fixed heuristics a trained policy's goodput is judged against: vLLM's FCFS, SGLang's LPM,
#: DFS and HRRN, the Feather rule and ``cht``. ``feather-hold`` and ``feather-resident`` are not
#: among them: they are the project's warm starts, judged by the same measure.
HEURISTICS = ("fcfs", "lpm", "dfs", "hrrn", "feather-rule", "cht")


def load_sweep(trace, cost_model, policy_names: list[str], loads: list[float], *, slo: SLO, config=None,
               policy_factory=None) -> dict:
    """The sweep of ``trace`` (see the module docstring): capacity, SLO, and rows per load and policy.

    ``policy_factory(name)`` makes a fresh policy per run (default :func:`~feather_gym.policies.make_policy`;
    the live sweep passes the policies as deployed)."""
    from feather_gym.simulator import EngineConfig, trace_digests

    config = config or EngineConfig()
    digests = trace_digests(trace, config.block_size or cost_model.block_size)
    capacity = find_capacity(trace, cost_model, config, digests=digests)
    rows = []
    for load in map(check_load, loads):
        for row in simulate_policies(at_load(trace, capacity, load), cost_model, policy_names, slo=slo, config=config,
                                     digests=digests, policy_factory=policy_factory):
            rows.append({"load": load, "arrival_rate_req_s": capacity.requests_per_s * load, **row})
    return {"requests": len(trace), "profile": cost_model.name, **capacity.as_dict(), **slo.as_dict(), "rows": rows}


def simulate_policies(trace, cost_model, policy_names: list[str], *, slo: SLO, config=None, digests=None,
                      policy_factory=None, step_factors=None) -> list[dict]:
    """One row per policy of ``trace`` served as it arrives: ``SimResult.metrics()`` and
    :func:`latency_and_goodput` (``policy_factory`` as in :func:`load_sweep`; ``step_factors`` as
    :class:`~feather_gym.simulator.Simulator`'s)."""
    from feather_gym.policies import make_policy
    from feather_gym.simulator import EngineConfig, simulate

    rows = []
    for name in policy_names:
        result = simulate(trace, cost_model, (policy_factory or make_policy)(name), config=config or EngineConfig(),
                          digests=digests, step_factors=step_factors)
        metrics = result.metrics()
        rows.append({"policy": name, **metrics, **latency_and_goodput(result, slo, metrics["makespan_s"])})
    return rows


def policy_label(name: str, width: int | None = None) -> str:
    """A policy's short name in tables and legends: a baseline's name, a policy file's folder and
    name (``run/policy.onnx``, so the files of two runs differ). With ``width``, at most that many
    characters: a run's ``policy.onnx`` longer than that is labelled by its run's folder, and a
    label still longer keeps its end after ``...``."""
    parts = name.split(os.sep)[-2:]
    label = "/".join(parts)
    if width is None or len(label) <= width:
        return label
    if len(parts) == 2 and parts[1] == "policy.onnx":
        label = parts[0]
    return label if len(label) <= width else "..." + label[3 - width:]


def format_sweep(report: dict) -> str:
    """The sweep as a table of at most 120 columns, one line per load and policy."""
    header = (f"{'load':>5} {'policy':<24} {'req/s':>8} {'tok/s':>10} {'ttft p50':>9} {'ttft p99':>9} "
              f"{'tpot p99':>9} {'queue p99':>9} {'forced':>7} {'goodput':>8} {'met':>6}")
    lines = [header]
    for row in report["rows"]:
        lines.append(f"{row['load']:>5.2f} {policy_label(row['policy'], 24):<24} {row['arrival_rate_req_s']:>8.3g} "
                     f"{row['throughput_tok_s']:>10.4g} {row['ttft_p50_s']:>8.3g}s {row['ttft_p99_s']:>8.3g}s "
                     f"{row['tpot_p99_ms']:>7.3g}ms {row['queue_delay_p99_s']:>8.3g}s "
                     f"{row['forced_wait_admissions']:>7d} {row['goodput_req_s']:>8.3g} "
                     f"{100 * row['slo_met_fraction']:>5.1f}%")
    return "\n".join(lines)


def summarise_sweeps(reports: list[dict]) -> list[dict]:
    """One row per load and policy over the :func:`load_sweep` reports of several instances of one
    workload (seeds, or time windows of a trace; the same loads and policies in each): goodput's
    mean, least and greatest, the mean share within the SLO and mean TTFT p99; where a heuristic
    of :data:`HEURISTICS` ran, the best of them by mean goodput (``best_heuristic``) and the
    policy's goodput over it, as a ratio of the means, its least and greatest per instance
    (instances where the heuristic's goodput is 0 left out; None where it is 0 in every one) and
    its paired 95% interval (:func:`_over`); where FCFS ran, the mean TTFT p99 over FCFS's in
    the same four figures."""
    runs = defaultdict(list)
    for report in reports:
        for row in report["rows"]:
            runs[row["load"], row["policy"]].append(row)
    summary = []
    for load in dict.fromkeys(load for load, _ in runs):
        at_load = {policy: rows for (row_load, policy), rows in runs.items() if row_load == load}
        goodput = {policy: np.array([row["goodput_req_s"] for row in rows]) for policy, rows in at_load.items()}
        ttft_p99 = {policy: np.array([row["ttft_p99_s"] for row in rows]) for policy, rows in at_load.items()}
        best = max((p for p in at_load if p in HEURISTICS), key=lambda p: goodput[p].mean(), default=None)
        for policy, rows in at_load.items():
            entry = {"load": load, "policy": policy, "instances": len(rows),
                     "goodput_mean_req_s": float(goodput[policy].mean()),
                     "goodput_min_req_s": float(goodput[policy].min()),
                     "goodput_max_req_s": float(goodput[policy].max()),
                     "slo_met_fraction_mean": float(np.mean([row["slo_met_fraction"] for row in rows])),
                     "ttft_p99_mean_s": float(ttft_p99[policy].mean())}
            if best is not None:
                entry |= {"best_heuristic": best, **_over(goodput[policy], goodput[best], "goodput_vs_best_heuristic")}
            if "fcfs" in at_load:
                entry |= _over(ttft_p99[policy], ttft_p99["fcfs"], "ttft_p99_vs_fcfs")
            summary.append(entry)
    return summary


def _over(values: np.ndarray, base: np.ndarray, key: str) -> dict:
    """``key`` (the ratio of the means), ``key_min`` and ``key_max`` (per instance) and ``key_ci95``
    of ``values`` over ``base``, paired by instance.

    ``key_ci95`` is the 95% interval of the mean paired difference, ``values - base``, over the
    mean of ``base``, plus one: an interval around ``key`` that holds the instances' shared
    variation out, so a ratio whose interval holds 1 is not told apart from ``base`` by these
    instances. None for a single instance."""
    kept = base > 0
    if not kept.any():
        return {key: None, f"{key}_min": None, f"{key}_max": None, f"{key}_ci95": None}
    per_instance = values[kept] / base[kept]
    interval = mean_interval(values - base)
    scale = float(base.mean())
    return {key: float(values.mean() / scale), f"{key}_min": float(per_instance.min()),
            f"{key}_max": float(per_instance.max()),
            f"{key}_ci95": None if interval is None else [1 + interval[1] / scale, 1 + interval[2] / scale]}


def format_summary(summary: list[dict], over: str) -> str:
    """:func:`summarise_sweeps`'s rows as a table of at most 120 columns: a range (least-greatest
    over the instances, which ``over`` names) follows a goodput wherever the instances differ, and
    the paired 95% interval (``[low-high]``) follows a ratio to the best heuristic."""
    count = max(row["instances"] for row in summary)
    lines = [f"over {count} instance{'s' * (count > 1)} ({over}): the mean (least-greatest)"
             + ("; [the 95% interval, paired by instance]" if count > 1 else ""),
             f"vs best heuristic: goodput over the best mean goodput at the load of {', '.join(HEURISTICS)}",
             f"{'load':>5} {'policy':<24} {'goodput req/s':<28} {'vs best heuristic':<32} {'met':>6} "
             f"{'ttft p99':>9} {'vs fcfs':>7}"]
    for row in summary:
        ratio, interval = row.get("goodput_vs_best_heuristic"), row.get("goodput_vs_best_heuristic_ci95")
        versus = "-" if ratio is None else (
            f"{ratio:.3f}" + ("" if interval is None else f" [{interval[0]:.3f}-{interval[1]:.3f}]")
            + f" {policy_label(row['best_heuristic'], 12)}")
        goodput = _spread(row["goodput_mean_req_s"], row["goodput_min_req_s"], row["goodput_max_req_s"], ".4g")
        fcfs = row.get("ttft_p99_vs_fcfs")
        lines.append(f"{row['load']:>5.2f} {policy_label(row['policy'], 24):<24} {goodput:<28} "
                     f"{versus:<32} {100 * row['slo_met_fraction_mean']:>5.1f}% {row['ttft_p99_mean_s']:>8.3g}s "
                     f"{'-' if fcfs is None else format(fcfs, '.2f'):>7}")
    return "\n".join(lines)


def format_across(summaries: dict[str, list[dict]]) -> str:
    """Every policy's goodput over the best heuristic's (the ratio of the means) on every workload
    and load, from :func:`summarise_sweeps`'s rows by workload label: where a policy holds against
    the best of :data:`HEURISTICS` and where it does not. ``least`` is its least over the loads;
    ``-`` where no heuristic ran or every heuristic's goodput was 0. At most 120 columns for up to
    ten loads."""
    loads = list(dict.fromkeys(row["load"] for summary in summaries.values() for row in summary))
    policies = dict.fromkeys(row["policy"] for summary in summaries.values() for row in summary)
    lines = ["goodput over the best heuristic's, by workload (the ratio of the means; the best heuristic may "
             "differ by load)",
             f"{'policy':<24} {'workload':<16} " + " ".join(f"{load:>6.2f}" for load in loads) + f" {'least':>6}"]
    for policy in policies:
        for index, (label, summary) in enumerate(summaries.items()):
            ratios = {row["load"]: row.get("goodput_vs_best_heuristic") for row in summary if row["policy"] == policy}
            known = [ratio for ratio in ratios.values() if ratio is not None]
            cells = [ratios.get(load) for load in loads] + [min(known) if known else None]
            name = policy_label(policy, 24) if index == 0 else ""
            lines.append(f"{name:<24} {label[:16]:<16} "
                         + " ".join(f"{'-' if cell is None else format(cell, '.3f'):>6}" for cell in cells))
    return "\n".join(lines)


def _spread(mean: float, least: float, greatest: float, spec: str) -> str:
    """``mean`` alone where ``least`` and ``greatest`` agree, else ``mean (least-greatest)``."""
    if format(least, spec) == format(greatest, spec):
        return format(mean, spec)
    return f"{mean:{spec}} ({least:{spec}}-{greatest:{spec}})"


def plot_sweep(summary: list[dict], slo: dict, path: str, *, title: str) -> None:
    """TTFT p99 and goodput against load, one line per policy, from :func:`summarise_sweeps`'s rows
    (means over the instances; ``slo``: the report's ``slo_*`` keys) (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (latency, goodput) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(row["policy"] for row in summary):
        rows = [row for row in summary if row["policy"] == name]
        loads = [row["load"] for row in rows]
        latency.plot(loads, [row["ttft_p99_mean_s"] for row in rows], marker="o", label=policy_label(name))
        goodput.plot(loads, [row["goodput_mean_req_s"] for row in rows], marker="o", label=policy_label(name))
    latency.set(xlabel="load (x FCFS capacity)", ylabel="TTFT p99 (s)", yscale="log", title="latency")
    goodput.set(xlabel="load (x FCFS capacity)", ylabel="goodput (requests/s meeting the SLO)",
                title=f"goodput, SLO TTFT {slo['slo_ttft_s']:g} s, TPOT {1e3 * slo['slo_tpot_s']:g} ms")
    goodput.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
