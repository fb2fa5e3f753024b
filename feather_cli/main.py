"""``feather``: the umbrella command.

Each group module (:data:`GROUP_MODULES`) adds its commands with ``register(tree)``; the groups
and their one help text each are defined here (:data:`GROUPS`). Group modules keep heavy
imports (torch, ray, vllm, onnxruntime) inside their handlers, so ``feather --help`` stays fast.

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

from feather_cli.options import add_version, check_required

#: The command groups with their help text (``feather train`` and ``feather export`` are commands).
GROUPS = {
    "bench": "benchmarks, each comparing implementations or schedulers side by side in one run",
    "sim": "the serving simulator: policies side by side, and the simulator against the live engine",
    "trace": "workload traces: statistics and generation",
    "profile": "profile engine steps and fit step-time cost models",
    "placement": "checkpoint placement for recurrent-state prefix caching",
    "hybrid": "the small trained hybrid (Gated DeltaNet + attention) model",
    "replay": "SuffixReplay: rebuild linear-attention states from anchors",
}

#: Modules of ``feather_cli`` whose ``register(tree)`` adds their commands, imported by :func:`build_parser`.
GROUP_MODULES = ("train", "bench", "sim", "trace", "profile", "placement", "hybrid", "replay")

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
    """``feather COMMAND`` and ``feather GROUP COMMAND``, with hidden aliases for old names.

    Invariant: every group named in :data:`GROUPS` has one parser and one help text; a hidden
    alias (:meth:`alias`) is parsed like its new name but listed nowhere in ``--help``.
    """

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self._root = parser.add_subparsers(dest="group", required=True, metavar="COMMAND")
        self._groups: dict[str, argparse._SubParsersAction] = {}

    def command(self, name: str, **kwargs) -> argparse.ArgumentParser:
        """A top-level command, ``feather NAME``."""
        return self._root.add_parser(name, **kwargs)

    def group(self, name: str) -> argparse._SubParsersAction:
        """The subparsers of group ``name`` (one of :data:`GROUPS`), created on first use."""
        if name not in self._groups:
            hidden = name not in GROUPS
            group_parser = (self._root.add_parser(name) if hidden else
                            self._root.add_parser(name, help=GROUPS[name], description=GROUPS[name]))
            self._groups[name] = group_parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
        return self._groups[name]

    def alias(self, old: str, new: str, build) -> None:
        """``feather OLD`` (``"group command"``) as a hidden alias of ``feather NEW``: ``build(parser)``
        adds the same flags to both; the alias warns on stderr that it is deprecated."""
        group, _, command = old.partition(" ")
        parser = self.group(group).add_parser(command) if command else self._root.add_parser(group)
        build(parser)
        parser.set_defaults(deprecated=(old, new))


def build_parser(modules: tuple[str, ...] = GROUP_MODULES) -> argparse.ArgumentParser:
    """The ``feather`` parser with the commands of ``modules`` (all of :data:`GROUP_MODULES` by default)."""
    parser = argparse.ArgumentParser(prog="feather", description="feather-gym: prefix-aware LLM serving inside vLLM")
    add_version(parser)
    tree = CommandTree(parser)
    for name in modules:
        importlib.import_module(f"feather_cli.{name}").register(tree)
    return parser


def main(argv: list[str] | None = None, *, modules: tuple[str, ...] = GROUP_MODULES) -> int:
    """Run ``feather ARGV``; ``modules`` as in :func:`build_parser` (a group module run on its own
    passes only itself, so it imports only what that group needs)."""
    args = build_parser(modules).parse_args(argv)
    if getattr(args, "deprecated", None):
        old, new = args.deprecated
        print(f"feather: '{old}' is deprecated and will be removed in the next release; use '{new}'",
              file=sys.stderr)
    log_progress()
    try:
        check_required(args)
        return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:
        print(f"feather: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
