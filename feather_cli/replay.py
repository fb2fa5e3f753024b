"""``feather replay eval``: SuffixReplay on the hybrid model (see :mod:`feather_gym.hybrid.replay_eval`)."""

from __future__ import annotations

import json

from feather_cli.options import add_json, int_list, int_list_type, non_negative_int, positive_int
from feather_gym.hybrid.replay_eval import DEFAULT_WORKLOAD


def register(tree) -> None:
    """Add ``feather replay eval``."""
    replay = tree.group("replay")
    ev = replay.add_parser("eval", help="state error, quality retention, storage and rebuild time of SuffixReplay")
    ev.add_argument("--model", default="trained", metavar="trained|remember|tiny|DIR",
                    help="hybrid model (default trained)")
    ev.add_argument("--page", type=positive_int, default=256, help="page size in tokens (default 256)")
    ev.add_argument("--prefix-tokens", type=int_list, default="1024,2048", help="prefix lengths p, multiples of --page")
    ev.add_argument("--replay-tokens", type=int_list, default="16,32,64,128,256", help="replay lengths R per layer")
    ev.add_argument("--continuation-tokens", type=positive_int, default=64, help="tokens scored after p (default 64)")
    ev.add_argument("--samples", type=positive_int, default=4, help="held-out windows per prefix length (default 4)")
    ev.add_argument("--needles", type=non_negative_int, default=8, help="needles per placement (default 8; 0 skips)")
    ev.add_argument("--time-prefix-tokens", type=int_list_type(allow_empty=True), default="4096,16384,32768",
                    help="prefix lengths whose recomputation is timed ('' skips)")
    ev.add_argument("--anchor-dtype", default="bfloat16",
                    help="anchor store dtype: the anchors replayed and the bytes counted (default bfloat16)")
    ev.add_argument("--workload", default=DEFAULT_WORKLOAD, metavar="GEN_OR_FILE",
                    help=f"workload whose overlap depths the storage comparison uses (default {DEFAULT_WORKLOAD}; "
                         "'' skips)")
    ev.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    ev.add_argument("--seed", type=non_negative_int, default=0)
    add_json(ev)
    ev.set_defaults(func=eval_command)


def eval_command(args) -> int:
    from feather_gym.hybrid.replay_eval import evaluate as evaluate_replay

    prefixes = args.prefix_tokens
    if any(p % args.page for p in prefixes):
        raise ValueError(f"--prefix-tokens must be multiples of --page {args.page}: {prefixes}")
    report = evaluate_replay(args.model, page=args.page, prefixes=prefixes,
                      replay_tokens=args.replay_tokens,
                      continuation=args.continuation_tokens, samples=args.samples, needles=args.needles,
                      time_prefixes=args.time_prefix_tokens,
                      anchor_dtype=args.anchor_dtype, workload=args.workload, threads=args.threads,
                      seed=args.seed)
    from feather_gym.hybrid.replay_eval import print_report

    print_report(report)
    if args.json:
        print(json.dumps(report))
    return 0
