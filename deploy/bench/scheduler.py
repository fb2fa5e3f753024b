"""``feather bench scheduler``: vLLM's own scheduler against the Feather classes, model-free, side by side.

Every side is a fresh scheduler over a real ``KVCacheManager`` (:mod:`deploy.model_free`), stepped
with synthetic model outputs: each decoding request gets one token per step and finishes at
its trace's output length. The reference side is vLLM's ``Scheduler`` (``AsyncScheduler`` with
``pipelined``, the next step scheduled before the previous one's output is applied); the
other sides are :class:`~deploy.scheduler.FeatherScheduler` (``FeatherAsyncScheduler``) with
each policy and each step-log mode (``off``, the in-memory ``ring``, a ``file``).

A run of one side: ``waiting`` requests are added, then the engine steps. The queue is topped
up to ``waiting`` after every step (outside the step's timing; each ``add_request`` is timed on
its own). Each request is made, its block hashes computed, right before it is added, as vLLM's
engine core makes them. The **burst round** is the steps from an empty running set until ``max_num_seqs``
requests run (hundreds of admissions); the **steady state** is the ``steps`` steps after it,
where a few requests finish and are replaced per step. A step's time is the thread CPU time of
its ``schedule()`` plus its ``update_from_output()``.

Figures per side (keys carry their unit): ``step_us_p50/p99/max`` (steady state),
``burst_round_ms`` and ``burst_admissions``, ``admission_us_p50`` (burst steps: step time over
the requests it admitted), ``add_us_p50``; the side's own time (:class:`~deploy.bench.own_time.OwnTime`:
its waiting queue, and a Feather scheduler's step log and metrics) as ``own_step_us_p50`` (steady
state), ``own_burst_us_per_admission``, ``own_add_us_mean`` and their sum ``own_us_per_request``;
against the reference run on the same workload and configuration, ``feather_over_vllm_step_p50``,
``feather_over_vllm_burst_round``, ``own_us_per_request_beyond_vllm`` and
``own_step_us_p50_beyond_vllm`` (the time Feather adds, measured where it is spent rather than as
a difference of two noisy step totals); a ``ring`` side also has
``ring_over_off_step_p50`` against the same policy's ``off`` side; ``targets_met`` checks
:data:`TARGETS`. ``bubble_<profile>``
divides the steady-state step p50 by the modelled step (:mod:`feather_gym.costmodel`) of the
reference's median steady-state composition on that GPU profile; ``extra_bubble_<profile>`` divides
a Feather side's steady-state step p50 beyond vLLM's by the same modelled step. With ``repeats`` > 1 the
sides run in rotated order each repeat and every figure is the median over repeats, the
ratios' min and max beside it.
"""

from __future__ import annotations

import itertools
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deploy.bench.own_time import OwnTime
from deploy.model_free import ModelFreeEngine, model_free_scheduler, vllm_requests
from deploy.step_log import step_composition

#: Step-log modes of a Feather side.
STEP_LOGS = ("off", "ring", "file")
#: The reference side's label.
REFERENCE = "vllm"
#: The k = 4 network the bench builds when no policy file is given (see :func:`untrained_k4_policy`).
UNTRAINED_K4 = "k4-untrained"
#: GPU profiles the execution bubble is modelled on.
BUBBLE_PROFILES = ("h100", "h200")
#: ``prefix-groups`` with W/64 groups of 1.0-1.3K-token prompts; ``{n}`` and ``{groups}`` are filled in.
PREFIX_GROUPS = ("prefix-groups:num_requests={n},groups={groups},prefix_tokens=1000,suffix_tokens_min=16,"
                 "suffix_tokens_max=300,output_tokens_min=16,output_tokens_max=256,rate=1000")
DEFAULT_WORKLOADS = {"prefix-groups": PREFIX_GROUPS}
#: A burst round that has not filled the running set after this many steps ends (the queue ran dry).
MAX_BURST_STEPS = 10_000
#: The targets a Feather side is held to: name -> (figure, upper bound). Its own time per request
#: beyond vLLM's (:mod:`deploy.bench.own_time`), the burst round and the steady-state step against
#: vLLM's, the ring step log against none, and the execution bubble it adds to vLLM's own (H200).
TARGETS = {
    "own_time_10us_per_request": ("own_us_per_request_beyond_vllm", 10.0),
    "burst_round_1_3x": ("feather_over_vllm_burst_round", 1.3),
    "steady_step_1_05x": ("feather_over_vllm_step_p50", 1.05),
    "ring_log_1_02x": ("ring_over_off_step_p50", 1.02),
    "extra_bubble_h200_2pct": ("extra_bubble_h200", 0.02),
}


@dataclass(frozen=True)
class SchedulerBenchConfig:
    """One configuration of the benchmark (the scheduler's limits and the KV cache)."""

    waiting: int = 1000
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    kv_cache_tokens: int = 2**20
    steps: int = 200
    pipelined: bool = False

    def __post_init__(self) -> None:
        if min(self.waiting, self.block_size, self.max_num_seqs, self.steps, self.kv_cache_tokens) < 1:
            raise ValueError(f"{self}: waiting, block_size, max_num_seqs, steps and kv_cache_tokens must be >= 1")

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size

    def describe(self) -> dict:
        return {"waiting": self.waiting, "block_size_tokens": self.block_size, "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens, "kv_cache_blocks": self.num_blocks,
                "steps": self.steps, "pipelined": self.pipelined}


def untrained_k4_policy(folder: Path) -> Path:
    """An untrained ``k = 4`` network of the trainer's default shape whose STOP logit is held low,
    so it admits one of its candidates at every decision (the cost of a full k = 4 decision)."""
    import torch

    from feather_gym.observation import observation_size
    from trainer.config import TrainConfig
    from trainer.export import export_policy_module

    k, sizes = 4, TrainConfig().hidden_sizes
    torch.manual_seed(0)
    layers, width = [], observation_size(k)
    for size in sizes:
        layers += [torch.nn.Linear(width, size), torch.nn.Tanh()]
        width = size
    head = torch.nn.Linear(width, k + 1)
    with torch.no_grad():
        head.bias[0] = -20.0
    path = folder / f"{UNTRAINED_K4}.onnx"
    observations = np.random.default_rng(0).uniform(0.0, 2.0, (64, observation_size(k))).astype(np.float32)
    export_policy_module(torch.nn.Sequential(*layers, head), path, profile="h200", workload="prefix-groups",
                         observations=observations, num_candidates=k)
    return path


def workload_trace(spec: str, config: SchedulerBenchConfig, *, seed: int = 0):
    """The requests of one run: enough for ``waiting`` plus every admission of the run."""
    from traces import resolve_workload

    need = config.waiting + config.max_num_seqs + config.steps * 8
    trace = resolve_workload(spec.format(n=need, groups=max(config.waiting // 64, 1)), seed=seed)
    if len(trace) < config.waiting + config.max_num_seqs:
        raise ValueError(f"workload {spec!r} has {len(trace)} requests; this run needs at least "
                         f"{config.waiting + config.max_num_seqs}")
    return trace


def run_side(scheduler_cls, trace, config: SchedulerBenchConfig, **scheduler_kwargs) -> dict:
    """One side on ``trace`` (see the module docstring): per-step figures of the burst and the steady state."""
    scheduler = model_free_scheduler(scheduler_cls, block_size=config.block_size, num_blocks=config.num_blocks,
                                     max_num_seqs=config.max_num_seqs,
                                     max_num_batched_tokens=config.max_num_batched_tokens,
                                     max_model_len=config.max_model_len, async_scheduling=config.pipelined,
                                     **scheduler_kwargs)
    compositions: list[dict] = []
    ramped = False

    def observe(output) -> None:
        if ramped and output.total_num_scheduled_tokens:
            compositions.append(step_composition(output, scheduler.requests, scheduler.hash_block_size))

    engine = ModelFreeEngine(scheduler, pipelined=config.pipelined, on_schedule=observe)
    own = OwnTime(scheduler)
    # Each request is made (its block hashes computed) right before it is added, as vLLM's engine
    # core does, and after the engine was built (not frozen with it).
    arrivals = iter(trace.requests)

    def arrive(count: int) -> list[int]:
        return engine.add_requests(vllm_requests(itertools.islice(arrivals, count), block_size=config.block_size))

    add_ns = arrive(config.waiting)
    own_add_ns, added = own.take(), len(add_ns)
    burst, steady = [], []       # (step timing, own ns of the step)
    while len(steady) < config.steps and len(burst) < MAX_BURST_STEPS:
        timing = engine.step()
        own_ns = own.take()
        if timing.scheduler_output is not None:
            if ramped:
                steady.append((timing, own_ns))
            else:
                burst.append((timing, own_ns))
                ramped = len(scheduler.running) >= config.max_num_seqs
        top_up = min(config.waiting - len(scheduler.waiting), len(trace) - added)
        if top_up > 0:
            times = arrive(top_up)
            add_ns += times
            own_add_ns += own.take()
            added += len(times)
        if not scheduler.has_unfinished_requests():
            break
    engine.drain()
    stats = scheduler.feather_stats() if hasattr(scheduler, "feather_stats") else {}
    scheduler.shutdown()
    return {"burst": burst, "steady": steady, "add_ns": add_ns, "own_add_ns": own_add_ns, "added": added,
            "compositions": compositions, "finished": len(engine.finished), "stats": stats}


def _figures(run: dict) -> dict:
    steady = np.array([t.step_ns for t, _ in run["steady"]], dtype=np.float64) / 1e3
    steady_own = np.array([own for _, own in run["steady"]], dtype=np.float64) / 1e3
    burst = [t for t, _ in run["burst"] if t.admitted]
    per_admission = np.array([t.step_ns / t.admitted for t in burst], dtype=np.float64) / 1e3
    admissions = sum(t.admitted for t, _ in run["burst"])
    burst_ns = sum(t.step_ns for t, _ in run["burst"])
    own_burst_ns = sum(own for _, own in run["burst"])
    own_add_us = run["own_add_ns"] / 1e3 / run["added"]
    figures = {
        "step_us_p50": _round(np.percentile(steady, 50)) if len(steady) else None,
        "step_us_p99": _round(np.percentile(steady, 99)) if len(steady) else None,
        "step_us_max": _round(steady.max()) if len(steady) else None,
        "steady_steps": len(steady),
        "steady_admissions_per_step": _round(np.mean([t.admitted for t, _ in run["steady"]])) if len(steady) else None,
        "burst_round_ms": _round(burst_ns / 1e6),
        "burst_steps": len(run["burst"]),
        "burst_admissions": admissions,
        "burst_us_per_admission": _round(burst_ns / 1e3 / admissions) if admissions else None,
        "admission_us_p50": _round(np.percentile(per_admission, 50)) if len(per_admission) else None,
        "add_us_p50": _round(np.percentile(np.asarray(run["add_ns"]) / 1e3, 50)),
        "own_step_us_p50": _round(np.percentile(steady_own, 50)) if len(steady) else None,
        "own_burst_us_per_admission": _round(own_burst_ns / 1e3 / admissions) if admissions else None,
        "own_add_us_mean": _round(own_add_us),
        "own_us_per_request": _round(own_burst_ns / 1e3 / admissions + own_add_us) if admissions else None,
        "requests_finished": run["finished"],
    }
    if run["stats"]:
        figures["policy_decisions"] = run["stats"].get("decisions")
        figures["policy_fallbacks"] = run["stats"].get("fallbacks")
    return figures


def _round(value) -> float:
    return round(float(value), 3)


def _bubble(step_us: float | None, compositions: list[dict]) -> dict:
    """Scheduler step time over the modelled GPU step of the median steady-state composition."""
    from feather_gym.costmodel.features import DecodeBatch
    from feather_gym.costmodel.model import load_cost_model

    if step_us is None or not compositions:
        return {}
    middle = sorted(compositions, key=lambda c: c["decode_requests"])[len(compositions) // 2]
    batch = DecodeBatch(middle["decode_requests"], middle["decode_kv_tokens"], middle["decode_kv_tokens"],
                        middle["decode_requests"])
    new = sum(chunk[0] for chunk in middle["prefill_chunks"])
    cached = sum(chunk[1] for chunk in middle["prefill_chunks"])
    out = {}
    for profile in BUBBLE_PROFILES:
        modelled_s = load_cost_model(profile).step_s(batch, new, cached)
        out[f"modelled_step_ms_{profile}"] = _round(modelled_s * 1e3)
        out[f"bubble_{profile}"] = round(step_us / 1e6 / modelled_s, 4) if modelled_s > 0 else None
    return out


def sides_for(policies: list[str], step_logs: list[str], *, pipelined: bool, folder: Path) -> dict:
    """``{label: (scheduler class, constructor kwargs)}``: vLLM's first, then every policy x step log."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.scheduler import FeatherAsyncScheduler, FeatherConfig, FeatherScheduler

    sides = {REFERENCE: (AsyncScheduler if pipelined else Scheduler, {})}
    feather_cls = FeatherAsyncScheduler if pipelined else FeatherScheduler
    for policy in policies:
        path = str(untrained_k4_policy(folder)) if policy == UNTRAINED_K4 else policy
        name = Path(policy).stem if policy.endswith(".onnx") else policy
        for mode in step_logs:
            log = {"off": {"step_log_ring": 0}, "ring": {},
                   "file": {"step_log": str(folder / f"{name}.jsonl")}}[mode]
            config = FeatherConfig(policy=path, policy_reload_s=None, **log)
            sides[f"{name}/{mode}"] = (feather_cls, {"feather_config": config})
    return sides


def bench_schedulers(workloads: dict[str, str], configs: list[SchedulerBenchConfig], *, policies: list[str],
                     step_logs: list[str], repeats: int = 1, seed: int = 0) -> dict:
    """Every side on every workload and configuration; the report described in the module docstring."""
    bad = sorted(set(step_logs) - set(STEP_LOGS))
    if bad or not step_logs:
        raise ValueError(f"step logs must be among {STEP_LOGS}, got {step_logs}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    results = []
    with tempfile.TemporaryDirectory(prefix="feather-bench-scheduler-") as tmp:
        folder = Path(tmp)
        for workload, spec in workloads.items():
            for config in configs:
                trace = workload_trace(spec, config, seed=seed)
                sides = sides_for(policies, step_logs, pipelined=config.pipelined, folder=folder)
                results.append({"workload": workload, **config.describe(),
                                "sides": _run_repeated(sides, trace, config, repeats)})
    return {"policies": policies, "step_logs": step_logs, "repeats": repeats, "reference": REFERENCE,
            "results": results}


def _run_repeated(sides: dict, trace, config: SchedulerBenchConfig, repeats: int) -> dict:
    labels = list(sides)
    per_repeat: list[dict[str, dict]] = []
    compositions = []
    for repeat in range(repeats):
        shift = repeat % len(labels)
        figures = {}
        for label in labels[shift:] + labels[:shift]:
            cls, kwargs = sides[label]
            run = run_side(cls, trace, config, **kwargs)
            figures[label] = _figures(run)
            if label == REFERENCE:
                compositions += run["compositions"]
        per_repeat.append(figures)
    out = {}
    for label in labels:
        merged = _median_figures([r[label] for r in per_repeat])
        if label != REFERENCE:
            merged |= _ratios([(r[label], r[REFERENCE]) for r in per_repeat])
        unlogged = label.rsplit("/", 1)[0] + "/off"
        if label.endswith("/ring") and unlogged in labels:
            merged |= _ratios([(r[label], r[unlogged]) for r in per_repeat], prefix="ring_over_off")
        merged |= _bubble(merged["step_us_p50"], compositions)
        if label != REFERENCE:
            for profile in BUBBLE_PROFILES:
                modelled_ms = merged.get(f"modelled_step_ms_{profile}")
                steps = (merged["step_us_p50"], out[REFERENCE]["step_us_p50"])
                extra_us = steps[0] - steps[1] if None not in steps else None
                merged[f"extra_bubble_{profile}"] = (round(extra_us / 1e3 / modelled_ms, 4)
                                                     if modelled_ms and extra_us is not None else None)
            merged["targets_met"] = targets_met(merged)
        out[label] = merged
    return out


def _median_figures(figures: list[dict]) -> dict:
    out = {}
    for key in figures[0]:
        values = [f[key] for f in figures if f[key] is not None]
        out[key] = None if not values else (_round(np.median(values)) if isinstance(values[0], float)
                                            else int(np.median(values)))
    return out


def _ratios(pairs: list[tuple[dict, dict]], prefix: str = "feather_over_vllm") -> dict:
    """Per-repeat ratios of ``side`` over ``reference`` (median, min, max); against vLLM, also the own
    time beyond vLLM's (median of the per-repeat differences)."""
    out = {}
    for name, key in ((f"{prefix}_step_p50", "step_us_p50"), (f"{prefix}_burst_round", "burst_round_ms")):
        values = [side[key] / ref[key] for side, ref in pairs if side[key] and ref[key]]
        out[name] = round(float(np.median(values)), 4) if values else None
        out[f"{name}_min"] = round(min(values), 4) if values else None
        out[f"{name}_max"] = round(max(values), 4) if values else None
    if prefix == "feather_over_vllm":
        for key in ("own_us_per_request", "own_step_us_p50"):
            values = [side[key] - ref[key] for side, ref in pairs if side[key] is not None and ref[key] is not None]
            out[f"{key}_beyond_vllm"] = _round(np.median(values)) if values else None
    return out


def targets_met(side: dict) -> dict:
    """Each target of :data:`TARGETS` that ``side`` reports a figure for: met or not."""
    return {name: side[key] <= bound for name, (key, bound) in TARGETS.items() if side.get(key) is not None}


def format_report(report: dict) -> str:
    """The report as one table per workload and configuration, and the targets each side misses."""
    lines = []
    for result in report["results"]:
        lines.append(f"{result['workload']}: W={result['waiting']} block={result['block_size_tokens']} "
                     f"max_num_seqs={result['max_num_seqs']} pipelined={result['pipelined']}")
        lines.append(f"  {'side':<18}{'step us':>11}{'p99 us':>8}{'x vllm':>8}{'burst ms':>10}{'x vllm':>8}"
                     f"{'own/req':>9}{'+us/req':>9}{'+us/step':>9}{'ring x':>8}{'bubble h200':>12}{'+bubble':>8}")
        for label, side in result["sides"].items():
            lines.append(f"  {label:<18}{_cell(side['step_us_p50']):>11}{_cell(side['step_us_p99']):>8}"
                         f"{_cell(side.get('feather_over_vllm_step_p50')):>8}{_cell(side['burst_round_ms']):>10}"
                         f"{_cell(side.get('feather_over_vllm_burst_round')):>8}"
                         f"{_cell(side.get('own_us_per_request')):>9}"
                         f"{_cell(side.get('own_us_per_request_beyond_vllm')):>9}"
                         f"{_cell(side.get('own_step_us_p50_beyond_vllm')):>9}{_cell(side.get('ring_over_off_step_p50')):>8}"
                         f"{_cell(side.get('bubble_h200')):>12}{_cell(side.get('extra_bubble_h200')):>8}")
        for label, side in result["sides"].items():
            missed = [name for name, met in side.get("targets_met", {}).items() if not met]
            if missed:
                lines.append(f"  {label} misses: {', '.join(missed)}")
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 10 else f"{value:.0f}"
