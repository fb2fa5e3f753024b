"""The record of one training run: RLlib's result dicts as TensorBoard events, plus the curve.

Each ``algo.train()`` result is written, flattened with ``/`` as Tune does, to a TensorBoard
event file under ``<output>/tensorboard`` (numeric leaves only, x-axis = env steps sampled), and
its headline numbers are kept in :attr:`RunLog.history` for the learning-curve PNG and the JSON
summary.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class IterationRecord:
    """Headline numbers of one PPO iteration. ``episode_return_mean`` is NaN when no episode
    ended; ``policy_entropy`` (nats, mean over the iteration's minibatches of the sampling
    distribution's entropy; ln(k + 1) is uniform over the actions) is NaN when no update ran."""

    iteration: int
    env_steps: int
    episode_return_mean: float
    policy_entropy: float
    time_total_s: float


class RunLog:
    """TensorBoard writer + in-memory history. Use as a context manager (closes the writer)."""

    def __init__(self, tensorboard_dir: Path) -> None:
        from tensorboardX import SummaryWriter

        self.history: list[IterationRecord] = []
        self._writer = SummaryWriter(str(tensorboard_dir), flush_secs=10)

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc) -> None:
        self._writer.close()

    def record(self, result: dict, *, time_total_s: float) -> IterationRecord:
        """Log one ``algo.train()`` result; returns its headline numbers."""
        from ray.rllib.core import DEFAULT_MODULE_ID
        from ray.tune.utils import flatten_dict

        record = IterationRecord(
            iteration=int(result["training_iteration"]),
            env_steps=int(result.get("num_env_steps_sampled_lifetime", 0)),
            episode_return_mean=float(result.get("env_runners", {}).get("episode_return_mean", math.nan)),
            policy_entropy=float(result.get("learners", {}).get(DEFAULT_MODULE_ID, {}).get("entropy", math.nan)),
            time_total_s=time_total_s,
        )
        self.history.append(record)
        for name, value in flatten_dict({k: v for k, v in result.items() if k != "config"}, delimiter="/").items():
            if isinstance(value, (int, float, np.number)) and not isinstance(value, bool) and np.isfinite(value):
                self._writer.add_scalar(f"rllib/{name}", float(value), global_step=record.env_steps)
        self._writer.flush()
        return record

    def history_json(self) -> list[dict]:
        """The history as JSON-ready dicts (NaN returns as ``None``)."""
        return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(r).items()}
                for r in self.history]

    def plot_learning_curve(self, path: Path, *, title: str, validation: list[dict] = ()) -> None:
        """A PNG (matplotlib Agg): mean episode return and policy entropy against env steps and, below it when given,
        the ``validation`` history (``{"iteration", "worst_margin", "mean_margin"}`` rows of the
        greedy network's throughput over its targets)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [r.env_steps for r in self.history]
        returns = [r.episode_return_mean for r in self.history]
        fig, axes = plt.subplots(2 if validation else 1, 1, figsize=(7, 6.5 if validation else 4), sharex=True,
                                 squeeze=False)
        ax = axes[0, 0]
        ax.plot(steps, returns, marker="o", markersize=3)
        ax.set_ylabel("mean episode return\n(share of FCFS time saved)")
        entropy_axis = ax.twinx()
        entropy_axis.plot(steps, [r.policy_entropy for r in self.history], color="tab:red", linewidth=1)
        entropy_axis.set_ylabel("policy entropy (nats)", color="tab:red")
        ax.set_title(title)
        if validation:
            steps_at = {0: 0, **{r.iteration: r.env_steps for r in self.history}}
            x = [steps_at.get(v["iteration"], math.nan) for v in validation]
            low = axes[1, 0]
            low.plot(x, [v["mean_margin"] for v in validation], marker="o", markersize=3, label="mean over workloads")
            low.plot(x, [v["worst_margin"] for v in validation], marker="o", markersize=3, label="worst workload")
            low.axhline(1.0, color="grey", linewidth=0.8)
            low.set_ylabel("greedy policy, validation seeds:\nthroughput / target")
            low.legend()
        axes[-1, 0].set_xlabel("env steps sampled")
        for row in axes:
            row[0].grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
