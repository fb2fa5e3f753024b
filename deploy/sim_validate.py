"""``feather sim validate``: the simulator against the live engine, one workload, the same policies.

Each policy serves the workload twice: in the simulator (:mod:`feather_gym.simulator`, step
times from the cost model of ``profile``) and on the live in-process vLLM engine
(:func:`deploy.serve_bench.run_schedulers`, rounds alternated). The simulator is configured as
the engine it is checked against: the engine's KV block size, token budget, ``max_num_seqs``
and KV capacity (read from the started engine), the admission's ``max_wait_s``, and the same
regime (every request at once, or online at the trace's arrival times x ``time_scale``).

Policies: ``fcfs`` is vLLM's own ``Scheduler``; every other one (``feather-rule``, a trained
``*.onnx``) runs in :class:`deploy.scheduler.FeatherScheduler`, in the simulator on the CHT's
candidate exactly as deployed (:func:`deploy.scheduler.load_deployable_policy`).

Per policy and figure (engine steps, output tokens/s, mean step time, cached prompt tokens,
TTFT p50/p99): simulated, live, and the relative error ``sim / live - 1``. Targets
(:data:`TARGETS`): throughput and steps within 10%, and the same ranking of the policies by
throughput on both sides.
"""

from __future__ import annotations

import dataclasses
import json
import time

from traces.workload import ENGINE_SIZED_WORKLOADS

#: Figures compared, as keys of both sides' reports.
FIGURES = ("steps", "output_tok_s", "step_ms_mean", "cached_prompt_tokens", "ttft_p50_s", "ttft_p99_s")
#: Largest |sim / live - 1| accepted per figure.
TARGETS = {"output_tok_s": 0.10, "steps": 0.10}
DEFAULT_POLICIES = ("fcfs", "feather-rule")
#: Default workloads: one prefix-heavy (under KV pressure in the bench's 0.25 GiB), one without sharing.
DEFAULT_WORKLOADS = {name: ENGINE_SIZED_WORKLOADS[name] for name in ("prefix-heavy", "no-sharing")}


def as_served(trace, *, online: bool, time_scale: float):
    """``trace`` with the arrival times the live round submits it at (all 0 unless ``online``)."""
    import traces

    from deploy.serve_bench import submission_offsets

    offsets = submission_offsets(trace, online=online, time_scale=time_scale)
    requests = [dataclasses.replace(r, arrival_s=float(t)) for r, t in zip(trace, offsets)]
    return traces.Trace(trace.name, requests, trace.source, trace.block_size)


def simulated(trace, cost_model, engine_config, policy_name: str) -> dict:
    """The simulator's :data:`FIGURES` for ``policy_name`` on ``trace``."""
    from feather_gym.policies import make_policy
    from feather_gym.simulator import simulate

    policy = make_policy("fcfs") if policy_name == "fcfs" else _deployable(policy_name)
    metrics = simulate(trace, cost_model, policy, config=engine_config).metrics()
    return {"steps": metrics["steps"], "output_tok_s": metrics["throughput_tok_s"],
            "step_ms_mean": metrics["step_ms_mean"], "cached_prompt_tokens": metrics["cached_prompt_tokens"],
            "ttft_p50_s": metrics["ttft_p50_s"], "ttft_p99_s": metrics["ttft_p99_s"],
            "preemptions": metrics["preemptions"], "decisions": metrics["decisions"]}


def _deployable(name: str):
    from deploy.scheduler import load_deployable_policy

    return load_deployable_policy(name)


def live_sides(policies, *, max_wait_s: float) -> dict:
    """``run_schedulers`` sides: vLLM's ``Scheduler`` for ``fcfs``, ``FeatherScheduler`` for the rest."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.scheduler import FeatherConfig, FeatherScheduler

    return {name: (Scheduler, {}) if name == "fcfs" else
            (FeatherScheduler, {"feather_config": FeatherConfig(policy=name, max_wait_s=max_wait_s)})
            for name in policies}


def compare_sides(sim: dict[str, dict], live: dict[str, dict]) -> dict:
    """Per policy and figure ``{"sim", "live", "error"}``; the rankings and whether targets are met."""
    table = {}
    for name in sim:
        table[name] = {}
        for figure in FIGURES:
            s, v = sim[name][figure], live[name][figure]
            error = (s / v - 1.0) if s is not None and v else None
            table[name][figure] = {"sim": s, "live": v, "error": None if error is None else round(error, 4)}
    sim_rank = sorted(sim, key=lambda n: -sim[n]["output_tok_s"])
    live_rank = sorted(live, key=lambda n: -live[n]["output_tok_s"])
    met = {figure: all(abs(table[n][figure]["error"]) <= bound for n in table) for figure, bound in TARGETS.items()}
    return {"policies": table, "sim_ranking": sim_rank, "live_ranking": live_rank,
            "same_ranking": sim_rank == live_rank, "targets_met": {**met, "ranking": sim_rank == live_rank}}


def validate(workloads: dict[str, str], *, policies=DEFAULT_POLICIES, profile: str | None = None,
             rounds: int = 3, online: bool = False, time_scale: float = 1.0, kv_cache_gib: float | None = None,
             max_wait_s: float | None = None, max_input_tokens: int | None = None,
             max_output_tokens: int | None = None, seed: int = 0) -> dict:
    """The whole report: one engine, and per workload the simulator and the engine on every policy."""
    from deploy.serve_bench import DEFAULT_BENCH_KV_CACHE_GIB, clip_lengths, kv_capacity, run_schedulers
    from feather_gym.costmodel import hardware_profile, load_cost_model
    from feather_gym.policies import DEFAULT_MAX_WAIT_S
    from feather_gym.simulator import EngineConfig
    from feather_gym.vllm_engine import resolve_kv_cache_gib, start_engine
    from traces import resolve_workload

    policies = list(dict.fromkeys(policies))
    for name in policies:            # refuse a bad policy before the engine starts
        if name != "fcfs":
            _deployable(name)
    profile = profile or hardware_profile()
    cost_model = load_cost_model(profile)
    max_wait_s = DEFAULT_MAX_WAIT_S if max_wait_s is None else max_wait_s
    started = time.perf_counter()
    traces = {name: clip_lengths(resolve_workload(spec, seed=seed), max_input_tokens=max_input_tokens,
                                 max_output_tokens=max_output_tokens) for name, spec in workloads.items()}
    longest = max(r.input_len + r.output_len for t in traces.values() for r in t)
    kv_cache_gib = resolve_kv_cache_gib(kv_cache_gib, default=DEFAULT_BENCH_KV_CACHE_GIB)
    llm = start_engine(max_model_len=max(2048, longest), seed=seed, kv_cache_gib=kv_cache_gib)
    capacity = kv_capacity(llm)
    scheduler_config = llm.llm_engine.vllm_config.scheduler_config
    engine_config = EngineConfig(token_budget=scheduler_config.max_num_batched_tokens,
                                 max_num_seqs=scheduler_config.max_num_seqs,
                                 block_size=capacity["kv_block_size_tokens"],
                                 kv_capacity_tokens=capacity["kv_capacity_tokens"], max_wait_s=max_wait_s)
    report = {"profile": cost_model.name, "policies": policies, "rounds": rounds, "online": online,
              "time_scale": time_scale, "max_wait_s": max_wait_s, "kv_cache_gib": kv_cache_gib, **capacity,
              "token_budget": engine_config.token_budget, "max_num_seqs": engine_config.max_num_seqs,
              "workloads": {}}
    sides = live_sides(policies, max_wait_s=max_wait_s)
    for name, trace in traces.items():
        served = as_served(trace, online=online, time_scale=time_scale)
        sim = {policy: simulated(served, cost_model, engine_config, policy) for policy in policies}
        live = run_schedulers(llm, trace, sides, rounds=rounds, online=online, time_scale=time_scale)
        report["workloads"][name] = {"spec": workloads[name], "num_requests": len(trace),
                                     **compare_sides(sim, live["sides"]),
                                     "live_ratio_to_first": live["ratios"],
                                     "requests_lost": {p: live["sides"][p]["requests_lost"] for p in policies}}
    report["wall_s"] = round(time.perf_counter() - started, 1)
    return report


def format_report(report: dict) -> str:
    """The sim-against-live table, one row per workload, policy and figure."""
    rows = [f"profile {report['profile']}, {report['rounds']} live rounds per policy, "
            f"{'online' if report['online'] else 'all requests at once'}, KV {report['kv_capacity_tokens']} tokens",
            f"{'workload':<16}{'policy':<22}{'figure':<22}{'sim':>12}{'live':>12}{'error':>9}"]
    for name, w in report["workloads"].items():
        for policy, figures in w["policies"].items():
            label = policy if len(policy) <= 21 else "..." + policy[-18:]
            for figure, cell in figures.items():
                error = "" if cell["error"] is None else f"{cell['error']:+.1%}"
                rows.append(f"{name:<16}{label:<22}{figure:<22}{_num(cell['sim']):>12}{_num(cell['live']):>12}"
                            f"{error:>9}")
        rows.append(f"{name:<16}ranking sim {w['sim_ranking']} live {w['live_ranking']}; "
                    f"targets met {w['targets_met']}")
    return "\n".join(rows)


def _num(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def register(commands) -> None:
    """Add ``sim validate`` to the ``feather`` command tree."""
    parser = commands.group("sim", help="simulate serving policies").add_parser(
        "validate", help="the simulator against the live vLLM engine, same workload and policies",
        description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="append", metavar="[NAME=]SPEC",
                        help="workload spec, repeatable; default: " + ", ".join(DEFAULT_WORKLOADS))
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help="comma-separated: fcfs (vLLM's scheduler), feather-rule, *.onnx (default %(default)s)")
    parser.add_argument("--profile", default=None, help="cost-model profile (default: this hardware's)")
    parser.add_argument("--rounds", type=int, default=3, help="live rounds per policy (default 3)")
    parser.add_argument("--online", action="store_true", help="submit requests at their trace times")
    parser.add_argument("--time-scale", type=float, default=1.0, help="online: scale the trace's arrival times")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="KV cache (GiB; default $VLLM_CPU_KVCACHE_SPACE, else the bench's 0.25)")
    parser.add_argument("--max-wait-s", type=float, default=None, help="the admission's waiting-time bound (default 10)")
    parser.add_argument("--max-input-tokens", type=int, default=None)
    parser.add_argument("--max-output-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object (last line)")
    parser.set_defaults(func=_command)


def _command(args) -> int:
    from deploy.cli import parse_workloads

    report = validate(parse_workloads(args.workload) or DEFAULT_WORKLOADS,
                      policies=[p for p in args.policies.split(",") if p], profile=args.profile,
                      rounds=args.rounds, online=args.online, time_scale=args.time_scale,
                      kv_cache_gib=args.kv_cache_gib, max_wait_s=args.max_wait_s,
                      max_input_tokens=args.max_input_tokens, max_output_tokens=args.max_output_tokens,
                      seed=args.seed)
    print(format_report(report))
    if args.json:
        print(json.dumps(report))
    return 0
