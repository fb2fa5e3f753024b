"""The Feather scheduler's per-step log: a bounded in-memory ring and an optional rotating JSONL file.

Each engine step that computes something yields one
:class:`~feather_gym.costmodel.refit.LiveStep`: the batch's composition (what the cost model's
features need), the policy's observations and actions, and the measured step time, which
``feather profile refit --from-logs`` fits the cost model to.

What is timed: from the start of the scheduler's ``schedule()`` to the end of its
``update_from_output()`` for the same ``SchedulerOutput`` (paired by identity, so async
scheduling, where the next ``schedule()`` runs before this step's update, pairs correctly).
That is vLLM's ``EngineCore.step``: scheduling, model execution, sampling and the scheduler's
output update, on the wall clock and in the engine thread's CPU time. The profiler
(:mod:`feather_gym.costmodel.profiler_vllm`) times ``LLMEngine.step``, which adds the front
end's output processing (detokenisation) to the same work; with one torch thread the
model runs in the timed thread, so the CPU clock matches the profile's ``thread_time``.

Invariants: the ring never holds more than ``ring_steps`` records; the file never grows past
``max_bytes`` before it is rotated (``path`` -> ``path.1`` -> ... -> ``path.<backups>``, the
oldest dropped); a failing file (full disk, unwritable path) never raises into the engine: the
first failure logs one warning and the file is dropped for the rest of the scheduler's life
while the ring goes on.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from pathlib import Path

from deploy._composition import DecodeComposition
from feather_gym.costmodel.refit import LiveStep

__all__ = ["DecodeComposition", "StepLog", "step_composition"]

logger = logging.getLogger(__name__)


def step_composition(scheduler_output, requests: dict, block_size: int) -> dict:
    """The :class:`LiveStep` composition fields of a step vLLM has just scheduled.

    Read after ``schedule()``, when each request's ``num_computed_tokens`` already counts
    this step's tokens. A request scheduling one token after its prompt is a decode (context:
    the tokens computed before, plus this one); any other is a prefill chunk ``[new, cached]``
    (a preempted request's recomputation included); ``prefill_chunks`` lists them in ascending order.
    Distinct KV and groups come from the
    requests' block hashes (equal hashes are one cached block in vLLM's prefix cache); groups
    are keyed by the first block, a request without a full block is a group of its own.
    ``block_size`` is the tokens per block hash (the scheduler's ``hash_block_size``).
    O(blocks of the decoding requests): the definition, which :class:`DecodeComposition`
    (compiled, ``deploy/native/composition.cpp``) maintains incrementally for the scheduler: the
    same figures from O(scheduled requests) checks a step, plus O(blocks) once per request that
    starts or stops decoding.
    """
    decode = kv = 0
    chunks: list[list[int]] = []
    blocks: set = set()
    firsts: set = set()
    ungrouped = full_tokens = 0
    for request_id, new in scheduler_output.num_scheduled_tokens.items():
        request = requests[request_id]
        before = request.num_computed_tokens - new
        if new != 1 or before < request.num_prompt_tokens:
            chunks.append([new, before])
            continue
        decode += 1
        kv += before + 1
        hashes = request.block_hashes
        full = min(len(hashes), (before + 1) // block_size) if hashes else 0
        if full:
            firsts.add(hashes[0])
            blocks.update(hashes[:full])
            full_tokens += full * block_size
        else:
            ungrouped += 1
    unique = len(blocks) * block_size + (kv - full_tokens)
    return {"decode_requests": decode, "decode_kv_tokens": kv, "decode_unique_kv_tokens": unique,
            "decode_groups": len(firsts) + ungrouped, "prefill_chunks": sorted(chunks)}


class StepLog:
    """Records of the last ``ring_steps`` steps (``recent()``), also appended to ``path`` when given.

    ``enabled`` is False when neither keeps anything: the scheduler then builds no records.
    """

    def __init__(self, *, ring_steps: int = 4096, path: str | os.PathLike | None = None,
                 max_bytes: int = 64 * 2**20, backups: int = 2) -> None:
        if ring_steps < 0 or max_bytes < 1 or backups < 0:
            raise ValueError(f"step log: need ring_steps >= 0, max_bytes >= 1, backups >= 0 "
                             f"(got {ring_steps}, {max_bytes}, {backups})")
        self.ring: deque[LiveStep] = deque(maxlen=ring_steps)
        self.path = Path(path) if path is not None else None
        self.max_bytes, self.backups = max_bytes, backups
        self.enabled = ring_steps > 0 or self.path is not None
        self.steps = 0
        self.file_error: str | None = None
        self._file = None
        self._bytes = 0
        self._pending: dict[int, tuple[LiveStep, float, float]] = {}

    @staticmethod
    def clock() -> tuple[float, float]:
        """(wall seconds, this thread's CPU seconds), the two clocks a step is timed on."""
        return time.perf_counter(), time.thread_time()

    def begin(self, scheduler_output, record: LiveStep, start: tuple[float, float]) -> None:
        """``record`` (times not yet set) is the step ``scheduler_output``, started at ``start``."""
        if len(self._pending) >= 8:                 # steps never updated (an aborted engine): drop the oldest
            self._pending.pop(next(iter(self._pending)))
        self._pending[id(scheduler_output)] = (record, *start)

    def end(self, scheduler_output) -> LiveStep | None:
        """The step of ``scheduler_output`` has been updated: time it and keep it (None if not begun)."""
        pending = self._pending.pop(id(scheduler_output), None)
        if pending is None:
            return None
        record, wall, cpu = pending
        end_wall, end_cpu = self.clock()
        record.step_wall_s, record.step_cpu_s = end_wall - wall, end_cpu - cpu
        self.steps += 1
        self.ring.append(record)
        if self.path is not None and self.file_error is None:
            self._write(record.to_json() + "\n")
        return record

    def recent(self) -> list[LiveStep]:
        return list(self.ring)

    def describe(self) -> dict:
        return {"steps_logged": self.steps, "ring_steps": len(self.ring),
                "step_log": str(self.path) if self.path else None, "step_log_error": self.file_error}

    def _write(self, line: str) -> None:
        data = line.encode()
        try:
            if self._file is None:
                self._open()
            if self._bytes and self._bytes + len(data) > self.max_bytes:
                self._rotate()
            self._file.write(data)
            self._file.flush()
            self._bytes += len(data)
        except OSError as exc:  # full disk, unwritable path, vanished folder: never the engine's problem
            self.file_error = f"{type(exc).__name__}: {exc}"
            logger.warning("Feather step log %s failed (%s); the file log is off, serving and the in-memory "
                           "log go on", self.path, self.file_error)
            self.close()

    def _open(self) -> None:
        self._file = open(self.path, "ab")
        self._bytes = self._file.tell()

    def _rotate(self) -> None:
        self._file.close()
        self._file = None
        for index in range(self.backups, 0, -1):
            source = self.path.with_name(f"{self.path.name}.{index - 1}") if index > 1 else self.path
            if source.exists():
                os.replace(source, self.path.with_name(f"{self.path.name}.{index}"))
        if not self.backups:
            self.path.unlink(missing_ok=True)
        self._open()

    def close(self) -> None:
        """Close the file (kept records stay); errors on close are dropped."""
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass
