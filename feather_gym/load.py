"""Load as a parameter of a workload: its capacity on a profile, and the workload replayed at a load factor.

**Capacity.** A workload's capacity on a cost-model profile is the highest arrival rate that FCFS
(vLLM's scheduler in the simulator) sustains. The workload keeps its arrival pattern, scaled in
time (:func:`traces.rate.at_rate`). FCFS *sustains* a rate when the engine keeps up: the drain
after the last arrival (makespan minus arrival span), beyond the longest request's own service
time (first scheduling to finish) in that run, and the p99 queueing delay (arrival to first
scheduling) are both at most ``tolerance`` (default 5%) of the arrival span. The service-time
allowance keeps a short trace's last request from counting as a backlog. Sustaining is taken
to be monotone in the rate. :func:`find_capacity` brackets the threshold by doubling or halving the
recorded rate, then bisects it in log space to ``precision``.

**Load factor.** ``SPEC@load=X`` (:func:`split_load`) is the workload ``SPEC`` replayed at ``X``
times its capacity's arrival rate: 1 is the capacity, below 1 underload, above 1 overload. Any
workload spec takes it, e.g. ``mooncake@load=0.9`` or ``prefix-groups:groups=8@load=1.1``. The
capacity depends on the profile, the engine configuration and the requests (a truncated trace
has its own).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from traces.rate import at_rate
from traces.request import Trace

DEFAULT_TOLERANCE = 0.05
DEFAULT_PRECISION = 0.02
_LOAD = re.compile(r"^(?P<spec>.+)@load=(?P<load>[^@]+)$")
_MAX_DOUBLINGS = 40


@dataclass(frozen=True)
class Capacity:
    """FCFS's sustained arrival rate for one trace, profile and engine configuration."""

    rate_factor: float        #: multiple of the trace's recorded arrival rate
    requests_per_s: float     #: mean arrival rate at capacity (requests / arrival span)
    simulations: int          #: FCFS runs the search took

    def as_dict(self) -> dict:
        return {"capacity_rate_factor": self.rate_factor, "capacity_requests_per_s": self.requests_per_s,
                "capacity_simulations": self.simulations}


def check_load(load: float) -> float:
    """``load`` if it is a positive finite number; ``ValueError`` naming it otherwise."""
    if not 0.0 < load < math.inf:
        raise ValueError(f"load factor must be a positive number, got {load!r}")
    return load


def split_load(spec: str) -> tuple[str, float | None]:
    """``(workload spec, load factor)`` of ``SPEC@load=X``; ``(spec, None)`` without the suffix."""
    match = _LOAD.match(spec)
    if match is None:
        return spec, None
    try:
        load = float(match["load"])
    except ValueError:
        raise ValueError(f"workload {spec!r}: load={match['load']!r} is not a number") from None
    return match["spec"], check_load(load)


def sustains(result, tolerance: float = DEFAULT_TOLERANCE) -> bool:
    """Whether a ``SimResult`` kept up with its arrivals (see the module docstring)."""
    metrics, done = result.metrics(), result.finished
    span = metrics["arrival_span_s"]
    service = float((result.finish_s[done] - result.first_scheduled_s[done]).max())
    drain = metrics["makespan_s"] - span - service
    return drain <= tolerance * span and metrics["queue_delay_p99_s"] <= tolerance * span


def find_capacity(trace: Trace, cost_model, config=None, *, tolerance: float = DEFAULT_TOLERANCE,
                  precision: float = DEFAULT_PRECISION, digests=None) -> Capacity:
    """The :class:`Capacity` of ``trace`` under FCFS on ``cost_model`` (see the module docstring).

    ``digests``: the trace's ``trace_digests`` when the caller has them (rescaling keeps prompts).
    ``ValueError`` for a trace of fewer than two arrival times (it has no rate).
    """
    from feather_gym.policies import make_policy
    from feather_gym.simulator import EngineConfig, simulate, trace_digests

    if trace.duration_s <= 0:
        raise ValueError(f"trace {trace.name}: all requests arrive at once, so it has no arrival rate to scale")
    if not (tolerance > 0 and 0 < precision < 1):
        raise ValueError("tolerance must be > 0 and precision in (0, 1)")
    config = config or EngineConfig()
    if digests is None:
        digests = trace_digests(trace, config.block_size or cost_model.block_size)
    runs = 0

    def ok(factor: float) -> bool:
        nonlocal runs
        runs += 1
        result = simulate(at_rate(trace, factor), cost_model, make_policy("fcfs"), config=config, digests=digests)
        return sustains(result, tolerance)

    low, high = 1.0, 1.0
    if ok(1.0):
        while ok(high := high * 2):
            low = high
            if runs > _MAX_DOUBLINGS:
                raise ValueError(f"trace {trace.name}: FCFS keeps up at {high:g}x its rate; no capacity found")
    else:
        while not ok(low := low / 2):
            high = low
            if runs > _MAX_DOUBLINGS:
                raise ValueError(f"trace {trace.name}: FCFS does not keep up even at {low:g}x its rate")
    while high / low > 1 + precision:
        middle = math.sqrt(low * high)
        low, high = (middle, high) if ok(middle) else (low, middle)
    return Capacity(rate_factor=low, requests_per_s=len(trace) * low / trace.duration_s, simulations=runs)


def at_load(trace: Trace, capacity: Capacity, load: float) -> Trace:
    """``trace`` replayed at ``load`` times ``capacity``'s arrival rate."""
    return at_rate(trace, capacity.rate_factor * check_load(load))


def resolve_at_load(spec: str, *, seed: int, cost_model, config=None, max_requests: int | None = None):
    """``(trace, load report)`` of a workload spec that may end in ``@load=X``: the workload (its first
    ``max_requests`` requests when given) at that load of its capacity on ``cost_model``; the report
    (load, capacity, arrival rate) is None without the suffix."""
    from traces import resolve_workload

    base, load = split_load(spec)
    trace = resolve_workload(base, seed=seed)
    if max_requests is not None:
        trace = Trace(trace.name, trace.requests[:max_requests], trace.source, trace.block_size)
    if load is None:
        return trace, None
    capacity = find_capacity(trace, cost_model, config)
    return at_load(trace, capacity, load), {"load": load, "arrival_rate_req_s": capacity.requests_per_s * load,
                                            **capacity.as_dict()}


class LoadedWorkloads:
    """The traces of workload specs that may end in ``@load=X`` on one cost model and engine
    configuration, with their block digests (``trace_digests`` at the engine's block size).

    Each trace (a spec less its load factor, at a seed) is resolved, hashed and, when some spec
    asks for a load of it, its capacity searched once, whatever loads are asked of it: the
    loads of one trace share its capacity, and a trace replayed at another rate keeps its prompts."""

    def __init__(self, cost_model, config) -> None:
        self.cost_model, self.config = cost_model, config
        self._traces: dict[tuple[str, int], tuple[Trace, list]] = {}
        self._capacities: dict[tuple[str, int], Capacity] = {}

    def get(self, spec: str, seed: int) -> tuple[Trace, list]:
        """``(trace, digests)`` of ``spec`` at ``seed``: the workload, at its load factor when it has one."""
        from feather_gym.simulator import EngineConfig, trace_digests
        from traces import resolve_workload

        base, load = split_load(spec)
        key = (base, seed)
        if key not in self._traces:
            trace = resolve_workload(base, seed=seed)
            block_size = (self.config or EngineConfig()).block_size or self.cost_model.block_size
            self._traces[key] = (trace, trace_digests(trace, block_size))
        trace, digests = self._traces[key]
        if load is None:
            return trace, digests
        if key not in self._capacities:
            self._capacities[key] = find_capacity(trace, self.cost_model, self.config, digests=digests)
        return at_load(trace, self._capacities[key], load), digests
