"""``feather sim compare|validate``: policies side by side in the simulator, and the simulator
against the live engine."""

from __future__ import annotations

import json

from feather_cli.options import (
    add_json,
    add_policies,
    add_submission,
    add_workloads,
    non_negative_int,
    parse_policies,
    parse_workloads,
    positive_float,
    positive_int,
    split_workload,
    submission,
)
from feather_gym.compare import DEFAULT_POLICIES
from feather_gym.policies import DEFAULT_MAX_WAIT_STEPS


def register(tree) -> None:
    """Add ``feather sim compare|validate``."""
    from deploy.bench.validate import DEFAULT_POLICIES as VALIDATE_POLICIES
    from deploy.bench.validate import DEFAULT_WORKLOADS as VALIDATE_WORKLOADS

    sim = tree.group("sim")
    compare = sim.add_parser("compare", help="run one trace under several scheduling policies, side by side")
    add_workloads(compare, "trace file, shared trace name (mooncake, azure-conv) or KIND[:key=value,...]; "
                           "SPEC@START-END takes a time window (e.g. mooncake@0.7-1: the held-out last 30%%)",
                  repeat=False, required=True)
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
    compare.add_argument("--plot", metavar="FILE", help="write a bar chart (PNG) of throughput and TTFT")
    add_json(compare)
    compare.set_defaults(func=compare_command)

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
    validate.add_argument("--max-wait-steps", type=non_negative_int, default=DEFAULT_MAX_WAIT_STEPS,
                          help=f"the admission's waiting-time bound in engine steps (default {DEFAULT_MAX_WAIT_STEPS})")
    validate.add_argument("--max-input-tokens", type=positive_int, default=None, help="cut prompts to this many tokens")
    validate.add_argument("--max-output-tokens", type=positive_int, default=None,
                          help="cut outputs to this many tokens")
    validate.add_argument("--seed", type=non_negative_int, default=0, help="the workload's (first) seed (default 0)")
    validate.add_argument("--seeds", type=positive_int, default=1,
                          help="seeds per workload: --seed, --seed + 1, ... (default 1); a summary over them")
    add_json(validate)
    validate.set_defaults(func=validate_command)


def compare_command(args) -> int:
    import traces
    from feather_gym.compare import compare_policies, format_comparison, hybrid_configs, plot_comparison
    from feather_gym.costmodel import hardware_profile, load_cost_model
    from feather_gym.costmodel.model import HYBRID_CPU_PROFILE
    from feather_gym.simulator import EngineConfig

    names = parse_policies(args.policies)
    label, spec = split_workload(args.workload)
    trace = traces.resolve_workload(spec, seed=args.seed)
    if args.max_requests is not None:
        trace = traces.Trace(trace.name, trace.requests[:args.max_requests], trace.source, trace.block_size)
    cost_model = load_cost_model(args.profile or (hardware_profile() if args.model is None else HYBRID_CPU_PROFILE))
    if args.model is None:
        results = compare_policies(trace, cost_model, names, EngineConfig(kv_capacity_tokens=args.kv_tokens))
    else:
        configs, description = hybrid_configs(args.model, placements=parse_policies(args.placements),
                                              max_states=args.max_states, anchor_pages=args.anchor_pages,
                                              kv_tokens=args.kv_tokens)
        print(description)
        results = {f"{name}@{placement}": metrics for placement, config in configs.items()
                   for name, metrics in compare_policies(trace, cost_model, names, config).items()}
    print(f"workload {label} ({len(trace)} requests arriving over {trace.duration_s:.3f} s), "
          f"profile {cost_model.name}; queue = arrival to first scheduling")
    print(format_comparison(results))
    if args.plot:
        plot_comparison(results, args.plot, title=f"{label} on {cost_model.name}")
        print(f"wrote {args.plot}")
    if args.json:
        print(json.dumps({"workload": label, "spec": spec, "profile": cost_model.name, "requests": len(trace),
                          "arrival_span_s": trace.duration_s, "policies": results}))
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
