"""``feather train`` (= ``feather-train``) and ``feather export``: RLlib PPO, held-out evaluation, ONNX export.

Usage::

    feather-train [--config FILE] [--workload SPEC ...] [--profile NAME] [--iterations N | --time-budget S]
                  [--env-runners N] [--seed N] [--output DIR] [--resume RUN_DIR|CHECKPOINT] [--lr LR] ... [--json]
    feather export CHECKPOINT -o policy.onnx [--profile NAME] [--workload SPEC ...] [--json]

Every setting of :class:`~trainer.config.TrainConfig` is a flag (:func:`add_dataclass_flags`): its
name with dashes (``--entropy-coeff``), except the few spelled as they always were
(``--workload``, ``--time-budget``, ``--env-runners``, ``--output``).

With no arguments it trains on a built-in mix of prefix-sharing and no-sharing workloads with the
shipped cost-model profile of this hardware, on a budget that finishes in under 10 minutes on 2
cores. The final evaluation is held out: generated workloads on other seeds, trace files on the
later ``--eval-fraction`` of their arrival span. Bad input (unknown workload, missing profile,
corrupted checkpoint, overlapping seed sets) exits with status 2 and a one-line
``feather-train: error: ...``.

``--resume RUN_DIR --profile NEW`` fine-tunes a finished run on another cost-model profile (e.g.
one ``feather profile refit`` wrote from the live engine's steps): it restores
``RUN_DIR/checkpoint`` and takes the run's settings from ``RUN_DIR/summary.json`` (workloads, KV
capacity, network, PPO and seeds), except where it ran and for how long; a config file and
flags override them. ``--resume CHECKPOINT`` restores a bare RLlib checkpoint with this run's
settings. ``feather-train export`` is a hidden alias of ``feather export`` for one release.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from pathlib import Path

from feather_cli.options import add_json, add_output, add_version
from trainer.config import OFF, TrainConfig

TRAIN_HELP = "train the Feather policy with RLlib PPO, evaluate it held out, export it to ONNX"
EXPORT_HELP = ("export the policy of an RLlib checkpoint to a Feather ONNX file, verified against torch with "
               "onnxruntime")


def add_dataclass_flags(parser, cls, spelling: dict[str, dict]) -> None:
    """Add to ``parser`` (or an argument group) one flag per field of the dataclass ``cls``:
    ``--<field-name-with-dashes>``, help ``metadata["help"]`` and the default, typed by the
    annotation (``X | None`` as ``X``; a tuple takes one or more values; an optional field with a
    default other than None also takes :data:`~trainer.config.OFF`). A flag not given is None,
    so it overrides nothing. ``spelling[name]`` adds or replaces ``add_argument`` keywords of
    a field's flag, and ``"flags"`` (its names) and ``"group"`` (where it goes)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        args = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        optional = isinstance(kind, types.UnionType) and len(args) == 1
        if optional:
            kind = args[0]
        if typing.get_origin(kind) is tuple:
            options = {"type": typing.get_args(kind)[0], "nargs": "+", "action": "extend"}
        else:
            options = {"type": kind}
        if optional and field.default is not None:
            options["type"] = _or_off(options["type"])
        shown = "" if field.default is None else f" (default: {_shown(field.default)})"
        options |= {"dest": field.name, "default": None, "help": field.metadata["help"] + shown}
        options |= spelling.get(field.name, {})
        group = options.pop("group", parser)
        group.add_argument(*options.pop("flags", ("--" + field.name.replace("_", "-"),)), **options)


def _or_off(kind):
    """An argparse type: ``kind``, or :data:`~trainer.config.OFF` as it is."""
    def parse(text: str):
        return OFF if text == OFF else kind(text)

    parse.__name__ = f"{kind.__name__} or {OFF}"    # argparse's "invalid <name> value"
    return parse


def _shown(value) -> str:
    """A default as a flag takes it (a run of consecutive integers as ``first..last``)."""
    if not isinstance(value, tuple):
        return str(value)
    if len(value) > 2 and isinstance(value[0], int) and value == tuple(range(value[0], value[0] + len(value))):
        return f"{value[0]}..{value[-1]}"
    return " ".join(map(str, value))


#: The :class:`TrainConfig` flags not spelled ``--<field-name-with-dashes>`` or with a metavar
#: (:func:`add_dataclass_flags`'s ``spelling``; ``"group": BUDGET`` puts a flag in the budget group).
BUDGET = "budget"
SPELLING = {
    "workloads": {"flags": ("--workload",), "action": "append", "nargs": None, "metavar": "SPEC"},
    "kv_capacity_tokens": {"metavar": "TOKENS"},
    "max_wait_steps": {"metavar": "STEPS"},
    "iterations": {"group": BUDGET, "metavar": "N"},
    "time_budget_s": {"flags": ("--time-budget",), "group": BUDGET, "metavar": "SECONDS"},
    "num_env_runners": {"flags": ("--env-runners",), "metavar": "N"},
    "output_dir": {"flags": ("-o", "--output"), "metavar": "DIR"},
    "resume": {"metavar": "RUN_DIR|CHECKPOINT"},
    "num_candidates": {"metavar": "K"},
    "warm_start": {"metavar": "BASELINE"},
    "improve_warm_start": {"metavar": "MIN_GAIN|off"},
}


def setting_flag(name: str) -> str:
    """The long flag of :class:`TrainConfig` setting ``name`` (``kv_capacity_tokens`` -> ``--kv-capacity-tokens``)."""
    return SPELLING.get(name, {}).get("flags", ("--" + name.replace("_", "-"),))[-1]


def flag_error(exc: ValueError, flags: dict) -> ValueError:
    """``exc`` with its leading setting name (``"iterations: ..."``) replaced by the flag's,
    when that setting was given as a flag (a config file's setting keeps its name)."""
    name, sep, rest = str(exc).partition(": ")
    if sep and flags.get(name) is not None:
        return ValueError(f"argument {setting_flag(name)}: {rest}")
    return exc


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path,
                        help="YAML (.yaml/.yml) or TOML (.toml) file of settings; flags override it")
    budget = parser.add_mutually_exclusive_group()
    add_dataclass_flags(parser, TrainConfig, {
        name: {**options, "group": budget} if options.get("group") == BUDGET else options
        for name, options in SPELLING.items()})
    add_json(parser)
    parser.set_defaults(func=train_command)


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, help="RLlib checkpoint directory (e.g. <output>/checkpoint)")
    add_output(parser, "ONNX file to write", type=Path)
    parser.add_argument("--profile", help="profile recorded in the metadata (default: the checkpoint's)")
    parser.add_argument("--workload", dest="workloads", action="append", metavar="SPEC",
                        help="workload(s) recorded in the metadata (default: the checkpoint's)")
    add_json(parser)
    parser.set_defaults(func=export_command)


def register(tree) -> None:
    """Add ``feather train`` and ``feather export``."""
    add_train_arguments(tree.command("train", help=TRAIN_HELP, description=TRAIN_HELP))
    add_export_arguments(tree.command("export", help=EXPORT_HELP, description=EXPORT_HELP))


def train_flags(args: argparse.Namespace) -> dict:
    """The parsed flags that are :class:`TrainConfig` settings (None where not given)."""
    names = {field.name for field in dataclasses.fields(TrainConfig)}
    return {key: value for key, value in vars(args).items() if key in names}


def train_command(args: argparse.Namespace) -> int:
    from trainer.config import run_config
    from trainer.train import train

    flags = train_flags(args)
    try:
        summary = train(run_config(flags, args.config))
    except ValueError as exc:
        raise flag_error(exc, flags) from exc
    print(f"wrote {summary['policy']}, {Path(summary['policy']).parent / 'summary.json'}; "
          f"trained {summary['train_s']:.0f} s, total {summary['total_s']:.0f} s")
    if args.json:
        print(json.dumps(summary))
    return 0


def export_command(args: argparse.Namespace) -> int:
    from trainer.export import export_checkpoint

    report = export_checkpoint(args.checkpoint, args.output, profile=args.profile, workloads=args.workloads)
    print(f"wrote {args.output}: max abs diff vs torch {report['max_abs_diff_random']:.2g} (random), "
          f"{report['max_abs_diff_real']:.2g} (real, {report['num_real_observations']} observations)")
    if args.json:
        print(json.dumps(report))
    return 0


def build_train_parser() -> argparse.ArgumentParser:
    """``feather-train``: the train flags, and ``export`` as a hidden subcommand (the old name of
    ``feather export``)."""
    parser = argparse.ArgumentParser(prog="feather-train", description=TRAIN_HELP,
                                     epilog="Export a checkpoint: feather export CHECKPOINT -o policy.onnx.")
    add_version(parser)
    add_train_arguments(parser)
    old = parser.add_subparsers(dest="old_command", required=False, help=argparse.SUPPRESS)
    add_export_arguments(old.add_parser("export", prog="feather-train export"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_train_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.old_command == "export":
        print("feather-train: 'feather-train export' is deprecated and will be removed in the next release; use "
              "'feather export'", file=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:
        print(f"feather-train: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
