"""Reading and writing trace files: :func:`load_trace` (any format, auto-detected) and
:func:`write_trace` (the native JSONL of :mod:`traces.formats`, which round-trips).

Blank lines are ignored. Every other line becomes a request or a :class:`TraceFormatError`
naming file, line and field; with ``skip_bad=True`` bad lines are skipped instead and
counted in ``Trace.skipped_lines`` (nothing is dropped silently). Arrival times must be
non-decreasing in file order: a line whose time goes backwards is a bad line.

Cost: one ``json.loads`` (or one CSV split and datetime parse) per line and no per-token
work; block ids stay block ids.
"""

from __future__ import annotations

import itertools
import json
import os

from traces.formats import NATIVE_FORMAT, NATIVE_VERSION, TraceFormatError, detect_format
from traces.request import Request, Trace


def load_trace(path: str | os.PathLike, *, skip_bad: bool = False) -> Trace:
    """Load a native, Mooncake or Azure trace file (format detected from its first line).

    A file that is not UTF-8 text (a binary file, say) is a ``ValueError`` naming it, whatever
    ``skip_bad`` says: no line of it can be trusted.
    """
    path = str(path)
    try:
        return _load_trace(path, skip_bad=skip_bad)
    except UnicodeDecodeError:
        raise not_text(path, "trace file (JSONL or CSV)") from None


def not_text(path: str | os.PathLike, what: str) -> ValueError:
    """The error of a file that should be text but is not UTF-8: it names the file and what it should be."""
    return ValueError(f"{path}: not a {what}: not UTF-8 text")


def read_text(path: str | os.PathLike, what: str) -> str:
    """The UTF-8 text of the file at ``path``; a file that is not text (a binary file) is a
    ``ValueError`` naming it and ``what`` it should be (:func:`not_text`), a missing one a
    ``FileNotFoundError`` naming both, any other unreadable one an ``OSError``."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        raise not_text(path, what) from None
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such {what}") from None


def _load_trace(path: str, *, skip_bad: bool) -> Trace:
    requests: list[Request] = []
    seen_ids: set[str] = set()
    skipped = 0
    previous_arrival = 0.0
    with open(path, encoding="utf-8") as lines:
        numbered = ((lineno, line) for lineno, line in enumerate(lines, start=1) if line.strip())
        first = next(numbered, None)
        if first is None:
            raise TraceFormatError(path, 1, None, "empty trace file")
        fmt = detect_format(path, first[1], first[0])
        if not fmt.has_header:
            numbered = itertools.chain([first], numbered)
        for lineno, line in numbered:
            try:
                fields = fmt.parse(line, lineno)
                request_id = fields.pop("request_id", None) or str(len(requests) + skipped)
                if request_id in seen_ids:
                    raise fmt.error(lineno, "id", f"duplicate request id {request_id!r}")
                if fields["arrival_s"] < previous_arrival:
                    raise fmt.error(lineno, fmt.time_field, "time goes backwards: "
                                    f"{fields['arrival_s']} s after {previous_arrival} s")
                try:
                    request = Request(request_id, **fields)
                except ValueError as exc:
                    raise fmt.error(lineno, None, str(exc)) from None
            except TraceFormatError:
                if not skip_bad:
                    raise
                skipped += 1
                continue
            requests.append(request)
            seen_ids.add(request_id)
            previous_arrival = request.arrival_s
    return Trace(requests=requests, skipped_lines=skipped, **fmt.metadata())


def write_trace(trace: Trace, path: str | os.PathLike) -> None:
    """Write ``trace`` as native JSONL; ``load_trace`` gives back equal requests and metadata."""
    with open(path, "w", encoding="utf-8") as out:
        header = {"format": NATIVE_FORMAT, "version": NATIVE_VERSION, "name": trace.name,
                  "source": trace.source, "block_size": trace.block_size}
        out.write(json.dumps(header) + "\n")
        for r in trace:
            record = {"id": r.request_id, "arrival_s": r.arrival_s, "input_len": r.input_len,
                      "output_len": r.output_len}
            if r.token_ids is not None:
                record["token_ids"] = r.tokens().tolist()
            else:
                record["block_ids"] = r.block_ids.tolist()
                record["block_size"] = r.block_size
            for label in ("session", "group"):
                if getattr(r, label) is not None:
                    record[label] = getattr(r, label)
            out.write(json.dumps(record, separators=(",", ":")) + "\n")

