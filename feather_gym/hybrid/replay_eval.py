"""``feather replay eval`` (provider of feather_cli/main.py): SuffixReplay on the hybrid model.

``feather replay eval [--model trained|remember|tiny|DIR] [--page 256] [--prefix-tokens 1024,2048]
[--replay-tokens 16,32,64,128,256] [--continuation-tokens 64] [--samples 4] [--needles 8]
[--time-prefix-tokens 4096,16384,32768] [--anchor-dtype bfloat16] [--workload SPEC] [--threads N]
[--seed 0] [--json]``

On windows of the corpus's held-out tail (text the model was not trained on), float32 model;
anchors are stored and read back in ``--anchor-dtype`` (bfloat16 by default) before replay:

* (a) ``quality``: relative Frobenius error of every GDN layer's recurrent (and conv) state
  rebuilt at the page boundary ``p`` (= the prefix length) against the exact one, by method,
  ``R`` and layer;
* (b) ``quality``: over the ``--continuation-tokens`` tokens after ``p`` (exact attention KV,
  replayed GDN states; :func:`feather_gym.hybrid.suffix_replay.continuation_logits`): mean next-token
  KL(exact || replayed) in nats, the perplexity ratio replayed/exact and top-1 agreement;
  ``needle``: a key-value needle ("The secret number for NAME is NNNNNN.") inside the last
  tokens before ``p`` or before every replay window, then the query after ``p``; a needle counts
  when every digit is the top-1 prediction (teacher forced, i.e. greedy decoding would produce
  it), for the exact states and the replayed ones side by side, with the per-digit accuracy and
  mean log-probability of the true digits (nats);
* (c) ``storage``: bytes per cached token of the anchors against exact checkpoints every 8,192
  tokens and every 256-token block (:class:`cache_core.hybrid.layout.HybridCacheLayout`), and,
  on the overlap depths of ``--workload`` at page-sized blocks, the tokens each recomputes per
  request beside the exact DP placement given the anchors' bytes per cached token, bytes
  counted on the workload's prefix tree (:func:`cache_core.hybrid.replay_placement.storage_on_workload`);
* (d) ``timing``: wall time to rebuild every GDN state by replay against recomputing the
  prefix (a full forward; the KV hit is not credited to it).

Methods: ``uniform`` (every GDN layer, ``R`` anchors each), ``decay`` (the same total budget
split by each layer's measured memory length, :func:`feather_gym.hybrid.suffix_replay.memory_lengths`),
``layerwise`` (residual-stream anchors at the first GDN layer after each attention layer; the
layers below the lowest one start from the suffix's token embeddings, which cost no anchor bytes
since the token ids are known; the layers in between are replayed through the decoder layers)
and ``suffix`` (no anchors: the last ``R`` tokens recomputed through the whole model from their
embeddings). In both, attention layers crossed by the replay attend over the suffix only.
``zero`` (every GDN state zero, R = 0) is the floor: how much the states matter at all.
``--json`` prints one object on the last line.
"""

from __future__ import annotations

import time

#: The branching workload of the storage comparison unless --workload is given.
DEFAULT_WORKLOAD = "long-doc-qa:num_requests=200"

NAMES = ("Anna", "Boris", "Clara", "Dmitri", "Elena", "Fyodor", "Galina", "Igor", "Katya", "Leonid",
         "Marina", "Nikolai", "Olga", "Pavel", "Rosa", "Sergei")


def evaluate(model_kind: str, *, page: int, prefixes: list[int], replay_tokens: list[int], continuation: int,
             samples: int, needles: int, time_prefixes: list[int], anchor_dtype: str = "bfloat16",
             workload: str = "", threads: int | None = None, seed: int = 0) -> dict:
    """The whole report (see the module docstring); every key carries its unit."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from cache_core.hybrid.anchor_store import DTYPES
    from cache_core.hybrid.layout import HybridCacheLayout
    from feather_gym.hybrid import suffix_replay as sr
    from feather_gym.hybrid.model import heldout_start, load_model
    from traces.text import corpus_token_ids

    if anchor_dtype not in DTYPES:
        raise ValueError(f"unknown --anchor-dtype {anchor_dtype!r}; choose from {sorted(DTYPES)}")
    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    model = load_model(model_kind)
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    ids = corpus_token_ids(tokenizer)
    tail = ids[heldout_start(ids.size):]
    config = model.config
    gdn = sorted(sr.gdn_modules(model))
    layer_anchored = sr.layerwise_anchor_layers(config.layer_types)
    rng = np.random.default_rng(seed)
    methods = _methods(sr, gdn, layer_anchored, config.linear_conv_kernel_dim, anchor_dtype, page)

    quality, last_run = [], None
    for p in prefixes:
        window = p + continuation + 1
        if window > tail.size:
            raise ValueError(f"held-out text has {tail.size} tokens; a prefix of {p} + {continuation} does not fit")
        acc = {}
        for start in rng.integers(0, tail.size - window, samples):
            x = tail[start:start + window]
            run = sr.run_prefix(model, x[:p], [p])
            last_run = run
            targets = torch.as_tensor(x[p + 1:p + continuation + 1])
            exact = sr.continuation_logits(model, run.cache, p, run.states[p], x[p:p + continuation])
            for (method, r), (states, per_layer) in _replayed(model, run, p, x, replay_tokens, methods).items():
                logits = sr.continuation_logits(model, run.cache, p, states, x[p:p + continuation])
                row = acc.setdefault((method, r), {"errors": [], "conv": [], "kl": [], "nll": [], "nll_exact": [],
                                                   "top1": [], "per_layer": []})
                row["per_layer"].append(per_layer)
                row["errors"].append([sr.relative_error(states[g].recurrent, run.states[p][g].recurrent) for g in gdn])
                row["conv"].append([sr.relative_error(states[g].conv, run.states[p][g].conv) for g in gdn])
                row["kl"].append(_kl(exact, logits))
                row["nll"].append(torch.nn.functional.cross_entropy(logits, targets).item())
                row["nll_exact"].append(torch.nn.functional.cross_entropy(exact, targets).item())
                row["top1"].append((logits.argmax(-1) == exact.argmax(-1)).float().mean().item())
        for (method, r), row in acc.items():
            errors = np.mean(row["errors"], axis=0)
            quality.append({"prefix_tokens": p, "method": method, "replay_tokens": r,
                            "replay_tokens_by_layer_mean": {str(k): float(np.mean([d[k] for d in row["per_layer"]]))
                                                            for k in row["per_layer"][0]},
                            "anchored_layers": methods[method]["anchored"](r),
                            "state_rel_error_by_layer": {str(g): float(e) for g, e in zip(gdn, errors)},
                            "state_rel_error_mean": float(errors.mean()),
                            "conv_rel_error_mean": float(np.mean(row["conv"])),
                            "kl_nats_mean": float(np.mean(row["kl"])),
                            "ppl_ratio": float(np.exp(np.mean(row["nll"]) - np.mean(row["nll_exact"]))),
                            "ppl_retention": float(np.exp(np.mean(row["nll_exact"]) - np.mean(row["nll"]))),
                            "ppl_exact": float(np.exp(np.mean(row["nll_exact"]))),
                            "top1_agreement": float(np.mean(row["top1"]))})

    layout = HybridCacheLayout.from_hf_config(config)
    anchor_bytes = DTYPES[anchor_dtype].itemsize
    storage = {"anchor_dtype": anchor_dtype, "page_tokens": page,
               "note": "R anchors per anchored layer per page, not shared between pages (R > page overlaps)",
               "state_bytes_per_checkpoint": layout.state_bytes,
               "checkpoint_every_8192_bytes_per_token": layout.state_bytes / 8192,
               "checkpoint_every_256_bytes_per_token": layout.state_bytes / 256,
               "rows": []}
    for method, spec in methods.items():
        for r in spec.get("replay_tokens", replay_tokens):
            per_token = len(methods[method]["anchored"](r)) * r * config.hidden_size * anchor_bytes / page
            storage["rows"].append({"method": method, "replay_tokens": r, "anchor_bytes_per_token": per_token,
                                    "vs_checkpoint_8192": per_token / storage["checkpoint_every_8192_bytes_per_token"],
                                    "vs_checkpoint_256": per_token / storage["checkpoint_every_256_bytes_per_token"]})
    if workload:
        from cache_core.hybrid.replay_placement import hit_tree_copies, storage_on_workload
        from traces.stats import overlap_depths, request_digests
        from traces.workload import resolve_workload

        trace = resolve_workload(workload, seed=seed)
        depths = overlap_depths(trace, block_size=page)
        storage["workload"] = {"spec": workload, "block_size_tokens": page, **storage_on_workload(
            depths, page_tokens=page, state_bytes=layout.state_bytes,
            bytes_per_token=[row["anchor_bytes_per_token"] for row in storage["rows"]],
            **dict(zip(("family", "copies"), hit_tree_copies(request_digests(trace, page), depths))))}
        for row, dp in zip(storage["rows"], storage["workload"].pop("dp_at_equal_bytes")):
            row["dp_states_at_equal_bytes"] = dp["states"]
            row["dp_recompute_tokens_at_equal_bytes"] = dp["expected_recompute_tokens"]
            row["dp_state_copies_at_equal_bytes"] = dp["state_copies"]

    report = {"model": str(model.name_or_path), "dtype": "float32", "anchor_dtype": anchor_dtype, "page_tokens": page,
              "gdn_layers": gdn, "layerwise_anchored_layers": layer_anchored,
              "continuation_tokens": continuation, "samples_per_prefix": samples,
              "torch_threads": torch.get_num_threads(), "quality": quality, "storage": storage,
              "memory_length_tokens_by_layer": {
                  str(k): v for k, v in sr.memory_lengths(model, last_run.gdn_inputs).items()}}
    if needles:
        report["needle"] = _needles(sr, model, tokenizer, tail, rng, page=prefixes[0], count=needles,
                                    replay_tokens=replay_tokens, methods=methods)
    report["timing"] = _timing(sr, model, tail, last_run, prefixes[-1], replay_tokens, time_prefixes, methods)
    report["wall_s"] = time.perf_counter() - started
    return report


def _methods(sr, gdn, layer_anchored, kernel, anchor_dtype: str, page: int) -> dict:
    """Method name -> ``{"replay": f(model, run, p, x, R) -> (states of every GDN layer, R per
    anchored layer), "anchored": g(R) -> the layers that store anchors}`` (and ``"replay_tokens"``
    where the method ignores ``--replay-tokens``). Anchors go through an :class:`AnchorStore` in
    ``anchor_dtype`` (put under the page digest of ``x[0:p]``, then read back), so the quality
    measured is that of the stored anchors."""
    import torch

    from cache_core.hybrid.anchor_store import AnchorStore

    def stored(anchors, p, x):
        sizes = {layer: a.shape[0] for layer, a in anchors.items()}
        store = AnchorStore(sum(sizes.values()) * next(iter(anchors.values())).shape[1] * 4,
                            hidden_size=next(iter(anchors.values())).shape[1], replay_tokens=sizes,
                            page_tokens=page, dtype=anchor_dtype)
        key = store.keys_for(x[:p])[-1]
        store.put(key, anchors)
        return {layer: a.to(torch.float32) for layer, a in store.get(key).items()}

    def uniform(model, run, p, x, r):
        return sr.replay_states(model, stored(run.anchors(p, r), p, x)), dict.fromkeys(gdn, r)

    def decay(model, run, p, x, r):
        weights = sr.memory_lengths(model, {g: run.gdn_inputs[g][:p] for g in gdn})
        per_layer = sr.allocate_replay_tokens(r * len(gdn), weights, minimum=min(kernel, r), maximum=p)
        return sr.replay_states(model, stored(run.anchors(p, per_layer), p, x)), per_layer

    def layerwise(model, run, p, x, r):
        anchors = stored(run.anchors(p, r, residual=True, layers=layer_anchored), p, x) if layer_anchored else {}
        return sr.replay_layerwise(model, anchors, p, suffix_tokens=x[p - r:p]), dict.fromkeys(layer_anchored, r)

    def suffix(model, run, p, x, r):
        return sr.replay_layerwise(model, {}, p, suffix_tokens=x[p - r:p]), {}

    def zero(model, run, p, x, r):
        return {g: sr.GDNState(*map(torch.zeros_like, s)) for g, s in run.states[p].items()}, {}

    return {"uniform": {"replay": uniform, "anchored": lambda r: gdn},
            "decay": {"replay": decay, "anchored": lambda r: gdn},
            "layerwise": {"replay": layerwise, "anchored": lambda r: layer_anchored},
            "suffix": {"replay": suffix, "anchored": lambda r: []},
            "zero": {"replay": zero, "anchored": lambda r: [], "replay_tokens": [0]}}


def _replayed(model, run, p, x, replay_tokens, methods) -> dict:
    """(method, R) -> (rebuilt states of every GDN layer, R per anchored layer), for R <= p."""
    return {(name, r): spec["replay"](model, run, p, x, r) for name, spec in methods.items()
            for r in spec.get("replay_tokens", replay_tokens) if r <= p}


def _kl(exact, approx) -> float:
    """Mean over positions of KL(softmax(exact) || softmax(approx)) in nats."""
    import torch

    log_p, log_q = torch.log_softmax(exact.double(), -1), torch.log_softmax(approx.double(), -1)
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())


def _needles(sr, model, tokenizer, tail, rng, *, page, count, replay_tokens, methods) -> dict:
    """Key-value needle accuracy, exact vs replayed, with the needle inside every replay window
    (it ends 2 tokens before p) or before every one (it ends max(R) + 16 tokens before p)."""
    import numpy as np
    import torch

    encode = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    placements = {"inside": 2, "before": max(replay_tokens) + 16}
    results = {}
    for placement, gap in placements.items():
        scores: dict = {}
        for k in range(count):
            name, number = NAMES[k % len(NAMES)], f"{int(rng.integers(0, 10**6)):06d}"
            needle = encode(f" The secret number for {name} is {number}.")
            query = encode(f" The secret number for {name} is")
            answer = needle[len(query):-1]                         # ' ', then the six digits
            cut = page - len(needle) - gap
            if cut < 0:
                raise ValueError(f"prefix {page} too short for a needle {gap} tokens before the boundary")
            start = int(rng.integers(0, tail.size - page))
            x = np.concatenate([tail[start:start + cut], needle, tail[start + cut:start + cut + gap],
                                query, answer]).astype(np.int64)
            run = sr.run_prefix(model, x[:page], [page])
            follow = x[page:]
            rows = slice(len(query) - 1, len(follow) - 1)          # the rows that predict the answer
            digits = np.asarray(answer[1:])

            def score(states):
                logits = sr.continuation_logits(model, run.cache, page, states, follow)[rows][1:]
                hits = logits.argmax(-1).numpy() == digits
                logprob = torch.log_softmax(logits.double(), -1)[torch.arange(digits.size), digits].mean()
                return [float(hits.all()), float(hits.mean()), float(logprob)]

            scores.setdefault(("exact", 0), []).append(score(run.states[page]))
            for key, (states, _) in _replayed(model, run, page, x, replay_tokens, methods).items():
                scores.setdefault(key, []).append(score(states))
        exact = np.mean(scores.pop(("exact", 0)), axis=0)
        results[placement] = {
            "tokens_between_needle_and_boundary": gap, "needles": count,
            "exact_accuracy": float(exact[0]), "exact_digit_accuracy": float(exact[1]),
            "exact_digit_logprob_nats": float(exact[2]),
            "rows": [dict(zip(("method", "replay_tokens", "accuracy", "digit_accuracy", "digit_logprob_nats"),
                              (m, r, *map(float, np.mean(v, axis=0))))) for (m, r), v in scores.items()]}
    results["prefix_tokens"] = page
    return results


def _timing(sr, model, tail, run, p, replay_tokens, time_prefixes, methods) -> dict:
    """Median wall seconds to rebuild every GDN state by each method (at boundary p of ``run``)
    and single-run seconds of a full forward over each prefix length (logits of the last token only)."""
    import torch

    x = run.token_ids.numpy()
    rebuild = [{"method": name, "replay_tokens": r,
                "rebuild_s": sr.timed(spec["replay"], model, run, p, x, r, repeats=5)[0]}
               for name, spec in methods.items() if name in ("uniform", "layerwise", "suffix")
               for r in replay_tokens if r <= p]
    prefill = []
    with torch.no_grad():
        model(torch.as_tensor(tail[:256])[None], logits_to_keep=1)   # warm-up
        for n in time_prefixes:
            if n > tail.size:
                prefill.append({"prefix_tokens": n, "skipped": f"held-out text has only {tail.size} tokens"})
                continue
            seconds, _ = sr.timed(model, torch.as_tensor(tail[:n])[None], use_cache=True, logits_to_keep=1, repeats=1)
            prefill.append({"prefix_tokens": n, "recompute_s": seconds,
                            "speedup_by_replay_tokens": {str(row["replay_tokens"]): seconds / row["rebuild_s"]
                                                         for row in rebuild if row["method"] == "uniform"}})
    return {"rebuild": rebuild, "prefix_recompute": prefill,
            "note": "rebuild includes an anchor-store put and get (dtype round trip), no device transfer; "
                    "recompute is a full forward over the prefix (its KV hit not credited)",
            "median_of": 5, "rebuild_at_prefix_tokens": p}


def print_report(report: dict) -> None:
    """Human-readable tables of :func:`evaluate`'s report."""
    from traces.workload import workload_label

    print(f"model {report['model']} (float32, {report['torch_threads']} threads), page {report['page_tokens']}, "
          f"GDN layers {report['gdn_layers']}, layer-wise anchors at {report['layerwise_anchored_layers']}")
    print("memory length (tokens to decay 1e-3, slowest head):",
          {k: round(v, 1) for k, v in report["memory_length_tokens_by_layer"].items()})
    print(f"{'p':>6} {'method':>9} {'R':>4} {'state err':>10} {'KL nats':>9} {'ppl ratio':>9} {'top1':>6}"
          "  err by layer")
    for q in report["quality"]:
        layers = " ".join(f"{v:.1e}" for v in q["state_rel_error_by_layer"].values())
        print(f"{q['prefix_tokens']:>6} {q['method']:>9} {q['replay_tokens']:>4} {q['state_rel_error_mean']:>10.2e} "
              f"{q['kl_nats_mean']:>9.2e} {q['ppl_ratio']:>9.4f} {q['top1_agreement']:>6.3f}  {layers}")
    if "needle" in report:
        for placement in ("inside", "before"):
            n = report["needle"][placement]
            print(f"needle {placement} (ends {n['tokens_between_needle_and_boundary']} tokens before p): exact "
                  f"{n['exact_accuracy']:.2f} (digits {n['exact_digit_accuracy']:.2f}, log p/digit "
                  f"{n['exact_digit_logprob_nats']:.2f}); replayed accuracy/digits/log p: " + ", ".join(
                      f"{r['method']} R={r['replay_tokens']} {r['accuracy']:.2f}/{r['digit_accuracy']:.2f}/"
                      f"{r['digit_logprob_nats']:.2f}" for r in n["rows"]))
    s = report["storage"]
    print(f"storage: checkpoint every 8192 tokens {s['checkpoint_every_8192_bytes_per_token']:.1f} B/token, "
          f"every 256 {s['checkpoint_every_256_bytes_per_token']:.1f} B/token")
    w = s.get("workload")
    if w:
        print(f"  on {workload_label(w['spec'])} (page-sized blocks, horizon {w['horizon_blocks']}, "
              f"{w['cached_pages']} pages hit, mean overlap {w['mean_overlap_tokens']:.0f} tokens), "
              "recomputed tokens per request: anchors on every page "
              f"{w['replay_every_page_recompute_tokens']:.0f}, "
              f"ckpt-8192 {w['checkpoint_every_8192_recompute_tokens']:.0f}, "
              f"ckpt-256 {w['checkpoint_every_256_recompute_tokens']:.0f}")
    for row in s["rows"]:
        dp = (f"; DP at equal bytes: {row['dp_states_at_equal_bytes']} depths "
              f"({row['dp_state_copies_at_equal_bytes']} states in the tree), "
              f"{row['dp_recompute_tokens_at_equal_bytes']:.0f} tokens recomputed" if w else "")
        print(f"  {row['method']:>9} R={row['replay_tokens']:>4}: {row['anchor_bytes_per_token']:8.1f} B/token "
              f"({row['vs_checkpoint_8192']:.2f}x ckpt-8192, {row['vs_checkpoint_256']:.3f}x ckpt-256){dp}")
    t = report["timing"]
    for row in t["rebuild"]:
        print(f"  rebuild {row['method']:>9} R={row['replay_tokens']:>4}: {row['rebuild_s'] * 1e3:8.1f} ms")
    for row in t["prefix_recompute"]:
        speedups = ", ".join(f"{v:.0f}x at R={r}" for r, v in row.get("speedup_by_replay_tokens", {}).items())
        print(f"  recompute {row['prefix_tokens']} tokens: "
              + (row.get("skipped") or f"{row['recompute_s']:.2f} s; replay (uniform) is {speedups} faster"))
