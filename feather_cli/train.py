"""``feather train`` and ``feather export`` (``feather-train`` is the same command)."""

from __future__ import annotations

import sys

from trainer import cli as trainer_cli


def register(tree) -> None:
    """Add ``feather train`` and ``feather export``."""
    train = tree.command("train", help="train the Feather policy with RLlib PPO (= feather-train)",
                         parents=[trainer_cli.build_train_parser()], add_help=False)
    train.set_defaults(func=trainer_cli.run_train)
    export = tree.command("export", help="export a checkpoint's policy to a Feather ONNX file",
                          parents=[trainer_cli.build_export_parser()], add_help=False)
    export.set_defaults(func=trainer_cli.run_export)


def main(argv: list[str] | None = None) -> int:
    return trainer_cli.main(sys.argv[1:] if argv is None else argv)
