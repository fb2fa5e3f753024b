"""The hybrid bench's sides: every capped side holds the same recurrent-state bytes (states plus anchors)."""

from __future__ import annotations

import pytest

BUDGET = 32 * 2**20


def side_bytes(kwargs) -> int:
    anchors = kwargs["replay_config"].anchor_budget_bytes if "replay_config" in kwargs else 0
    return kwargs["hybrid_config"].state_budget_bytes + anchors


def test_every_capped_side_holds_the_same_bytes():
    from deploy.bench.hybrid import SIDES, placement_sides

    sides = placement_sides(BUDGET, checkpoints=8, resolve_every=1, replay={"replay_tokens": 32}, anchor_share=0.25)
    assert list(sides) == list(SIDES)
    assert {label: side_bytes(kwargs) for label, (_, kwargs) in sides.items() if label != "vllm-uncapped"} == {
        "vllm": BUDGET, "dp": BUDGET, "replay": BUDGET, "dp-replay": BUDGET}
    assert sides["vllm-uncapped"][1]["hybrid_config"].state_budget_bytes is None
    assert sides["replay"][1]["hybrid_config"].state_budget_bytes == 0                 # anchors only
    assert sides["dp-replay"][1]["replay_config"].anchor_budget_bytes == BUDGET // 4
    assert sides["dp-replay"][1]["hybrid_config"].placement == "dp"
    assert sides["replay"][1]["replay_config"].replay_tokens == 32


def test_a_subset_of_sides_keeps_the_report_order_and_unknown_sides_are_refused():
    from deploy.bench.hybrid import placement_sides

    assert list(placement_sides(BUDGET, checkpoints=8, resolve_every=1, sides=("replay", "vllm"))) == ["vllm", "replay"]
    with pytest.raises(ValueError, match="unknown sides"):
        placement_sides(BUDGET, checkpoints=8, resolve_every=1, sides=("vllm", "radix"))
    with pytest.raises(ValueError, match="anchor_share"):
        placement_sides(BUDGET, checkpoints=8, resolve_every=1, anchor_share=1.0)


def test_replay_variants_run_beside_the_sides_with_their_own_settings_at_the_same_bytes():
    from deploy.bench.hybrid import parse_replay_variant, placement_sides

    variants = dict(map(parse_replay_variant, ["lw:anchor_layers=[0,4],replay_tokens=16,replay_split=uniform",
                                               "lean:anchor_pages=expected,anchor_eviction=utility",
                                               "decode:anchor_decode_pages=true"]))
    assert variants == {"replay:lw": {"anchor_layers": [0, 4], "replay_tokens": 16, "replay_split": "uniform"},
                        "replay:lean": {"anchor_pages": "expected", "anchor_eviction": "utility"},
                        "replay:decode": {"anchor_decode_pages": True}}
    sides = placement_sides(BUDGET, checkpoints=8, resolve_every=1, sides=("vllm", "replay"),
                            replay={"replay_split": "gate_memory"}, variants=variants)
    assert list(sides) == ["vllm", "replay", "replay:lw", "replay:lean", "replay:decode"]
    configs = {label: kwargs["replay_config"] for label, (_, kwargs) in sides.items() if label != "vllm"}
    assert configs["replay"].replay_split == "gate_memory" and configs["replay"].replay_tokens == 64
    assert configs["replay:lw"].anchor_layers == (0, 4) and configs["replay:lw"].replay_split == "uniform"
    assert (configs["replay:lean"].anchor_pages, configs["replay:lean"].replay_split) == ("expected", "gate_memory")
    assert configs["replay:decode"].anchor_decode_pages is True
    assert {side_bytes(kwargs) for _, kwargs in sides.values()} == {BUDGET}
    with pytest.raises(ValueError, match="anchor_pagez"):
        placement_sides(BUDGET, checkpoints=8, resolve_every=1, variants={"replay:x": {"anchor_pagez": "every"}})
    for bad in ("lw", "lw:", "lw:anchor_layers"):
        with pytest.raises(ValueError, match="replay-variant"):
            parse_replay_variant(bad)


def test_add_recompute_compares_every_side_with_vllm():
    from deploy.bench.hybrid import add_recompute

    side = lambda cached, ttft: {"cached_prompt_tokens": cached, "ttft_p50_s": ttft}   # noqa: E731
    result = {"prompt_tokens": 1000, "reference": "vllm",
              "sides": {"vllm": side(600, 0.4), "replay": side(800, 0.2)},
              "ratios": {"replay": {"mean": 1.1}}}
    report = add_recompute(result)["vs_vllm"]["replay"]
    assert report == {"recompute_reduction_pct": pytest.approx(50.0), "ttft_p50_speedup_x": pytest.approx(2.0),
                      "throughput_ratio": 1.1}
