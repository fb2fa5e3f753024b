"""Trace file formats, each read one line at a time into request fields.

The first non-blank line tells the format apart:

* native: the header ``{"format": "feather-trace", "version": 1, ...}``; then one JSON request a line;
* mooncake: a JSON object with ``hash_ids`` or ``input_length`` (a request; no header);
* plain: a JSON object with ``token_ids`` (a request; no header): bring-your-own token traces;
* azure: the CSV header ``TIMESTAMP,ContextTokens,GeneratedTokens``; then one request a row.

**Native JSONL schema** (version 1; written by :func:`traces.io.write_trace`, round-trips):

* line 1, the header: ``{"format": "feather-trace", "version": 1, "name": str, "source": str,
  "block_size": int | null}``;
* every further line, one request: ``{"id": str, "arrival_s": float >= 0, "input_len": int >= 1,
  "output_len": int >= 1}`` plus the prompt, either ``"token_ids": [int, ...]`` (``input_len``
  of them) or ``"block_ids": [int, ...], "block_size": int`` (``ceil(input_len / block_size)``
  chained ids), and optionally ``"session": str`` and ``"group": str``.

**Mooncake** (FAST'25 traces): ``timestamp`` in ms becomes ``arrival_s = timestamp / 1000``;
``hash_ids`` are chained ids of 512-token blocks and stay block ids (no per-token work).

**Plain token JSONL** (no header): one request a line, ``{"timestamp": float >= 0,
"token_ids": [int, ...], "output_length": int >= 1}``, ``timestamp`` in **seconds** (any
origin; arrivals are kept as given), optionally ``"id"``, ``"session"`` and ``"group"``. The
prompt length is the number of token ids; the trace has no block size of its own.

**Azure LLM inference trace** (2023): ``TIMESTAMP`` is a datetime; ``arrival_s`` is seconds
since the first request. The trace has no prompt contents, so every request gets fresh,
trace-unique block ids: no two requests share a block (a no-sharing control).

A format only parses fields; :mod:`traces.io` owns the line loop, the time order and
``skip_bad``. Every problem raises :class:`TraceFormatError` naming file, line and field.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

NATIVE_FORMAT = "feather-trace"
NATIVE_VERSION = 1
MOONCAKE_BLOCK_SIZE = 512
#: Block size of the synthetic, never-shared block ids given to Azure prompts.
AZURE_BLOCK_SIZE = 512
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceFormatError(ValueError):
    """A bad trace line. ``path``, ``line`` (1-based) and ``field`` (None: the whole line) name it."""

    def __init__(self, path: str, line: int, field: str | None, problem: str) -> None:
        self.path, self.line, self.field, self.problem = str(path), line, field, problem
        where = f"{path}, line {line}" + (f", field '{field}'" if field else "")
        super().__init__(f"{where}: {problem}")


class LineFormat(ABC):
    """One trace file format. A fresh instance reads one file (it may keep per-file state).

    ``parse`` returns the keyword arguments of :class:`traces.request.Request` except
    ``request_id`` when the line has none of its own (``"request_id"`` present otherwise).
    """

    kind: ClassVar[str]
    #: The field that holds the arrival time (named in "time goes backwards" errors).
    time_field: ClassVar[str]
    #: Whether the first non-blank line is a header rather than a request.
    has_header: ClassVar[bool]

    def __init__(self, path: str, first_line: str, lineno: int) -> None:
        self.path = path

    @staticmethod
    @abstractmethod
    def sniff(first_line: str) -> bool:
        """Whether a file whose first non-blank line is ``first_line`` is in this format."""

    @abstractmethod
    def parse(self, line: str, lineno: int) -> dict[str, Any]:
        """Request fields of one line; raises :class:`TraceFormatError`."""

    def metadata(self) -> dict[str, Any]:
        """Trace ``name``, ``source`` and ``block_size``."""
        return {"name": Path(self.path).stem, "source": f"{self.kind}:{self.path}", "block_size": None}

    def error(self, lineno: int, field: str | None, problem: str) -> TraceFormatError:
        return TraceFormatError(self.path, lineno, field, problem)

    # Field readers shared by the formats.

    def json_object(self, line: str, lineno: int) -> dict:
        return json_object(self.path, line, lineno)

    def field(self, record: dict, key: str, lineno: int) -> Any:
        if key not in record:
            raise self.error(lineno, key, "missing field")
        return record[key]

    def length(self, record: dict, key: str, lineno: int) -> int:
        """A token count: an integer >= 1 (negative or zero lengths are errors)."""
        value = self.field(record, key, lineno)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(lineno, key, f"expected an integer length, got {value!r}")
        if value < 0:
            raise self.error(lineno, key, f"negative length {value}")
        if value == 0:
            raise self.error(lineno, key, "length must be >= 1, got 0")
        return value

    def time(self, record: dict, key: str, lineno: int) -> float:
        """A time: a finite number >= 0."""
        value = self.field(record, key, lineno)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) < 1e300:
            raise self.error(lineno, key, f"expected a finite number, got {value!r}")
        if value < 0:
            raise self.error(lineno, key, f"negative time {value}")
        return float(value)

    def ids(self, record: dict, key: str, lineno: int, *, need: int | None = None) -> np.ndarray:
        """An int64 array of ids (a JSON list of 64-bit integers); exactly ``need`` of them when given."""
        value = self.field(record, key, lineno)
        try:
            array = np.asarray(value) if isinstance(value, list) else None
        except ValueError:                      # ragged nesting
            array = None
        if array is None or array.ndim != 1 or (len(array) and array.dtype.kind != "i"):
            raise self.error(lineno, key, "expected a list of 64-bit integers")
        if need is not None and len(array) != need:
            problem = "too short" if len(array) < need else "too long"
            raise self.error(lineno, key, f"{problem}: {len(array)} ids where {need} are needed")
        return array.astype(np.int64, copy=False)

    def block_prompt(self, record: dict, key: str, lineno: int, input_len: int, block_size: int) -> dict:
        need = -(-input_len // block_size)
        return {"block_ids": self.ids(record, key, lineno, need=need), "block_size": block_size}


class NativeFormat(LineFormat):
    kind = "native"
    time_field = "arrival_s"
    has_header = True

    def __init__(self, path: str, first_line: str, lineno: int) -> None:
        super().__init__(path, first_line, lineno)
        header = self.json_object(first_line, lineno)
        version = self.field(header, "version", lineno)
        if version != NATIVE_VERSION:
            raise self.error(lineno, "version",
                             f"unsupported version {version!r} (this reader knows {NATIVE_VERSION})")
        block_size = header.get("block_size")
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                       or block_size < 1):
            raise self.error(lineno, "block_size", f"expected a positive integer or null, got {block_size!r}")
        self._header = {"name": str(self.field(header, "name", lineno)), "source": str(header.get("source", "")),
                        "block_size": block_size}

    @staticmethod
    def sniff(first_line: str) -> bool:
        return f'"{NATIVE_FORMAT}"' in first_line and '"format"' in first_line

    def metadata(self) -> dict[str, Any]:
        return dict(self._header)

    def parse(self, line: str, lineno: int) -> dict[str, Any]:
        record = self.json_object(line, lineno)
        request_id = self.field(record, "id", lineno)
        if not isinstance(request_id, str) or not request_id:
            raise self.error(lineno, "id", f"expected a non-empty string, got {request_id!r}")
        input_len = self.length(record, "input_len", lineno)
        fields = {"request_id": request_id,
                  "arrival_s": self.time(record, "arrival_s", lineno),
                  "input_len": input_len, "output_len": self.length(record, "output_len", lineno)}
        if ("token_ids" in record) == ("block_ids" in record):
            raise self.error(lineno, "token_ids", "give exactly one of token_ids or block_ids")
        if "token_ids" in record:
            fields["token_ids"] = self.ids(record, "token_ids", lineno, need=input_len)
        else:
            fields.update(self.block_prompt(record, "block_ids", lineno, input_len,
                                            self.length(record, "block_size", lineno)))
        for label in ("session", "group"):
            if record.get(label) is not None:
                fields[label] = str(record[label])
        return fields


class MooncakeFormat(LineFormat):
    kind = "mooncake"
    time_field = "timestamp"
    has_header = False

    @staticmethod
    def sniff(first_line: str) -> bool:
        return first_line.lstrip().startswith("{") and any(f'"{key}"' in first_line
                                                            for key in ("hash_ids", "input_length"))

    def metadata(self) -> dict[str, Any]:
        return {**super().metadata(), "block_size": MOONCAKE_BLOCK_SIZE}

    def parse(self, line: str, lineno: int) -> dict[str, Any]:
        record = self.json_object(line, lineno)
        input_len = self.length(record, "input_length", lineno)
        return {"arrival_s": self.time(record, "timestamp", lineno) / 1000.0,
                "input_len": input_len, "output_len": self.length(record, "output_length", lineno),
                **self.block_prompt(record, "hash_ids", lineno, input_len, MOONCAKE_BLOCK_SIZE)}


class PlainTokenFormat(LineFormat):
    kind = "plain"
    time_field = "timestamp"
    has_header = False

    @staticmethod
    def sniff(first_line: str) -> bool:
        return first_line.lstrip().startswith("{") and '"token_ids"' in first_line

    def parse(self, line: str, lineno: int) -> dict[str, Any]:
        record = self.json_object(line, lineno)
        token_ids = self.ids(record, "token_ids", lineno)
        if token_ids.size == 0:
            raise self.error(lineno, "token_ids", "expected at least one token id")
        fields = {"arrival_s": self.time(record, "timestamp", lineno), "input_len": int(token_ids.size),
                  "output_len": self.length(record, "output_length", lineno), "token_ids": token_ids}
        for label, key in (("request_id", "id"), ("session", "session"), ("group", "group")):
            if record.get(key) is not None:
                fields[label] = str(record[key])
        return fields


class AzureFormat(LineFormat):
    kind = "azure"
    time_field = "TIMESTAMP"
    has_header = True

    def __init__(self, path: str, first_line: str, lineno: int) -> None:
        super().__init__(path, first_line, lineno)
        header = [name.strip() for name in first_line.split(",")]
        missing = [name for name in AZURE_COLUMNS if name not in header]
        if missing:
            raise self.error(lineno, missing[0], "missing column in the CSV header")
        self._columns = {name: header.index(name) for name in AZURE_COLUMNS}
        self._width = len(header)
        self._first_time: datetime | None = None
        self._next_block_id = 0

    @staticmethod
    def sniff(first_line: str) -> bool:
        return first_line.startswith("TIMESTAMP,")

    def metadata(self) -> dict[str, Any]:
        return {**super().metadata(), "block_size": AZURE_BLOCK_SIZE}

    def _cell(self, cells: list[str], name: str) -> str:
        return cells[self._columns[name]].strip()

    def _length(self, cells: list[str], name: str, lineno: int) -> int:
        text = self._cell(cells, name)
        try:
            value = int(text)
        except ValueError:
            raise self.error(lineno, name, f"expected an integer length, got {text!r}") from None
        return self.length({name: value}, name, lineno)

    def parse(self, line: str, lineno: int) -> dict[str, Any]:
        cells = line.rstrip("\r\n").split(",")
        if len(cells) != self._width:
            raise self.error(lineno, None, f"expected {self._width} comma-separated fields, got {len(cells)}")
        text = self._cell(cells, "TIMESTAMP")
        try:
            stamp = datetime.fromisoformat(text)
        except ValueError:
            raise self.error(lineno, "TIMESTAMP", f"not a datetime: {text!r}") from None
        input_len = self._length(cells, "ContextTokens", lineno)
        output_len = self._length(cells, "GeneratedTokens", lineno)
        if self._first_time is None:
            self._first_time = stamp
        num_blocks = -(-input_len // AZURE_BLOCK_SIZE)
        block_ids = np.arange(self._next_block_id, self._next_block_id + num_blocks, dtype=np.int64)
        self._next_block_id += num_blocks
        return {"arrival_s": (stamp - self._first_time).total_seconds(), "input_len": input_len,
                "output_len": output_len, "block_ids": block_ids, "block_size": AZURE_BLOCK_SIZE}


FORMATS: tuple[type[LineFormat], ...] = (NativeFormat, MooncakeFormat, PlainTokenFormat, AzureFormat)


def json_object(path: str, line: str, lineno: int) -> dict:
    """One JSON object from one line."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(path, lineno, None, f"malformed JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise TraceFormatError(path, lineno, None, f"expected a JSON object, got {type(record).__name__}")
    return record


def detect_format(path: str, first_line: str, lineno: int) -> LineFormat:
    """The reader for a file whose first non-blank line, number ``lineno``, is ``first_line``."""
    for fmt in FORMATS:
        if fmt.sniff(first_line):
            return fmt(path, first_line, lineno)
    if first_line.lstrip().startswith("{"):
        json_object(path, first_line, lineno)  # a malformed first line is named as such
    raise TraceFormatError(path, lineno, None, "unrecognised trace format: expected a feather-trace header, "
                           "a Mooncake record with hash_ids, a plain record with token_ids, or the Azure CSV header "
                           + ",".join(AZURE_COLUMNS))
