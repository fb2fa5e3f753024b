"""``feather bench cht``: Chunked Hash Tree costs, side by side with an SGLang LPM pass.

Workloads: seeded prefix groups (``--groups`` shared prefixes of ``--prefix-tokens``
tokens, each request adding ``--suffix-tokens`` unique ones), at every ``--waiting`` size;
the same with ~10K-token prompts; and the Mooncake conversation trace (block-id input,
chunk = its 512-token blocks) when the shared copy is present.

Each scheduling step, as a server would run it with W waiting and a full running batch:
``find_best`` then ``candidate_stats`` (the decision), ``activate`` it, ``finish`` the
oldest running request, and a new arrival is added so W stays constant. Single calls are
timed with ``perf_counter_ns`` (which adds ~0.05 µs), with the garbage collector off as
``timeit`` does. Numbers are printed, never asserted.

Against SGLang's LPM (:mod:`cache_core.cht.lpm`), twice:

* at W = ``--lpm-waiting`` (5,000): one LPM pass against one CHT decision. SGLang itself runs
  FCFS there (LPM only while at most :data:`SGLANG_LPM_MAX_WAITING` requests wait); the figure
  says what LPM would cost at that size.
* per scheduling round at each W of ``--lpm-round-waiting`` (at most 128, where SGLang does run
  LPM): SGLang's round is one LPM pass over the queue (its radix tree kept across passes, as
  the server keeps it); the CHT's round decides and activates each request it admits, timed
  for a round admitting one request and one admitting all W (the least and the most CHT work
  a round can take). SGLang's per-admission work is not counted: that favours SGLang.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections import deque

import numpy as np

from cache_core.cht.tree import ChunkedHashTree
from traces.chunk_hash import chained_chunk_hashes, request_chunk_hashes

MOONCAKE_TRACE = "mooncake_conversation_trace.jsonl"
#: SGLang's scheduler runs LPM only while the waiting queue holds at most this many requests, FCFS above.
SGLANG_LPM_MAX_WAITING = 128
TARGETS = {"add_10k_us": 50.0, "find_best_w20000_us_p50": 5.0, "activate_finish_10k_us": 50.0, "lpm_speedup_x": 1000.0}


class PrefixGroupPrompts:
    """Seeded prompts: ``groups`` shared prefixes, each request adds a unique suffix.

    A prompt is kept as ``(group, suffix)``; tokens are materialised on demand, so W=20,000
    prompts of 4,100 tokens do not all sit in memory at once.
    """

    def __init__(self, seed: int, groups: int, prefix_tokens: int, suffix_tokens: int) -> None:
        if groups < 1 or prefix_tokens < 0 or suffix_tokens < 0:
            raise ValueError("--groups must be >= 1 and token counts >= 0")
        self._rng = np.random.default_rng(seed)
        self._prefixes = self._rng.integers(256, 32000, size=(groups, prefix_tokens))
        self._prefix_lists = [p.tolist() for p in self._prefixes]
        self.suffix_tokens = suffix_tokens

    def next(self) -> tuple[int, np.ndarray]:
        return int(self._rng.integers(len(self._prefixes))), self._rng.integers(256, 32000, self.suffix_tokens)

    def tokens(self, prompt: tuple[int, np.ndarray]) -> np.ndarray:
        return np.concatenate([self._prefixes[prompt[0]], prompt[1]])

    def token_list(self, prompt: tuple[int, np.ndarray]) -> list[int]:
        """The prompt as SGLang holds it (a Python list; the group prefix's ints are shared)."""
        return self._prefix_lists[prompt[0]] + prompt[1].tolist()


def _us(ns: list[int] | np.ndarray, q: float) -> float:
    return round(float(np.percentile(np.asarray(ns) / 1e3, q)), 3) if len(ns) else float("nan")


def _timed(fn, *args) -> int:
    start = time.perf_counter_ns()
    fn(*args)
    return time.perf_counter_ns() - start


def fill(cht: ChunkedHashTree, digests: list[np.ndarray], first_id: int = 0) -> np.ndarray:
    """Add ``digests`` as waiting requests; ns per add."""
    times = np.empty(len(digests), dtype=np.int64)
    for i, d in enumerate(digests):
        start = time.perf_counter_ns()
        cht.add(first_id + i, d)
        times[i] = time.perf_counter_ns() - start
    return times


def add_figures(add_ns: np.ndarray, hash_ns: np.ndarray | None = None) -> dict:
    """Per-request add (and hashing) µs: medians, which a loaded machine disturbs least, and means."""
    figures = {"add_us_p50": _us(add_ns, 50), "add_us_mean": round(float(np.mean(add_ns)) / 1e3, 3)}
    if hash_ns is not None:
        figures |= {"hash_us_p50": _us(hash_ns, 50), "add_with_hash_us_p50": _us(hash_ns + add_ns, 50),
                    "add_with_hash_us_mean": round(float(np.mean(hash_ns + add_ns)) / 1e3, 3)}
    return figures


def schedule(cht: ChunkedHashTree, arrivals, steps: int, batch: int, first_id: int) -> dict:
    """Run ``steps`` scheduling steps (see module docstring); per-call µs percentiles.

    ``arrivals`` yields digests of new requests (None: no arrivals, the queue drains).
    """
    running: deque = deque()
    decide, stats_ns, activate, finish = [], [], [], []
    next_id = first_id
    for _ in range(steps):
        start = time.perf_counter_ns()
        best = cht.find_best()
        decided = time.perf_counter_ns()
        if best is None:
            break
        cht.candidate_stats(best)
        done = time.perf_counter_ns()
        decide.append(decided - start)
        stats_ns.append(done - start)
        activate.append(_timed(cht.activate, best))
        running.append(best)
        if len(running) > batch:
            finish.append(_timed(cht.finish, running.popleft()))
        if arrivals is not None:
            cht.add(next_id, next(arrivals))
            next_id += 1
    return {"find_best_us_p50": _us(decide, 50), "find_best_us_p99": _us(decide, 99),
            "decision_us_p50": _us(stats_ns, 50), "decision_us_p99": _us(stats_ns, 99),
            "activate_us_p50": _us(activate, 50), "activate_us_p99": _us(activate, 99),
            "finish_us_p50": _us(finish, 50), "finish_us_p99": _us(finish, 99),
            "steps": len(decide)}


def peak_bytes_per_request(chunk_size: int, digests: list[np.ndarray]) -> float:
    """tracemalloc peak of a CHT holding ``digests`` as waiting requests (own copies)."""
    gc.collect()
    tracemalloc.start()
    cht = ChunkedHashTree(chunk_size)
    for i, d in enumerate(digests):
        cht.add(i, d.copy())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return round(peak / len(digests), 1)


def hashed_prompts(prompts: PrefixGroupPrompts, count: int, chunk_size: int, log: dict) -> tuple[list, np.ndarray]:
    """``count`` new prompts recorded in ``log`` (id -> prompt), their digests, ns of hashing each."""
    digests, hash_ns = [], np.empty(count, dtype=np.int64)
    for i in range(count):
        prompt = log[len(log)] = prompts.next()
        tokens = prompts.tokens(prompt)
        start = time.perf_counter_ns()
        digests.append(chained_chunk_hashes(tokens, chunk_size))
        hash_ns[i] = time.perf_counter_ns() - start
    return digests, hash_ns


def bench_prefix_groups(args, waiting: int, lpm: bool) -> dict:
    """Fill W waiting requests, run the scheduling loop; optionally the LPM comparison."""
    prompts = PrefixGroupPrompts(args.seed, args.groups, args.prefix_tokens, args.suffix_tokens)
    log: dict[int, tuple] = {}
    digests, hash_ns = hashed_prompts(prompts, waiting, args.chunk_size, log)
    cht = ChunkedHashTree(args.chunk_size)
    add_ns = fill(cht, digests)
    arrivals = (hashed_prompts(prompts, 1, args.chunk_size, log)[0][0] for _ in iter(int, 1))
    result = {"waiting": waiting, "prompt_tokens": args.prefix_tokens + args.suffix_tokens,
              **add_figures(add_ns, hash_ns)}
    result |= schedule(cht, arrivals, args.steps, args.batch, first_id=waiting)
    result["peak_bytes_per_request"] = peak_bytes_per_request(args.chunk_size, digests)
    if lpm:
        # Same running batch and waiting queue for both sides: the batch the CHT loop formed
        # (one prefix group at a time), and the first arrivals as FCFS would run them (what
        # SGLang does itself above 128 waiting requests; the batch spans many groups).
        fcfs = ChunkedHashTree(args.chunk_size)
        fill(fcfs, digests)
        for i in range(args.batch):
            fcfs.activate(i)
        result["lpm_vs_cht"] = [
            {"running_set": name, **bench_lpm(tree, [prompts.token_list(log[i]) for i in tree.running_ids()],
                                              [prompts.token_list(log[i]) for i in tree.waiting_ids()])}
            for name, tree in (("cht_batch", cht), ("fcfs_batch", fcfs))]
    return result


def bench_10k_prompts(args, count: int) -> dict:
    """~10K-token prompts (groups share all but the last ``--suffix-tokens``)."""
    prompts = PrefixGroupPrompts(args.seed + 1, args.groups, 10_000 - args.suffix_tokens, args.suffix_tokens)
    digests, hash_ns = hashed_prompts(prompts, count, args.chunk_size, {})
    cht = ChunkedHashTree(args.chunk_size)
    add_ns = fill(cht, digests)
    steps = schedule(cht, None, count, args.batch, first_id=count)
    return {"requests": count, "prompt_tokens": 10_000, **add_figures(add_ns, hash_ns),
            **{k: v for k, v in steps.items() if k.startswith(("activate", "finish"))}}


def bench_chunk_sizes(args, count: int, sizes=(16, 32, 64, 128, 256, 512)) -> list[dict]:
    """Hash + add cost of 10K-token prompts per chunk size (how the default was chosen)."""
    rows = []
    for size in sizes:
        prompts = PrefixGroupPrompts(args.seed + 2, args.groups, 10_000 - args.suffix_tokens, args.suffix_tokens)
        digests, hash_ns = hashed_prompts(prompts, count, size, {})
        rows.append({"chunk_size_tokens": size, **add_figures(fill(ChunkedHashTree(size), digests), hash_ns)})
    return rows


def radix_cache(running: list[list[int]]):
    """SGLang's radix cache holding the ``running`` prompts."""
    from cache_core.cht.lpm import RadixCache

    cache = RadixCache()
    for prompt in running:
        cache.insert(prompt)
    return cache


def one_decision(cht: ChunkedHashTree) -> None:
    """One CHT decision: the best candidate and its observation features."""
    cht.candidate_stats(cht.find_best())


def admit(cht: ChunkedHashTree, limit: int) -> None:
    """The CHT's side of a scheduling round: decide and activate up to ``limit`` candidates."""
    for _ in range(limit):
        best = cht.find_best()
        if best is None:
            return
        cht.candidate_stats(best)
        cht.activate(best)


def bench_lpm(cht: ChunkedHashTree, running: list[list[int]], waiting: list[list[int]]) -> dict:
    """One SGLang LPM pass over the waiting queue vs one CHT decision, same running set."""
    from cache_core.cht.lpm import lpm_pass

    lpm_us = _timed(lpm_pass, radix_cache(running), waiting) / 1e3
    decision_us = _us([_timed(one_decision, cht) for _ in range(1000)], 50)
    return {"waiting": len(waiting), "running": len(running), "lpm_pass_us": round(lpm_us, 1),
            "cht_decision_us_p50": decision_us, "speedup_x": round(lpm_us / decision_us, 1)}


def bench_lpm_rounds(args, waiting: int) -> list[dict]:
    """Per scheduling round at W = ``waiting`` (see the module docstring), for two running sets of
    ``--batch`` requests: the first ones the CHT picks (few groups) and the first arrivals (FCFS)."""
    from cache_core.cht.lpm import lpm_pass

    prompts = PrefixGroupPrompts(args.seed, args.groups, args.prefix_tokens, args.suffix_tokens)
    log: dict[int, tuple] = {}
    digests, _ = hashed_prompts(prompts, args.batch + waiting, args.chunk_size, log)
    rows = []
    for running_set in ("cht_batch", "fcfs_batch"):
        def build() -> ChunkedHashTree:
            cht = ChunkedHashTree(args.chunk_size)
            fill(cht, digests)
            for i in range(args.batch):
                cht.activate(cht.find_best() if running_set == "cht_batch" else i)
            return cht

        cht = build()
        cache = radix_cache([prompts.token_list(log[i]) for i in cht.running_ids()])
        queue = [prompts.token_list(log[i]) for i in cht.waiting_ids()]
        lpm_us = _us([_timed(lpm_pass, cache, queue) for _ in range(args.round_repeats)], 50)
        row = {"waiting": waiting, "running": args.batch, "running_set": running_set, "lpm_pass_us_p50": lpm_us}
        for admitted, limit in (("one", 1), ("all", waiting)):
            cht_us = _us([_timed(admit, build(), limit) for _ in range(args.round_repeats)], 50)
            row |= {f"cht_round_{admitted}_us_p50": cht_us, f"speedup_x_{admitted}": round(lpm_us / cht_us, 2)}
        rows.append(row)
    return rows


def bench_mooncake(args) -> dict | None:
    """The Mooncake conversation trace: block ids used as digests (chunk = its blocks)."""
    from traces import load_trace, shared_trace_path

    path = shared_trace_path(MOONCAKE_TRACE)
    if path is None:
        return None
    trace = load_trace(path)
    digests = [request_chunk_hashes(request, trace.block_size) for request in trace]
    cht = ChunkedHashTree(trace.block_size)
    result = {"requests": len(digests), "chunk_size_tokens": trace.block_size,
              "mean_chunks_per_request": round(float(np.mean([len(d) for d in digests])), 1),
              **add_figures(fill(cht, digests))}
    result |= schedule(cht, None, len(digests), args.batch, first_id=len(digests))
    result["peak_bytes_per_request"] = peak_bytes_per_request(trace.block_size, digests)
    return result


def measure(args) -> dict:
    report = {"chunk_size_tokens": args.chunk_size, "seed": args.seed, "batch": args.batch,
              "workload": {"groups": args.groups, "prefix_tokens": args.prefix_tokens,
                           "suffix_tokens": args.suffix_tokens}}
    groups = []
    for waiting in sorted(set(args.waiting) | {args.lpm_waiting}):
        result = bench_prefix_groups(args, waiting, lpm=waiting == args.lpm_waiting)
        if "lpm_vs_cht" in result:
            report["lpm_vs_cht"] = result.pop("lpm_vs_cht")
        if waiting in args.waiting:
            groups.append(result)
        gc.collect()
    report["prefix_groups"] = groups
    report["lpm_vs_cht_rounds"] = [row for waiting in args.lpm_round_waiting for row in bench_lpm_rounds(args, waiting)]
    gc.collect()
    report["prompts_10k"] = bench_10k_prompts(args, args.long_prompts)
    report["chunk_size_sweep_10k"] = bench_chunk_sizes(args, max(args.long_prompts // 3, 1))
    report["mooncake"] = None if args.no_trace else bench_mooncake(args)
    largest, long = max(groups, key=lambda g: g["waiting"]), report["prompts_10k"]
    lpm = min(report["lpm_vs_cht"], key=lambda row: row["speedup_x"])
    report["targets"] = {
        "add_10k_us_max": TARGETS["add_10k_us"],
        "add_10k_met": long["add_with_hash_us_p50"] <= TARGETS["add_10k_us"],
        "find_best_us_p50_max": TARGETS["find_best_w20000_us_p50"], "find_best_at_waiting": largest["waiting"],
        "find_best_met": largest["find_best_us_p50"] <= TARGETS["find_best_w20000_us_p50"],
        "activate_finish_10k_us_max": TARGETS["activate_finish_10k_us"],
        "activate_finish_10k_met": (max(long["activate_us_p50"], long["finish_us_p50"])
                                    <= TARGETS["activate_finish_10k_us"]),
        "lpm_speedup_x_min": TARGETS["lpm_speedup_x"], "lpm_at_waiting": lpm["waiting"],
        "lpm_speedup_met": lpm["speedup_x"] >= TARGETS["lpm_speedup_x"],
    }
    return report


def print_table(report: dict) -> None:
    print(f"CHT benchmark (chunk {report['chunk_size_tokens']} tokens, batch {report['batch']}, "
          f"seed {report['seed']})")
    print(f"{'W':>7} {'hash p50':>8} {'add p50':>7} {'find_best p50/p99 µs':>21} {'decision p50 µs':>16} "
          f"{'activate p50 µs':>16} {'finish p50 µs':>14} {'bytes/req':>10}")
    for g in report["prefix_groups"]:
        print(f"{g['waiting']:>7} {g['hash_us_p50']:>8.2f} {g['add_us_p50']:>7.2f} "
              f"{g['find_best_us_p50']:>10.2f} / {g['find_best_us_p99']:<8.2f} {g['decision_us_p50']:>16.2f} "
              f"{g['activate_us_p50']:>16.2f} {g['finish_us_p50']:>14.2f} {g['peak_bytes_per_request']:>10.0f}")
    long = report["prompts_10k"]
    print(f"10K-token prompts: add p50 {long['add_with_hash_us_p50']:.2f} µs with hashing "
          f"({long['hash_us_p50']:.2f} hashing), {long['add_us_p50']:.2f} µs from digests; "
          f"activate p50/p99 {long['activate_us_p50']:.2f}/{long['activate_us_p99']:.2f} µs; "
          f"finish p50/p99 {long['finish_us_p50']:.2f}/{long['finish_us_p99']:.2f} µs")
    print("chunk size sweep (10K-token add p50 with hashing, µs): " + ", ".join(
        f"{row['chunk_size_tokens']}: {row['add_with_hash_us_p50']:.1f}" for row in report["chunk_size_sweep_10k"]))
    for lpm in report["lpm_vs_cht"]:
        print(f"SGLang LPM pass at W={lpm['waiting']} ({lpm['running']} running, {lpm['running_set']}; SGLang "
              f"runs FCFS above W={SGLANG_LPM_MAX_WAITING}): {lpm['lpm_pass_us'] / 1e3:.1f} ms vs CHT decision "
              f"{lpm['cht_decision_us_p50']:.2f} µs: {lpm['speedup_x']:.0f}x")
    print(f"per scheduling round at W <= {SGLANG_LPM_MAX_WAITING}, where SGLang runs LPM (p50 µs; SGLang: one LPM "
          f"pass; CHT: decide + activate each admitted request; x = LPM pass / CHT round):")
    print(f"{'W':>5} {'running set':>12} {'LPM pass':>10} {'CHT, 1 admitted':>16} {'x':>8} "
          f"{'CHT, all W admitted':>20} {'x':>7}")
    for row in report["lpm_vs_cht_rounds"]:
        print(f"{row['waiting']:>5} {row['running_set']:>12} {row['lpm_pass_us_p50']:>10.1f} "
              f"{row['cht_round_one_us_p50']:>16.1f} {row['speedup_x_one']:>7.1f}x "
              f"{row['cht_round_all_us_p50']:>20.1f} {row['speedup_x_all']:>6.2f}x")
    moon = report["mooncake"]
    if moon is None:
        print(f"Mooncake trace: skipped (--no-trace, or {MOONCAKE_TRACE} not found by traces.shared_trace_path)")
    else:
        print(f"Mooncake ({moon['requests']} requests, {moon['mean_chunks_per_request']} chunks each): add "
              f"{moon['add_us_p50']:.2f} µs; find_best p50/p99 {moon['find_best_us_p50']:.2f}/"
              f"{moon['find_best_us_p99']:.2f} µs; activate p50 {moon['activate_us_p50']:.2f} µs; finish p50 "
              f"{moon['finish_us_p50']:.2f} µs; {moon['peak_bytes_per_request']:.0f} bytes/request")
    print("targets: " + ", ".join(f"{k}={v}" for k, v in report["targets"].items() if k.endswith("_met")))
