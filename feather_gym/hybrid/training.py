"""How a hybrid model is trained: settings, the batches of a length curriculum, the loss, the gates' start.

* :class:`TrainSettings`: AdamW within a step and CPU-time budget, and a curriculum of
  :class:`Stage` (sequence length and task mix by training progress).
* :func:`training_batch`: the batch of the stage at the current progress; each sample is text with a task of the mix
  buried in it (:func:`feather_gym.hybrid.long_tasks.training_sample`).
* :func:`weighted_loss`: the weighted mean next-token cross-entropy, with logits computed only
  at the positions that count (a kept fraction of the plain-text positions, every task
  position): the output projection over the vocabulary dominates a step otherwise.
* :func:`init_gate_memory`: Gated DeltaNet gates whose decay spans short to long memories
  (Mamba's time-step initialization) instead of transformers' default, which forgets within a
  few tokens.
* ``recall_start``: :func:`feather_gym.hybrid.recall_start.attention_recall_start`, an induction
  circuit in the attention layer, so that training refines one instead of having to find one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from feather_gym.hybrid.long_tasks import Encode, training_sample


@dataclass(frozen=True)
class Stage:
    """From training progress ``start`` on: batches of ``batch`` samples of ``length`` tokens, tasks
    drawn by ``task_mix`` weights (``(task, weight)`` of :data:`feather_gym.hybrid.long_tasks.TRAINING_TASKS`)."""

    start: float
    length: int
    batch: int
    task_mix: tuple[tuple[str, float], ...] = (("text", 1.0),)


@dataclass(frozen=True)
class TrainSettings:
    """How a hybrid model is trained (see the module docstring).

    The learning rate warms up over ``warmup_steps`` and then follows a cosine over training
    progress, the larger of the step fraction and the fraction of ``max_cpu_minutes`` spent, so
    a run cut short by the budget still ends at a low rate; the curriculum stage follows the same
    progress. The budget counts the training process's CPU time (all its threads), not wall
    time, so other work sharing the machine shortens a run less than it would by the clock (it
    still slows each step, so a run beside other work may end on the budget before
    ``max_steps``); with one thread on an idle machine the two agree.
    ``gate_dt_range`` is the (low, high) range of the gates' initial time step, log-uniform per
    head (``None`` keeps transformers' initialization); ``recall_start`` starts the model from
    :func:`feather_gym.hybrid.recall_start.attention_recall_start`. ``recall_lengths`` and
    ``recall_samples`` size the recall measurement of the report (none when empty).
    """

    curriculum: tuple[Stage, ...] = (Stage(0.0, 256, 16),)
    answer_weight: float = 1.0
    text_loss_fraction: float = 1.0
    gate_dt_range: tuple[float, float] | None = None
    recall_start: bool = False
    lr: float = 3e-3
    warmup_steps: int = 20
    max_steps: int = 400
    max_cpu_minutes: float = 40.0
    heldout_window: int = 256
    heldout_fraction: float = 0.05
    heldout_windows: int = 64
    recall_lengths: tuple[int, ...] = ()
    recall_samples: int = 16
    seed: int = 0
    threads: int = 2

    def __post_init__(self):
        starts = [stage.start for stage in self.curriculum]
        if not starts or starts[0] != 0.0 or starts != sorted(starts):
            raise ValueError(f"the curriculum must start at progress 0.0 and increase: {starts}")
        if not 0 < self.text_loss_fraction <= 1:
            raise ValueError(f"text_loss_fraction must lie in (0, 1], got {self.text_loss_fraction}")

    def stage(self, progress: float) -> Stage:
        """The stage at ``progress`` in [0, 1]."""
        return [stage for stage in self.curriculum if stage.start <= progress][-1]

    def learning_rate(self, step: int, progress: float) -> float:
        scale = min(1.0, (step + 1) / self.warmup_steps) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return self.lr * max(scale, 0.05)


def training_batch(settings: TrainSettings, source: np.ndarray, encode: Encode, rng: np.random.Generator,
                   progress: float) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, weights)``, both ``[batch, length]`` of the stage at ``progress`` (see the module docstring)."""
    stage = settings.stage(progress)
    tasks, weights = zip(*stage.task_mix)
    drawn = rng.choice(len(tasks), stage.batch, p=np.asarray(weights) / sum(weights))
    samples = [training_sample(tasks[t], source, encode, rng, length=stage.length,
                               answer_weight=settings.answer_weight) for t in drawn]
    return np.stack([s.ids for s in samples]), np.stack([s.weights for s in samples])


def weighted_loss(model, ids, weights: np.ndarray, rng: np.random.Generator, text_loss_fraction: float):
    """``(loss, answer accuracy)``: the weighted mean cross-entropy of predicting ``ids[:, t]`` at
    ``t - 1`` over the positions of weight other than 1 (zero-weight ones drop out) and a random
    ``text_loss_fraction`` of the weight-1 ones; and the fraction of positions weighing more
    than 1 (the answers) whose token is the top-1 prediction (NaN without any)."""
    import torch

    w = weights[:, 1:]
    keep = (w > 0) & ((w != 1) | (rng.uniform(size=w.shape) < text_loss_fraction))
    keep_t = torch.from_numpy(keep)
    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1][keep_t]
    logits = model.lm_head(hidden)
    targets = ids[:, 1:][keep_t]
    nll = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    w_kept = torch.from_numpy(w[keep])
    answers = w_kept > 1
    accuracy = (logits[answers].argmax(-1) == targets[answers]).float().mean().item() if answers.any() else math.nan
    return (nll * w_kept).sum() / w_kept.sum(), accuracy


def init_gate_memory(model, dt_range: tuple[float, float], generator) -> None:
    """Set every GDN module's ``dt_bias`` so that its heads' time steps ``softplus(dt_bias)``
    lie log-uniformly in ``dt_range`` (the per-token log decay at a zero gate input is then
    ``-exp(A_log) * dt``)."""
    import torch

    low, high = dt_range
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "dt_bias") and hasattr(module, "A_log"):
                u = torch.rand(module.dt_bias.shape, generator=generator)
                dt = torch.exp(u * (math.log(high) - math.log(low)) + math.log(low))
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))     # inverse softplus
