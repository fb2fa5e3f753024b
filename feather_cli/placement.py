"""``feather placement eval`` and ``feather bench placement`` .

* ``feather placement eval --workload SPEC [--budgets 1,2,4,...] [--block-size B]
  [--cache-blocks C] [--decay D] [--resolve-every K] [--seed S] [--model hybrid|DIR]
  [--prefill-profile FILE] [--json] [--plot FILE]``: overlap depths of the workload
  (:func:`traces.stats.overlap_depths`, infinite cache or LRU of ``C`` blocks), then the
  expected recomputed tokens per request of the exact DP (in hindsight and learnt online)
  and of each heuristic at each budget (:func:`cache_core.hybrid.placement_eval.evaluate_placements`).
  ``--model`` (the trained hybrid, or a model folder) adds the hybrid cache layout: state and
  KV bytes per method, the ``no_cache``/``kv_only`` baselines and the per-length DP;
  ``--prefill-profile`` (written by ``feather profile prefill``) adds the estimated time to
  first token and the time-optimal DP. ``--replay FILE`` (a ``feather replay eval --json``
  report; needs ``--model``) adds SuffixReplay at equal bytes: align grid, DP only, replay only
  and DP plus replay (``--replay-method``, ``--replay-tokens`` pick the measured anchors;
  ``--replay-accounting`` counts bytes on the whole prefix tree or per shared prefix;
  :mod:`cache_core.hybrid.replay_placement`). ``--plot`` draws the recompute-vs-states frontier as a
  PNG (against state bytes when a layout is given).
* ``feather bench placement [--positions N] [--budget M] [--repeats R] [--oracle-budget K]
  [--json]``: the exact solver against the ``O(M N^2)`` oracle in the same run.
"""

from __future__ import annotations

import json

from cache_core.hybrid.placement_eval import DEFAULT_BLOCK_SIZE, DEFAULT_BUDGETS
from feather_cli.options import add_json, fraction, int_list_type, non_negative_int, positive_int


def register(tree) -> None:
    """Add ``feather placement eval`` and ``feather bench placement``."""
    placement = tree.group("placement")
    evaluate = placement.add_parser("eval", help="recompute vs states stored: exact DP and heuristics on a workload")
    evaluate.add_argument("--workload", required=True, metavar="GEN_OR_FILE",
                          help="trace file, shared trace (mooncake, azure-conv) or KIND[:key=value,...]")
    evaluate.add_argument("--budgets", type=int_list_type(0), default=",".join(map(str, DEFAULT_BUDGETS)),
                          help="comma-separated checkpoint budgets (default 1,2,4,...,256)")
    evaluate.add_argument("--block-size", type=positive_int, default=None,
                          help=f"block size in tokens (default: the trace's own block size, else {DEFAULT_BLOCK_SIZE})")
    evaluate.add_argument("--cache-blocks", type=positive_int, default=None,
                          help="LRU prefix cache capacity in blocks for the overlap depths (default: infinite)")
    evaluate.add_argument("--decay", type=fraction, default=0.999,
                          help="online estimator: per-observation decay of the depth histogram (default 0.999)")
    evaluate.add_argument("--resolve-every", type=positive_int, default=64,
                          help="online estimator: re-solve after this many requests (default 64)")
    evaluate.add_argument("--seed", type=non_negative_int, default=0, help="generator seed (default 0)")
    evaluate.add_argument("--model", metavar="hybrid|DIR", default=None,
                          help="hybrid model whose config gives the cache layout (state and KV bytes): "
                               "'hybrid' for the trained one, or a model folder")
    evaluate.add_argument("--prefill-profile", metavar="FILE", default=None,
                          help="prefill-time JSON of `feather profile prefill`, or a shipped one (hybrid-vllm-cpu, "
                               "hybrid-torch-cpu): adds estimated TTFT and dp_time")
    evaluate.add_argument("--replay", metavar="FILE", default=None,
                          help="`feather replay eval --json` output (needs --model): adds align grid, DP, "
                               "SuffixReplay and DP + SuffixReplay at equal bytes")
    evaluate.add_argument("--replay-method", default="uniform", choices=("uniform", "layerwise"),
                          help="which measured anchors --replay uses (default uniform: every GDN layer)")
    evaluate.add_argument("--replay-tokens", type=positive_int, default=16,
                          help="anchors R per anchored layer per page for --replay (default 16)")
    evaluate.add_argument("--replay-accounting", default="tree", choices=("tree", "path"),
                          help="bytes for --replay: on the workload's whole prefix tree (default) or per shared "
                               "prefix path, as the budgets of the other tables")
    add_json(evaluate)
    evaluate.add_argument("--plot", metavar="FILE", help="write the Pareto plot as a PNG")
    evaluate.set_defaults(func=eval_command)

    bench = tree.group("bench")
    solver = bench.add_parser("placement", help="exact placement solver vs the O(M N^2) oracle (same run)")
    solver.add_argument("--positions", type=positive_int, default=4096, help="horizon N in blocks (default 4096)")
    solver.add_argument("--budget", type=positive_int, default=256, help="checkpoint budget M (default 256)")
    solver.add_argument("--repeats", type=positive_int, default=5, help="timed runs of the fast solver (default 5)")
    solver.add_argument("--oracle-budget", type=positive_int, default=None,
                        help="time the oracle at this many layers and extrapolate linearly (default: the full budget)")
    solver.add_argument("--seed", type=non_negative_int, default=0)
    add_json(solver)
    solver.set_defaults(func=bench_command)


def eval_command(args) -> int:
    from cache_core.hybrid.placement_eval import evaluate_workload
    from cache_core.hybrid.placement_report import format_report, plot_frontier
    from feather_gym.hybrid.placement_inputs import load_layout, load_prefill, load_replay
    from traces.workload import resolve_workload

    report = {"workload": args.workload, "cache_blocks": args.cache_blocks, "model": args.model,
              **evaluate_workload(resolve_workload(args.workload, seed=args.seed), block_size=args.block_size,
                                  cache_blocks=args.cache_blocks, budgets=args.budgets,
                                  decay=args.decay, resolve_every=args.resolve_every,
                                  layout=None if args.model is None else load_layout(args.model),
                                  prefill=None if args.prefill_profile is None else load_prefill(args.prefill_profile),
                                  replay=None if args.replay is None else load_replay(
                                      args.replay, args.model, method=args.replay_method,
                                      replay_tokens=args.replay_tokens),
                                  replay_accounting=args.replay_accounting)}
    if args.plot:
        plot_frontier(report, args.plot)
    print(format_report(report))
    if args.json:
        print(json.dumps(report))
    return 0


def bench_command(args) -> int:
    from cache_core.hybrid.placement_eval import benchmark_solver

    report = benchmark_solver(num_positions=args.positions, budget=args.budget, repeats=args.repeats,
                              oracle_budget=args.oracle_budget, seed=args.seed)
    suffix = "" if "oracle_ms" in report else "_extrapolated"
    print(f"N={report['num_positions']} M={report['budget']} (Dirichlet(1), all budgets 0..M in one run)")
    print(f"  fast solver  wall p50 {report['fast_ms_p50']:.1f} ms (min {report['fast_ms_min']:.1f}), "
          f"CPU p50 {report['fast_cpu_ms_p50']:.1f} ms")
    print(f"  oracle       wall {report['oracle_ms' + suffix]:.0f} ms, CPU {report['oracle_cpu_ms' + suffix]:.0f} ms"
          + (f" (timed at {report['oracle_budget_timed']} layers, scaled to {report['budget']})" if suffix else ""))
    print(f"  speedup      {report['speedup_x']:.0f}x wall, {report['speedup_cpu_x']:.0f}x CPU; "
          f"max relative cost difference {report['max_cost_rel_diff']:.1e}")
    print("  other shapes " + ", ".join(f"{k} {v:.1f} ms" for k, v in report["fast_ms_by_shape"].items()))
    if args.json:
        print(json.dumps(report))
    return 0
