"""The text tables and the Pareto plot of a placement report
(:func:`cache_core.hybrid.placement_eval.evaluate_workload`)."""

from __future__ import annotations

from traces.workload import workload_label


def format_report(report: dict) -> str:
    """The frontier as text tables, one row per budget and one column per method: recomputed
    tokens per request (states used in brackets when under budget), then, when present, the
    recurrent-state MiB per shared prefix and the estimated time to first token."""
    lines = [
        f"workload {workload_label(report['workload'])}: {report['num_requests']} requests, "
        f"block {report['block_size_tokens']} tokens, "
        f"horizon {report['horizon_blocks']} blocks",
        f"  hit fraction {report['hit_fraction']:.3f}, "
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
                     f"{layout['state_bytes']} B per checkpoint")
        lines.append(f"  KV of the mean overlap {kv / 2**20:.2f} MiB per request (every method but no_cache)")
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
    """``title`` then a right-aligned :func:`traces.table.format_table`: ``cell(method_row, i, budget)``
    per budget and method, plus an optional ``(header, cell(i))`` last column."""
    from traces.table import format_table

    header = ["budget", *report["methods"], *([extra[0]] if extra else [])]
    rows = [[str(budget), *(cell(m, i, budget) for m in report["methods"].values()),
             *([extra[1](i)] if extra else [])] for i, budget in enumerate(report["budgets"])]
    return [title, format_table(header, rows, align="r" * len(header))]


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
