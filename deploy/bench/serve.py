"""``feather bench serve``: vLLM's own scheduler against the Feather scheduler, live, on one engine.

One in-process engine per run; per workload, vLLM's ``Scheduler`` ("default", the reference) and
:class:`deploy.scheduler.FeatherScheduler` ("feather") with one policy take turns round by round
(:func:`deploy.bench.harness.run_schedulers`), and the report holds each side's figures and the
paired throughput ratio feather / default.
"""

from __future__ import annotations

import time

from deploy.bench.harness import DEFAULT_BENCH_KV_CACHE_GIB, clip_lengths, ideal_cached_tokens, run_schedulers
from deploy.engine_rounds import DEFAULT_ONLINE, kv_capacity
from feather_gym.policies import DEFAULT_MAX_WAIT_STEPS
from feather_gym.vllm_engine import resolve_kv_cache_gib, start_engine
from traces.table import cut
from traces.workload import ENGINE_SIZED_WORKLOADS

#: Default workloads: :data:`traces.workload.ENGINE_SIZED_WORKLOADS`, the CPU engine's workloads
#: (also the first three of the CPU training mix, the same specs). prefix-sharing: 4 groups share
#: a 3-block prefix (block size 128 on CPU), all of it fits in the KV cache; no-sharing: unique
#: prompts with Azure-conversation lengths capped at 512/48 tokens; prefix-heavy: 16 groups of
#: 4-block prefixes, 64 blocks where the cache holds 45, so a scheduler that interleaves groups
#: evicts shared prefixes and computes them again.
DEFAULT_WORKLOADS = ENGINE_SIZED_WORKLOADS
#: Default timed rounds per side.
DEFAULT_ROUNDS = 4


def compare(llm, trace, *, feather_kwargs: dict, rounds: int = DEFAULT_ROUNDS, online: bool = DEFAULT_ONLINE,
            time_scale: float = 1.0) -> dict:
    """:func:`run_schedulers` with vLLM's ``Scheduler`` ("default") and ``FeatherScheduler`` ("feather")."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.scheduler import FeatherScheduler

    return run_schedulers(llm, trace, {"default": (Scheduler, {}), "feather": (FeatherScheduler, feather_kwargs)},
                          rounds=rounds, online=online, time_scale=time_scale)


def serve_bench(policy: str, *, workloads: dict[str, str] | None = None, dtype: str = "float32",
                rounds: int = DEFAULT_ROUNDS, max_wait_steps: int = DEFAULT_MAX_WAIT_STEPS,
                max_input_tokens: int | None = None, max_output_tokens: int | None = None,
                online: bool = DEFAULT_ONLINE, time_scale: float = 1.0, kv_cache_gib: float | None = None,
                seed: int = 0) -> dict:
    """The whole ``feather serve bench`` report: one engine, one :func:`compare` per workload."""
    from deploy.scheduler import FeatherConfig, load_deployable_policy
    from traces import resolve_workload

    load_deployable_policy(policy)  # a missing/corrupt/incompatible policy fails here, before the engine starts
    started = time.perf_counter()
    kv_cache_gib = resolve_kv_cache_gib(kv_cache_gib, default=DEFAULT_BENCH_KV_CACHE_GIB)
    workloads = workloads or DEFAULT_WORKLOADS
    traces = {name: clip_lengths(resolve_workload(spec, seed=seed), max_input_tokens=max_input_tokens,
                                 max_output_tokens=max_output_tokens) for name, spec in workloads.items()}
    longest = max(r.input_len + r.output_len for t in traces.values() for r in t)
    config = FeatherConfig(policy=policy, max_wait_steps=max_wait_steps)
    llm = start_engine(dtype=dtype, max_model_len=max(2048, longest), seed=seed, kv_cache_gib=kv_cache_gib)
    capacity = kv_capacity(llm)
    report = {"model": "SmolLM2-135M-Instruct", "dtype": dtype, "policy": policy, "rounds": rounds,
              "online": online, "time_scale": time_scale, "max_wait_steps": config.max_wait_steps,
              "max_input_tokens": max_input_tokens, "max_output_tokens": max_output_tokens,
              "kv_cache_gib": kv_cache_gib, **capacity, "workloads": {}}
    for name, trace in traces.items():
        result = compare(llm, trace, feather_kwargs={"feather_config": config}, rounds=rounds, online=online,
                         time_scale=time_scale)
        report["workloads"][name] = {
            "spec": workloads[name],
            "ideal_cached_prompt_tokens": ideal_cached_tokens(trace, capacity["kv_block_size_tokens"]), **result}
    report["wall_s"] = round(time.perf_counter() - started, 1)
    return report


def format_serve_report(report: dict) -> str:
    """Side-by-side table of every workload's sides, then each side's paired throughput ratio."""
    arrivals = f"online x{report['time_scale']:g}" if report["online"] else "all requests at once"
    rows = [f"model {report['model']} ({report['dtype']}), policy {report['policy']}, {report['rounds']} rounds "
            f"each, {arrivals}, KV {report['kv_cache_gib']:g} GiB = {report['kv_capacity_tokens']} tokens, "
            f"{report['wall_s']:.0f} s",
            f"{'workload':<16}{'scheduler':<10}{'tok/s':>9}{'steps':>8}{'step ms':>9}{'cached tok':>12}"
            f"{'ttft p50 s':>12}{'ttft p99 s':>12}{'lost':>6}{'sched us/step':>15}"]
    for name, w in report["workloads"].items():
        short = cut(name, 15)
        for side, s in w["sides"].items():
            rows.append(f"{short:<16}{side:<10}{s['output_tok_s']:>9.1f}{s['steps']:>8.1f}{s['step_ms_mean']:>9.1f}"
                        f"{s['cached_prompt_tokens']:>12.0f}{_seconds(s['ttft_p50_s']):>12}"
                        f"{_seconds(s['ttft_p99_s']):>12}{s['requests_lost']:>6}"
                        f"{s['schedule_cpu_us_per_step'] + s['update_cpu_us_per_step']:>15.1f}")
        rows.append(f"{short:<16}ideal cached tokens {w['ideal_cached_prompt_tokens']}, identical outputs "
                    f"{w['identical_outputs']}/{w['num_requests']}")
        for side, r in w["ratios"].items():
            spread = "" if r["ci95"] is None else f", 95% CI {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}"
            rows.append(f"{short:<16}{side}/{w['reference']} throughput {r['mean']:.3f} (rounds "
                        f"{' '.join(f'{v:.3f}' for v in r['per_round'])}{spread})")
    return "\n".join(rows)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
