"""``feather hybrid build`` and ``feather hybrid check``.

* ``feather hybrid build [--model trained|remember|tiny] [--force] [--json]``: train the hybrid
  model when its folder is absent (or ``--force``), then print its training report (held-out
  perplexity, steps, tokens, minutes, needle accuracy by task and length, the gates' memory per
  layer and head) and its cache layout (KV bytes per token, state bytes).
* ``feather hybrid check [--model ...] [--prompts N] [--max-new-tokens T] [--json]``: greedy
  agreement of vLLM and transformers in bfloat16 on held-out prompts.
"""

from __future__ import annotations

import json
import shutil

from feather_cli.options import add_json, non_negative_int, positive_int

#: The built-in hybrid models (feather_gym.hybrid.model.SPECS; not imported here to keep the CLI light).
KINDS = ("trained", "remember", "tiny")


def register(tree) -> None:
    """Add ``feather hybrid build|check``."""
    hybrid = tree.group("hybrid")
    build = hybrid.add_parser("build", help="train the hybrid model if absent; print its report")
    build.add_argument("--model", choices=KINDS, default="trained")
    build.add_argument("--force", action="store_true", help="train again even if the folder exists")
    add_json(build)
    build.set_defaults(func=build_command)
    check = hybrid.add_parser("check", help="greedy agreement of vLLM and transformers (bfloat16)")
    check.add_argument("--model", choices=KINDS, default="trained")
    check.add_argument("--prompts", type=positive_int, default=16, help="held-out prompts (default 16)")
    check.add_argument("--max-new-tokens", type=positive_int, default=16, help="greedy tokens per prompt (default 16)")
    check.add_argument("--seed", type=non_negative_int, default=0)
    add_json(check)
    check.set_defaults(func=check_command)


def build_command(args) -> int:
    from cache_core.hybrid.layout import HybridCacheLayout
    from feather_gym.hybrid.model import ensure_hybrid_hf, hybrid_dir, training_report

    if args.force and hybrid_dir(args.model).exists():
        shutil.rmtree(hybrid_dir(args.model))
    path = ensure_hybrid_hf(args.model)
    report = {"path": str(path), **training_report(path),
              "layout": HybridCacheLayout.from_model_dir(path).as_dict()}
    print(f"{report['model']} at {path}: {report['steps']} steps, {report['train_tokens']} tokens, "
          f"{report['train_minutes']:.1f} min; held-out perplexity {report['heldout_perplexity']:.1f} "
          f"on {report['heldout_tokens']} tokens of {report['corpus']}")
    for task, by_length in report.get("recall_accuracy", {}).items():
        print(f"  {task} accuracy by length: " + ", ".join(f"{n}: {a:.2f}" for n, a in by_length.items()))
    threshold = report.get("gate_memory_threshold")
    for layer, heads in report.get("gate_memory_tokens_by_layer_head", {}).items():
        print(f"  GDN layer {layer}: tokens until a contribution decays below {threshold:g}, by head: "
              + " ".join(f"{h:.0f}" for h in heads))
    layout = report["layout"]
    print(f"cache layout: {layout['attention_layers']} attention + {layout['linear_layers']} GDN layers, "
          f"{layout['kv_bytes_per_token']} B of KV per token, {layout['state_bytes']} B per recurrent checkpoint")
    if args.json:
        print(json.dumps(report))
    return 0


def check_command(args) -> int:
    from feather_gym.hybrid.agreement import compare_greedy
    from feather_gym.hybrid.model import ensure_hybrid_hf

    report = compare_greedy(str(ensure_hybrid_hf(args.model)), num_prompts=args.prompts,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    print(f"vLLM vs transformers (bf16, greedy {report['max_new_tokens']} tokens, {report['num_prompts']} prompts of "
          f"{report['prompt_tokens_min']}-{report['prompt_tokens_max']} tokens): "
          f"exact {report['exact_match_fraction']:.2f}, "
          f"first token {report['first_token_agreement']:.2f}, "
          f"common prefix {report['mean_common_prefix_fraction']:.2f}")
    if args.json:
        print(json.dumps(report))
    return 0
