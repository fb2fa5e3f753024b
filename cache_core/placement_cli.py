"""``feather placement eval`` and ``feather bench placement`` (provider of feather_gym/cli.py).

* ``feather placement eval --workload SPEC [--budgets 1,2,4,...] [--block-size B]
  [--cache-blocks C] [--decay D] [--resolve-every K] [--seed S] [--json] [--plot FILE]``:
  overlap depths of the workload (:func:`traces.stats.overlap_depths`, infinite cache or
  LRU of ``C`` blocks), then the expected recomputed tokens per request of the exact DP (in
  hindsight and learnt online) and of each heuristic at each budget
  (:func:`cache_core.placement_eval.evaluate_placements`); ``--plot`` draws the
  recompute-vs-states frontier as a PNG.
* ``feather bench placement [--positions N] [--budget M] [--repeats R] [--oracle-budget K]
  [--json]``: the exact solver against the ``O(M N^2)`` oracle in the same run.
"""

from __future__ import annotations

import json

#: Budgets of the evaluation unless --budgets is given: 1, 2, 4, ..., 256.
DEFAULT_BUDGETS = tuple(2**i for i in range(9))
#: Block size for traces that carry token ids (a trace with block ids uses its own).
DEFAULT_BLOCK_SIZE = 16


def register(commands) -> None:
    """Add ``feather placement eval`` and ``feather bench placement``."""
    placement = commands.group("placement", help="checkpoint placement for recurrent-state prefix caching")
    evaluate = placement.add_parser("eval", help="recompute vs states stored: exact DP and heuristics on a workload")
    evaluate.add_argument("--workload", required=True, metavar="GEN_OR_FILE",
                          help="trace file, shared trace (mooncake, azure-conv) or KIND[:key=value,...]")
    evaluate.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)),
                          help="comma-separated checkpoint budgets (default 1,2,4,...,256)")
    evaluate.add_argument("--block-size", type=int, default=None,
                          help=f"block size in tokens (default: the trace's own block size, else {DEFAULT_BLOCK_SIZE})")
    evaluate.add_argument("--cache-blocks", type=int, default=None,
                          help="LRU prefix cache capacity in blocks for the overlap depths (default: infinite)")
    evaluate.add_argument("--decay", type=float, default=0.999,
                          help="online estimator: per-observation decay of the depth histogram (default 0.999)")
    evaluate.add_argument("--resolve-every", type=int, default=64,
                          help="online estimator: re-solve after this many requests (default 64)")
    evaluate.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    evaluate.add_argument("--plot", metavar="FILE", help="write the Pareto plot as a PNG")
    evaluate.set_defaults(func=eval_command)

    bench = commands.group("bench", help="benchmarks, each comparing implementations side by side")
    solver = bench.add_parser("placement", help="exact placement solver vs the O(M N^2) oracle (same run)")
    solver.add_argument("--positions", type=int, default=4096, help="horizon N in blocks (default 4096)")
    solver.add_argument("--budget", type=int, default=256, help="checkpoint budget M (default 256)")
    solver.add_argument("--repeats", type=int, default=5, help="timed runs of the fast solver (default 5)")
    solver.add_argument("--oracle-budget", type=int, default=None,
                        help="time the oracle at this many layers and extrapolate linearly (default: the full budget)")
    solver.add_argument("--seed", type=int, default=0)
    solver.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    solver.set_defaults(func=bench_command)


def parse_budgets(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; ``ValueError`` for anything but non-negative integers."""
    try:
        budgets = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--budgets expects comma-separated integers, got {text!r}") from None
    if not budgets or min(budgets) < 0:
        raise ValueError(f"--budgets expects non-negative integers, got {text!r}")
    return budgets


def eval_command(args) -> int:
    from cache_core.placement_eval import evaluate_placements
    from traces.stats import overlap_depths
    from traces.workload import resolve_workload

    budgets = parse_budgets(args.budgets)
    if args.block_size is not None and args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    trace = resolve_workload(args.workload, seed=args.seed)
    block_size = args.block_size or trace.block_size or DEFAULT_BLOCK_SIZE
    depths = overlap_depths(trace, block_size=block_size, cache_blocks=args.cache_blocks)
    report = {"workload": args.workload, "cache_blocks": args.cache_blocks,
              **evaluate_placements(depths, block_size=block_size, budgets=budgets, decay=args.decay,
                                   resolve_every=args.resolve_every)}
    if args.plot:
        plot_frontier(report, args.plot)
    print(format_report(report))
    if args.json:
        print(json.dumps(report))
    return 0


def format_report(report: dict) -> str:
    """The frontier as a text table: recomputed tokens per request, states used in brackets when under budget."""
    methods = report["methods"]
    lines = [
        f"workload {report['workload']}: {report['num_requests']} requests, "
        f"block {report['block_size_tokens']} tokens, "
        f"horizon {report['horizon_blocks']} blocks, hit fraction {report['hit_fraction']:.3f}, "
        f"mean overlap {report['mean_overlap_tokens']:.0f} tokens (= recompute with no stored state)",
        "expected recomputed tokens per request [states stored, when fewer than the budget]",
    ]
    header = ["budget", *methods, "dp_gain_%"]
    rows = []
    for i, budget in enumerate(report["budgets"]):
        cells = [str(budget)]
        for method in methods.values():
            value, states = method["expected_recompute_tokens"][i], method["states_stored"][i]
            cells.append(f"{value:.1f}" + (f" [{states}]" if states < budget else ""))
        rows.append([*cells, f"{report['dp_gain_vs_best_heuristic_pct'][i]:.1f}"])
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in [header, *rows]]
    return "\n".join(lines)


def plot_frontier(report: dict, path: str) -> None:
    """Expected recompute vs states stored, one line per method (PNG, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, method in report["methods"].items():
        points = sorted({(s, r) for s, r in zip(method["states_stored"], method["expected_recompute_tokens"]) if s > 0})
        if points:
            ax.plot(*zip(*points), marker="o" if name == "dp" else ".", linewidth=2 if name == "dp" else 1, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("states stored per prefix")
    ax.set_ylabel("expected recomputed tokens per request")
    ax.set_title(f"{report['workload']} (block {report['block_size_tokens']} tokens)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench_command(args) -> int:
    from cache_core.placement_eval import benchmark_solver

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
