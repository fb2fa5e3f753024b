"""Time windows of a trace: the requests that arrive in a fraction of its arrival span.

A trace file is one recording, so a held-out evaluation on it cannot come from another seed:
it comes from later in time. :func:`time_window` cuts a trace by arrival time, and
:func:`traces.workload.split_spec` names the training and evaluation parts of a workload.

Invariant: for ``0 <= a < b < c <= 1`` the windows ``[a, b)`` and ``[b, c)`` of one trace are
disjoint, and every request of the second arrives after every request of the first (the
boundary ``b`` is one float, compared once per request). The window ending at 1 includes the
last arrival.
"""

from __future__ import annotations

import dataclasses

from traces.request import Trace


def check_window(start: float, end: float) -> None:
    """``ValueError`` unless ``0 <= start < end <= 1``."""
    if not 0.0 <= start < end <= 1.0:
        raise ValueError(f"time window [{start:g}, {end:g}): need 0 <= start < end <= 1")


def time_window(trace: Trace, start: float, end: float) -> Trace:
    """The requests of ``trace`` arriving in ``[start, end)`` of its arrival span (fractions;
    ``end == 1`` includes the last request), with arrivals shifted so the first is at 0.

    Request ids, prompts and metadata are kept; the name gets ``@start-end``. An empty window is
    a ``ValueError``.
    """
    check_window(start, end)
    if not trace.requests:
        raise ValueError(f"trace {trace.name}: no requests to cut")
    first = trace.requests[0].arrival_s
    low, high = start * trace.duration_s, end * trace.duration_s
    kept = [r for r in trace.requests if low <= r.arrival_s - first and (end == 1.0 or r.arrival_s - first < high)]
    name = f"{trace.name}@{start:g}-{end:g}"
    if not kept:
        raise ValueError(f"{name}: no request arrives in [{low:.3f} s, {high:.3f} s) of {trace.name}")
    shift = kept[0].arrival_s
    requests = [dataclasses.replace(r, arrival_s=r.arrival_s - shift) for r in kept]
    return Trace(name, requests, trace.source, trace.block_size, trace.skipped_lines)
