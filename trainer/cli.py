"""``feather-train``: train the Feather policy with RLlib PPO, evaluate it, export it to ONNX.

Usage::

    feather-train [--config FILE] [--workload SPEC ...] [--profile NAME] [--iterations N | --time-budget S]
                  [--env-runners N] [--seed N] [--eval-fraction F] [--output DIR] [--resume RUN_DIR|CHECKPOINT]
                  [--ray-address ADDR] [--json]
    feather-train export CHECKPOINT -o policy.onnx [--profile NAME] [--workload SPEC ...] [--json]

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
from datetime import datetime
from pathlib import Path

from trainer.config import DEFAULT_MIXES, OFF, TrainConfig, build_config, load_config_file


def min_gain(text: str) -> float | str:
    """``--improve-warm-start``'s value: a minimum gain, or :data:`~trainer.config.OFF` (no improvement)."""
    if text == OFF:
        return OFF
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a minimum gain (e.g. 0.01) or off, got {text!r}") from None


def build_train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="feather-train", description=__doc__.splitlines()[0],
        epilog="Export a checkpoint: feather-train export CHECKPOINT -o policy.onnx (see feather-train export -h).")
    defaults = TrainConfig()
    parser.add_argument("--config", type=Path, help="YAML (.yaml/.yml) or TOML (.toml) file of settings; flags override it")
    parser.add_argument("--workload", dest="workloads", action="append", metavar="SPEC",
                        help="workload of the training mix (repeat for a mix): a trace file, a shared-trace name or "
                             "KIND[:key=value,...]; default: the built-in mix of the profile's device ("
                             + "; ".join(f"{device}: {' '.join(mix.workloads)}" for device, mix in DEFAULT_MIXES.items()) + ")")
    parser.add_argument("--kv-capacity-tokens", type=int, metavar="TOKENS",
                        help="KV capacity of the simulated engine (default: the built-in mix's, else the profile's)")
    parser.add_argument("--max-wait-steps", type=int, metavar="STEPS",
                        help=f"the admission's waiting-time bound in engine steps (default {defaults.max_wait_steps}); "
                             "serve with the same (additional_config feather.max_wait_steps)")
    parser.add_argument("--profile", help="cost-model profile name or file; default: the shipped one for this hardware")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--iterations", type=int, help="train for exactly N PPO iterations")
    budget.add_argument("--time-budget", dest="time_budget_s", type=float, metavar="SECONDS",
                        help="warm-start and train until another iteration would exceed this "
                             f"(default {defaults.time_budget_s:.0f})")
    parser.add_argument("--env-runners", dest="num_env_runners", type=int,
                        help=f"RLlib env runner processes (default {defaults.num_env_runners})")
    parser.add_argument("--seed", type=int, help=f"training seed (default {defaults.seed})")
    parser.add_argument("--eval-fraction", type=float, metavar="F",
                        help="share of a trace file's arrival span held out, at its end, for the final evaluation "
                             f"(default {defaults.eval_fraction}; generated workloads are held out by seed)")
    parser.add_argument("--output", dest="output_dir", type=Path, help="output folder (default runs/feather-<UTC time>)")
    parser.add_argument("--resume", type=Path, metavar="RUN_DIR|CHECKPOINT",
                        help="fine-tune from a previous run's folder (its checkpoint and settings) or an RLlib checkpoint")
    parser.add_argument("--num-candidates", type=int, metavar="K",
                        help=f"candidate slots of the action: 1 is ADD/STOP on the CHT's best candidate, K > 1 "
                             f"chooses among its K best prefix groups or STOP (default {defaults.num_candidates})")
    parser.add_argument("--warm-start", metavar="BASELINE",
                        help=f"baseline cloned into the network before PPO, or none (default {defaults.warm_start})")
    parser.add_argument("--improve-warm-start", type=min_gain, metavar="MIN_GAIN|off",
                        help="clone one step of policy iteration on the warm-start baseline instead of the baseline: "
                             "a decision takes STOP where its simulated playouts (mean over sampled "
                             "output-length futures) gain over MIN_GAIN (a share of the window's time) "
                             f"on the baseline's; off clones the baseline as it is (default {defaults.improve_warm_start})")
    parser.add_argument("--ray-address", help="train on an existing Ray cluster (e.g. auto, ray://host:10001); "
                                              "default: start a local Ray")
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
