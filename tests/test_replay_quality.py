"""``feather bench replay-quality``'s prompts and scoring, without an engine."""

from __future__ import annotations

import numpy as np
import pytest

from deploy.bench.replay_quality import METHODS, Prompt, method_settings, quality_prompts, summarise


def char_encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_every_prompt_resumes_at_a_block_boundary_with_its_needle_before_and_its_scored_tokens_after_it():
    source = np.random.default_rng(0).integers(200, 5000, 50_000)
    prompts = quality_prompts(source, char_encode, block=384, lengths=[1024, 2048], samples=4, continuation_tokens=64)
    assert [(p.task, p.length) for p in prompts].count(("multi_key", 2048)) == 4
    assert {p.task for p in prompts} == {"single_key", "multi_key", "passkey", "text"}
    for p in prompts:
        assert p.boundary % 384 == 0 and p.boundary >= 384
        assert p.boundary < p.scored.start and p.scored.stop <= p.ids.size
        if p.task == "text":
            assert p.ids.size == p.boundary + 64 and p.needle_to_boundary_tokens is None
        else:
            assert p.ids.size == p.length and 0 <= p.needle_to_boundary_tokens < p.boundary
    distances = [p.needle_to_boundary_tokens for p in prompts if p.task == "single_key" and p.length == 2048]
    assert distances == sorted(distances, reverse=True)             # stratified depths: deeper needles nearer


def test_a_length_without_a_whole_block_before_its_query_is_refused():
    with pytest.raises(ValueError, match="no whole block"):
        quality_prompts(np.arange(10_000), char_encode, block=384, lengths=[400], samples=1, continuation_tokens=8)


def scores(right: list[bool], logprob: float, next_token: list[float], cached: int) -> dict:
    return {"logprob": np.full(len(right), logprob), "top1": np.array(right), "next_token": np.log(next_token),
            "cached_tokens": cached}


def test_retention_counts_only_prompts_the_exact_prefill_gets_right_and_misses_are_left_out():
    ids = np.zeros(800, dtype=np.int64)
    prompts = [Prompt("single_key", 800, ids, 384, slice(790, 796), 100) for _ in range(4)]
    prompts.append(Prompt("text", 800, ids, 384, slice(385, 448)))
    exact = [scores([True] * 6, -1.0, [0.5, 0.5], 0), scores([True] * 6, -1.0, [0.5, 0.5], 0),
             scores([True, False] + [True] * 4, -1.0, [0.5, 0.5], 0), scores([True] * 6, -1.0, [0.5, 0.5], 0),
             scores([True] * 63, -2.0, [0.5, 0.5], 0)]
    replayed = [scores([True] * 6, -1.0, [0.5, 0.5], 384), scores([False] + [True] * 5, -1.0, [0.5, 0.5], 384),
                scores([True] * 6, -1.0, [0.5, 0.5], 384), scores([True] * 6, -1.0, [0.5, 0.5], 0),   # a miss
                scores([True] * 63, -2.5, [0.9, 0.1], 384)]
    s = summarise(prompts, exact, replayed)
    row = s["accuracy"]["single_key"]["800"]
    assert s["misses"] == 1 and row["prompts"] == 3
    assert row["exact_accuracy"] == pytest.approx(2 / 3) and row["replay_accuracy"] == pytest.approx(2 / 3)
    assert row["retention"] == pytest.approx(1 / 2)          # of the two the exact gets right, replay keeps one
    assert s["ppl_ratio"] == pytest.approx(np.exp(0.5)) and s["ppl_exact"] == pytest.approx(np.exp(2.0))
    assert s["next_token_kl_nats_mean"] == pytest.approx(0.5 * np.log(0.5 / 0.9) + 0.5 * np.log(0.5 / 0.1))
    own = summarise(prompts, exact)
    assert own["misses"] == 0 and own["ppl_ratio"] == 1.0 and own["next_token_kl_nats_mean"] == 0.0


def test_methods_name_the_engines_replay_settings():
    types = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    assert method_settings("uniform", 64, types) == {"replay_tokens": 64}
    assert method_settings("decay", 64, types) == {"replay_tokens": 64, "replay_split": "gate_memory"}
    assert method_settings("layerwise", 16, types) == {"replay_tokens": 16, "anchor_layers": [3]}
    assert method_settings("suffix", 16, types) == {"replay_tokens": 16, "anchor_layers": []}
    with pytest.raises(ValueError, match="unknown method"):
        method_settings("zero", 16, types)
    assert set(METHODS) == {"uniform", "decay", "layerwise", "suffix"}


def test_the_retention_plot_is_written(tmp_path):
    from deploy.bench.replay_quality import plot_retention

    configs = [{"method": m, "replay_tokens": r, "vs_checkpoint_8192": x, "retention_mean": y}
               for m, r, x, y in (("uniform", 16, 1.3, 0.0), ("uniform", 256, 20.4, 0.04), ("suffix", 16, 0.0, None))]
    path = tmp_path / "retention.png"
    plot_retention({"model": "/models/remember-4l/", "block_tokens": 384, "lengths_tokens": [1024],
                    "configs": configs}, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
