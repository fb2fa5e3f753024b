"""Latency targets (SLOs) and goodput: the requests that meet both targets, per second.

A request meets an :class:`SLO` when its TTFT and its TPOT are both within the bounds; a
one-token request has no TPOT (NaN) and meets any TPOT bound. Goodput is the requests that meet
it per second of makespan (simulated) or of wall time (live). SLO defaults are per profile
device (:data:`DEFAULT_SLOS`): a GPU serving an 8B model and a 2-core CPU serving a 135M model
do not answer in the same time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np


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
