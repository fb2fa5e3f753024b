"""``feather sim compare`` (policies side by side on one trace) and ``feather bench env``.

Every comparison reports its load regime (``arrival_span_s``, ``queue_delay_*`` of ``SimResult.metrics``), since ratios mean different
things in different regimes: when the makespan is close to the arrival span the engine keeps up
and every policy finishes with the last arrival; when it is much longer, requests queue and the
order of admission decides the throughput.
"""

from __future__ import annotations

import json
import time

import numpy as np

DEFAULT_POLICIES = "fcfs,lpm,dfs,feather-rule,group-label"


def register(commands) -> None:
    """Add ``sim compare`` and ``bench env`` to the ``feather`` command tree."""
    sim = commands.group("sim", help="serving simulator")
    compare = sim.add_parser("compare", help="run one trace under several scheduling policies, side by side")
    compare.add_argument("--workload", required=True,
                         help="trace file, shared trace name (mooncake, azure-conv) or KIND[:key=value,...]; "
                              "SPEC@START-END takes a time window (e.g. mooncake@0.7-1: the held-out last 30%%)")
    compare.add_argument("--profile", default=None,
                         help="cost-model profile name or file (default: this machine's, hardware_profile())")
    compare.add_argument("--policies", default=DEFAULT_POLICIES,
                         help=f"comma-separated policy names or *.onnx files (default {DEFAULT_POLICIES})")
    compare.add_argument("--seed", type=int, default=0, help="seed of generated workloads")
    compare.add_argument("--max-requests", type=int, default=None,
                         help="simulate only the first N requests of the trace (a truncated window)")
    compare.add_argument("--model", default=None, metavar="hybrid|tiny|DIR",
                         help="simulate a hybrid model's recurrent-state cache: its layout comes from the model's "
                              "config (hybrid = the trained one; no weights needed); step times from --profile, "
                              "by default the trained hybrid's measured vllm-cpu-hybrid")
    compare.add_argument("--placements", default="vllm,dp",
                         help="--model: recurrent-state placements to compare, comma-separated (vllm, dp, grid)")
    compare.add_argument("--max-states", type=int, default=32, help="--model: recurrent states kept at most")
    compare.add_argument("--anchor-pages", type=int, default=0,
                         help="--model: SuffixReplay anchors on at most this many prompt pages (default 0: none)")
    compare.add_argument("--kv-tokens", type=int, default=None,
                         help="KV-cache capacity in tokens, the state reserve included (default: the profile's)")
    compare.add_argument("--plot", metavar="FILE", help="write a bar chart (PNG) of throughput and TTFT")
    compare.add_argument("--json", action="store_true", help="one JSON object on the last line")
    compare.set_defaults(func=_compare)

    bench = commands.group("bench", help="benchmarks")
    env = bench.add_parser("env", help="steps per second of the Feather gym env (one core)")
    env.add_argument("--workload", default=None,
                     help="workload spec of the episodes (default: the first of feather-train's built-in mix for the "
                          "profile's device, in that mix's KV capacity)")
    env.add_argument("--profile", default=None, help="cost-model profile name or file (default: this machine's)")
    env.add_argument("--steps", type=int, default=20_000, help="steps per measured pass")
    env.add_argument("--json", action="store_true")
    env.set_defaults(func=_bench_env)


def compare_policies(trace, cost_model, policy_names: list[str], config=None) -> dict[str, dict]:
    """``SimResult.metrics()`` of each policy on ``trace`` plus ``ratio_to_fcfs`` (throughput over
    FCFS's; FCFS is run as well when not listed). Runs share one hashing. ``config``: the
    simulator's :class:`~feather_gym.simulator.EngineConfig` (default: the profile's engine)."""
    from feather_gym.policies import make_policy
    from feather_gym.simulator import EngineConfig, simulate, trace_digests

    config = config or EngineConfig()
    digests = trace_digests(trace, config.block_size or cost_model.block_size)
    results = {}
    for name in dict.fromkeys(["fcfs", *policy_names]):
        start = time.perf_counter()
        results[name] = simulate(trace, cost_model, make_policy(name), config=config, digests=digests).metrics()
        results[name]["wall_s"] = time.perf_counter() - start
    fcfs = results["fcfs"]["throughput_tok_s"]
    for metrics in results.values():
        metrics["ratio_to_fcfs"] = metrics["throughput_tok_s"] / fcfs
    return {name: results[name] for name in policy_names}


def _compare(args) -> int:
    import traces
    from feather_gym.costmodel import hardware_profile, load_cost_model
    from feather_gym.costmodel.model import HYBRID_CPU_PROFILE
    from feather_gym.simulator import EngineConfig

    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    if not names:
        raise ValueError("--policies: give at least one policy")
    trace = traces.resolve_workload(args.workload, seed=args.seed)
    if args.max_requests is not None:
        if args.max_requests < 1:
            raise ValueError("--max-requests must be >= 1")
        trace = traces.Trace(trace.name, trace.requests[:args.max_requests], trace.source, trace.block_size)
    default_profile = hardware_profile() if args.model is None else HYBRID_CPU_PROFILE
    cost_model = load_cost_model(args.profile or default_profile)
    if args.model is None:
        results = compare_policies(trace, cost_model, names, EngineConfig(kv_capacity_tokens=args.kv_tokens))
    else:
        results = {f"{name}@{placement}": metrics for placement, config in hybrid_configs(args).items()
                   for name, metrics in compare_policies(trace, cost_model, names, config).items()}
    header = (f"{'policy':<22}{'tok/s':>10}{'x FCFS':>8}{'makespan s':>12}{'TTFT mean s':>13}{'TTFT p99 s':>12}"
              f"{'TPOT ms':>9}{'queue mean s':>14}{'queue p99 s':>13}{'max wait s':>12}{'preempt':>9}")
    print(f"workload {args.workload} ({len(trace)} requests arriving over {trace.duration_s:.3f} s), "
          f"profile {cost_model.name}; queue = arrival to first scheduling")
    print(header)
    for name, m in results.items():
        print(f"{name[-22:]:<22}{m['throughput_tok_s']:>10.1f}{m['ratio_to_fcfs']:>8.2f}{m['makespan_s']:>12.3f}"
              f"{m['ttft_mean_s']:>13.3f}{m['ttft_p99_s']:>12.3f}{m['tpot_mean_ms']:>9.2f}"
              f"{m['queue_delay_mean_s']:>14.3f}{m['queue_delay_p99_s']:>13.3f}{m['longest_wait_s']:>12.3f}"
              f"{m['preemptions']:>9d}")
    if args.plot:
        _plot(results, args.plot, title=f"{args.workload} on {cost_model.name}")
        print(f"wrote {args.plot}")
    if args.json:
        print(json.dumps({"workload": args.workload, "profile": cost_model.name, "requests": len(trace),
                          "arrival_span_s": trace.duration_s, "policies": results}))
    return 0


def hybrid_configs(args) -> dict:
    """``{placement: EngineConfig}`` of ``--model``/``--placements``/``--max-states``/``--anchor-pages``;
    prints the layout."""
    from cache_core.hybrid_layout import HybridCacheLayout
    from feather_gym.hybrid.model import SPECS, hybrid_dir, is_built
    from feather_gym.hybrid.state_keeping import HybridSimConfig
    from feather_gym.simulator import EngineConfig

    kind = {"hybrid": "trained", "tiny": "tiny"}.get(args.model)
    if kind is None:
        layout = HybridCacheLayout.from_model_dir(args.model)
    elif is_built(kind):
        layout = HybridCacheLayout.from_model_dir(hybrid_dir(kind))
    else:                                          # the layout needs the config only, not the weights
        layout = HybridCacheLayout.from_hf_config(SPECS[kind][0].config(vocab_size=1))
    state_blocks = HybridSimConfig.state_blocks_for(layout)
    placements = [p.strip() for p in args.placements.split(",") if p.strip()]
    print(f"hybrid model {args.model}: {layout.attention_layers} attention + {layout.linear_layers} GDN layers, "
          f"a recurrent state takes {state_blocks} KV blocks, at most {args.max_states} kept"
          + (f", anchors on at most {args.anchor_pages} pages" if args.anchor_pages else ""))
    block_size = layout.vllm_block_size()
    print(f"  engine block {block_size} tokens (vLLM's choice for this model on CPU)")
    return {p: EngineConfig(block_size=block_size, kv_capacity_tokens=args.kv_tokens,
                            hybrid=HybridSimConfig(placement=p, max_states=args.max_states, state_blocks=state_blocks,
                                                   anchor_pages=args.anchor_pages))
            for p in placements}


def _plot(results: dict[str, dict], path: str, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(2 + 1.6 * len(names), 4))
    left.bar(names, [results[n]["throughput_tok_s"] for n in names], color="tab:blue")
    left.set_ylabel("throughput (output tokens/s)")
    right.bar(names, [results[n]["ttft_mean_s"] for n in names], color="tab:orange")
    right.set_ylabel("mean TTFT (s)")
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bench_env(args) -> int:
    import gymnasium as gym

    from feather_gym.costmodel import hardware_profile
    from feather_gym.envs import ENV_ID
    from trainer.config import profile_mix

    args.profile = args.profile or hardware_profile()
    kv_capacity_tokens = None
    if args.workload is None:   # the generators' own sizes leave a CPU engine no decision to make
        mix = profile_mix(args.profile)
        args.workload, kv_capacity_tokens = mix.workloads[0], mix.kv_capacity_tokens
    env = gym.make(ENV_ID, workloads=[args.workload], profile=args.profile, seed=0,
                   kv_capacity_tokens=kv_capacity_tokens)
    rng = np.random.default_rng(0)

    def run(steps: int) -> tuple[float, float, int]:
        """(steps per wall second, steps per CPU second of this process, episodes)."""
        env.reset(seed=0)
        episodes, wall, cpu = 0, time.perf_counter(), time.process_time()
        for _ in range(steps):
            _, _, terminated, _, _ = env.step(int(rng.random() < 0.8))
            if terminated:
                episodes += 1
                env.reset()
        return steps / (time.perf_counter() - wall), steps / (time.process_time() - cpu), episodes

    cold, cold_cpu, episodes = run(args.steps)   # builds every window and its FCFS baseline on first use
    warm, warm_cpu, _ = run(args.steps)          # the same episodes again: the steady state of training
    print(f"env {ENV_ID} on {args.workload} ({args.profile}), {episodes} episodes in {args.steps} steps:")
    print(f"  first pass (window building included): {cold:,.0f} steps/s wall, {cold_cpu:,.0f} per CPU second")
    print(f"  warm (training steady state):          {warm:,.0f} steps/s wall, {warm_cpu:,.0f} per CPU second")
    if args.json:
        print(json.dumps({"env_id": ENV_ID, "workload": args.workload, "profile": args.profile,
                          "kv_capacity_tokens": kv_capacity_tokens,
                          "steps": args.steps, "episodes": episodes, "steps_per_s_cold": cold,
                          "steps_per_s_warm": warm, "steps_per_cpu_s_cold": cold_cpu,
                          "steps_per_cpu_s_warm": warm_cpu}))
    return 0
