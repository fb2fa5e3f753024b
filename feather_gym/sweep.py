"""Policies against load in the simulator: latency percentiles and goodput under a latency SLO.

:func:`load_sweep` finds the workload's capacity (:func:`feather_gym.load.find_capacity`), replays
it at each load factor and runs every policy there. Per load and policy it reports
``SimResult.metrics()`` plus the TPOT percentiles and the goodput: the requests that meet the SLO
(TTFT and TPOT both within it) per second of makespan, and their share of all requests.

The SLO, its defaults per device and the goodput figures are :mod:`feather_gym.slo`'s.
"""

from __future__ import annotations

import os

from feather_gym.load import at_load, check_load, find_capacity
from feather_gym.slo import SLO, latency_and_goodput


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
                      policy_factory=None) -> list[dict]:
    """One row per policy of ``trace`` served as it arrives: ``SimResult.metrics()`` and
    :func:`latency_and_goodput` (``policy_factory`` as in :func:`load_sweep`)."""
    from feather_gym.policies import make_policy
    from feather_gym.simulator import EngineConfig, simulate

    rows = []
    for name in policy_names:
        result = simulate(trace, cost_model, (policy_factory or make_policy)(name), config=config or EngineConfig(),
                          digests=digests)
        metrics = result.metrics()
        rows.append({"policy": name, **metrics, **latency_and_goodput(result, slo, metrics["makespan_s"])})
    return rows


def policy_label(name: str, width: int | None = None) -> str:
    """A policy's short name in tables and legends: a baseline's name, a policy file's folder and
    name (``run/policy.onnx``, so the files of two runs differ). With ``width``, at most that many
    characters: a longer label keeps its end after ``...``."""
    label = "/".join(name.split(os.sep)[-2:])
    return label if width is None or len(label) <= width else "..." + label[3 - width:]


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


def plot_sweep(report: dict, path: str, *, title: str) -> None:
    """TTFT p99 and goodput against load, one line per policy (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (latency, goodput) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(row["policy"] for row in report["rows"]):
        rows = [row for row in report["rows"] if row["policy"] == name]
        loads = [row["load"] for row in rows]
        latency.plot(loads, [row["ttft_p99_s"] for row in rows], marker="o", label=policy_label(name))
        goodput.plot(loads, [row["goodput_req_s"] for row in rows], marker="o", label=policy_label(name))
    latency.set(xlabel="load (x FCFS capacity)", ylabel="TTFT p99 (s)", yscale="log", title="latency")
    goodput.set(xlabel="load (x FCFS capacity)", ylabel="goodput (requests/s meeting the SLO)",
                title=f"goodput, SLO TTFT {report['slo_ttft_s']:g} s, TPOT {1e3 * report['slo_tpot_s']:g} ms")
    goodput.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
