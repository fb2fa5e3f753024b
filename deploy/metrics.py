"""Feather's Prometheus metrics, served on vLLM's own ``/metrics`` endpoint under the ``feather:`` prefix.

==========================================  =========  ===================================================
metric                                      type       meaning
==========================================  =========  ===================================================
``feather:decisions_total{action}``         counter    policy answers, ``action`` ``add`` or ``stop``
``feather:forced_admissions_total{rule}``   counter    admissions without a policy answer: ``resumed``,
                                                       ``max_wait``, ``idle``, ``after_fallback``
``feather:fallbacks_total``                 counter    policy calls that raised (that step admits FCFS)
``feather:policy_swaps_total``              counter    policy files hot-swapped in
``feather:policy_swaps_refused_total``      counter    changed policy files refused (the old one serves)
``feather:replay_hits_total``               counter    prefix hits resumed by SuffixReplay
``feather:rebuilt_states_total``            counter    (layer, request) recurrent states rebuilt by replay
``feather:waiting_requests``                gauge      requests in the Feather waiting queue
``feather:cht_prefixes``                    gauge      prefixes indexed by the Chunked Hash Tree
``feather:anchor_bytes{layer}``             gauge      bytes of SuffixReplay anchors kept, per GDN layer
``feather:kept_state_bytes``                gauge      pool bytes of exact recurrent states kept
``feather:decision_latency_seconds``        histogram  one policy decision (observation and policy call)
``feather:scheduler_step_seconds``          histogram  one Feather ``schedule()`` call
``feather:rebuild_seconds``                 histogram  replay rebuild time per hit (a step's mean)
==========================================  =========  ===================================================

The metrics live in the process that runs the scheduler, the engine core. vLLM's OpenAI server
always runs the engine core in a process of its own (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` only
keeps the model in the core's process): its ``/metrics`` shows them only in prometheus_client's
multiprocess mode, which vLLM uses when ``PROMETHEUS_MULTIPROC_DIR`` names an empty directory
before the server starts (vLLM sets it itself with ``--api-server-count`` > 1). With vLLM's
``LLM`` class and ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the core runs in the caller's process and
the metrics are in its default registry. Gauges sum over live processes.

Each metric is created once per process (:func:`feather_metrics`); every scheduler instance
reports into it through its own :class:`MetricsRecorder`, which turns the scheduler's cumulative
counters into increments, so counters only grow.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from functools import cache

from prometheus_client import Counter, Gauge, Histogram

logger = logging.getLogger(__name__)

PREFIX = "feather:"
#: Histogram buckets (seconds): decisions take microseconds, scheduler steps and rebuilds milliseconds.
DECISION_BUCKETS_S = (2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3)
STEP_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.5)
REBUILD_BUCKETS_S = (1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0)
#: :class:`~deploy.admission.AdmissionStats` field -> ``rule`` label of ``feather:forced_admissions_total``.
FORCED_RULES = {"forced_resumed": "resumed", "forced_wait": "max_wait", "forced_idle": "idle",
                "fcfs_admissions": "after_fallback"}


@dataclass(frozen=True)
class FeatherMetrics:
    """The process's metric objects (see the module docstring's table)."""

    decisions: Counter
    forced: Counter
    fallbacks: Counter
    swaps: Counter
    refused_swaps: Counter
    replay_hits: Counter
    rebuilt_states: Counter
    waiting: Gauge
    cht_prefixes: Gauge
    anchor_bytes: Gauge
    kept_state_bytes: Gauge
    decision_latency: Histogram
    step_time: Histogram
    rebuild_time: Histogram

    def names(self) -> list[str]:
        """The exposed metric family names (counters without their ``_total``)."""
        return [getattr(self, f.name)._name for f in fields(self)]


@cache
def feather_metrics() -> FeatherMetrics:
    """The metrics of this process, registered in prometheus_client's default registry on first use."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        logger.info("Feather metrics are in this process's Prometheus registry; behind vLLM's OpenAI server, "
                    "set PROMETHEUS_MULTIPROC_DIR to an empty directory before starting it to see them on /metrics")

    def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(PREFIX + name, doc, labels, multiprocess_mode="livesum")

    return FeatherMetrics(
        decisions=Counter(PREFIX + "decisions", "Feather policy answers, by action.", ["action"]),
        forced=Counter(PREFIX + "forced_admissions", "Admissions without a policy answer, by rule.", ["rule"]),
        fallbacks=Counter(PREFIX + "fallbacks", "Feather policy calls that raised (the step admits FCFS)."),
        swaps=Counter(PREFIX + "policy_swaps", "Policy files hot-swapped in."),
        refused_swaps=Counter(PREFIX + "policy_swaps_refused", "Changed policy files refused."),
        replay_hits=Counter(PREFIX + "replay_hits", "Prefix hits resumed by SuffixReplay."),
        rebuilt_states=Counter(PREFIX + "rebuilt_states", "Recurrent states rebuilt by SuffixReplay."),
        waiting=gauge("waiting_requests", "Requests in the Feather waiting queue."),
        cht_prefixes=gauge("cht_prefixes", "Prefixes indexed by the Chunked Hash Tree."),
        anchor_bytes=gauge("anchor_bytes", "Bytes of SuffixReplay anchors kept, per GDN layer.", ["layer"]),
        kept_state_bytes=gauge("kept_state_bytes", "Pool bytes of exact recurrent states kept."),
        decision_latency=Histogram(PREFIX + "decision_latency_seconds", "One Feather policy decision.",
                                   buckets=DECISION_BUCKETS_S),
        step_time=Histogram(PREFIX + "scheduler_step_seconds", "One Feather schedule() call.",
                            buckets=STEP_BUCKETS_S),
        rebuild_time=Histogram(PREFIX + "rebuild_seconds", "SuffixReplay rebuild time per hit (a step's mean).",
                               buckets=REBUILD_BUCKETS_S),
    )


class MetricsRecorder:
    """One scheduler's reports into :func:`feather_metrics`: cumulative counts in, increments out."""

    def __init__(self) -> None:
        self.metrics = feather_metrics()
        self._last: dict[str, float] = {}
        self._decisions = {action: self.metrics.decisions.labels(action=action) for action in ("add", "stop")}
        self._forced = {field: self.metrics.forced.labels(rule=rule) for field, rule in FORCED_RULES.items()}

    def _delta(self, key: str, total: float) -> float:
        """``total`` minus the last total reported under ``key``."""
        delta = total - self._last.get(key, 0)
        self._last[key] = total
        return delta

    def admission(self, stats) -> None:
        """An :class:`~deploy.admission.AdmissionStats` after a step."""
        for action, counter in self._decisions.items():
            if delta := self._delta(action, getattr(stats, action + "s")):
                counter.inc(delta)
        for name, counter in self._forced.items():
            if delta := self._delta(name, getattr(stats, name)):
                counter.inc(delta)
        if delta := self._delta("fallbacks", stats.fallbacks):
            self.metrics.fallbacks.inc(delta)

    def decision_latencies(self, latencies_ns: list[int]) -> None:
        observe = self.metrics.decision_latency.observe
        for ns in latencies_ns:
            observe(ns * 1e-9)

    def step(self, seconds: float, *, waiting: int, cht_prefixes: int) -> None:
        self.metrics.step_time.observe(seconds)
        self.metrics.waiting.set(waiting)
        self.metrics.cht_prefixes.set(cht_prefixes)

    def policy_reloads(self, *, swaps: int, refusals: int) -> None:
        if delta := self._delta("swaps", swaps):
            self.metrics.swaps.inc(delta)
        if delta := self._delta("refusals", refusals):
            self.metrics.refused_swaps.inc(delta)

    def replay(self, *, hits: int, rebuilt_states: int, rebuild_s: float, anchor_layer_bytes: dict[int, int]) -> None:
        """SuffixReplay's cumulative hits, rebuilt states and rebuild time after a step, and the
        anchor bytes each GDN layer holds."""
        new_hits = self._delta("replay_hits", hits)
        spent = self._delta("rebuild_s", rebuild_s)
        if new_hits:
            self.metrics.replay_hits.inc(new_hits)
            for _ in range(int(new_hits)):
                self.metrics.rebuild_time.observe(spent / new_hits)
        if delta := self._delta("rebuilt_states", rebuilt_states):
            self.metrics.rebuilt_states.inc(delta)
        for layer, held in anchor_layer_bytes.items():
            self.metrics.anchor_bytes.labels(layer=str(layer)).set(held)

    def kept_states(self, state_bytes: int) -> None:
        self.metrics.kept_state_bytes.set(state_bytes)
