"""Does batch homogeneity pay? Side-by-side step times of homogeneous and mixed batches.

The Feather paper's point: Llama-3-8B, 10K-token shared prefixes, 8 homogeneous batches of
100 (one prefix each) against one mixed batch of 800 (all 8 prefixes) decode the same 800
tokens; the homogeneous schedule is about 2x faster on an RTX 6000 Ada.
"""

from __future__ import annotations

from collections.abc import Callable

from .features import DecodeBatch

#: The paper's published point and the band an analytic profile must land in to agree with it.
PAPER_POINT = {"model": "llama3-8b", "batch_size": 800, "groups": 8, "prefix_tokens": 10_000,
               "speedup": 2.0, "hardware": "RTX 6000 Ada"}
PAPER_SPEEDUP_BAND = (1.5, 3.0)


def compare(step_s: Callable[[DecodeBatch], float], batch_size: int, groups: int, prefix_tokens: int,
            unique_tokens: int) -> dict:
    """Step times of (a) one mixed batch of ``batch_size`` over ``groups`` prefixes,
    (b) ``groups`` homogeneous batches of ``batch_size // groups`` (same tokens decoded), and
    (c) one homogeneous batch of ``batch_size`` (equal batch size and total KV as (a)), from
    ``step_s`` (a model's prediction or a measurement lookup). Speedups > 1: homogeneity helps.
    """
    if batch_size % groups:
        raise ValueError(f"batch_size {batch_size} is not a multiple of groups {groups}")
    mixed = step_s(DecodeBatch.from_groups(batch_size, groups, prefix_tokens, unique_tokens))
    small = step_s(DecodeBatch.from_groups(batch_size // groups, 1, prefix_tokens, unique_tokens))
    same_size = step_s(DecodeBatch.from_groups(batch_size, 1, prefix_tokens, unique_tokens))
    return {"batch_size": batch_size, "groups": groups, "prefix_tokens": prefix_tokens,
            "unique_tokens_per_request": unique_tokens, "mixed_step_s": mixed,
            "homogeneous_steps_total_s": groups * small, "homogeneous_same_size_step_s": same_size,
            "speedup_split_homogeneous": mixed / (groups * small),
            "speedup_same_size_homogeneous": mixed / same_size}


def homogeneity_comparison(model, batch_size: int = 800, groups: int = 8, prefix_tokens: int = 10_000,
                           unique_tokens: int = 256) -> dict:
    """:func:`compare` with a CostModel's predictions."""
    return compare(model.decode_step_s, batch_size, groups, prefix_tokens, unique_tokens)


def measured_comparison(profile: dict, attention: str, batch_size: int, groups: int, prefix_tokens: int,
                        unique_tokens: int) -> dict | None:
    """:func:`compare` with a measured profile's median times; None if a point was not measured."""
    times = {(r["batch_size"], r["num_groups"], r["total_kv_tokens"], r["unique_kv_tokens"]): r["median_s"]
             for r in profile["measurements"] if r["phase"] == "decode" and r["attention"] == attention}
    try:
        return compare(lambda b: times[b.batch_size, b.num_groups, b.total_kv_tokens, b.unique_kv_tokens],
                       batch_size, groups, prefix_tokens, unique_tokens)
    except KeyError:
        return None


def paper_check(model) -> dict:
    """The paper's point on ``model`` (a Llama-3-8B profile): the comparison plus ``within_paper_band``.
    Only a profile of the paper's hardware (``rtx6000-ada``) is expected to land in the band."""
    result = homogeneity_comparison(model, PAPER_POINT["batch_size"], PAPER_POINT["groups"],
                                    PAPER_POINT["prefix_tokens"])
    low, high = PAPER_SPEEDUP_BAND
    result.update(paper_speedup=PAPER_POINT["speedup"], paper_hardware=PAPER_POINT["hardware"],
                  within_paper_band=low <= result["speedup_split_homogeneous"] <= high)
    return result
