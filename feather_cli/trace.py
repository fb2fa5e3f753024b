"""``feather trace``: workload statistics and generation.

* ``feather trace stats SPEC [--block-size N] [--seed S] [--skip-bad] [--json]``: the
  statistics of :func:`traces.stats.trace_stats` for a trace file, a shared trace name or a
  generator spec (see :mod:`traces.workload`), plus load and statistics times.
* ``feather trace gen KIND [--seed S] [--num-requests N] [--param key=value ...] -o FILE``:
  write a generated workload as native JSONL.
* ``feather trace kinds [KIND ...] [--json]``: every generator's parameters with their types,
  defaults and ranges (:func:`traces.generators.parameters`).
"""

from __future__ import annotations

import json
import sys
import time

from feather_cli.options import add_json, add_output, non_negative_int, positive_int
from traces.generators import GENERATOR_KINDS


def register(tree) -> None:
    """Add ``feather trace stats|gen``."""
    trace = tree.group("trace")
    stats = trace.add_parser("stats", help="statistics of a trace file, shared trace or generator spec")
    stats.add_argument("spec", metavar="FILE_OR_GENERATOR",
                       help="trace file, shared trace (mooncake, azure-conv) or KIND[:key=value,...]")
    stats.add_argument("--block-size", type=positive_int, default=512, help="prefix block size in tokens (default 512)")
    stats.add_argument("--seed", type=non_negative_int, default=0, help="generator seed (default 0)")
    stats.add_argument("--skip-bad", action="store_true", help="skip bad lines of a trace file and count them")
    add_json(stats)
    stats.set_defaults(func=stats_command)

    gen = trace.add_parser("gen", help="write a generated workload as native JSONL",
                           epilog="`feather trace kinds KIND` lists a generator's parameters, defaults and ranges.")
    gen.add_argument("kind", choices=GENERATOR_KINDS)
    gen.add_argument("--seed", type=non_negative_int, default=0)
    gen.add_argument("--num-requests", type=positive_int, help="number of requests (default: the generator's)")
    gen.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                     help="a generator parameter (repeatable)")
    add_output(gen, "native JSONL file to write", metavar="FILE")
    gen.set_defaults(func=gen_command)

    kinds = trace.add_parser("kinds", help="the workload generators: parameters, defaults and ranges")
    kinds.add_argument("kinds", nargs="*", metavar="KIND",
                       help=f"generators to list (default all: {', '.join(GENERATOR_KINDS)})")
    add_json(kinds)
    kinds.set_defaults(func=kinds_command)


def stats_command(args) -> int:
    from traces.stats import trace_stats
    from traces.workload import resolve_workload

    start = time.perf_counter()
    trace = resolve_workload(args.spec, seed=args.seed, skip_bad=args.skip_bad)
    loaded = time.perf_counter()
    stats = trace_stats(trace, block_size=args.block_size)
    stats["load_s"] = round(loaded - start, 4)
    stats["stats_s"] = round(time.perf_counter() - loaded, 4)
    if trace.skipped_lines:
        print(f"feather: skipped {trace.skipped_lines} bad line(s) of {args.spec}", file=sys.stderr)
    if args.json:
        print(json.dumps(stats))
    else:
        width = max(map(len, stats))
        for key, value in stats.items():
            print(f"{key:<{width}}  {value}")
    return 0


def gen_command(args) -> int:
    from traces.generators import make_generator
    from traces.io import write_trace
    from traces.workload import parse_params

    params = parse_params(args.kind, ",".join(args.param))
    if args.num_requests is not None:
        params["num_requests"] = args.num_requests
    trace = make_generator(args.kind, **params).generate(args.seed)
    write_trace(trace, args.output)
    print(f"wrote {len(trace)} requests of {trace.source} to {args.output}")
    return 0


def kinds_command(args) -> int:
    from traces.generators import WorkloadGenerator, generator_class, parameters
    from traces.table import WIDTH, cut, format_table

    report = {kind: parameters(kind) for kind in args.kinds or GENERATOR_KINDS}   # ValueError names the kinds
    blocks = []
    for kind, rows in report.items():
        cls = generator_class(kind)
        summary = " ".join(cls.__doc__.split()).replace("``", "").split(". ")[0]
        lines = [cut(f"{kind}: {summary}", WIDTH),
                 format_table(["parameter", "type", "default", "range"],
                              [[row["name"], row["type"], row["default"], row["range"]] for row in rows], align="llrl")]
        if cls.validate is not WorkloadGenerator.validate:
            lines.append(cut("also " + " ".join(cls.validate.__doc__.split()).replace("``", ""), WIDTH))
        blocks.append("\n".join(lines))
    print("\n\n".join(blocks)
          + "\n\nA spec sets parameters as KIND:key=value,... (e.g. prefix-groups:groups=4,rate=50).")
    if args.json:
        print(json.dumps(report))
    return 0
