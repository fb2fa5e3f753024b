"""A trace replayed at another arrival rate: the same arrival pattern, scaled in time.

Invariant: :func:`at_rate` keeps every request, its order, prompt and metadata, and the arrival
pattern (bursts included): the gap between any two arrivals is divided by ``rate_factor``; the
first arrival is at 0.
"""

from __future__ import annotations

import dataclasses

from traces.request import Trace


def at_rate(trace: Trace, rate_factor: float) -> Trace:
    """``trace`` with every inter-arrival gap divided by ``rate_factor`` (2: twice the arrival rate).

    ``ValueError`` unless ``rate_factor`` is a positive finite number. The name gets ``@xFACTOR``.
    """
    if not 0.0 < rate_factor < float("inf"):
        raise ValueError(f"rate factor must be a positive finite number, got {rate_factor!r}")
    first = trace.requests[0].arrival_s if trace.requests else 0.0
    requests = [dataclasses.replace(r, arrival_s=(r.arrival_s - first) / rate_factor) for r in trace.requests]
    return Trace(f"{trace.name}@x{rate_factor:.4g}", requests, trace.source, trace.block_size)
