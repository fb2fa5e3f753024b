"""``feather-train``: train the Feather policy with RLlib PPO, evaluate it, export it to ONNX.

Usage::

    feather-train [--config FILE] [--workload SPEC ...] [--profile NAME] [--iterations N | --time-budget S]
                  [--env-runners N] [--seed N] [--output DIR] [--resume RUN_DIR|CHECKPOINT] [--lr LR] ... [--json]
    feather-train export CHECKPOINT -o policy.onnx [--profile NAME] [--workload SPEC ...] [--json]

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
settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from datetime import datetime
from pathlib import Path

from trainer.config import OFF, TrainConfig, build_config, load_config_file


def add_dataclass_flags(parser, cls, spelling: dict[str, dict]) -> None:
    """Add to ``parser`` (or an argument group) one flag per field of the dataclass ``cls``:
    ``--<field-name-with-dashes>``, help ``metadata["help"]`` and the default, typed by the
    annotation (``X | None`` as ``X``; a tuple takes one or more values; an optional field with a
    default other than None also takes :data:`~trainer.config.OFF`). A flag not given is None,
    so it overrides nothing. ``spelling[name]`` adds or replaces ``add_argument`` keywords of
    a field's flag, and ``"flag"`` (its name) and ``"group"`` (where it goes)."""
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
        group.add_argument(options.pop("flag", "--" + field.name.replace("_", "-")), **options)


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


def build_train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="feather-train", description=__doc__.splitlines()[0],
        epilog="Export a checkpoint: feather-train export CHECKPOINT -o policy.onnx (see feather-train export -h).")
    parser.add_argument("--config", type=Path, help="YAML (.yaml/.yml) or TOML (.toml) file of settings; flags override it")
    budget = parser.add_mutually_exclusive_group()
    add_dataclass_flags(parser, TrainConfig, {
        "workloads": {"flag": "--workload", "action": "append", "nargs": None, "metavar": "SPEC"},
        "kv_capacity_tokens": {"metavar": "TOKENS"},
        "max_wait_steps": {"metavar": "STEPS"},
        "iterations": {"group": budget, "metavar": "N"},
        "time_budget_s": {"flag": "--time-budget", "group": budget, "metavar": "SECONDS"},
        "num_env_runners": {"flag": "--env-runners", "metavar": "N"},
        "output_dir": {"flag": "--output", "metavar": "DIR"},
        "resume": {"metavar": "RUN_DIR|CHECKPOINT"},
        "num_candidates": {"metavar": "K"},
        "warm_start": {"metavar": "BASELINE"},
        "improve_warm_start": {"metavar": "MIN_GAIN|off"},
    })
    parser.add_argument("--json", action="store_true", help="print the run summary as one JSON object on the last line")
    return parser


def build_export_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="feather-train export",
                                     description="Export the policy of an RLlib checkpoint to a Feather ONNX file, "
                                                 "verified against torch with onnxruntime.")
    parser.add_argument("checkpoint", type=Path, help="RLlib checkpoint directory (e.g. <output>/checkpoint)")
    parser.add_argument("-o", "--output", type=Path, required=True, help="ONNX file to write")
    parser.add_argument("--profile", help="profile recorded in the metadata (default: the checkpoint's)")
    parser.add_argument("--workload", dest="workloads", action="append", metavar="SPEC",
                        help="workload(s) recorded in the metadata (default: the checkpoint's)")
    parser.add_argument("--json", action="store_true", help="print the parity report as one JSON object")
    return parser


#: Settings a resumed run does not take over from the run it continues: where and how long it runs.
NOT_RESUMED = ("output_dir", "resume", "iterations", "time_budget_s", "ray_address", "warm_start",
               "improve_warm_start")


def resumed_run(resume: Path) -> tuple[Path, dict]:
    """(the checkpoint, the settings) ``--resume`` continues: a run folder's ``checkpoint/`` and its
    ``summary.json`` settings less :data:`NOT_RESUMED`, or a checkpoint folder with no settings.
    A setting this build no longer has (an older run's) is left out."""
    run = Path(resume)
    if not (run / "checkpoint").is_dir():
        return run, {}
    summary = run / "summary.json"
    settings = json.loads(summary.read_text())["config"] if summary.is_file() else {}
    known = {field.name for field in dataclasses.fields(TrainConfig)} - set(NOT_RESUMED)
    return run / "checkpoint", {key: value for key, value in settings.items() if key in known}


def run_train(args: argparse.Namespace) -> int:
    from trainer.train import train

    file_settings = load_config_file(args.config) if args.config else {}
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "json")}
    if args.resume is not None:
        flags["resume"], run_settings = resumed_run(args.resume)
        file_settings = {**run_settings, **file_settings}
    summary = train(build_config(file_settings, flags))
    print(f"wrote {summary['policy']}, {Path(summary['policy']).parent / 'summary.json'}; "
          f"trained {summary['train_s']:.0f} s, total {summary['total_s']:.0f} s")
    if args.json:
        print(json.dumps(summary))
    return 0


def run_export(args: argparse.Namespace) -> int:
    from trainer.export import export_policy_module, load_policy_network, read_training_info

    info = read_training_info(args.checkpoint) or {}      # ValueError: trained for another observation contract
    network = load_policy_network(args.checkpoint)
    profile = args.profile or info.get("profile")
    workloads = args.workloads or info.get("workloads")
    if not profile or not workloads:
        raise ValueError(f"checkpoint {args.checkpoint} does not record its profile and workloads "
                         "(not written by feather-train); pass --profile and --workload")
    trained_at = datetime.fromisoformat(info["trained_at"]) if "trained_at" in info else None
    report = export_policy_module(network, args.output, profile=profile, workload=workloads, trained_at=trained_at,
                                  max_wait_steps=info.get("max_wait_steps"))
    print(f"wrote {args.output}: max abs diff vs torch {report['max_abs_diff_random']:.2g} (random), "
          f"{report['max_abs_diff_real']:.2g} (real, {report['num_real_observations']} observations)")
    if args.json:
        print(json.dumps(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        args, handler = build_export_parser().parse_args(argv[1:]), run_export
    else:
        args, handler = build_train_parser().parse_args(argv), run_train
    try:
        return handler(args)
    except (ValueError, OSError) as exc:
        print(f"feather-train: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
