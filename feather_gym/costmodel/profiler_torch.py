"""Torch profiler backend: time real decode (and prefill) steps of a model's layers.

One decode step = for every layer: RMSNorm, QKV projection, attention of each request over
its KV, output projection, RMSNorm, gated SiLU MLP; then the LM head. Weights and KV are
random tensors of the model's shape (values do not change the work). The KV of a prefix
group is ONE tensor that all the group's requests read (paged prefix caching); requests of
different groups are interleaved in the batch (request ``i`` is in group ``i % G``).

Two attention variants, both merging the shared-prefix part with the request's own suffix
by log-sum-exp:

* ``per_request``: each request attends to its group's prefix on its own (a paged-attention
  kernel): the prefix is read once per request. One call per group runs the group's requests
  as a batch over the prefix's K/V broadcast to them (a stride-0 view, not a copy);
* ``cascade``: each group's prefix is attended once for all its requests' queries stacked
  (FlashInfer / vLLM cascade attention): the prefix is read once per group.

Suffix attention is batched over requests (all have the same suffix length in a grid point).

Layer scaling: on CPU only ``profiled_layers`` of the model's layers are run (default 4) and
the layers' time is multiplied by ``layers / profiled_layers``; the LM head is timed apart
and not scaled. Layers are identical in work, so this is exact up to cache effects between
layers. CUDA runs all layers; every grid point is warmed up before timing; the two variants'
repetitions are interleaved so machine load hits both alike.

On CUDA a grid point's layers and its LM head are captured once as two CUDA graphs and every
timed step replays them between CUDA events, so kernel-launch overhead, which vLLM's CUDA-graph
decode does not pay, is not timed; where capture fails the run goes on eagerly, synchronising
around each timed region, and its settings say so. Weights and KV are drawn on the device.

Budget: with ``budget_s`` no grid point after the first starts once that many seconds have
passed. Points are measured in priority order (the homogeneity points, then the prefills, then
the other decode points in a seeded random order), so a run cut short keeps the homogeneity
comparison and a uniform sample of the rest; rows are written in grid order either way.

Clock: CUDA events around graph replays on CUDA (wall time, ``perf_counter``, when eager), and
wall time on multi-threaded CPU runs. A single-threaded CPU run (the default) uses the thread's
CPU time (``thread_time``): torch then runs every op in the calling thread, so the step's CPU
time is its wall time on an idle machine, and other processes' time slices on a shared machine
do not count (on this 2-core box shared by
several jobs, wall-time repeats of one point spread by ~40%, CPU-time repeats by ~5%).
Cache and memory-bandwidth interference from other processes still shows.
"""

from __future__ import annotations

import math
import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from .features import DecodeBatch
from .profile_io import PROFILE_SCHEMA, STAT_FIELDS
from .shapes import ModelShape, model_preset

CPU_PROFILED_LAYERS = 4
#: KV cache space recorded for CPU profiles: the vLLM CPU backend's KV space (VLLM_CPU_KVCACHE_SPACE, GiB).
CPU_KV_CACHE_BYTES = 4 * 2**30
MAX_POOL_TOKENS = 65_536   # per layer: max B x suffix and max G x prefix in a grid


@dataclass(frozen=True)
class DecodePoint:
    batch_size: int
    num_groups: int
    shared_prefix_tokens: int
    unique_tokens_per_request: int

    def batch(self) -> DecodeBatch:
        return DecodeBatch.from_groups(self.batch_size, self.num_groups, self.shared_prefix_tokens,
                                       self.unique_tokens_per_request)


#: Points always profiled: homogeneous vs mixed at equal batch size and KV, and the split batches.
HOMOGENEITY_POINTS = (DecodePoint(32, 1, 8192, 256), DecodePoint(32, 8, 8192, 256), DecodePoint(4, 1, 8192, 256))
#: Batch sizes of the decode grid; a CUDA grid adds batches of the size a GPU serves.
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
CUDA_BATCH_SIZES = BATCH_SIZES + (128, 256)
#: (batch size, groups, prefix tokens, own tokens) of a CUDA profile's homogeneity comparison
#: (its ``settings.homogeneity_point``): 256 requests over 8 prefixes against one prefix, and
#: against 8 batches of 32 (:data:`HOMOGENEITY_POINTS`' first).
CUDA_HOMOGENEITY = (256, 8, 8192, 256)


def homogeneity_points(device: str) -> tuple[DecodePoint, ...]:
    """The points a grid on ``device`` always holds and measures first: :data:`HOMOGENEITY_POINTS`,
    on CUDA with the mixed and the one-prefix batch of :data:`CUDA_HOMOGENEITY`."""
    if device != "cuda":
        return HOMOGENEITY_POINTS
    batch, groups, prefix, own = CUDA_HOMOGENEITY
    return HOMOGENEITY_POINTS + (DecodePoint(batch, groups, prefix, own), DecodePoint(batch, 1, prefix, own))


def decode_grid(quick: bool, seed: int = 0, device: str = "cpu") -> list[DecodePoint]:
    """Grid of batch compositions over :data:`BATCH_SIZES` (:data:`CUDA_BATCH_SIZES` on CUDA).
    Sharing points: G in {1,2,4,8} (G < B, G | B), prefix in {512, 2048, 8192}, suffix in
    {16, 256, 1024}; no-sharing points: G = B, prefix 0, suffix up to 2048; every KV pool within
    :data:`MAX_POOL_TOKENS`. ``quick`` samples 48 of them plus :func:`homogeneity_points`."""
    points = []
    for b in CUDA_BATCH_SIZES if device == "cuda" else BATCH_SIZES:
        points += [DecodePoint(b, b, 0, s) for s in (16, 256, 1024, 2048) if b * s <= MAX_POOL_TOKENS]
        points += [DecodePoint(b, g, p, s) for g in (1, 2, 4, 8) if g < b and b % g == 0
                   for p in (512, 2048, 8192) if g * p <= MAX_POOL_TOKENS
                   for s in (16, 256, 1024) if b * s <= MAX_POOL_TOKENS]
    if quick:
        first = homogeneity_points(device)
        rest = [p for p in points if p not in first]
        points = list(first) + random.Random(seed).sample(rest, 48)
    return sorted(set(points), key=lambda p: (p.batch_size, p.num_groups, p.shared_prefix_tokens,
                                              p.unique_tokens_per_request))


def prefill_grid(quick: bool) -> list[tuple[int, int]]:
    """(new_tokens, cached_tokens) pairs."""
    news, cached = ((16, 64, 256, 512), (0, 2048)) if quick else ((16, 64, 256, 1024), (0, 1024, 4096, 8192))
    return [(n, c) for n in news for c in cached]


class TorchStepRunner:
    """Weights and KV pools of ``profiled_layers`` layers of ``shape`` on ``device``; runs steps.

    KV pools are flat per-layer buffers of :data:`MAX_POOL_TOKENS` tokens; a grid point views
    the first ``G x prefix`` (resp. ``B x suffix``) tokens, contiguous, without copying.
    ``cuda_graphs`` (CUDA only) says whether steps are timed as graph replays; it turns False,
    with the reason in ``graph_error``, when a capture fails.
    """

    def __init__(self, shape: ModelShape, device: str, profiled_layers: int, seed: int = 0) -> None:
        import torch

        self.torch = torch
        self.shape = shape
        self.device = torch.device(device)
        self.dtype = getattr(torch, shape.dtype)
        self.profiled_layers = profiled_layers
        generator = torch.Generator(device=self.device).manual_seed(seed)
        s = shape

        def rand(*size, scale=1.0):
            return torch.randn(*size, generator=generator, device=self.device, dtype=self.dtype).mul_(scale)

        w = 1.0 / math.sqrt(s.hidden)
        self.layers = [dict(
            wqkv=rand(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim, scale=w),
            wo=rand(s.heads * s.head_dim, s.hidden, scale=w),
            wgu=rand(s.hidden, 2 * s.intermediate, scale=w),
            wdown=rand(s.intermediate, s.hidden, scale=1.0 / math.sqrt(s.intermediate)),
            norm1=rand(s.hidden), norm2=rand(s.hidden),
            k_prefix=rand(MAX_POOL_TOKENS * s.kv_heads * s.head_dim),
            v_prefix=rand(MAX_POOL_TOKENS * s.kv_heads * s.head_dim),
            k_suffix=rand(MAX_POOL_TOKENS * s.kv_heads * s.head_dim),
            v_suffix=rand(MAX_POOL_TOKENS * s.kv_heads * s.head_dim),
        ) for _ in range(profiled_layers)]
        self.head = rand(s.hidden, s.vocab, scale=w)
        self.final_norm = rand(s.hidden)
        self.scale = 1.0 / math.sqrt(s.head_dim)
        self.clock = time.thread_time if self.device.type == "cpu" and torch.get_num_threads() == 1 \
            else time.perf_counter
        self.cuda_graphs = self.device.type == "cuda"
        self.graph_error: str | None = None

    @property
    def timing(self) -> str:
        """How steps are timed: ``cuda_graph_events``, or the clock's name (``thread_time``, ``perf_counter``)."""
        return "cuda_graph_events" if self.cuda_graphs else self.clock.__name__

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def _rmsnorm(self, x, weight):
        return x * self.torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def _attend(self, q, k, v, causal: bool = False):
        """Fused attention of ``q [batch, heads, n, d]`` over ``k, v [batch, heads, t, d]``
        (torch's flash-attention kernel, which also returns the log-sum-exp): (output, lse [..., n, 1])."""
        aten = self.torch.ops.aten
        if self.device.type == "cuda":
            out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=self.scale)[:2]
        else:
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=self.scale)
        return out, lse.unsqueeze(-1).to(out.dtype)

    def _merge(self, first, second):
        """Combine two partial attentions over disjoint KV by their log-sum-exps."""
        (o1, lse1), (o2, lse2) = first, second
        top = self.torch.maximum(lse1, lse2)
        w1, w2 = self.torch.exp(lse1 - top), self.torch.exp(lse2 - top)
        return (o1 * w1 + o2 * w2) / (w1 + w2)

    def _prefix_attention(self, q, k_prefix, v_prefix, groups: int, cascade: bool):
        """``q [B, kv_heads, q_per_kv, d]`` over group ``i % groups``'s prefix ``[G, kv_heads, P, d]``,
        one call per group: its requests' queries stacked as one (``cascade``), or its requests
        as a batch reading the prefix each (``per_request``)."""
        torch = self.torch
        b, kvh, per_kv, d = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(b, kvh, per_kv, 1, device=q.device, dtype=q.dtype)
        for g in range(groups):
            members = q[g::groups]
            n = members.shape[0]
            k, v = k_prefix[g: g + 1], v_prefix[g: g + 1]
            if cascade:
                stacked = members.permute(1, 0, 2, 3).reshape(1, kvh, n * per_kv, d)
                o, l = self._attend(stacked, k, v)
                o = o.reshape(kvh, n, per_kv, d).permute(1, 0, 2, 3)
                l = l.reshape(kvh, n, per_kv, 1).permute(1, 0, 2, 3)
            else:
                o, l = self._attend(members.contiguous(), k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1))
            out[g::groups], lse[g::groups] = o, l
        return out, lse

    def _layer(self, x, weights, attention: Callable):
        s = self.shape
        h = self._rmsnorm(x, weights["norm1"]) @ weights["wqkv"]
        q = h[..., : s.heads * s.head_dim]
        attended = attention(q, h, weights)
        x = x + attended.reshape(x.shape[0], -1) @ weights["wo"]
        gate, up = (self._rmsnorm(x, weights["norm2"]) @ weights["wgu"]).chunk(2, dim=-1)
        return x + (self.torch.nn.functional.silu(gate) * up) @ weights["wdown"]

    def _timer(self, x, attention: Callable, sampled_rows: int) -> Callable[[], float]:
        """A callable that times one forward of ``x`` and returns its seconds: all layers (scaled to
        the full model) plus the LM head and greedy sampling of the last ``sampled_rows`` rows
        (every request in decode, the last token in prefill). On CUDA it replays the forward
        captured as graphs (module docstring); otherwise it runs the forward eagerly."""
        def layers():
            y = x
            for weights in self.layers:
                y = self._layer(y, weights, attention)
            return y

        def head(y):
            return (self._rmsnorm(y[-sampled_rows:], self.final_norm) @ self.head).argmax(-1)

        scale = self.shape.layers / self.profiled_layers
        if self.cuda_graphs:
            replay = self._graph_timer(layers, head, scale)
            if replay is not None:
                return replay

        def eager() -> float:
            with self.torch.inference_mode():
                self.synchronize()
                start = self.clock()
                y = layers()
                self.synchronize()
                middle = self.clock()
                head(y)
                self.synchronize()
                end = self.clock()
            return (middle - start) * scale + (end - middle)

        return eager

    def _graph_timer(self, layers: Callable, head: Callable, scale: float) -> Callable[[], float] | None:
        """Replays of ``layers`` and ``head`` captured as two CUDA graphs, timed by CUDA events;
        None (and graphs off for the rest of the run) when capture fails."""
        torch = self.torch
        try:
            with torch.inference_mode():
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):   # lazy initialisation (cuBLAS, kernels) outside capture
                    head(layers())
                torch.cuda.current_stream().wait_stream(side)
                body, tail = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                with torch.cuda.graph(body):
                    out = layers()
                with torch.cuda.graph(tail, pool=body.pool()):
                    head(out)
        except RuntimeError as exc:
            self.cuda_graphs, self.graph_error = False, f"{type(exc).__name__}: {exc}"
            return None
        start, middle, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))

        def replay() -> float:
            start.record()
            body.replay()
            middle.record()
            tail.replay()
            end.record()
            end.synchronize()
            return start.elapsed_time(middle) / 1e3 * scale + middle.elapsed_time(end) / 1e3

        return replay

    def decode_step_s(self, point: DecodePoint, cascade: bool) -> float:
        """Time one decode step of the batch ``point`` describes."""
        return self.decode_timer(point, cascade)()

    def decode_timer(self, point: DecodePoint, cascade: bool) -> Callable[[], float]:
        """A callable timing decode steps of the batch ``point`` describes (:meth:`_timer`)."""
        s, b, g = self.shape, point.batch_size, point.num_groups
        kvh, d, per_kv = s.kv_heads, s.head_dim, s.heads // s.kv_heads
        prefix, suffix = point.shared_prefix_tokens, point.unique_tokens_per_request

        def attention(q, _, weights):
            q = q.reshape(b, kvh, per_kv, d).contiguous()
            own = self._attend(q, weights["k_suffix"][: b * kvh * suffix * d].view(b, kvh, suffix, d),
                               weights["v_suffix"][: b * kvh * suffix * d].view(b, kvh, suffix, d))
            if not prefix:
                return own[0]
            shared = self._prefix_attention(
                q, weights["k_prefix"][: g * kvh * prefix * d].view(g, kvh, prefix, d),
                weights["v_prefix"][: g * kvh * prefix * d].view(g, kvh, prefix, d), g, cascade)
            return self._merge(shared, own)

        x = self.torch.randn(b, s.hidden, device=self.device, dtype=self.dtype)
        return self._timer(x, attention, sampled_rows=b)

    def _prefill_attention(self, q, k_new, v_new, k_cached=None, v_cached=None):
        """Attention of ``n`` new tokens: causal over their own K/V, plus (if given) the cached
        prefix's, merged by LSE. ``q [n, heads, d]``, ``k_new, v_new [n, kv_heads, d]``,
        ``k_cached, v_cached [kv_heads, cached, d]``. The own part runs per query head (the new
        K/V is small, so it is repeated per head); the cached part runs in the grouped layout,
        so the cache is read without copying. Returns ``[n, heads, d]``."""
        n, heads, d = q.shape
        kvh = k_new.shape[1]
        q = q.transpose(0, 1).unsqueeze(0)
        k_new, v_new = (t.transpose(0, 1).repeat_interleave(heads // kvh, dim=0).unsqueeze(0) for t in (k_new, v_new))
        out, lse = self._attend(q, k_new, v_new, causal=True)
        if k_cached is not None:
            o, l = self._attend(q.reshape(1, kvh, heads // kvh * n, d), k_cached.unsqueeze(0), v_cached.unsqueeze(0))
            out = self._merge((o.reshape(1, heads, n, d), l.reshape(1, heads, n, 1)), (out, lse))
        return out[0].transpose(0, 1)

    def prefill_step_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Time a prefill of ``new_tokens`` (causal among themselves) after ``cached_tokens`` cached."""
        return self.prefill_timer(new_tokens, cached_tokens)()

    def prefill_timer(self, new_tokens: int, cached_tokens: int) -> Callable[[], float]:
        """A callable timing prefill steps as :meth:`prefill_step_s` describes (:meth:`_timer`)."""
        torch, s = self.torch, self.shape
        kvh, d, n = s.kv_heads, s.head_dim, new_tokens

        def attention(q, h, weights):
            k_new, v_new = (h[:, (s.heads + i * kvh) * d: (s.heads + (i + 1) * kvh) * d].reshape(n, kvh, d)
                            for i in (0, 1))
            cached = (weights[f"{kv}_prefix"][: kvh * cached_tokens * d].view(kvh, cached_tokens, d)
                      for kv in "kv") if cached_tokens else ()
            return self._prefill_attention(q.reshape(n, s.heads, d), k_new, v_new, *cached)

        x = torch.randn(n, s.hidden, device=self.device, dtype=self.dtype)
        return self._timer(x, attention, sampled_rows=1)


def _stats(samples: list[float]) -> dict:
    ordered = sorted(samples)
    mean = sum(ordered) / len(ordered)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    std = math.sqrt(sum((t - mean) ** 2 for t in ordered) / len(ordered))
    return dict(zip(STAT_FIELDS, (median, mean, std, ordered[0], ordered[-1]))) | {"repeats": len(ordered)}


def measurement_order(decode_points: list[DecodePoint], prefill_points: list[tuple[int, int]],
                      seed: int = 0, first: tuple[DecodePoint, ...] = HOMOGENEITY_POINTS,
                      ) -> list[DecodePoint | tuple[int, int]]:
    """The order a budgeted run measures its points in: the decode points that are in ``first``
    (the device's :func:`homogeneity_points`), then the prefill points, then the other decode
    points in a seeded random order."""
    rest = [p for p in decode_points if p not in first]
    random.Random(seed).shuffle(rest)
    return [p for p in decode_points if p in first] + list(prefill_points) + rest


def _decode_rows(runner: TorchStepRunner, point: DecodePoint, repeats: int, warmup: int) -> list[dict]:
    """The per-request and the cascade row of ``point``, their repetitions interleaved."""
    timers = {cascade: runner.decode_timer(point, cascade) for cascade in (False, True)}
    samples = {False: [], True: []}
    for cascade, timer in timers.items():
        for _ in range(warmup):
            timer()
    for _ in range(repeats):
        for cascade, timer in timers.items():
            samples[cascade].append(timer())
    batch = point.batch()
    return [{"phase": "decode", "attention": "cascade" if cascade else "per_request",
             "batch_size": point.batch_size, "num_groups": batch.num_groups,
             "shared_prefix_tokens": point.shared_prefix_tokens,
             "unique_tokens_per_request": point.unique_tokens_per_request,
             "total_kv_tokens": batch.total_kv_tokens, "unique_kv_tokens": batch.unique_kv_tokens,
             **_stats(samples[cascade])} for cascade in (False, True)]


def _prefill_row(runner: TorchStepRunner, new: int, cached: int, repeats: int, warmup: int) -> dict:
    timer = runner.prefill_timer(new, cached)
    for _ in range(warmup):
        timer()
    return {"phase": "prefill", "new_tokens": new, "cached_tokens": cached, **_stats([timer() for _ in range(repeats)])}


def _measure(runner: TorchStepRunner, decode_points: list[DecodePoint], prefill_points: list[tuple[int, int]],
             repeats: int, warmup: int, progress: Callable[[str], None] | None,
             budget_s: float | None = None, seed: int = 0,
             first: tuple[DecodePoint, ...] = HOMOGENEITY_POINTS) -> tuple[list[dict], int]:
    """Measurement rows (profile_io schema) of the points started within ``budget_s`` seconds
    (the first always; all without a budget), both attention variants for decode, in grid order
    (decode points, then prefill points), and how many points the budget left out. Measured in
    :func:`measurement_order`."""
    deadline = None if budget_s is None else time.monotonic() + budget_s
    order = measurement_order(decode_points, prefill_points, seed, first)
    rows: dict = {}
    for index, point in enumerate(order):
        if rows and deadline is not None and time.monotonic() >= deadline:
            break
        if isinstance(point, DecodePoint):
            rows[point] = _decode_rows(runner, point, repeats, warmup)
            line = (f"per_request {rows[point][0]['median_s'] * 1e3:.1f} ms, "
                    f"cascade {rows[point][1]['median_s'] * 1e3:.1f} ms")
        else:
            rows[point] = [_prefill_row(runner, *point, repeats, warmup)]
            line = f"prefill {rows[point][0]['median_s'] * 1e3:.1f} ms"
        if progress:
            progress(f"{index + 1}/{len(order)} {point}: {line}")
    measured = [row for point in [*decode_points, *prefill_points] if point in rows for row in rows[point]]
    return measured, len(order) - len(rows)


def hardware_info(device: str) -> dict:
    """Device name, cores, memory and last-level cache size of this machine (or its GPU)."""
    import torch

    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        return {"device": "cuda", "name": props.name, "cores": props.multi_processor_count,
                "memory_bytes": props.total_memory, "cache_bytes": getattr(props, "L2_cache_size", 50 * 2**20)}
    name = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    caches = [int(open(f"/sys/devices/system/cpu/cpu0/cache/index{i}/size").read().strip().rstrip("K")) * 1024
              for i in range(4) if os.path.exists(f"/sys/devices/system/cpu/cpu0/cache/index{i}/size")]
    return {"device": "cpu", "name": name, "cores": os.cpu_count() or 1,
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "cache_bytes": max(caches, default=32 * 2**20)}


def run_torch_profile(model: str, device: str = "cpu", *, quick: bool = False, profiled_layers: int | None = None,
                      repeats: int | None = None, warmup: int = 1, seed: int = 0, name: str | None = None,
                      progress: Callable[[str], None] | None = None, decode_points: list[DecodePoint] | None = None,
                      prefill_points: list[tuple[int, int]] | None = None, threads: int | None = 1,
                      budget_s: float | None = None) -> dict:
    """Profile ``model`` (a preset name) on ``device``; returns a ``feather-profile/1`` dict.

    Weights and KV are float32 on CPU, bfloat16 on CUDA. ``decode_points``/``prefill_points``
    override the grids (tests use tiny ones). ``threads`` sets torch's intra-op threads
    (default 1: on a small shared machine more threads than free cores makes OpenMP spin and
    timings erratic; ``None`` keeps torch's default). ``budget_s``: no point starts after that
    many seconds of measuring (module docstring); ``settings.skipped_points`` counts those left out.
    """
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device")
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"budget_s must be a positive number of seconds, got {budget_s!r}")
    shape = model_preset(model).with_dtype("bfloat16" if device == "cuda" else "float32")
    layers = profiled_layers
    if layers is None:
        layers = shape.layers if device == "cuda" else min(CPU_PROFILED_LAYERS, shape.layers)
    if repeats is None:
        repeats = 5 if quick else 7
    decode_points = decode_grid(quick, seed, device) if decode_points is None else decode_points
    prefill_points = prefill_grid(quick) if prefill_points is None else prefill_points
    previous_threads = torch.get_num_threads()
    # An in-process vLLM CPU engine replaces torch.set_num_threads with a no-op, so record the
    # thread count actually in effect, not the one asked for.
    torch.set_num_threads(previous_threads if threads is None else threads)
    threads = torch.get_num_threads()
    try:
        runner = TorchStepRunner(shape, device, layers, seed)
        measurements, skipped = _measure(runner, decode_points, prefill_points, repeats, warmup, progress,
                                         budget_s, seed, homogeneity_points(device))
    finally:
        torch.set_num_threads(previous_threads)
    hardware = hardware_info(device)
    kv_cache_bytes = (int(0.9 * hardware["memory_bytes"] - shape.weight_bytes) if device == "cuda"
                      else CPU_KV_CACHE_BYTES)
    return {
        "schema": PROFILE_SCHEMA, "kind": "measured", "name": name or device,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "backend": "torch", "hardware": hardware,
        "software": {"python": platform.python_version(), "torch": torch.__version__},
        "model": shape.to_dict(),
        "settings": {"clock": runner.timing, "profiled_layers": layers, "layer_scale": shape.layers / layers,
                     "repeats": repeats, "warmup": warmup, "quick": quick, "threads": threads, "seed": seed,
                     "budget_s": budget_s, "skipped_points": skipped,
                     **({"cuda_graphs": runner.cuda_graphs, "graph_error": runner.graph_error,
                         "homogeneity_point": list(CUDA_HOMOGENEITY)} if device == "cuda" else {}),
                     "note": "layers' time scaled by layers/profiled_layers, LM head unscaled; "
                             "requests of different groups interleaved; one attention call per group"},
        "kv_cache_bytes": kv_cache_bytes,
        "measurements": measurements,
    }
