"""Synthetic long-range tasks buried in real text: what a hybrid model must remember.

A :class:`Sample` is a window of corpus token ids with task pieces inserted between its
tokens. The tasks:

* **key-value** (RULER-style): needles ``" The secret number for NAME is DDDDDD."`` with
  distinct names; a query is the same sentence later in the text, and its answer is the six
  digits. One needle is the single-key task, several the multi-key task (distractors).
* **passkey**: ``" The pass key is DDDDD. Remember it. DDDDD is the pass key."`` buried in
  the text; the query ``" What is the pass key? The pass key is DDDDD."``.
* **copy**: a span of random tokens (drawn independently from the tokens the other tasks use:
  digits, names, template words; nothing but the earlier copy predicts them) repeated verbatim
  later, one to three times; the answer is the repeat after its first
  token (which nothing announces).

Loss weights (``Sample.weights[t]`` weighs predicting token ``t`` from the tokens before it):
answer tokens weigh ``answer_weight``; random tokens where nothing before predicts them (a
needle's value, a copied span and the first token of its repeat) weigh 0; everything else 1.

Invariants (``tests/test_long_tasks.py``): a sample has exactly the length asked; each
``answers[i]`` holds exactly the value tokens of the needle at ``needles[i]`` and lies after
it; a piece placed at fractional depth ``d`` starts after ``round(d * text_tokens)`` text
tokens, pieces at the same depth keep their list order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

#: Names of the key-value needles (one needle per name in a sample).
NAMES = ("Anna", "Boris", "Clara", "Dmitri", "Elena", "Fyodor", "Galina", "Igor", "Katya", "Leonid",
         "Marina", "Nikolai", "Olga", "Pavel", "Rosa", "Sergei", "Tamara", "Viktor", "Yulia", "Arkady",
         "Vera", "Gleb", "Lydia", "Oleg", "Sonya", "Yakov", "Zoya", "Ivan", "Nina", "Petr", "Daria", "Maxim")

#: Task names of :func:`training_sample` (``kv`` draws its number of keys) and :func:`eval_sample`.
TRAINING_TASKS = ("kv", "passkey", "copy", "text")
EVAL_TASKS = ("single_key", "multi_key", "passkey")

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class Piece:
    """Tokens to insert, their loss weights, and where in them the value lies."""

    ids: np.ndarray
    weights: np.ndarray
    value: slice


@dataclass(frozen=True)
class Sample:
    """Token ids with loss weights; ``needles[i]`` and ``answers[i]`` are the positions of a
    needle's value and of its query's answer (the same tokens)."""

    ids: np.ndarray
    weights: np.ndarray
    needles: list[slice]
    answers: list[slice]


def _digits(rng: np.random.Generator, count: int) -> str:
    return "".join(str(d) for d in rng.integers(0, 10, count))


def _piece(encode: Encode, before: str, value: str, after: str, value_weight: float) -> Piece:
    """``before + value + after`` tokenized piecewise (value tokens exactly the value's)."""
    head, mid, tail = encode(before), encode(value), encode(after)
    ids = np.array(head + mid + tail, dtype=np.int64)
    weights = np.ones(ids.size, dtype=np.float32)
    value_slice = slice(len(head), len(head) + len(mid))
    weights[value_slice] = value_weight
    return Piece(ids, weights, value_slice)


def key_value(encode: Encode, name: str, digits: str, answer_weight: float) -> tuple[Piece, Piece]:
    """(needle, query) of the key-value task; the value is ``" "`` + digits' tokens minus the space."""
    needle = _piece(encode, f" The secret number for {name} is ", digits, ".", 0.0)
    query = _piece(encode, f" The secret number for {name} is ", digits, ".", answer_weight)
    return needle, query


def passkey(encode: Encode, digits: str, answer_weight: float) -> tuple[Piece, Piece]:
    """(needle, query) of the passkey task."""
    needle = _piece(encode, " The pass key is ", digits, f". Remember it. {digits} is the pass key.", 0.0)
    query = _piece(encode, " What is the pass key? The pass key is ", digits, ".", answer_weight)
    return needle, query


def copy_pair(span: np.ndarray, answer_weight: float) -> tuple[Piece, Piece]:
    """(span, its repeat); the span is the needle, the repeat's answer every token after its
    first (which nothing announces: it weighs 0, as the random span does)."""
    first = Piece(span.copy(), np.zeros(span.size, dtype=np.float32), slice(1, span.size))
    weights = np.full(span.size, answer_weight, dtype=np.float32)
    weights[0] = 0.0
    return first, Piece(span.copy(), weights, slice(1, span.size))


def bury(text: np.ndarray, placed: list[tuple[float, Piece]], pairs: list[tuple[int, int]]) -> Sample:
    """``text`` with each piece inserted after ``round(depth * len(text))`` of its tokens (ties
    in list order); ``pairs`` are (needle, query) indices into ``placed``."""
    cuts = [int(round(d * text.size)) for d, _ in placed]
    order = sorted(range(len(placed)), key=lambda i: (cuts[i], i))
    ids, weights, starts, at, pos = [], [], {}, 0, 0
    for i in order:
        ids.append(text[at:cuts[i]])
        weights.append(np.ones(cuts[i] - at, dtype=np.float32))
        pos += cuts[i] - at
        at = cuts[i]
        piece = placed[i][1]
        starts[i] = pos
        ids.append(piece.ids)
        weights.append(piece.weights)
        pos += piece.ids.size
    ids.append(text[at:])
    weights.append(np.ones(text.size - at, dtype=np.float32))

    def span(i):
        value = placed[i][1].value
        return slice(starts[i] + value.start, starts[i] + value.stop)

    return Sample(np.concatenate(ids).astype(np.int64), np.concatenate(weights),
                  [span(n) for n, _ in pairs], [span(q) for _, q in pairs])


def _window(source: np.ndarray, rng: np.random.Generator, size: int) -> np.ndarray:
    if size < 0:
        raise ValueError(f"the task pieces exceed the sample length by {-size} tokens")
    start = int(rng.integers(0, source.size - size + 1))
    return source[start:start + size]


def _assemble(source, rng, length: int, placed, pairs) -> Sample:
    text = _window(source, rng, length - sum(p.ids.size for _, p in placed))
    return bury(text, placed, pairs)


def training_sample(task: str, source: np.ndarray, encode: Encode, rng: np.random.Generator, *, length: int,
                    answer_weight: float, max_keys: int = 16) -> Sample:
    """One training sample of ``task`` (:data:`TRAINING_TASKS`), ``length`` tokens of ``source``
    text around it. ``kv``: 1 to ``min(max_keys, length // 48)`` keys at uniform depths, each
    queried with probability 3/4, half of the queries at the end and half anywhere after their
    needle; ``passkey``: one, queried at the end; ``copy``: 16-32 tokens drawn independently from
    :func:`task_token_ids`, repeated 1-3 times anywhere after them."""
    placed, pairs = [], []
    if task == "kv":
        keys = int(rng.integers(1, max(1, min(max_keys, length // 48)) + 1))
        for name in rng.choice(NAMES, keys, replace=False):
            needle, query = key_value(encode, str(name), _digits(rng, 6), answer_weight)
            depth = float(rng.uniform(0, 1))
            placed.append((depth, needle))
            if rng.uniform() < 0.75:
                placed.append((1.0 if rng.uniform() < 0.5 else float(rng.uniform(depth, 1)), query))
                pairs.append((len(placed) - 2, len(placed) - 1))
    elif task == "passkey":
        needle, query = passkey(encode, _digits(rng, 5), answer_weight)
        placed = [(float(rng.uniform(0, 1)), needle), (1.0, query)]
        pairs = [(0, 1)]
    elif task == "copy":
        first, repeat = copy_pair(rng.choice(task_token_ids(encode), int(rng.integers(16, 33))), answer_weight)
        depth = float(rng.uniform(0, 1))
        placed = [(depth, first)] + [(float(rng.uniform(depth, 1)), repeat) for _ in range(rng.integers(1, 4))]
        pairs = [(0, i) for i in range(1, len(placed))]
    elif task != "text":
        raise ValueError(f"unknown task {task!r}; choose from {TRAINING_TASKS}")
    return _assemble(source, rng, length, placed, pairs)


def eval_sample(task: str, source: np.ndarray, encode: Encode, rng: np.random.Generator, *, length: int,
                depth: float, distractors: int = 3) -> Sample:
    """A test sample of ``task`` (:data:`EVAL_TASKS`): the queried needle at fractional
    ``depth`` of the text, its query at the end (``answers[0]``); ``multi_key`` adds
    ``distractors`` other needles at uniform depths."""
    if task == "passkey":
        needle, query = passkey(encode, _digits(rng, 5), 1.0)
        return _assemble(source, rng, length, [(depth, needle), (1.0, query)], [(0, 1)])
    if task not in EVAL_TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {EVAL_TASKS}")
    others = distractors if task == "multi_key" else 0
    names = rng.choice(NAMES, 1 + others, replace=False)
    pieces = [key_value(encode, str(n), _digits(rng, 6), 1.0) for n in names]
    placed = [(depth, pieces[0][0])] + [(float(rng.uniform(0, 1)), p[0]) for p in pieces[1:]] + [(1.0, pieces[0][1])]
    return _assemble(source, rng, length, placed, [(0, len(placed) - 1)])


@functools.lru_cache(maxsize=4)
def task_token_ids(encode: Encode) -> np.ndarray:
    """Every token id a task piece can hold (the templates, the names, the digits), sorted."""
    texts = [f" The secret number for {name} is 0123456789." for name in NAMES]
    texts += [" The pass key is 0123456789. Remember it. 0123456789 is the pass key.",
              " What is the pass key? The pass key is 0123456789."]
    return np.unique(np.concatenate([np.asarray(encode(t), dtype=np.int64) for t in texts]))
