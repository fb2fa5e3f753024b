"""``feather``: the umbrella command.

Each package contributes its subcommands through a ``register(commands)`` function in its
provider module (listed in :data:`PROVIDERS`). Providers keep heavy imports (torch, ray,
vllm, onnxruntime) inside their handlers, so ``feather --help`` stays fast.

A handler is ``func(args) -> int`` set with ``parser.set_defaults(func=...)``. User errors
(bad files, bad arguments) are raised as ``ValueError`` or ``OSError``; they print as
``feather: error: ...`` with exit status 2, without a traceback.

Progress (e.g. a live bench's line per round as it ends) is logged at INFO by the project's
packages (:data:`LOGGED_PACKAGES`) and printed on stderr, so stdout keeps only the report and
a run cut short still shows what it finished.
"""

from __future__ import annotations

import argparse
import importlib
import logging
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

#: Packages whose INFO records ``feather`` prints on stderr.
LOGGED_PACKAGES = ("cache_core", "deploy", "feather_gym", "trainer", "traces")


class _StderrHandler(logging.StreamHandler):
    """A stream handler on whatever ``sys.stderr`` is when a record is emitted."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


_STDERR_HANDLER = _StderrHandler()
_STDERR_HANDLER.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))


def log_progress() -> None:
    """Print the INFO records of :data:`LOGGED_PACKAGES` on stderr (idempotent)."""
    for name in LOGGED_PACKAGES:
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        if _STDERR_HANDLER not in logger.handlers:
            logger.addHandler(_STDERR_HANDLER)


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
    log_progress()
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:
        print(f"feather: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
