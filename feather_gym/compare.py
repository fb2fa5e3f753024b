"""Policies side by side on one trace in the simulator: the report of ``feather sim compare``.

Every comparison reports its load regime (``arrival_span_s``, ``queue_delay_*`` of
``SimResult.metrics``), since ratios mean different things in different regimes: when the makespan
is close to the arrival span the engine keeps up and every policy finishes with the last arrival;
when it is much longer, requests queue and the order of admission decides the throughput."""

from __future__ import annotations

import time
from pathlib import Path

from feather_gym.policies import DEFAULT_MAX_WAIT_STEPS

DEFAULT_POLICIES = "fcfs,lpm,dfs,hrrn,feather-rule,group-label"


def compare_policies(trace, cost_model, policy_names: list[str], config=None) -> dict[str, dict]:
    """``SimResult.metrics()`` of each policy on ``trace`` plus ``ratio_to_fcfs`` (throughput over
    FCFS's; FCFS is run as well when not listed). Runs share one hashing. ``config``: the
    simulator's :class:`~feather_gym.simulator.EngineConfig` (default: the profile's engine)."""
    from feather_gym.policies import make_policy
    from feather_gym.simulator import EngineConfig, simulate, trace_digests

    config = config or EngineConfig()
    digests = trace_digests(trace, config.resolve(cost_model).block_size)
    results = {}
    for name in dict.fromkeys(["fcfs", *policy_names]):
        start = time.perf_counter()
        results[name] = simulate(trace, cost_model, make_policy(name), config=config, digests=digests).metrics()
        results[name]["wall_s"] = time.perf_counter() - start
    fcfs = results["fcfs"]["throughput_tok_s"]
    for metrics in results.values():
        metrics["ratio_to_fcfs"] = metrics["throughput_tok_s"] / fcfs
    return {name: results[name] for name in policy_names}


def hybrid_configs(model: str, *, placements: list[str], max_states: int, anchor_pages: int,
                   kv_tokens: int | None, max_wait_steps: int = DEFAULT_MAX_WAIT_STEPS) -> tuple[dict, str]:
    """``({placement: EngineConfig}, description)`` of a hybrid model (``hybrid`` or ``trained`` = the
    trained one, ``tiny``, or a local model folder, :func:`~feather_gym.hybrid.model.resolve_model`);
    the layout needs the model's config only, not its weights."""
    from cache_core.hybrid.layout import HybridCacheLayout
    from feather_gym.hybrid.model import SPECS, is_built, resolve_model
    from feather_gym.hybrid.state_keeping import HybridSimConfig
    from feather_gym.simulator import EngineConfig

    kind, folder = resolve_model(model)
    if kind is None or is_built(kind):
        layout = HybridCacheLayout.from_model_dir(folder)
    else:
        layout = HybridCacheLayout.from_hf_config(SPECS[kind][0].config(vocab_size=1))
    state_blocks = HybridSimConfig.state_blocks_for(layout)
    block_size = layout.vllm_block_size()
    description = (f"hybrid model {model}: {layout.attention_layers} attention + {layout.linear_layers} GDN layers, "
                   f"a recurrent state takes {state_blocks} KV blocks, at most {max_states} kept"
                   + (f", anchors on at most {anchor_pages} pages" if anchor_pages else "")
                   + f"\n  engine block {block_size} tokens (vLLM's choice for this model on CPU)")
    configs = {p: EngineConfig(block_size=block_size, kv_capacity_tokens=kv_tokens, max_wait_steps=max_wait_steps,
                               hybrid=HybridSimConfig(placement=p, max_states=max_states, state_blocks=state_blocks,
                                                      anchor_pages=anchor_pages))
               for p in placements}
    return configs, description


def format_comparison(results: dict[str, dict]) -> str:
    """One row per policy: throughput, ratio to FCFS, makespan, TTFT, TPOT, queueing, preemptions
    (a :func:`traces.table.format_table`, within its width)."""
    from traces.table import format_table

    header = ["policy", "tok/s", "x FCFS", "makespan s", "TTFT s", "TTFT p99 s", "TPOT ms", "queue s",
              "queue p99 s", "max wait s", "preempt"]
    rows = [[Path(name).name, f"{m['throughput_tok_s']:.1f}", f"{m['ratio_to_fcfs']:.2f}", f"{m['makespan_s']:.3f}",
             f"{m['ttft_mean_s']:.3f}", f"{m['ttft_p99_s']:.3f}", f"{m['tpot_mean_ms']:.2f}",
             f"{m['queue_delay_mean_s']:.3f}", f"{m['queue_delay_p99_s']:.3f}", f"{m['longest_wait_s']:.3f}",
             m["preemptions"]] for name, m in results.items()]
    return format_table(header, rows)


def plot_comparison(results: dict[str, dict], path: str, *, title: str) -> None:
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
