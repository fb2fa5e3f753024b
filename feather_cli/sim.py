"""``feather sim compare|sweep|validate``: policies side by side in the simulator, against load, and the
simulator against the live engine."""

from __future__ import annotations

import json
import re
import sys

from feather_cli.options import (
    add_json,
    add_max_wait_steps,
    add_policies,
    add_submission,
    add_workloads,
    float_list,
    non_negative_int,
    parse_policies,
    parse_workloads,
    positive_float,
    positive_int,
    split_workload,
    submission,
)
from feather_gym.compare import DEFAULT_POLICIES
from feather_gym.slo import DEFAULT_SLOS

WORKLOAD_HELP = ("trace file, shared trace name (mooncake, azure-conv) or KIND[:key=value,...]; "
                 "SPEC@START-END takes a time window (e.g. mooncake@0.7-1: the held-out last 30%%)")
DEFAULT_LOADS = "0.5,0.7,0.9,1.0,1.1,1.3"
DEFAULT_SWEEP_POLICIES = "fcfs,lpm,dfs,hrrn,feather-rule,feather-hold,feather-resident,cht"


def register(tree) -> None:
    """Add ``feather sim compare|sweep|validate``."""
    from deploy.bench.validate import DEFAULT_POLICIES as VALIDATE_POLICIES
    from deploy.bench.validate import DEFAULT_WORKLOADS as VALIDATE_WORKLOADS

    sim = tree.group("sim")
    compare = sim.add_parser("compare", help="run one trace under several scheduling policies, side by side")
    add_workloads(compare, WORKLOAD_HELP + "; SPEC@load=X replays it at X times FCFS's capacity", repeat=False,
                  required=True)
    compare.add_argument("--profile", default=None,
                         help="cost-model profile name or file (default: this machine's, hardware_profile())")
    add_policies(compare, DEFAULT_POLICIES, "comma-separated policy names or *.onnx files")
    compare.add_argument("--seed", type=non_negative_int, default=0, help="seed of generated workloads")
    compare.add_argument("--max-requests", type=positive_int, default=None,
                         help="simulate only the first N requests of the trace (a truncated window)")
    compare.add_argument("--model", default=None, metavar="hybrid|tiny|DIR",
                         help="simulate a hybrid model's recurrent-state cache: its layout comes from the model's "
                              "config (hybrid = the trained one; no weights needed); step times from --profile, "
                              "by default the trained hybrid's measured vllm-cpu-hybrid")
    compare.add_argument("--placements", default="vllm,dp",
                         help="--model: recurrent-state placements to compare, comma-separated (vllm, dp, grid)")
    compare.add_argument("--max-states", type=non_negative_int, default=32,
                         help="--model: recurrent states kept at most")
    compare.add_argument("--anchor-pages", type=non_negative_int, default=0,
                         help="--model: SuffixReplay anchors on at most this many prompt pages (default 0: none)")
    compare.add_argument("--kv-tokens", type=positive_int, default=None,
                         help="KV-cache capacity in tokens, the state reserve included (default: the profile's)")
    add_max_wait_steps(compare)
    compare.add_argument("--plot", metavar="FILE", help="write a bar chart (PNG) of throughput and TTFT")
    add_json(compare)
    compare.set_defaults(func=compare_command)

    sweep = sim.add_parser("sweep", help="policies against load: latency percentiles and goodput under an SLO",
                           description="Find the workload's FCFS capacity on the profile, replay it at each load "
                                       "factor of it, and run every policy there. Several workloads are swept "
                                       "one after another and then compared in one table.")
    add_workloads(sweep, WORKLOAD_HELP + "; repeat to sweep several", required=True)
    sweep.add_argument("--loads", type=float_list, default=DEFAULT_LOADS,
                       help=f"comma-separated load factors (default {DEFAULT_LOADS})")
    add_policies(sweep, DEFAULT_SWEEP_POLICIES, "comma-separated policy names or *.onnx files")
    sweep.add_argument("--profile", default=None, help="cost-model profile (default: this hardware's)")
    sweep.add_argument("--slo", default="", metavar="ttft=2s,tpot=100ms",
                       help="latency SLO of goodput (default per profile device: " + ", ".join(
                           f"{device} ttft={slo.ttft_s:g}s,tpot={slo.tpot_s * 1e3:g}ms"
                           for device, slo in DEFAULT_SLOS.items()) + ")")
    sweep.add_argument("--seed", type=non_negative_int, default=0, help="seed of generated workloads")
    sweep.add_argument("--seeds", type=positive_int, default=1,
                       help="instances of a generated workload: seeds --seed, --seed + 1, ... (default 1); the "
                            "table gives each figure's mean and range over them")
    sweep.add_argument("--windows", type=positive_int, default=1,
                       help="instances of a recorded trace: its span (or the window SPEC@START-END) cut into this "
                            "many equal time windows (default 1); summarised as --seeds")
    sweep.add_argument("--max-requests", type=positive_int, default=None, help="only the first N requests of the trace")
    sweep.add_argument("--kv-tokens", type=positive_int, default=None,
                       help="KV-cache capacity in tokens (default: the profile's)")
    add_max_wait_steps(sweep)
    sweep.add_argument("--plot", metavar="FILE", help="write TTFT p99 and goodput against load (PNG)")
    add_json(sweep)
    sweep.set_defaults(func=sweep_command)

    validate = sim.add_parser("validate", help="the simulator against the live vLLM engine, same workload and policies",
                              description="The simulator against the live engine: one workload, the same policies.")
    add_workloads(validate, "workload, repeatable; default: " + ", ".join(VALIDATE_WORKLOADS))
    add_policies(validate, ",".join(VALIDATE_POLICIES),
                 "comma-separated: fcfs (vLLM's scheduler), feather-rule, *.onnx")
    validate.add_argument("--profile", default=None, help="cost-model profile (default: this hardware's)")
    validate.add_argument("--rounds", type=positive_int, default=3, help="live rounds per policy (default 3)")
    add_submission(validate)
    validate.add_argument("--kv-cache-gib", type=positive_float, default=None,
                          help="KV cache (GiB; default $VLLM_CPU_KVCACHE_SPACE, else the bench's 0.25)")
    add_max_wait_steps(validate)
    validate.add_argument("--max-input-tokens", type=positive_int, default=None, help="cut prompts to this many tokens")
    validate.add_argument("--max-output-tokens", type=positive_int, default=None,
                          help="cut outputs to this many tokens")
    validate.add_argument("--seed", type=non_negative_int, default=0, help="the workload's (first) seed (default 0)")
    validate.add_argument("--seeds", type=positive_int, default=1,
                          help="seeds per workload: --seed, --seed + 1, ... (default 1); a summary over them")
    add_json(validate)
    validate.set_defaults(func=validate_command)


def compare_command(args) -> int:
    from feather_gym.compare import compare_policies, format_comparison, hybrid_configs, plot_comparison
    from feather_gym.costmodel import hardware_profile, load_cost_model
    from feather_gym.costmodel.model import HYBRID_CPU_PROFILE
    from feather_gym.load import resolve_at_load
    from feather_gym.simulator import EngineConfig

    names = parse_policies(args.policies)
    warn_of_trained_bounds(names, args.max_wait_steps)
    label, spec = split_workload(args.workload)
    cost_model = load_cost_model(args.profile or (hardware_profile() if args.model is None else HYBRID_CPU_PROFILE))
    config = EngineConfig(kv_capacity_tokens=args.kv_tokens, max_wait_steps=args.max_wait_steps)
    trace, load = resolve_at_load(spec, seed=args.seed, cost_model=cost_model, config=config,
                                  max_requests=args.max_requests)
    if load is not None:
        print(f"load {load['load']:g} of FCFS's capacity ({load['capacity_requests_per_s']:.4g} requests/s, "
              f"{load['capacity_rate_factor']:.4g}x the recorded rate): {load['arrival_rate_req_s']:.4g} requests/s")
    if args.model is None:
        results = compare_policies(trace, cost_model, names, config)
    else:
        configs, description = hybrid_configs(args.model, placements=parse_policies(args.placements),
                                              max_states=args.max_states, anchor_pages=args.anchor_pages,
                                              kv_tokens=args.kv_tokens, max_wait_steps=args.max_wait_steps)
        print(description)
        results = {f"{name}@{placement}": metrics for placement, config in configs.items()
                   for name, metrics in compare_policies(trace, cost_model, names, config).items()}
    print(f"workload {label} ({len(trace)} requests arriving over {trace.duration_s:.3f} s), "
          f"profile {cost_model.name}; queue = arrival to first scheduling")
    return _emit(args, format_comparison(results),
                 lambda path: plot_comparison(results, path, title=f"{label} on {cost_model.name}"),
                 {"workload": label, "spec": spec, "profile": cost_model.name, "requests": len(trace),
                  "arrival_span_s": trace.duration_s, "max_wait_steps": args.max_wait_steps, **(load or {}),
                  "policies": results})


def warn_of_trained_bounds(names: list[str], max_wait_steps: int) -> None:
    """On stderr, each policy file among ``names`` trained under another waiting-time bound than
    ``max_wait_steps`` (as the deployed scheduler warns at start)."""
    from feather_gym.policy_runtime import OnnxPolicy

    for name in names:
        if name.endswith(".onnx") and (trained := OnnxPolicy(name).trained_bound_differs(max_wait_steps)):
            print(f"feather: warning: {name} was trained with max_wait_steps={trained} and is simulated with "
                  f"{max_wait_steps}: its decisions meet states it was not trained in", file=sys.stderr)


def sweep_command(args) -> int:
    from feather_gym.costmodel import hardware_profile, load_cost_model
    from feather_gym.simulator import EngineConfig
    from feather_gym.slo import parse_slo
    from feather_gym.sweep import HEURISTICS, format_across

    workloads = parse_workloads(args.workload)
    instances = {label: _sweep_instances(spec, args.seed, args.seeds, args.windows)
                 for label, spec in workloads.items()}
    cost_model = load_cost_model(args.profile or hardware_profile())
    slo = parse_slo(args.slo, DEFAULT_SLOS[cost_model.device])
    config = EngineConfig(kv_capacity_tokens=args.kv_tokens, max_wait_steps=args.max_wait_steps)
    warn_of_trained_bounds(parse_policies(args.policies), args.max_wait_steps)
    payloads = []
    for label, spec in workloads.items():
        if payloads:
            print()
        payloads.append(_sweep_workload(args, label, spec, instances[label], cost_model, slo, config))
    if len(payloads) == 1:
        payload = payloads[0]
    else:
        print("\n" + format_across({payload["workload"]: payload["summary"] for payload in payloads}))
        payload = {**slo.as_dict(), "workloads": payloads}
    if args.json:
        print(json.dumps({**payload, "max_wait_steps": config.max_wait_steps, "heuristics": list(HEURISTICS)}))
    return 0


def _sweep_workload(args, label: str, spec: str, instances: list[dict], cost_model, slo, config) -> dict:
    """Sweep one workload's ``instances``, print its tables (and write its plot with ``--plot``) and
    return its JSON payload."""
    from feather_gym.load import resolve_at_load
    from feather_gym.sweep import format_summary, format_sweep, load_sweep, plot_sweep, summarise_sweeps

    print(f"workload {label}, profile {cost_model.name}; SLO TTFT {slo.ttft_s:g} s, TPOT {slo.tpot_s * 1e3:g} ms; "
          f"waiting bound {config.max_wait_steps} engine steps")
    reports = []
    for instance in instances:
        trace, _ = resolve_at_load(instance["spec"], seed=instance["seed"], cost_model=cost_model, config=config,
                                   max_requests=args.max_requests)
        reports.append(load_sweep(trace, cost_model, parse_policies(args.policies), args.loads, slo=slo,
                                  config=config))
        name = f"window {instance['spec'].rpartition('@')[2]}" if args.windows > 1 else f"seed {instance['seed']}"
        print(f"{name}: {reports[-1]['requests']} requests, FCFS capacity "
              f"{reports[-1]['capacity_requests_per_s']:.4g} requests/s ({reports[-1]['capacity_rate_factor']:.4g}x "
              f"the recorded rate, {reports[-1]['capacity_simulations']} runs)")
    summary = summarise_sweeps(reports)
    over = (f"seeds {args.seed}-{args.seed + args.seeds - 1}" if args.seeds > 1 else
            f"{args.windows} time windows" if args.windows > 1 else f"seed {args.seed}")
    several = len(instances) > 1
    print("\n\n".join(([] if several else [format_sweep(reports[0])]) + [format_summary(summary, over)]))
    if args.plot:
        path = args.plot if len(args.workload) == 1 else _labelled_path(args.plot, label)
        plot_sweep(summary, slo.as_dict(), path,
                   title=f"{label} on {cost_model.name}" + (f", mean over {over}" * several))
        print(f"wrote {path}")
    payload = ({**slo.as_dict(), "instances": [instance | report for instance, report in zip(instances, reports)]}
               if several else reports[0])
    return {"workload": label, "spec": spec, **payload, "summary": summary}


def _labelled_path(path: str, label: str) -> str:
    """``path`` with ``_label`` before its suffix (characters other than letters, digits, ``.``, ``_``
    and ``-`` as ``-``): one plot per workload of a sweep over several."""
    from pathlib import Path

    path = Path(path)
    return str(path.with_name(f"{path.stem}_{re.sub(r'[^A-Za-z0-9._-]+', '-', label)}{path.suffix}"))


def _sweep_instances(spec: str, seed: int, seeds: int, windows: int) -> list[dict]:
    """The instances ``feather sim sweep`` runs, each ``{"spec", "seed"}``: a generator's seeds, a
    recorded trace's time windows (:func:`traces.workload.time_windows`), or ``spec`` alone."""
    from traces.workload import is_generated, time_windows

    if seeds > 1 and windows > 1:
        raise SystemExit("--seeds and --windows: give one (a generator's instances are seeds, a trace's windows)")
    if seeds > 1 and not is_generated(spec):
        raise SystemExit(f"--seeds {seeds}: {spec!r} is not a generator (KIND[:key=value,...]); a recorded trace "
                         "is the same at every seed: give --windows instead")
    if windows > 1:
        try:
            return [{"spec": window, "seed": seed} for window in time_windows(spec, windows)]
        except ValueError as exc:
            raise SystemExit(f"--windows {windows}: {exc}") from None
    return [{"spec": spec, "seed": instance} for instance in range(seed, seed + seeds)]


def _emit(args, table: str, plot, payload: dict) -> int:
    """Print ``table``; with ``--plot``, ``plot(path)``; with ``--json``, ``payload`` as the last line."""
    print(table)
    if args.plot:
        plot(args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        print(json.dumps(payload))
    return 0


def validate_command(args) -> int:
    from deploy.bench.validate import DEFAULT_WORKLOADS, format_report, validate

    report = validate(parse_workloads(args.workload) or DEFAULT_WORKLOADS, policies=parse_policies(args.policies),
                      profile=args.profile, rounds=args.rounds, **submission(args),
                      kv_cache_gib=args.kv_cache_gib, max_wait_steps=args.max_wait_steps,
                      max_input_tokens=args.max_input_tokens, max_output_tokens=args.max_output_tokens,
                      seed=args.seed, num_seeds=args.seeds)
    print(format_report(report))
    if args.json:
        print(json.dumps(report))
    return 0
