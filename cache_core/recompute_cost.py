"""Prefill time of a prompt span: the time side of the placement problem (cache_core.placement).

Model. Computing prompt positions ``0..n`` from nothing costs the cumulative time

    T(n) = b n + c n^2  (ms),

linear work per token (weights, MLPs, the Gated DeltaNet recurrence) plus attention over
pairs of tokens; every prefill also pays a fixed ``a`` ms (scheduling, the final logits).
Resuming from position ``from`` (the KV and recurrent state of ``0..from`` available) and
computing up to ``to`` costs ``T(to) - T(from) + a`` when ``to > from``, else nothing
(:meth:`PrefillTime.ms`). So the recompute of block ``u`` (tokens ``uB..(u+1)B``) costs
``w[u] = T((u+1)B) - T(uB)``, the DP's block costs in ms (:meth:`PrefillTime.block_costs`),
and ``W[t] = T(tB)``.

:meth:`PrefillTime.fit` fits ``a, b, c >= 0`` to measured ``(tokens, ms)`` prefills from 0
(``ms = a + T(tokens)``); the profilers measure those points on the transformers model
(:func:`profile_torch`) or a running vLLM engine (:func:`profile_vllm`).
``feather profile prefill`` (feather_gym/costmodel/cli.py) runs them and writes the JSON that
``feather placement eval --prefill-profile`` reads.
"""

from __future__ import annotations

import itertools

import time
from dataclasses import asdict, dataclass

import numpy as np

#: Timed runs per length (the median is kept) unless told otherwise.
DEFAULT_REPEATS = 3


@dataclass(frozen=True)
class PrefillTime:
    """``ms(from, to) = a + T(to) - T(from)`` with ``T(n) = b n + c n^2`` (to > from; else 0).

    Invariants (``ValueError`` otherwise): the three coefficients are finite and
    non-negative, so ``ms`` never decreases in ``to`` nor increases in ``from``.
    """

    fixed_ms: float                 # a: per prefill
    ms_per_token: float             # b
    ms_per_token_squared: float     # c

    def __post_init__(self) -> None:
        values = np.array([self.fixed_ms, self.ms_per_token, self.ms_per_token_squared], dtype=np.float64)
        if not np.all(np.isfinite(values)) or np.any(values < 0):
            raise ValueError(f"prefill coefficients must be finite and non-negative, got {values.tolist()}")

    def cumulative_ms(self, tokens):
        """``T(n)``: computing positions ``0..n`` without the fixed cost (elementwise)."""
        n = np.asarray(tokens, dtype=np.float64)
        return self.ms_per_token * n + self.ms_per_token_squared * n * n

    def ms(self, tokens_from, tokens_to):
        """Time to compute prompt positions ``from..to`` given the KV/state of ``0..from``
        (elementwise; a float for scalar arguments): ``T(to) - T(from) + a`` if ``to > from``, else 0."""
        start, stop = np.asarray(tokens_from, dtype=np.float64), np.asarray(tokens_to, dtype=np.float64)
        out = np.where(stop > start, self.cumulative_ms(stop) - self.cumulative_ms(start) + self.fixed_ms, 0.0)
        return float(out) if out.ndim == 0 else out

    def block_costs(self, block_size: int, num_blocks: int) -> np.ndarray:
        """``w[u] = T((u+1) B) - T(u B)`` ms for ``u = 0..num_blocks-1``: a
        :class:`~cache_core.placement.PlacementProblem`'s ``block_costs`` (positive, so the
        model must have ``b > 0`` or ``c > 0``)."""
        if block_size < 1 or num_blocks < 1:
            raise ValueError(f"block_size and num_blocks must be >= 1, got {block_size}, {num_blocks}")
        if self.ms_per_token <= 0 and self.ms_per_token_squared <= 0:
            raise ValueError("a prefill model with no per-token cost gives zero block costs")
        return np.diff(self.cumulative_ms(np.arange(num_blocks + 1) * block_size))

    @classmethod
    def fit(cls, points) -> PrefillTime:
        """Non-negative least squares of ``ms = a + b n + c n^2`` over ``(n, ms)`` pairs of prefills from 0.

        Exact: the non-negative optimum is the unconstrained least-squares fit on some subset of
        the three columns, so every subset is solved (columns scaled to unit norm, as ``n^2``
        spans many more orders of magnitude than ``1``) and the best non-negative fit kept.
        Needs at least one point with ``n >= 1``.
        """
        data = np.asarray(points, dtype=np.float64).reshape(-1, 2)
        n, ms = data[:, 0], data[:, 1]
        if n.size == 0 or np.any(n < 1) or not np.all(np.isfinite(data)) or np.any(ms < 0):
            raise ValueError("points must be (tokens >= 1, ms >= 0) pairs, at least one")
        design = np.stack([np.ones_like(n), n, n * n], axis=1)
        scale = np.linalg.norm(design, axis=0)
        scaled = design / scale
        best, best_error = np.zeros(3), float(ms @ ms)
        for subset in itertools.chain.from_iterable(itertools.combinations(range(3), k) for k in (1, 2, 3)):
            columns = list(subset)
            solution = np.linalg.lstsq(scaled[:, columns], ms, rcond=None)[0]
            if np.all(solution >= 0):
                coef = np.zeros(3)
                coef[columns] = solution
                error = float(np.sum((scaled @ coef - ms) ** 2))
                if error < best_error:
                    best, best_error = coef, error
        return cls(*(best / scale).tolist())

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PrefillTime:
        """The model from :meth:`to_dict`'s keys; other keys (the profile's points, backend) are ignored."""
        return cls(float(data["fixed_ms"]), float(data["ms_per_token"]), float(data["ms_per_token_squared"]))


def _profile(run, lengths, repeats: int, seed: int) -> list[tuple[int, float]]:
    """``(n, median ms)`` per length of ``repeats`` timed calls ``run(ids)``.

    Each call gets a new prompt of ``n`` random token ids above the special tokens (fresh
    text: never a prefix-cache hit), built before its timer starts. One untimed call at the
    shortest length warms up first.
    """
    from feather_gym.costmodel.profiler_vllm import VOCAB_HIGH, VOCAB_LOW

    lengths = [int(n) for n in lengths]
    if not lengths or min(lengths) < 1 or repeats < 1:
        raise ValueError(f"need lengths >= 1 (got {lengths}) and repeats >= 1 (got {repeats})")
    rng = np.random.default_rng(seed)

    def prompt(n: int) -> list[int]:
        return rng.integers(VOCAB_LOW, VOCAB_HIGH, size=n).tolist()

    run(prompt(min(lengths)))
    points = []
    for n in lengths:
        samples = []
        for _ in range(repeats):
            ids = prompt(n)
            start = time.perf_counter()
            run(ids)
            samples.append((time.perf_counter() - start) * 1e3)
        points.append((n, float(np.median(samples))))
    return points


def profile_torch(model_dir, lengths, dtype: str = "bfloat16", *, repeats: int = DEFAULT_REPEATS,
                  threads: int | None = None, seed: int = 0) -> list[tuple[int, float]]:
    """``(n, ms)``: median wall time of a transformers forward over ``n`` fresh tokens.

    The forward runs under ``torch.no_grad`` with no KV cache kept and logits for the last
    position only (as a server's prefill), on ``threads`` torch threads (restored afterwards;
    ``None`` keeps the current count).
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()

    def forward(ids: list[int]) -> None:
        model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)

    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        with torch.no_grad():
            return _profile(forward, lengths, repeats, seed)
    finally:
        torch.set_num_threads(previous)


def profile_vllm(llm, lengths, *, repeats: int = DEFAULT_REPEATS, seed: int = 0) -> list[tuple[int, float]]:
    """``(n, ms)``: median wall time of ``llm.generate`` on a fresh random prompt of ``n`` tokens.

    ``llm`` is a started ``vllm.LLM`` (prefix caching on or off: every prompt is new random
    text, so nothing hits). Each call generates one token (``max_tokens=1``): the time to
    first token of a lone request, prefill plus one sampling step. One untimed call at the
    shortest length warms the engine up.
    """
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def generate(ids: list[int]) -> None:
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)

    return _profile(generate, lengths, repeats, seed)
