"""Flags that mean the same in every command: one definition each.

* ``-o/--output``: where a command writes its file or folder.
* ``--workload``: ``NAME=SPEC`` or ``SPEC`` (:func:`traces.resolve_workload`), repeatable where a
  command takes several; a spec without a name is named by its short label
  (:func:`traces.workload.workload_label`: a generator's kind, a trace's name), which printed
  tables show; the full spec goes into the JSON reports.
* ``--policies``: comma-separated policy names or ``*.onnx`` files.
* ``--json``: the report as one JSON object on the last line of stdout.
* ``--version``: ``feather-gym VERSION`` of ``feather`` and ``feather-train`` alike.
* ``--all-at-once`` / ``--time-scale``: how a live bench submits a trace's requests.

Numbers mean what they say: a count or a size takes :func:`positive_int` (or
:func:`non_negative_int` where 0 means something, e.g. ``--seed``), so a value out of range is
refused by argparse with a one-line ``error: argument --FLAG: ...`` and exit status 2, never
replaced by a default.
"""

from __future__ import annotations

import argparse
import json


def package_version() -> str:
    """The installed feather-gym's version, or ``unknown (not installed)`` from a bare source tree."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("feather-gym")
    except PackageNotFoundError:
        return "unknown (not installed)"


def add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"feather-gym {package_version()}")


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object on the last line")


def add_output(parser: argparse.ArgumentParser, help: str, *, required: bool = True, old: str | None = None,
               **kwargs) -> None:
    """``-o/--output``; ``old`` names the flag's former spelling, kept hidden for one release."""
    add_flag(parser, "-o", "--output", required=required, help=help, old=old, **kwargs)


def add_flag(parser: argparse.ArgumentParser, *flags: str, required: bool = False, old: str | None = None,
             **kwargs) -> None:
    """``parser.add_argument(*flags, ...)``, with ``old`` as a hidden former name of the same flag.

    With an old name, ``required`` is checked by :func:`check_required` (argparse would demand
    the new name even when the old one is given)."""
    if old is None:
        parser.add_argument(*flags, required=required, **kwargs)
        return
    dest = flags[-1].lstrip("-").replace("-", "_")
    if required:
        kwargs["help"] = f"{kwargs.get('help', '')} (required)"
        parser.set_defaults(**{REQUIRED: (*(parser.get_default(REQUIRED) or ()), (dest, flags[-1]))})
    parser.add_argument(*flags, dest=dest, **kwargs)
    parser.add_argument(old, dest=dest, help=argparse.SUPPRESS, **{k: v for k, v in kwargs.items() if k != "help"})


#: The namespace attribute listing ``(dest, flag)`` pairs :func:`check_required` checks.
REQUIRED = "required_flags"


def check_required(args: argparse.Namespace) -> None:
    """``ValueError`` naming the first required flag (of :func:`add_flag`) that was not given."""
    for dest, flag in getattr(args, REQUIRED, None) or ():
        if getattr(args, dest) is None:
            raise ValueError(f"{flag} is required")


def add_workloads(parser: argparse.ArgumentParser, help: str, *, repeat: bool = True, **kwargs) -> None:
    """``--workload [NAME=]SPEC``: repeatable (a list, :func:`parse_workloads`) or, with
    ``repeat=False``, one value."""
    parser.add_argument("--workload", action="append" if repeat else "store", metavar="[NAME=]SPEC",
                        help=help, **kwargs)


def split_workload(text: str) -> tuple[str, str]:
    """``"NAME=SPEC"`` -> ``(NAME, SPEC)``; ``"SPEC"`` -> ``(label, SPEC)``, ``label`` its
    :func:`~traces.workload.workload_label`.

    ``kind:key=value`` has its '=' after a ':' and ``SPEC@load=X`` after an '@', so only a '='
    before any ':' and any '@' names the workload.
    """
    from traces.workload import workload_label

    name, sep, spec = text.partition("=")
    if not sep or ":" in name or "@" in name:
        return workload_label(text), text
    return name, spec


def parse_workloads(texts: list[str] | None) -> dict[str, str] | None:
    """``--workload`` values -> ``{name: spec}`` (:func:`split_workload`), the names made unique
    (:func:`~traces.workload.workload_labels`); ``None`` when none was given."""
    from traces.workload import workload_labels

    if not texts:
        return None
    return dict(zip(workload_labels(texts), (split_workload(text)[1] for text in texts)))


def add_policies(parser: argparse.ArgumentParser, default: str, help: str) -> None:
    parser.add_argument("--policies", default=default, help=f"{help} (default {default})")


def parse_policies(text: str) -> list[str]:
    """``--policies`` -> the names, in order; ``ValueError`` when there is none."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError("--policies: give at least one policy")
    return names


def add_max_wait_steps(parser: argparse.ArgumentParser) -> None:
    """``--max-wait-steps``: the admission's waiting-time bound, as the simulator and the deployed
    scheduler both apply it (:data:`feather_gym.policies.DEFAULT_MAX_WAIT_STEPS`)."""
    from feather_gym.policies import DEFAULT_MAX_WAIT_STEPS

    parser.add_argument("--max-wait-steps", type=non_negative_int, default=DEFAULT_MAX_WAIT_STEPS, metavar="STEPS",
                        help="the admission's waiting-time bound: the earliest-arrived waiting request is admitted "
                             f"unasked once it has waited this many engine steps (default {DEFAULT_MAX_WAIT_STEPS})")


def add_submission(parser: argparse.ArgumentParser) -> None:
    """The live benches' submission flags; :func:`submission` reads them back."""
    parser.add_argument("--all-at-once", action="store_true",
                        help="submit every request before the first step (default: each at its trace arrival "
                             "time, the regime feather-train trains in)")
    parser.add_argument("--time-scale", type=positive_float, default=1.0,
                        help="multiply the trace's arrival times by this (default 1; not with --all-at-once)")


def submission(args: argparse.Namespace) -> dict:
    """``online`` and ``time_scale`` keyword arguments from :func:`add_submission`'s flags."""
    if args.all_at_once and args.time_scale != 1.0:
        raise ValueError("--time-scale scales arrival times, which --all-at-once does not use: give one of them")
    return {"online": not args.all_at_once, "time_scale": args.time_scale}


def bounded(kind, low, high=None, *, above: bool = False):
    """An argparse ``type``: ``kind(text)`` at least ``low`` (``above``: greater than ``low``) and
    at most ``high`` when given; anything else is an ``ArgumentTypeError``, which argparse prints
    after the flag's name."""
    relation = ">" if above else ">="
    expected = f"{relation} {low}" + ("" if high is None else f" and <= {high}")

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if not ((value > low if above else value >= low) and (high is None or value <= high)):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text}")
        return value

    parse.__name__ = f"{kind.__name__} {expected}"
    return parse


#: argparse types of counts, sizes and seeds (:func:`bounded`).
positive_int = bounded(int, 1)
non_negative_int = bounded(int, 0)
positive_float = bounded(float, 0, above=True)
non_negative_float = bounded(float, 0.0)
#: A share in (0, 1].
fraction = bounded(float, 0, 1, above=True)


def int_list_type(low: int = 1, *, allow_empty: bool = False):
    """An argparse ``type``: ``"1000,5000"`` -> ``[1000, 5000]``, every integer at least ``low``
    and at least one (``allow_empty``: ``""`` is ``[]``)."""
    kind = {1: "positive", 0: "non-negative"}.get(low, f">= {low}")

    def parse(text: str) -> list[int]:
        try:
            values = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            values = None
        if values == [] and allow_empty and not text.strip():
            return []
        if not values or min(values) < low:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind} integers, got {text!r}")
        return values

    parse.__name__ = "int_list"
    return parse


#: ``"1000,5000"`` -> ``[1000, 5000]``: one or more positive integers (:func:`int_list_type`).
int_list = int_list_type()


def float_list(text: str) -> list[float]:
    """An argparse ``type``: ``"0.7,0.9"`` -> ``[0.7, 0.9]``, one or more positive finite numbers."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive numbers, got {text!r}")
    return values


def print_report(text: str, report: dict, *, as_json: bool) -> int:
    """Print a command's table, then (``--json``) its report as one object on the last line; exit code 0."""
    print(text)
    if as_json:
        print(json.dumps(report))
    return 0
