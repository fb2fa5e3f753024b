"""Train the Feather admission policy (STOP, or admit one of the CHT's candidates) with RLlib PPO
(new API stack) in the Feather gym.

One run: start (or join) Ray, build PPO on ``feather_gym/BatchFormation-v0`` with the run's
workload mix and cost-model profile, warm-start the network from a baseline
(:mod:`trainer.warm_start`, the Feather rule by default), iterate until the budget is spent
(printing a progress line per iteration and logging RLlib's metrics for TensorBoard), validate
the greedy network every few iterations on validation seeds and keep the best checkpoint,
export ``policy.onnx`` from it, evaluate it against every baseline on held-out seeds (trace files:
on the held-out later part of the trace, :meth:`TrainConfig.evaluation_workloads`), and write
the learning curve and a JSON summary. Output folder layout::

    <output>/checkpoint/        best-validated RLlib checkpoint (+ feather_training.json: profile, workloads, date)
    <output>/policy.onnx        the exported policy (trainer.export contract)
    <output>/clone.onnx         the warm-start clone as PPO began, evaluated beside it (absent when resuming)
    <output>/learning_curve.png
    <output>/summary.json       config, history, warm start, validation, timings, export parity, evaluation
    <output>/tensorboard/       RLlib result metrics as TensorBoard events
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from feather_gym.policies import Policy
from traces.workload import workload_labels
from trainer.config import TrainConfig, TrainingMix, training_env_seed
from trainer.logs import IterationRecord, RunLog

RLLIB_ENV_NAME = "feather-batch-formation"
CLONE_FILE, CLONE_LABEL = "clone.onnx", "clone"   # the warm-start clone, evaluated beside the trained policy
DEMONSTRATOR_LABEL = "demonstrator"   # the policy the warm start recorded (trainer.warm_start.demonstrator), likewise


def make_training_env(env_context):
    """RLlib env creator: the Feather env, its workload seeded per env runner
    (:func:`trainer.config.training_env_seed`)."""
    import gymnasium as gym

    from feather_gym.envs import ENV_ID

    seed = training_env_seed(env_context["seed"], env_context.worker_index)
    return gym.make(ENV_ID, **{**env_context, "seed": seed})


@contextlib.contextmanager
def ray_session(address: str | None) -> Iterator[None]:
    """Connect to the Ray cluster at ``address``, or start a private local Ray (no dashboard,
    auth disabled, a fresh temp dir) and shut it down and remove its temp dir afterwards."""
    import ray

    temp_dir = None
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        temp_dir = tempfile.mkdtemp(prefix="feather-ray-")
        ray.init(include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir)
    try:
        yield
    finally:
        ray.shutdown()
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)


@contextlib.contextmanager
def single_threaded_torch() -> Iterator[None]:
    """Torch on one thread in this process while it lasts: the learner (cloning and PPO's updates)
    runs here, on networks of a few thousand weights, where a second thread only contends with
    the env runner for the cores (measured several times slower on the 2-core VM)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def env_config(config: TrainConfig) -> dict:
    """The Feather env's settings for ``config`` (unset ones keep the env's defaults): the
    training part of each workload (:meth:`TrainConfig.training_workloads`)."""
    settings = {"workloads": list(config.training_workloads()), "profile": config.profile, "seed": config.seed,
                "window_requests": config.window_requests, "max_decisions": config.max_decisions,
                "kv_capacity_tokens": config.kv_capacity_tokens,
                "max_wait_steps": config.max_wait_steps,
                "num_candidates": config.num_candidates, "workload_instances": config.workload_instances}
    return {key: value for key, value in settings.items() if value is not None}


def ppo_config(config: TrainConfig):
    """RLlib's ``PPOConfig`` of ``config`` (its ``build_algo()`` needs Ray running)."""
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
    from ray.tune.registry import register_env

    register_env(RLLIB_ENV_NAME, make_training_env)
    return (
        PPOConfig()
        .environment(RLLIB_ENV_NAME, env_config=env_config(config))
        .env_runners(num_env_runners=config.num_env_runners, num_envs_per_env_runner=config.envs_per_env_runner,
                     rollout_fragment_length="auto")
        .learners(num_learners=0)
        .training(train_batch_size_per_learner=config.train_batch_size, minibatch_size=config.minibatch_size,
                  num_epochs=config.num_epochs, lr=config.lr, gamma=config.gamma, lambda_=config.gae_lambda,
                  entropy_coeff=config.entropy_coeff)
        .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=list(config.hidden_sizes),
                                                   fcnet_activation="tanh", vf_share_layers=False))
        .debugging(seed=config.seed)
    )


def restore(algo, checkpoint: Path) -> None:
    """Load a previous run's checkpoint into ``algo``; a corrupted one is a ``ValueError``."""
    try:
        algo.restore_from_path(str(Path(checkpoint).resolve()))
    except Exception as exc:  # RLlib surfaces pickle/IO/actor errors alike; all mean "unusable checkpoint"
        raise ValueError(f"cannot resume from checkpoint {checkpoint}: {type(exc).__name__}: {exc}") from exc


class NetworkPolicy(Policy):
    """The network being trained, acting greedily on the CHT's candidates (validation only).

    Its policy path (PPO's default module, ``vf_share_layers`` off: the actor encoder's dense
    layers with tanh between them, then the pi head) is copied into the compiled evaluator that
    runs the exported ONNX file (:class:`feather_gym._dense.DenseNet`, tanh as onnxruntime
    computes it), so a validation judges the network as it will be served. The copy is accepted
    only when its logits equal the module's within :data:`feather_gym.policy_runtime.NATIVE_PARITY_ATOL`
    on random observations (``RuntimeError`` otherwise)."""

    name = "network"

    def __init__(self, module) -> None:
        import numpy as np
        import torch
        from ray.rllib.core.columns import Columns

        from feather_gym._dense import DenseNet
        from feather_gym.policy_runtime import NATIVE_PARITY_ATOL, parity_observations

        dense = [layer for part in (module.encoder.actor_encoder, module.pi) for layer in part.modules()
                 if isinstance(layer, torch.nn.Linear)]
        self.network = DenseNet([layer.weight.detach().numpy() for layer in dense],
                                [layer.bias.detach().numpy() for layer in dense], "tanh")
        self.num_candidates = self.network.num_outputs - 1
        rows = parity_observations(self.network.num_inputs)
        with torch.no_grad():
            logits = module.forward_inference({Columns.OBS: torch.from_numpy(rows)})[Columns.ACTION_DIST_INPUTS]
        if not np.allclose(self.network.outputs(rows), logits.numpy(), rtol=0.0, atol=NATIVE_PARITY_ATOL):
            raise RuntimeError("the compiled copy of the policy network disagrees with the module's logits")

    def decide(self, point) -> int:
        return self.network.act(point.observation)


class BestCheckpoint:
    """Keeps, in ``path``, the checkpoint whose greedy policy scored best on the validation seeds
    (trace files: on their training part; the later part stays unseen until the final evaluation)
    among those no worse than the network PPO started from.

    Score: :func:`trainer.evaluate.validation_score` (the worst workload's throughput over its
    target within the 1% tolerance of the best heuristic; then, worst margins within the tie
    tolerance tying, the mean margin: :func:`trainer.evaluate.scores_higher`), so the
    kept policy is the one closest to meeting every target at once, and among those meeting them
    all the one with the most gain. Needed because PPO's stochastic policy can improve while its
    greedy policy, the one deployed, gets worse. The first validation is the start (the warm-start
    clone, or the resumed checkpoint) and is always kept; a later network is kept only if, paired
    run by run with the start, it is significantly faster on some workload and significantly slower
    on none (:func:`trainer.evaluate.paired_signs`), and if its share of requests within the SLO is
    not below the start's by more than the tie tolerance (:func:`trainer.evaluate.fewer_within_slo`).
    Without the first, a network no better than the start on the validation seeds would replace it,
    and differ from it where those seeds do not reach (the long queues of hundreds of arrivals that
    the start's demonstrations cover); without the second, the worst-margin score would let any
    workload fall to the level of the worst; without the third, PPO's throughput reward could buy
    throughput with the latency a service is judged by (a warm start that holds requests for
    goodput loses its holds).
    """

    def __init__(self, algo, config: TrainConfig, path: Path) -> None:
        from trainer.evaluate import Benchmark

        start = time.monotonic()
        self.algo, self.path = algo, path
        self.benchmark = Benchmark(workloads=config.training_workloads(), profile=config.profile,
                                   seeds=config.validation_seeds, engine=config.engine())
        self.best_score = (-math.inf, -math.inf)
        self.best_iteration: int | None = None
        self.start: dict | None = None   # the first validation's evaluation
        self.history: list[dict] = []
        self.benchmark_s, self.validation_s = time.monotonic() - start, 0.0

    def validate(self, iteration: int) -> str:
        """Score the current network; save the checkpoint when it is the best so far. Returns a log line."""
        from trainer.evaluate import (
            by_load,
            fewer_within_slo,
            paired_signs,
            scores_higher,
            slo_share,
            validation_score,
        )

        start = time.monotonic()
        module = learner_module(self.algo)
        evaluation = self.benchmark.evaluate(NetworkPolicy(module))
        first = self.start is None
        self.start = self.start or evaluation
        signs = paired_signs(evaluation, self.start)
        slower = [workload for workload, sign in signs.items() if sign < 0]
        faster = [workload for workload, sign in signs.items() if sign > 0]
        score = validation_score(evaluation)
        worst, mean = min(result["margin"] for result in evaluation["workloads"]), score[1]
        margins = [round(result["margin"], 4) for result in evaluation["workloads"]]
        loads = {load: {"worst_margin": summary["margin_worst"], "mean_margin": summary["margin_mean"]}
                 for load, summary in by_load(evaluation).items()}
        within_slo, fewer = slo_share(evaluation), fewer_within_slo(evaluation, self.start)
        self.history.append({"iteration": iteration, "worst_margin": worst, "mean_margin": mean, "margins": margins,
                             "by_load": loads, "slower_than_start": slower, "faster_than_start": faster,
                             "slo_met_fraction": within_slo})
        kept = scores_higher(score, self.best_score) and (first or faster) and not slower and not fewer
        if kept:
            self.best_score, self.best_iteration = score, iteration
            self.algo.save_to_path(str(self.path.resolve()))
        if slower:
            refusal = f"slower than the start on {', '.join(workload_labels(slower))}; "
        elif fewer:
            refusal = (f"fewer requests within the SLO than the start, {within_slo:.4f} against "
                       f"{slo_share(self.start):.4f}; ")
        elif not (first or faster):
            refusal = "faster than the start on no workload; "
        else:
            refusal = ""
        verdict = " (best so far, checkpoint saved)" if kept else f" ({refusal}best at iteration {self.best_iteration})"
        self.validation_s += time.monotonic() - start
        per_load = ", ".join(f"{load} {m['worst_margin']:.4f}/{m['mean_margin']:.4f}" for load, m in loads.items())
        return (f"validation after iteration {iteration}: margin worst {worst:.4f} mean {mean:.4f}; by load, "
                f"worst/mean: {per_load}" + verdict)


def learner_module(algo):
    """The (local) learner's RLModule: the network PPO is training."""
    from ray.rllib.core import DEFAULT_MODULE_ID

    return next(iter(algo.learner_group.foreach_learner(lambda learner: learner.module[DEFAULT_MODULE_ID]))).get()


def export_clone(algo, config: TrainConfig, path: Path) -> Path:
    """Export the learner's network as it is now (right after the warm start: the clone) to
    ``path``, so the final evaluation can show what PPO added to it."""
    import copy

    from trainer.export import PolicyLogits, export_policy_module

    module = learner_module(algo)
    export_policy_module(PolicyLogits(copy.deepcopy(module)), path, profile=config.profile,
                         workload=list(config.workloads), max_wait_steps=config.max_wait_steps)
    return path


def beyond(evaluation: dict, label: str) -> dict:
    """Per workload, the trained policy's throughput over reference ``label``'s (ratio of the
    means, and the per-run paired ratio of :func:`trainer.evaluate.paired_ratio`), and the
    workloads where the paired ratio is significantly above or below 1
    (:func:`trainer.evaluate.paired_sign`); per load (:func:`trainer.evaluate.load_label`), the
    paired ratio over every run of its workloads, and its significant workloads. Over the
    warm-start clone: what PPO learned and lost beyond noise; over the demonstrator: what the
    whole run (improved warm start and PPO) did."""
    from trainer.evaluate import load_label, paired_ratio, paired_sign

    ratios, paired, runs = {}, {}, {}
    for result in evaluation["workloads"]:
        spec = result["workload"]
        ratios[spec] = result["trained_over_reference"][label]
        paired[spec] = result["trained_over_reference_paired"][label]
        load = runs.setdefault(load_label(spec), ([], []))
        load[0].extend(result["trained_runs"])
        load[1].extend(result["reference_runs"][label])
    better = [spec for spec, pair in paired.items() if paired_sign(pair) > 0]
    worse = [spec for spec, pair in paired.items() if paired_sign(pair) < 0]
    by_load = {load: {**paired_ratio(trained, reference),
                      "better_on": [spec for spec in better if load_label(spec) == load],
                      "worse_on": [spec for spec in worse if load_label(spec) == load]}
               for load, (trained, reference) in runs.items()}
    return {"ratio_by_workload": ratios, "paired_by_workload": paired, "better_on": better, "worse_on": worse,
            "by_load": by_load}


def _beyond_lines(report: dict, what: str) -> list[str]:
    loads = ", ".join(f"{load} {pair['ratio_mean']:.4f} +- {pair['ratio_sem']:.4f} "
                      f"({pair['runs_faster']}/{pair['runs_slower']})" for load, pair in report["by_load"].items())
    return [f"trained over {what} by load, per-run paired ratio (mean +- standard error; runs faster/slower): "
            f"{loads}",
            f"significantly better than {what} on: {', '.join(workload_labels(report['better_on'])) or 'none'}; "
            f"worse on: {', '.join(workload_labels(report['worse_on'])) or 'none'}"]


def train_loop(algo, config: TrainConfig, run_log: RunLog, best: BestCheckpoint, *,
               progress: Callable[[str], None], spent_s: float = 0.0) -> tuple[float, float]:
    """Call ``algo.train()`` (at least once) until the iteration count or the time budget is
    spent, ``spent_s`` of it before the loop (the warm start and the first validation),
    validating every ``config.validate_every`` iterations and after the last; returns the
    seconds spent in the loop up to the last iteration, and in ``algo.train()`` alone."""
    start = time.monotonic()
    budget_s = config.time_budget_s - spent_s
    done, ppo_s = 0, 0.0
    while True:
        iteration_start = time.monotonic()
        algo_result = algo.train()
        ppo_s += time.monotonic() - iteration_start
        done += 1
        elapsed = time.monotonic() - start
        record = run_log.record(algo_result, time_total_s=elapsed)
        per_iteration = elapsed / done
        if config.iterations is not None:
            left = (config.iterations - done) * per_iteration
            finished = done >= config.iterations
        else:
            left = max(budget_s - elapsed, 0.0)
            finished = elapsed + per_iteration > budget_s
        progress(_progress_line(record, left))
        if finished or done % config.validate_every == 0:
            progress(best.validate(record.iteration))
        if finished:
            return elapsed, ppo_s


def _progress_line(record: IterationRecord, left_s: float) -> str:
    def shown(value: float, width: int) -> str:
        return f"{'n/a':>{width}}" if math.isnan(value) else f"{value:{width}.3f}"

    return (f"iter {record.iteration:4d} | env steps {record.env_steps:9,d} | "
            f"return {shown(record.episode_return_mean, 7)} | entropy {shown(record.policy_entropy, 5)} | "
            f"elapsed {record.time_total_s:6.0f} s | left ~{left_s:5.0f} s")


def time_report(config: TrainConfig, *, build_s: float, warm: dict | None, best: BestCheckpoint, ppo_s: float,
                eval_s: float, total_s: float) -> dict:
    """How a run's wall time was spent (seconds, and the budget's shares): Ray and the training envs
    (``build_s``), the warm start's recording (its playouts) and cloning, the validation benchmark's
    baselines, the validations, PPO's own iterations (``ppo_s``), the held-out evaluation, and the
    rest (export, the learning curve). The budget covers the warm start, the benchmark, the
    validations and PPO (:class:`~trainer.config.TrainConfig`)."""
    spent = {"ray_and_envs_s": build_s, "warm_start_record_s": warm["record_s"] if warm else 0.0,
             "warm_start_fit_s": warm["fit_s"] if warm else 0.0, "validation_benchmark_s": best.benchmark_s,
             "validation_s": best.validation_s, "ppo_s": ppo_s, "evaluation_s": eval_s}
    spent["other_s"] = total_s - sum(spent.values())
    spent = {key: round(value, 2) for key, value in spent.items()}
    budget = config.time_budget_s
    return {**spent, "total_s": round(total_s, 2),
            "budget_share": {key.removesuffix("_s"): round(spent[key] / budget, 3)
                             for key in ("warm_start_record_s", "warm_start_fit_s", "validation_benchmark_s",
                                         "validation_s", "ppo_s")}}


#: How :func:`_time_line` names the budget's parts.
_BUDGET_PARTS = {"warm_start_record": "demonstrations", "warm_start_fit": "cloning",
                 "validation_benchmark": "validation baselines", "validation": "validations", "ppo": "PPO"}


def _time_line(spent: dict) -> str:
    shares = ", ".join(f"{_BUDGET_PARTS[name]} {100 * share:.0f}%" for name, share in spent["budget_share"].items())
    return f"time: {spent['total_s']:.0f} s in all; of the budget: {shares}"


def train(config: TrainConfig, *, progress: Callable[[str], None] = print) -> dict:
    """Run the whole job of the module docstring; returns the summary (also in summary.json)."""
    from trainer.evaluate import evaluate_policy, format_table
    from trainer.export import export_policy_module, load_policy_network, write_training_info
    from trainer.warm_start import PLAYOUT_SHARE, demonstrator, warm_start

    config = config.resolved()
    config.validate()
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    progress(f"feather-train: profile {config.profile}, {len(config.workloads)} workloads "
             f"({TrainingMix(config.workloads).describe()}), "
             f"{f'{config.iterations} iterations' if config.iterations else f'budget {config.time_budget_s:.0f} s'}, "
             f"output {out}")

    job_start = time.monotonic()
    with ray_session(config.ray_address), single_threaded_torch(), RunLog(out / "tensorboard") as run_log:
        algo = ppo_config(config).build_algo()
        build_s = time.monotonic() - job_start
        try:
            warm = clone_path = None
            learning_start = time.monotonic()
            if config.resume:
                restore(algo, config.resume)
                progress(f"resumed from {config.resume}")
            elif config.warm_start != "none":
                warm = warm_start(algo, config.warm_start, env_config(config), smoothing=config.clone_smoothing,
                                  min_gain=config.improve_warm_start,
                                  playout_s=None if config.iterations else PLAYOUT_SHARE * config.time_budget_s)
                improved = (f" improved by playouts ({warm['relabelled']:,} labels changed of "
                            f"{warm['played_decisions']:,} played out, {warm['record_s']:.0f} s)"
                            if warm["min_gain"] is not None else "")
                progress(f"warm start: cloned {warm['policy']}{improved} from {warm['decisions']:,} decisions "
                         f"(accuracy {warm['accuracy']:.3f}, ADD share {warm['add_fraction']:.3f})")
                clone_path = export_clone(algo, config, out / CLONE_FILE)
            checkpoint = out / "checkpoint"
            best = BestCheckpoint(algo, config, checkpoint)
            progress(best.validate(algo.iteration))   # 0, or the resumed checkpoint's iteration
            setup_s = time.monotonic() - job_start
            train_s, ppo_s = train_loop(algo, config, run_log, best, progress=progress,
                                        spent_s=time.monotonic() - learning_start)
        finally:
            algo.stop()
    trained_at = datetime.now(UTC)
    write_training_info(checkpoint, profile=config.profile, workloads=config.workloads, trained_at=trained_at,
                        max_wait_steps=config.max_wait_steps)
    run_log.plot_learning_curve(out / "learning_curve.png", title=f"Feather PPO ({config.profile})",
                                validation=best.history)

    policy_path = out / "policy.onnx"
    parity = export_policy_module(load_policy_network(checkpoint), policy_path, profile=config.profile,
                                  workload=list(config.workloads), trained_at=trained_at,
                                  max_wait_steps=config.max_wait_steps)
    progress(f"exported {policy_path} (max abs diff vs torch: random {parity['max_abs_diff_random']:.2g}, "
             f"real {parity['max_abs_diff_real']:.2g})")
    eval_start = time.monotonic()
    references = {CLONE_LABEL: clone_path, DEMONSTRATOR_LABEL: demonstrator(config.warm_start)} if clone_path else None
    evaluation = evaluate_policy(policy_path, workloads=config.evaluation_workloads(), profile=config.profile,
                                 seeds=config.eval_seeds, engine=config.engine(), references=references)
    progress(format_table(evaluation))
    eval_s = time.monotonic() - eval_start
    clone = demonstrated = None
    if clone_path:
        clone, demonstrated = beyond(evaluation, CLONE_LABEL), beyond(evaluation, DEMONSTRATOR_LABEL)
        for line in (_beyond_lines(clone, "its warm-start clone")
                     + _beyond_lines(demonstrated, f"the demonstrator ({config.warm_start} as recorded)")):
            progress(line)
    time_spent = time_report(config, build_s=build_s, warm=warm, best=best, ppo_s=ppo_s, eval_s=eval_s,
                             total_s=time.monotonic() - job_start)
    progress(_time_line(time_spent))
    summary = {
        "config": config.to_json(),
        "trained_at": trained_at.isoformat(),
        "setup_s": round(setup_s, 2),
        "train_s": round(train_s, 2),
        "eval_s": round(eval_s, 2),
        "total_s": round(time_spent["total_s"], 2),
        "time_spent": time_spent,
        "iterations": len(run_log.history),
        "env_steps": run_log.history[-1].env_steps,
        "history": run_log.history_json(),
        "checkpoint": str(checkpoint),
        "policy": str(policy_path),
        "warm_start": warm,
        "validation": {"seeds": list(config.validation_seeds), "best_iteration": best.best_iteration,
                       "best_score": list(best.best_score), "history": best.history},
        "export_parity": parity,
        "evaluation": evaluation,
        "beyond_clone": clone,
        "beyond_demonstrator": demonstrated,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
