"""The long-range tasks (needles placed where said, answers correct), the training batches and
settings, the remembering model's config, and the training GDN scan against transformers'."""

from __future__ import annotations

import numpy as np
import pytest

from feather_gym.hybrid import long_tasks as lt
from feather_gym.hybrid.model import SPECS
from feather_gym.hybrid.training import Stage, TrainSettings, training_batch


@pytest.fixture(scope="module")
def encode():
    from transformers import AutoTokenizer

    from feather_gym.vllm_engine import ensure_smollm2_hf

    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2_hf())
    return lambda text: tokenizer(text)["input_ids"]


@pytest.fixture(scope="module")
def text():
    """A "text" whose tokens show their position (no id collides with a task token: all are >= 60,000)."""
    return np.arange(60_000, 80_000, dtype=np.int64)


def test_pieces_tokenize_as_the_whole_sentence_and_mark_the_value(encode):
    for name in lt.NAMES:
        needle, query = lt.key_value(encode, name, "407193", answer_weight=5.0)
        assert needle.ids.tolist() == encode(f" The secret number for {name} is 407193.")
        assert needle.ids[needle.value].tolist() == encode("407193") == query.ids[query.value].tolist()
        assert set(needle.weights[needle.value]) == {0.0} and set(query.weights[query.value]) == {5.0}
        assert np.all(np.delete(query.weights, np.arange(query.ids.size)[query.value]) == 1.0)
    needle, query = lt.passkey(encode, "55021", answer_weight=2.0)
    assert needle.ids.tolist() == encode(" The pass key is 55021. Remember it. 55021 is the pass key.")
    assert query.ids.tolist() == encode(" What is the pass key? The pass key is 55021.")
    assert query.ids[query.value].tolist() == encode("55021")
    assert set(lt.task_token_ids(encode)) >= set(needle.ids) | set(query.ids)


@pytest.mark.parametrize("task", lt.EVAL_TASKS)
@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0])
def test_eval_needle_sits_at_its_depth_and_the_query_at_the_end(encode, text, task, depth):
    sample = lt.eval_sample(task, text, encode, np.random.default_rng(3), length=1000, depth=depth)
    assert sample.ids.size == sample.weights.size == 1000
    (needle,), (answer,) = sample.needles, sample.answers
    assert np.array_equal(sample.ids[needle], sample.ids[answer])
    assert answer.stop == 999 and sample.ids[-1] == encode(".")[0]                  # the query closes the sample
    text_tokens = int(np.sum(sample.ids >= 60_000))
    assert int(np.sum(sample.ids[:needle.start] >= 60_000)) == round(depth * text_tokens)   # text before the needle
    if task == "multi_key":
        secret = encode(" The secret number for")
        starts = [i for i in range(sample.ids.size - 4) if sample.ids[i:i + 4].tolist() == secret]
        assert len(starts) == 5                                                       # 4 needles + the query
    digits = set(encode("0123456789"))
    assert set(sample.ids[answer].tolist()) <= digits and len(sample.ids[answer]) == (5 if task == "passkey" else 6)


def test_text_between_pieces_is_one_contiguous_passage(encode, text):
    sample = lt.eval_sample("multi_key", text, encode, np.random.default_rng(0), length=800, depth=0.5)
    words = sample.ids[sample.ids >= 60_000]
    assert np.all(np.diff(words) == 1)


@pytest.mark.parametrize("task", lt.TRAINING_TASKS)
def test_training_samples_pair_each_answer_with_its_needle(encode, text, task):
    rng = np.random.default_rng(7)
    for _ in range(20):
        sample = lt.training_sample(task, text, encode, rng, length=512, answer_weight=4.0)
        assert sample.ids.size == sample.weights.size == 512
        assert len(sample.needles) == len(sample.answers)
        for needle, answer in zip(sample.needles, sample.answers):
            assert needle.stop <= answer.start
            assert np.array_equal(sample.ids[needle], sample.ids[answer])
            assert np.all(sample.weights[answer] == 4.0)
            assert np.all(sample.weights[needle] == 0.0)
        answer_positions = np.zeros(512, dtype=bool)
        for answer in sample.answers:
            answer_positions[answer] = True
        assert np.all(sample.weights[~answer_positions] <= 1.0)
        if task == "text":
            assert np.array_equal(sample.ids, sample.ids[0] + np.arange(512)) and np.all(sample.weights == 1.0)


def test_kv_samples_use_distinct_names(encode, text):
    rng = np.random.default_rng(1)
    secret = encode(" The secret number for")
    for _ in range(10):
        sample = lt.training_sample("kv", text, encode, rng, length=2048, answer_weight=2.0)
        ids = sample.ids.tolist()
        names = []
        for needle in sample.needles:
            start = max(i for i in range(needle.start) if ids[i:i + 4] == secret)
            names.append(tuple(ids[start + 4:needle.start - 2]))          # between "for" and " is", " "
        assert len(set(names)) == len(names) >= 1


def test_pieces_longer_than_the_sample_are_refused(encode, text):
    with pytest.raises(ValueError, match="exceed"):
        lt.eval_sample("multi_key", text, encode, np.random.default_rng(0), length=40, depth=0.5)
    with pytest.raises(ValueError, match="unknown task"):
        lt.training_sample("sort", text, encode, np.random.default_rng(0), length=400, answer_weight=1.0)


def test_batches_follow_the_curriculum(encode, text):
    settings = TrainSettings(curriculum=(Stage(0.0, 128, 8, (("copy", 1.0),)),
                                         Stage(0.5, 512, 2, (("kv", 1.0), ("text", 1.0)))), answer_weight=3.0)
    ids, weights = training_batch(settings, text, encode, np.random.default_rng(0), progress=0.2)
    assert ids.shape == weights.shape == (8, 128) and np.all((weights == 3.0).sum(1) >= 15)   # a repeat each
    ids, weights = training_batch(settings, text, encode, np.random.default_rng(0), progress=0.5)
    assert ids.shape == (2, 512) and set(np.unique(weights)) <= {0.0, 1.0, 3.0}
    with pytest.raises(ValueError, match="progress 0.0"):
        TrainSettings(curriculum=(Stage(0.1, 128, 4),))


def test_the_remembering_config_has_one_attention_layer_and_trains_to_4k():
    spec, settings = SPECS["remember"]
    assert spec.layer_types.count("full_attention") == 1 and len(spec.layer_types) == spec.num_layers
    assert settings.curriculum[-1].length >= 4096 and max(settings.recall_lengths) >= 4096
    assert all(dict(stage.task_mix).keys() <= set(lt.TRAINING_TASKS) for stage in settings.curriculum)
    assert settings.gate_dt_range is not None and settings.recall_start
    config = spec.config(1000)
    assert config.model_type == "qwen3_next" and config.max_position_embeddings >= 4096
    trained = SPECS["trained"][1]                   # the benchmarks' model: plain text, transformers' gates
    assert trained.gate_dt_range is None and not trained.recall_start
    assert trained.curriculum[0].task_mix == (("text", 1.0),)


def test_gate_initialization_spans_the_time_step_range():
    import torch
    from transformers import Qwen3NextForCausalLM

    from feather_gym.hybrid.training import init_gate_memory

    spec, _ = SPECS["tiny"]
    model = Qwen3NextForCausalLM(spec.config(100))
    init_gate_memory(model, (1e-3, 1e-1), torch.Generator().manual_seed(0))
    dt = torch.cat([torch.nn.functional.softplus(m.dt_bias.detach()) for m in model.modules() if hasattr(m, "dt_bias")])
    assert dt.numel() == 3 * spec.linear_value_heads
    assert float(dt.min()) >= 1e-3 * 0.999 and float(dt.max()) <= 1e-1 * 1.001


def test_the_training_scan_matches_transformers_chunked_gated_delta_rule():
    import torch
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    from feather_gym.hybrid.gdn_scan import chunk_gated_delta_rule, faster_gdn_backward

    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, 150, 2, 16, generator=generator, requires_grad=True) for _ in range(3)]
    g = (-torch.rand(2, 150, 2, generator=generator) * 0.2).requires_grad_()
    beta = torch.rand(2, 150, 2, generator=generator).requires_grad_()
    initial = torch.randn(2, 2, 16, 16, generator=generator)
    results = []
    for rule in (qwen3_next.torch_chunk_gated_delta_rule, chunk_gated_delta_rule):
        out, state = rule(*inputs, g=g, beta=beta, chunk_size=32, initial_state=initial, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
        grads = torch.autograd.grad((out.square().sum() + state.sum()), [*inputs, g, beta])
        results.append((out, state, grads))
    (out_a, state_a, grads_a), (out_b, state_b, grads_b) = results
    torch.testing.assert_close(out_b, out_a)
    torch.testing.assert_close(state_b, state_a)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a)
    original = qwen3_next.torch_chunk_gated_delta_rule
    with faster_gdn_backward():
        assert qwen3_next.torch_chunk_gated_delta_rule is chunk_gated_delta_rule
    assert qwen3_next.torch_chunk_gated_delta_rule is original


def test_the_cli_offers_every_built_in_model():
    from feather_cli.hybrid import KINDS

    assert set(KINDS) == set(SPECS)
