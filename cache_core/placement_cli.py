"""``feather placement eval`` and ``feather bench placement`` (provider of feather_gym/cli.py).

* ``feather placement eval --workload SPEC [--budgets 1,2,4,...] [--block-size B]
  [--cache-blocks C] [--decay D] [--resolve-every K] [--seed S] [--model hybrid|DIR]
  [--prefill-profile FILE] [--json] [--plot FILE]``: overlap depths of the workload
  (:func:`traces.stats.overlap_depths`, infinite cache or LRU of ``C`` blocks), then the
  expected recomputed tokens per request of the exact DP (in hindsight and learnt online)
  and of each heuristic at each budget (:func:`cache_core.placement_eval.evaluate_placements`).
  ``--model`` (the trained hybrid, or a model folder) adds the hybrid cache layout: state and
  KV bytes per method, the ``no_cache``/``kv_only`` baselines and the per-length DP;
  ``--prefill-profile`` (written by ``feather profile prefill``) adds the estimated time to
  first token and the time-optimal DP. ``--replay FILE`` (a ``feather replay eval --json``
  report; needs ``--model``) adds SuffixReplay at equal bytes: align grid, DP only, replay only
  and DP plus replay (``--replay-method``, ``--replay-tokens`` pick the measured anchors;
  ``--replay-accounting`` counts bytes on the whole prefix tree or per shared prefix;
  :mod:`cache_core.replay_placement`). ``--plot`` draws the recompute-vs-states frontier as a
  PNG (against state bytes when a layout is given).
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
    evaluate.add_argument("--replay-tokens", type=int, default=16,
                          help="anchors R per anchored layer per page for --replay (default 16)")
    evaluate.add_argument("--replay-accounting", default="tree", choices=("tree", "path"),
                          help="bytes for --replay: on the workload's whole prefix tree (default) or per shared "
                               "prefix path, as the budgets of the other tables")
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
    import numpy as np

    from cache_core.placement_eval import evaluate_placements
    from cache_core.placement_heuristics import default_heuristics, engine_grids
    from traces.stats import overlap_depths
    from traces.workload import resolve_workload

    budgets = parse_budgets(args.budgets)
    if args.block_size is not None and args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    trace = resolve_workload(args.workload, seed=args.seed)
    block_size = args.block_size or trace.block_size or DEFAULT_BLOCK_SIZE
    depths = overlap_depths(trace, block_size=block_size, cache_blocks=args.cache_blocks)
    layout = None if args.model is None else load_layout(args.model)
    replay = None if args.replay is None else load_replay(args)
    prefill = None if args.prefill_profile is None else load_prefill(args.prefill_profile)
    hybrid = layout is not None or prefill is not None
    heuristics = (*default_heuristics(), *engine_grids(block_size)) if hybrid else None
    prompt_tokens = np.array([r.input_len for r in trace]) if hybrid else None
    tree = None
    if replay is not None and args.replay_accounting == "tree":
        from cache_core.replay_placement import hit_tree_copies
        from traces.stats import request_digests

        tree = hit_tree_copies(request_digests(trace, block_size), depths)
    report = {"workload": args.workload, "cache_blocks": args.cache_blocks, "model": args.model,
              **evaluate_placements(depths, block_size=block_size, budgets=budgets, decay=args.decay,
                                   resolve_every=args.resolve_every, prompt_tokens=prompt_tokens,
                                   layout=layout, prefill=prefill, heuristics=heuristics, replay=replay,
                                   tree=tree)}
    if args.plot:
        plot_frontier(report, args.plot)
    print(format_report(report))
    if args.json:
        print(json.dumps(report))
    return 0


def model_folder(model: str):
    """The folder of ``--model``: ``hybrid`` (the trained hybrid's folder, not built here) or a
    model folder; ``ValueError`` unless it holds a ``config.json``."""
    from pathlib import Path

    from feather_gym.hybrid.model import hybrid_dir

    folder = hybrid_dir("trained") if model == "hybrid" else Path(model)
    if not (folder / "config.json").is_file():
        hint = "; build it with `feather hybrid build` or pass --model DIR" if model == "hybrid" else ""
        raise ValueError(f"--model {model}: no model config at {folder / 'config.json'}{hint}")
    return folder


def load_layout(model: str):
    """The :class:`~cache_core.hybrid_layout.HybridCacheLayout` of ``--model`` (:func:`model_folder`)."""
    from cache_core.hybrid_layout import HybridCacheLayout

    return HybridCacheLayout.from_model_dir(model_folder(model))


def load_replay(args):
    """The :class:`~cache_core.replay_placement.ReplayCost` of ``--replay`` for ``--replay-method``
    and ``--replay-tokens``, with the anchor width (hidden size) of ``--model``."""
    from transformers import AutoConfig

    from cache_core.replay_placement import ReplayCost, load_replay_report

    if args.model is None:
        raise ValueError("--replay needs --model (anchor bytes depend on the model's hidden size)")
    hidden = AutoConfig.from_pretrained(model_folder(args.model)).hidden_size
    return ReplayCost.from_replay_report(load_replay_report(args.replay), method=args.replay_method,
                                         replay_tokens=args.replay_tokens, hidden_size=hidden)


#: Prefill-time profiles shipped with the package (``--prefill-profile NAME``), measured on the
#: trained hybrid model on the development machine (see the README).
SHIPPED_PREFILL = {"hybrid-vllm-cpu": "prefill-hybrid-vllm-cpu.json", "hybrid-torch-cpu": "prefill-hybrid-torch-cpu.json"}


def load_prefill(path: str):
    """The :class:`~cache_core.recompute_cost.PrefillTime` of a ``feather profile prefill`` JSON
    file, or of a shipped profile named in :data:`SHIPPED_PREFILL`."""
    from importlib.resources import files
    from pathlib import Path

    from cache_core.recompute_cost import PrefillTime

    if path in SHIPPED_PREFILL and not Path(path).exists():
        path = str(files("feather_gym.costmodel") / "profiles" / SHIPPED_PREFILL[path])
    with open(path) as f:
        data = json.load(f)
    try:
        return PrefillTime.from_dict(data)
    except KeyError as exc:
        raise ValueError(f"--prefill-profile {path}: missing key {exc}; "
                         "write it with `feather profile prefill`") from None


def format_report(report: dict) -> str:
    """The frontier as text tables, one row per budget and one column per method: recomputed
    tokens per request (states used in brackets when under budget), then, when present, the
    recurrent-state MiB per shared prefix and the estimated time to first token."""
    lines = [
        f"workload {report['workload']}: {report['num_requests']} requests, "
        f"block {report['block_size_tokens']} tokens, "
        f"horizon {report['horizon_blocks']} blocks, hit fraction {report['hit_fraction']:.3f}, "
        f"mean overlap {report['mean_overlap_tokens']:.0f} tokens (= recompute with no stored state)",
    ]
    gains = report["dp_gain_vs_best_heuristic_pct"]
    lines += _table(report, "expected recomputed tokens per request [states stored, when fewer than the budget]",
                    lambda m, i, budget: f"{m['expected_recompute_tokens'][i]:.1f}"
                    + (f" [{m['states_stored'][i]}]" if m["states_stored"][i] < budget else ""),
                    ("dp_gain_%", lambda i: f"{gains[i]:.1f}"))
    if "layout" in report:
        layout = report["layout"]
        kv = report["methods"]["kv_only"]["kv_bytes"][0]
        lines.append(f"layout {report.get('model') or 'given'}: {layout['attention_layers']} attention + "
                     f"{layout['linear_layers']} GDN layers, {layout['kv_bytes_per_token']} B KV per token, "
                     f"{layout['state_bytes']} B per checkpoint; KV of the mean overlap {kv / 2**20:.2f} MiB "
                     "per request (every method but no_cache)")
        lines += _table(report, "recurrent state MiB per shared prefix (states stored x state bytes)",
                        lambda m, i, budget: f"{m['state_bytes'][i] / 2**20:.2f}")
    if "prefill" in report:
        p = report["prefill"]
        lines.append(f"prefill {p['fixed_ms']:.2f} ms + {p['ms_per_token'] * 1e3:.3f} us/token "
                     f"+ {p['ms_per_token_squared'] * 1e6:.4f} ns/token^2 (cumulative), mean prompt "
                     f"{report['mean_prompt_tokens']:.0f} tokens")
        lines += _table(report, "estimated time to first token, ms (mean over requests)",
                        lambda m, i, budget: f"{m['ttft_est_ms'][i]:.1f}")
    if "equal_bytes" in report:
        lines += format_equal_bytes(report)
    return "\n".join(lines)


def format_equal_bytes(report: dict) -> list[str]:
    """The ``equal_bytes`` section: per budget (bytes = budget x checkpoint bytes) and
    configuration, recomputed tokens [exact states + anchor entries], estimated TTFT and the
    fraction of requests resumed from a replayed state."""
    section = report["equal_bytes"]
    r = section["replay"]
    quality = ("" if r["kl_nats"] is None else
               f", measured at p = {r['quality_prefix_tokens']}: KL {r['kl_nats']:.1e} nats, "
               f"perplexity ratio {r['ppl_ratio']:.4f}")
    view = {"budgets": report["budgets"], "methods": section["configs"]}
    where = ("per shared prefix" if section["accounting"] == "path" else
             f"on the whole prefix tree ({section['families']} families, {section['cached_pages']} pages hit)")
    lines = [f"SuffixReplay at equal bytes {where} (budget x {report['layout']['state_bytes']} B): "
             f"{r['method']} anchors, R = {r['replay_tokens']} at layers {r['anchored_layers']}, "
             f"{r['entry_bytes']} B per page, rebuild {r['rebuild_ms']:.1f} ms{quality}"]
    lines += _table(view, "bytes per cached token", lambda m, i, budget: f"{m['bytes_per_cached_token'][i]:.1f}")
    lines += _table(view, "expected recomputed tokens per request [exact states + anchors, tree nodes]",
                    lambda m, i, budget: f"{m['expected_recompute_tokens'][i]:.0f} "
                                         f"[{m['state_copies'][i]}+{m['anchor_copies'][i]}]")
    if "prefill" in report:
        lines += _table(view, "estimated time to first token, ms (rebuild included)",
                        lambda m, i, budget: f"{m['ttft_est_ms'][i]:.1f}")
    lines += _table(view, "fraction of requests resumed from a replayed state",
                    lambda m, i, budget: f"{m['replay_hit_fraction'][i]:.3f}")
    return lines


def _table(report: dict, title: str, cell, extra=None) -> list[str]:
    """``title`` then a right-aligned table: ``cell(method_row, i, budget)`` per budget and
    method, plus an optional ``(header, cell(i))`` last column."""
    header = ["budget", *report["methods"], *([extra[0]] if extra else [])]
    rows = [[str(budget), *(cell(m, i, budget) for m in report["methods"].values()),
             *([extra[1](i)] if extra else [])] for i, budget in enumerate(report["budgets"])]
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    return [title, *("  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in [header, *rows])]


def plot_frontier(report: dict, path: str) -> None:
    """Expected recompute vs states stored (state bytes when the report has a layout), one line
    per method; methods that store no state (``kv_only``, ``no_cache``) as one dashed level (PNG, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key = "state_bytes" if "layout" in report else "states_stored"
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = iter(plt.get_cmap("tab20").colors)         # one distinct colour per method (up to 20)
    stateless = []
    for name, method in report["methods"].items():
        points = sorted({(s, r) for s, r in zip(method[x_key], method["expected_recompute_tokens"]) if s > 0})
        if points:
            ax.plot(*zip(*points), marker="o" if name == "dp" else ".", linewidth=2.5 if name == "dp" else 1,
                    color=next(colors), label=name)
        else:
            stateless.append(name)
    if stateless:
        ax.axhline(report["mean_overlap_tokens"], color="gray", linestyle="--",
                   label=f"no state ({', '.join(stateless)})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("recurrent state bytes per shared prefix" if x_key == "state_bytes" else "states stored per prefix")
    ax.set_ylabel("expected recomputed tokens per request")
    ax.set_title(f"{report['workload']} (block {report['block_size_tokens']} tokens)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
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
