"""``feather``: the umbrella command.

Each package contributes its subcommands through a ``register(commands)`` function in its
provider module (listed in :data:`PROVIDERS`). Providers keep heavy imports (torch, ray,
vllm, onnxruntime) inside their handlers, so ``feather --help`` stays fast.

A handler is ``func(args) -> int`` set with ``parser.set_defaults(func=...)``. User errors
(bad files, bad arguments) are raised as ``ValueError`` or ``OSError``; they print as
``feather: error: ...`` with exit status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

PROVIDERS = (
    "traces.cli",                  # feather trace stats|gen
    "cache_core.cht_bench",        # feather bench cht
    "cache_core.placement_cli",    # feather placement eval
    "feather_gym.costmodel.cli",   # feather profile run|fit
    "feather_gym.sim_cli",         # feather sim compare, feather bench env
    "deploy.cli",                  # feather serve bench, feather bench policy
    "deploy.sim_validate",         # feather sim validate
    "feather_gym.hybrid.cli",      # feather hybrid build|check
    "cache_core.replay_cli",       # feather replay eval
    "trainer.headroom",            # feather bench headroom
)


class CommandTree:
    """Two-level command groups (``feather GROUP COMMAND``) shared by all providers."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self._root = parser.add_subparsers(dest="group", required=True, metavar="GROUP")
        self._groups: dict[str, argparse._SubParsersAction] = {}

    def group(self, name: str, help: str) -> argparse._SubParsersAction:
        """The subparsers of group ``name``, created on first use."""
        if name not in self._groups:
            group_parser = self._root.add_parser(name, help=help)
            self._groups[name] = group_parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
        return self._groups[name]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="feather", description=__doc__.splitlines()[0])
    commands = CommandTree(parser)
    for module in PROVIDERS:
        importlib.import_module(module).register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:
        print(f"feather: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
