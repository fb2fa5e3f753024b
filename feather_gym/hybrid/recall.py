"""What a hybrid model remembers: accuracy on buried needles by length, and its gates' memory.

* :func:`recall_accuracy`: for each task of :data:`feather_gym.hybrid.long_tasks.EVAL_TASKS`
  and each length, the fraction of samples whose every answer token is the model's top-1
  prediction (teacher forced: greedy decoding would produce the answer). The queried needle's
  depths are stratified, ``(k + 0.5) / samples``; the text around it is ``source`` (held-out
  text for a report).
* :func:`gate_memory_spectrum`: per GDN layer and value head, the tokens after which a
  token's decayed contribution to the state falls below ``eps``
  (:func:`feather_gym.hybrid.suffix_replay.head_memory_lengths` on the given text).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from feather_gym.hybrid.long_tasks import EVAL_TASKS, Encode, eval_sample


def recall_accuracy(model, source: np.ndarray, encode: Encode, *, lengths: list[int], samples: int,
                    tasks: tuple[str, ...] = EVAL_TASKS, seed: int = 0, batch_size: int = 4,
                    to_model_ids: Callable[[np.ndarray], np.ndarray] = lambda ids: ids) -> dict:
    """``{task: {str(length): accuracy}}`` (see the module docstring); ``to_model_ids`` maps
    tokenizer ids to the model's (a compact-vocabulary model during training)."""
    import torch

    rng = np.random.default_rng(seed)
    was_training = model.training
    model.eval()
    report = {}
    for task in tasks:
        report[task] = {}
        for length in lengths:
            made = [eval_sample(task, source, encode, rng, length=length, depth=(k + 0.5) / samples)
                    for k in range(samples)]
            hits = []
            for start in range(0, samples, batch_size):
                chunk = made[start:start + batch_size]
                ids = torch.as_tensor(np.stack([to_model_ids(s.ids) for s in chunk]))
                with torch.no_grad():
                    hidden = model.model(input_ids=ids).last_hidden_state
                    for row, sample in enumerate(chunk):
                        answer = sample.answers[0]
                        logits = model.lm_head(hidden[row, answer.start - 1:answer.stop - 1])
                        hits.append(bool((logits.argmax(-1) == ids[row, answer]).all()))
            report[task][str(length)] = float(np.mean(hits))
    model.train(was_training)
    return report


def gate_memory_spectrum(model, token_ids: np.ndarray, eps: float = 0.01) -> dict[str, list[float]]:
    """``{str(layer): [tokens per value head]}`` on ``token_ids`` (see the module docstring)."""
    from feather_gym.hybrid import suffix_replay as sr

    run = sr.run_prefix(model, token_ids, [len(token_ids)])
    return {str(layer): heads for layer, heads in sr.head_memory_lengths(model, run.gdn_inputs, eps).items()}
