"""The SuffixReplay scheduler's plan, model-free (no layer runs; what the layers would leave in the
plan is put there by hand).

* Capture windows: the anchors of boundary ``b`` are the rows ``[b - R, b)``; a window within one
  chunk is one capture, one reached while decoding (``anchor_decode_pages``) is captured a row per
  step, its page key given with its last row, and a request's incomplete windows go when it leaves.
* Per-layer budgets: with ``replay_split="gate_memory"`` the whole page is captured, and each
  page's budget of ``replay_tokens x GDN layers`` anchors is split between the layers by the gate
  memory they measured on it; the store keeps each layer's last ``R_l`` rows and counts bytes per
  layer, as do the scheduler's stats and the ``feather:anchor_bytes{layer}`` gauge.

The live counterparts are in ``test_replay_live.py``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

BLOCK = 128


@pytest.fixture
def make_scheduler():
    """``make(**replay)``: a model-free :class:`SuffixReplayScheduler` on the tiny hybrid's cache
    layout (its GDN layers declared replayable for the duration), no exact state kept."""
    from deploy.hybrid_placement import HybridPlacementConfig
    from deploy.model_free import model_free_scheduler
    from deploy.replay_plan import PLAN
    from deploy.replay_scheduler import SuffixReplayConfig, SuffixReplayScheduler
    from feather_gym.hybrid.model import ensure_hybrid_hf

    layers = json.loads((ensure_hybrid_hf("tiny") / "config.json").read_text())["num_hidden_layers"]
    saved, PLAN.layers = PLAN.layers, {f"model.layers.{i}.linear_attn": i for i in range(layers)}

    def make(**replay):
        return model_free_scheduler(
            SuffixReplayScheduler, block_size=BLOCK, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=4096,
            max_model_len=4096, hybrid=True, enforce_eager=True, replay_config=SuffixReplayConfig(**replay),
            hybrid_config=HybridPlacementConfig(placement="vllm", state_budget_bytes=0))

    yield make
    PLAN.layers = saved


def planned_captures(scheduler, prompt_tokens: int, output_tokens: int = 1, pending: bool = False) -> list[tuple]:
    """``(step, boundary, chunk row, rows, anchor row, completes)`` of every capture the scheduler
    plans while serving one prompt to its end; with ``pending``, each incomplete window is put in
    the plan's ``pending`` as a layer would leave it (the last check: none is left behind)."""
    from deploy.model_free import ModelFreeEngine, vllm_requests
    from deploy.replay_plan import PLAN
    from traces import Request, Trace

    tokens = np.random.default_rng(0).integers(100, 20000, size=prompt_tokens)
    planned, steps = [], []

    def record(_):
        for c in next(iter(PLAN.captures.values()), ()):            # one request: every GDN slot has its list
            planned.append((len(steps), c.window[1], c.chunk_row, c.count, c.anchor_row, c.key is not None))
            if pending and c.key is None:
                PLAN.pending.setdefault(c.window, {})[0] = (torch.zeros(1), 0)
        steps.append(len(PLAN.pending))

    engine = ModelFreeEngine(scheduler, on_schedule=record)
    engine.add_requests(vllm_requests(Trace("t", [Request("0", 0.0, prompt_tokens, output_tokens, token_ids=tokens)]),
                                      block_size=BLOCK))
    while not engine.finished:
        engine.step()
    assert not PLAN.pending and (max(steps) > 0) == pending
    return planned


def test_the_gate_memory_split_captures_whole_pages_and_uniform_its_tail(make_scheduler):
    from deploy.replay_plan import PLAN

    uniform = make_scheduler(replay_tokens=16)
    assert (PLAN.rows, PLAN.measure_memory) == (16, False)
    assert planned_captures(uniform, 300) == [(0, BLOCK, BLOCK - 16, 16, 0, True),
                                              (0, 2 * BLOCK, 2 * BLOCK - 16, 16, 0, True)]
    split = make_scheduler(replay_tokens=16, replay_split="gate_memory")
    assert (PLAN.rows, PLAN.measure_memory) == (BLOCK, True)
    assert planned_captures(split, 300) == [(0, BLOCK, 0, BLOCK, 0, True), (0, 2 * BLOCK, BLOCK, BLOCK, 0, True)]
    assert split.anchors.entry_bytes == uniform.anchors.entry_bytes      # the same bytes per page


def test_each_page_is_split_by_its_gate_memory_and_stored_with_exact_bytes_per_layer(make_scheduler):
    from prometheus_client import REGISTRY

    from deploy.model_free import ModelFreeEngine
    from deploy.replay_plan import PLAN
    from feather_gym.hybrid.suffix_replay import allocate_replay_tokens

    scheduler = make_scheduler(replay_tokens=16, replay_split="gate_memory")
    layers = sorted(scheduler.anchors.replay_tokens)
    hidden = scheduler.anchors.hidden_size
    assert scheduler.min_layer_replay_tokens == 4                       # the tiny model's conv kernel
    pages = {b"long-last": [5.0, 50.0, 500.0], b"even": [30.0, 30.0, 30.0]}
    captured = {key: {layer: torch.randn(BLOCK, hidden) for layer in layers} for key in pages}

    def capture(_):                                     # what the scheduler planned and the layers left
        scheduler._depths.update(dict.fromkeys(pages, BLOCK))
        PLAN.captured.update(captured)
        PLAN.memory.update({key: dict(zip(layers, memory)) for key, memory in pages.items()})

    ModelFreeEngine(scheduler, on_schedule=capture).step()
    long_last = {layer: a.shape[0] for layer, a in scheduler.anchors.get(b"long-last").items()}
    budget = 16 * len(layers)
    assert long_last == allocate_replay_tokens(budget, dict(zip(layers, pages[b"long-last"])), minimum=4,
                                               maximum=BLOCK)
    assert list(long_last.values()) == sorted(long_last.values()) and long_last[layers[-1]] > 16
    assert {a.shape[0] for a in scheduler.anchors.get(b"even").values()} == {16}
    for layer, anchors in scheduler.anchors.get(b"long-last").items():      # each layer's last rows
        assert torch.equal(anchors, captured[b"long-last"][layer][-long_last[layer]:].to(torch.bfloat16))
    stats = scheduler.feather_stats()
    row_bytes = hidden * 2
    by_layer = {str(layer): (long_last[layer] + 16) * row_bytes for layer in layers}
    assert stats["anchor_bytes_by_layer"] == by_layer and stats["replay_split"] == "gate_memory"
    assert stats["anchor_bytes"] == sum(by_layer.values()) == 2 * budget * row_bytes
    assert stats["anchor_bytes_per_page"] == budget * row_bytes
    assert stats["replay_tokens_by_layer_mean"] == {str(layer): (long_last[layer] + 16) / 2 for layer in layers}
    for layer in layers:
        assert REGISTRY.get_sample_value("feather:anchor_bytes", {"layer": str(layer)}) == by_layer[str(layer)]


def test_an_unknown_split_is_refused():
    from deploy.replay_scheduler import SuffixReplayConfig

    with pytest.raises(ValueError, match="replay_split must be one of"):
        SuffixReplayConfig.from_additional_config({"feather_replay": {"replay_split": "decay"}})


def test_pages_reached_while_decoding_are_captured_a_row_per_step_once_enabled(make_scheduler):
    # a 100-token prompt decoding 60 tokens passes boundary 128 at its 28th output token
    assert planned_captures(make_scheduler(replay_tokens=16), 100, 60) == []               # prompt pages only
    rows = planned_captures(make_scheduler(replay_tokens=16, anchor_decode_pages=True), 100, 60, pending=True)
    # step s (from 1) feeds position 99 + s: rows 112..127 of the window [112, 128), the last one with the key
    assert rows == [(p - 99, BLOCK, 0, 1, p - 112, p == 127) for p in range(112, 128)]
    whole = planned_captures(make_scheduler(replay_tokens=BLOCK, anchor_decode_pages=True), 100, 60, pending=True)
    # R = the block: the prefill holds the first 100 rows; then the next window starts at 128 (and the
    # request ends at position 158 inside it: that window is dropped when it leaves)
    assert whole == [(0, BLOCK, 0, 100, 0, False)] + [(p - 99, BLOCK, 0, 1, p, p == 127) for p in range(100, 128)] \
        + [(p - 99, 2 * BLOCK, 0, 1, p - BLOCK, False) for p in range(128, 159)]


def test_a_layer_assembles_a_window_in_order_and_drops_one_it_saw_only_part_of():
    """``ReplayPlan.capture`` for layer 0: the window's rows arrive over steps."""
    from deploy.replay_plan import PLAN, Capture

    saved = PLAN.rows
    PLAN.rows = 4
    try:
        rows = torch.arange(8.0).reshape(4, 2)
        assert PLAN.capture(0, Capture("w", 0, 3, 0), rows[:3]) is None
        assert not PLAN.captured and PLAN.pending["w"][0][1] == 3
        assert torch.equal(PLAN.capture(0, Capture("w", 0, 1, 3, key="page"), rows[3:]), rows)
        captured, _ = PLAN.take_captured()
        assert torch.equal(captured["page"][0], rows) and not PLAN.pending
        assert PLAN.capture(0, Capture("v", 0, 2, 2, key="late"), rows[2:]) is None     # its first rows never seen
        assert PLAN.take_captured() == ({}, {}) and not PLAN.pending
    finally:
        PLAN.rows = saved


TRAINED_LAYOUT = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]


def test_layer_wise_spans_start_at_the_anchored_layers_and_below_them_at_the_tokens():
    from deploy.replay_span import layer_spans

    assert layer_spans(TRAINED_LAYOUT, [4]) == {0: 2, 4: 6}           # one anchored layer per attention block
    assert layer_spans(TRAINED_LAYOUT, []) == {0: 6}                  # no anchors: the suffix through attention 3
    assert layer_spans(TRAINED_LAYOUT, [1]) == {0: 0, 1: 6}
    assert layer_spans(TRAINED_LAYOUT, [0, 5]) == {0: 4, 5: 6}          # attention 3 inside the first
    with pytest.raises(ValueError, match="GDN layers"):
        layer_spans(TRAINED_LAYOUT, [3])


@pytest.fixture
def decoder_stack():
    """Layer-wise replay needs the engine's decoder stack in the plan; model-free, a stand-in."""
    from deploy.replay_plan import PLAN

    saved, PLAN.model = PLAN.model, object()
    yield
    PLAN.model = saved
    PLAN.spans, PLAN.residual = {}, frozenset()


def test_layer_wise_replay_keeps_residual_anchors_at_the_anchored_layers_only(make_scheduler, decoder_stack):
    from deploy.replay_plan import PLAN

    uniform = make_scheduler(replay_tokens=16)
    layer_wise = make_scheduler(replay_tokens=16, anchor_layers=[1])
    assert (PLAN.spans, PLAN.residual) == ({0: 0, 1: 2}, {1})          # tiny: GDN layers 0-2, attention 3
    assert list(layer_wise.anchors.replay_tokens) == [1]
    assert layer_wise.anchors.entry_bytes * len(uniform.anchors.replay_tokens) == uniform.anchors.entry_bytes
    assert planned_captures(layer_wise, 300) == [(0, BLOCK, BLOCK - 16, 16, 0, True),
                                                 (0, 2 * BLOCK, 2 * BLOCK - 16, 16, 0, True)]
    none = make_scheduler(replay_tokens=16, anchor_layers=[])
    assert (PLAN.spans, PLAN.residual) == ({0: 2}, frozenset())
    assert planned_captures(none, 300) == []                           # nothing to keep
    stats = none.feather_stats()
    assert stats["anchor_layers"] == [] and stats["anchor_bytes_per_page"] == stats["anchor_bytes"] == 0
    assert none.resumable_blocks(SimpleNamespace(block_hashes=[b"a", b"b", b"c"]), 2) == 2   # every shared page


def test_layer_wise_refusals():
    from deploy.replay_scheduler import SuffixReplayConfig
    from deploy.replay_span import require_moe_layers_by_name

    with pytest.raises(ValueError, match="call order"):
        require_moe_layers_by_name(SimpleNamespace(fast_moe_cold_start=True))
    require_moe_layers_by_name(SimpleNamespace(fast_moe_cold_start=False))

    with pytest.raises(ValueError, match="token-wise"):
        SuffixReplayConfig(anchor_layers=[4], replay_split="gate_memory")
    with pytest.raises(ValueError, match="anchor_pages must be one of"):
        SuffixReplayConfig(anchor_pages="some")
    with pytest.raises(ValueError, match="anchor_eviction must be one of"):
        SuffixReplayConfig(anchor_eviction="lfu")
    assert SuffixReplayConfig.from_additional_config({"feather_replay": {"anchor_layers": [5, 4]}}).anchor_layers \
        == (4, 5)


def test_a_layer_wise_scheduler_needs_the_decoder_stack(make_scheduler, monkeypatch):
    from deploy.replay_plan import PLAN

    monkeypatch.setattr(PLAN, "model", None)               # no engine built a ReplayQwen3Next
    with pytest.raises(ValueError, match="register_replay_layer"):
        make_scheduler(anchor_layers=[1])


def planned_boundaries(scheduler, prompts) -> list[list[int]]:
    """Per prompt served one after another, the boundaries the scheduler plans to anchor (nothing
    is stored: no layer runs, so every hit recomputes from the start)."""
    from deploy.model_free import ModelFreeEngine, vllm_requests
    from deploy.replay_plan import PLAN
    from traces import Request, Trace

    planned = []
    engine = ModelFreeEngine(scheduler, on_schedule=lambda _: planned[-1].extend(
        c.window[1] for c in next(iter(PLAN.captures.values()), ()) if c.key is not None))
    for i, prompt in enumerate(prompts):
        planned.append([])
        engine.add_requests(vllm_requests(Trace("t", [Request(str(i), 0.0, len(prompt), 1, token_ids=prompt)]),
                                          block_size=BLOCK))
        while str(i) not in engine.finished:
            engine.step()
    return planned


def test_expected_pages_are_branch_points_past_branch_points_and_the_prompts_last(make_scheduler):
    rng = np.random.default_rng(1)
    shared = rng.integers(100, 20000, size=3 * BLOCK)
    prompts = [np.concatenate([shared[:pages * BLOCK], rng.integers(100, 20000, size=600 - pages * BLOCK)])
               for pages in (3, 3, 2)]
    every = planned_boundaries(make_scheduler(replay_tokens=16), prompts)
    assert every == [[BLOCK, 2 * BLOCK, 3 * BLOCK, 4 * BLOCK]] * 3
    expected = planned_boundaries(make_scheduler(replay_tokens=16, anchor_pages="expected"), prompts)
    # the first: its last page only; the second branches at page 3; the third at page 2, and page 3
    # is where its family's earlier hit ended
    assert expected == [[4 * BLOCK], [3 * BLOCK, 4 * BLOCK], [2 * BLOCK, 3 * BLOCK, 4 * BLOCK]]


def test_registering_the_replay_model_drops_vllms_cached_resolution(monkeypatch):
    """vLLM caches each model path's resolved class; an engine started on vLLM's own Qwen3-Next
    before the registration must not make the next engine on that path skip the replay model."""
    from vllm.model_executor.model_loader.utils import _MODEL_ARCH_BY_HASH
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM
    from vllm.model_executor.models.registry import ModelRegistry

    from deploy.replay_span import ARCHITECTURE, register_replay_model

    monkeypatch.setitem(ModelRegistry.models, ARCHITECTURE, ModelRegistry.models[ARCHITECTURE])
    monkeypatch.setitem(_MODEL_ARCH_BY_HASH, "qwen3-next path", (Qwen3NextForCausalLM, ARCHITECTURE))
    monkeypatch.setitem(_MODEL_ARCH_BY_HASH, "llama path", (LlamaForCausalLM, "LlamaForCausalLM"))
    register_replay_model()
    assert "qwen3-next path" not in _MODEL_ARCH_BY_HASH
    assert _MODEL_ARCH_BY_HASH["llama path"] == (LlamaForCausalLM, "LlamaForCausalLM")
    assert ModelRegistry._try_load_model_cls(ARCHITECTURE).__name__ == "ReplayQwen3Next"
