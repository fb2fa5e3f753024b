"""Policies against load in the simulator: latency percentiles and goodput under a latency SLO.

:func:`load_sweep` finds the workload's capacity (:func:`feather_gym.load.find_capacity`), replays
it at each load factor and runs every policy there. Per load and policy it reports
``SimResult.metrics()`` plus the TPOT percentiles and the goodput: the requests that meet the SLO
(TTFT and TPOT both within it) per second of makespan, and their share of all requests.

A request's TPOT is ``SimResult.latencies``'; a one-token request has none and meets any TPOT
bound. SLO defaults are per profile device (:data:`DEFAULT_SLOS`): a GPU
serving an 8B model and a 2-core CPU serving a 135M model do not answer in the same time.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

from feather_gym.load import at_load, check_load, find_capacity


@dataclass(frozen=True)
class SLO:
    """Latency targets one request must meet to count as goodput."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO bounds must be positive, got ttft={self.ttft_s!r} s, tpot={self.tpot_s!r} s")

    def as_dict(self) -> dict:
        return {"slo_ttft_s": self.ttft_s, "slo_tpot_s": self.tpot_s}

    def met(self, ttft: np.ndarray, tpot: np.ndarray) -> np.ndarray:
        """Which requests (TTFT and TPOT in seconds, TPOT NaN for a one-token output, which meets
        any bound) meet both targets."""
        return (ttft <= self.ttft_s) & ~(tpot > self.tpot_s)


#: Default SLOs by the profile's ``device``.
DEFAULT_SLOS = {"cuda": SLO(ttft_s=2.0, tpot_s=0.1), "cpu": SLO(ttft_s=10.0, tpot_s=0.5)}
_DURATION = re.compile(r"^(?P<value>[0-9.]+(?:e-?[0-9]+)?)(?P<unit>ms|s)$")


def parse_slo(text: str, default: SLO) -> SLO:
    """``ttft=2s,tpot=100ms`` (either key may be left out: ``default``'s) as an :class:`SLO`."""
    bounds = {"ttft": default.ttft_s, "tpot": default.tpot_s}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        match = _DURATION.match(value.strip())
        if key.strip() not in bounds or match is None:
            raise ValueError(f"SLO item {item!r}: expected ttft=<duration> or tpot=<duration>, e.g. ttft=2s,tpot=100ms")
        bounds[key.strip()] = float(match["value"]) * (1e-3 if match["unit"] == "ms" else 1.0)
    return SLO(ttft_s=bounds["ttft"], tpot_s=bounds["tpot"])


def latency_and_goodput(result, slo: SLO, makespan_s: float) -> dict:
    """TPOT percentiles and goodput of one ``SimResult`` under ``slo`` (``makespan_s``: its metrics')."""
    return slo_figures(*result.latencies(), slo, makespan_s)


def slo_figures(ttft: np.ndarray, tpot: np.ndarray, slo: SLO, makespan_s: float) -> dict:
    """TPOT percentiles and goodput of requests with these TTFTs and TPOTs (seconds, one per request,
    TPOT NaN for a one-token output) served in ``makespan_s``: the simulator's and the live engine's."""
    met = slo.met(ttft, tpot)
    multi = tpot[~np.isnan(tpot)]
    return {
        "tpot_p50_ms": float(np.percentile(multi, 50) * 1e3) if len(multi) else 0.0,
        "tpot_p99_ms": float(np.percentile(multi, 99) * 1e3) if len(multi) else 0.0,
        "slo_met_requests": int(met.sum()),
        "slo_met_fraction": float(met.sum() / len(ttft)),
        "goodput_req_s": float(met.sum() / makespan_s) if makespan_s > 0 else 0.0,
    }


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


def policy_label(name: str) -> str:
    """A policy's short name in tables and legends: a baseline's name, a policy file's name (at
    most 24 characters, its end kept)."""
    return os.path.basename(name)[-24:]


def format_sweep(report: dict) -> str:
    """The sweep as a table of at most 120 columns, one line per load and policy."""
    header = (f"{'load':>5} {'policy':<24} {'req/s':>8} {'tok/s':>10} {'ttft p50':>9} {'ttft p99':>9} "
              f"{'tpot p99':>9} {'queue p99':>9} {'forced':>7} {'goodput':>8} {'met':>6}")
    lines = [header]
    for row in report["rows"]:
        lines.append(f"{row['load']:>5.2f} {policy_label(row['policy']):<24} {row['arrival_rate_req_s']:>8.3g} "
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
