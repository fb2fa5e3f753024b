"""Prefill-time profilers: the measured ``(tokens, ms)`` points that
:meth:`cache_core.hybrid.recompute_cost.PrefillTime.fit` fits, on the transformers model
(:func:`profile_torch`) or a running vLLM engine (:func:`profile_vllm`).
"""

from __future__ import annotations

import time

import numpy as np

from cache_core.hybrid.recompute_cost import PrefillTime
from feather_gym.costmodel.profiler_vllm import VOCAB_HIGH, VOCAB_LOW

#: Timed runs per length (the median is kept) unless told otherwise.
DEFAULT_REPEATS = 3


def _profile(run, lengths, repeats: int, seed: int) -> list[tuple[int, float]]:
    """``(n, median ms)`` per length of ``repeats`` timed calls ``run(ids)``.

    Each call gets a new prompt of ``n`` random token ids above the special tokens (fresh
    text: never a prefix-cache hit), built before its timer starts. One untimed call at the
    shortest length warms up first.
    """
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
    torch.set_num_threads(previous if threads is None else threads)
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


def profile_prefill(model_dir: str, lengths, *, backend: str, dtype: str, repeats: int = DEFAULT_REPEATS,
                    threads: int | None = None) -> dict:
    """Time prefills from 0 on ``backend`` (``torch``: :func:`profile_torch`; ``vllm``: an engine
    started here, :func:`profile_vllm`) and fit :class:`PrefillTime` to them: the fitted
    coefficients (:meth:`PrefillTime.to_dict`) with the measured and fitted points."""
    if backend == "torch":
        points = profile_torch(model_dir, lengths, dtype, repeats=repeats, threads=threads)
    else:
        from feather_gym.vllm_engine import start_engine

        llm = start_engine(model_dir, dtype=dtype, max_model_len=max(lengths) + 16, threads=threads)
        points = profile_vllm(llm, lengths, repeats=repeats)
    model = PrefillTime.fit(points)
    return {**model.to_dict(), "backend": backend, "model": model_dir, "dtype": dtype, "threads": threads,
            "repeats": repeats, "points": [{"tokens": n, "ms": ms, "fit_ms": model.ms(0, n)} for n, ms in points]}
