"""The mimetic recall start (:mod:`feather_gym.hybrid.recall_start`): what it wires at initialization."""

import numpy as np
import pytest

from feather_gym.hybrid.model import SPECS


def _model(vocab: int = 200):
    import torch
    from transformers import Qwen3NextForCausalLM

    from feather_gym.hybrid.training import init_gate_memory

    torch.manual_seed(0)
    spec, settings = SPECS["remember"]
    model = Qwen3NextForCausalLM(spec.config(vocab))
    init_gate_memory(model, settings.gate_dt_range, torch.Generator().manual_seed(0))
    return model


def _repeats(rng: np.random.Generator, count: int, vocab: int = 200, span: int = 20):
    """``count`` sequences of random tokens in which a random span of ``span`` tokens recurs."""
    rows = []
    for _ in range(count):
        piece = rng.integers(1, vocab, span)
        rows.append(np.concatenate([rng.integers(1, vocab, 40), piece, rng.integers(1, vocab, 30), piece]))
    return np.stack(rows)


def test_the_attention_start_copies_a_recurring_span_at_initialization():
    import torch

    from feather_gym.hybrid.recall_start import attention_recall_start

    rng = np.random.default_rng(0)
    model = _model()
    ids = torch.from_numpy(_repeats(rng, 8))
    with torch.no_grad():
        before = model(input_ids=ids).logits.argmax(-1)
    attention_recall_start(model, torch.from_numpy(_repeats(rng, 32)))
    with torch.no_grad():
        after = model(input_ids=ids).logits.argmax(-1)
    repeat = slice(90, 109)                          # predicting tokens 2..20 of the recurring span
    right = lambda predicted: float((predicted[:, repeat] == ids[:, 91:110]).float().mean())   # noqa: E731
    assert right(before) < 0.05
    assert right(after) > 0.5


def test_the_attention_start_makes_layer_zero_write_the_two_previous_tokens_into_the_residual_half_tokens_leave_free():
    import torch

    from feather_gym.hybrid.recall_start import attention_recall_start

    rng = np.random.default_rng(1)
    model = _model()
    attention_recall_start(model, torch.from_numpy(_repeats(rng, 8)))
    layer = model.model.layers[0].linear_attn
    half = model.config.hidden_size // 2
    assert torch.all(model.model.embed_tokens.weight[:, half:] == 0)
    captured = {}
    layer.register_forward_hook(lambda module, args, kwargs, out: captured.__setitem__("out", out), with_kwargs=True)

    def written(ids):
        with torch.no_grad():
            model.model(input_ids=torch.as_tensor(ids)[None])
        return captured["out"][0]

    ids = rng.integers(1, 200, 32)
    base = written(ids)
    assert torch.all(base[:, :half] == 0)
    for back, depends in ((1, True), (2, True), (3, False), (6, False)):
        changed = ids.copy()
        changed[20 - back] = changed[20 - back] % 199 + 1
        moved = float((written(changed)[20] - base[20]).norm() / base[20].norm())
        assert (moved > 0.1) if depends else (moved < 1e-4), (back, moved)


def test_the_attention_start_needs_a_gdn_layer_before_an_attention_layer():
    import torch
    from transformers import Qwen3NextForCausalLM

    from feather_gym.hybrid.recall_start import attention_recall_start

    spec, _ = SPECS["tiny"]
    config = spec.config(100)
    config.layer_types = ["full_attention"] + config.layer_types[1:]
    with pytest.raises(ValueError, match="GDN layer 0"):
        attention_recall_start(Qwen3NextForCausalLM(config), torch.zeros(1, 8, dtype=torch.long))
