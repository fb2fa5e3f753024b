"""Torch profiler backend: attention variants agree numerically; measurements show what physics demands."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from feather_gym.costmodel import model_preset  # noqa: E402
from feather_gym.costmodel.profile_io import validate_profile  # noqa: E402
from feather_gym.costmodel.profiler_torch import DecodePoint, TorchStepRunner, run_torch_profile  # noqa: E402

SHAPE = model_preset("smollm2-135m").with_dtype("float32")


@pytest.fixture(scope="module")
def runner():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # thread CPU-time clock, as the profiler's default
    yield TorchStepRunner(SHAPE, "cpu", profiled_layers=1)
    torch.set_num_threads(previous)


@pytest.mark.parametrize("cascade", [False, True])
def test_prefix_attention_merged_by_lse_equals_full_attention(runner, cascade):
    """Shared-prefix + own-suffix attention (either variant) equals attention over the concatenation."""
    b, g, prefix, suffix = 6, 2, 40, 7
    kvh, d, per_kv = SHAPE.kv_heads, SHAPE.head_dim, SHAPE.heads // SHAPE.kv_heads
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, kvh, per_kv, d, generator=gen)
    k_pre, v_pre = torch.randn(2, g, kvh, prefix, d, generator=gen)
    k_suf, v_suf = torch.randn(2, b, kvh, suffix, d, generator=gen)
    merged = runner._merge(runner._prefix_attention(q, k_pre, v_pre, g, cascade), runner._attend(q, k_suf, v_suf))
    for i in range(b):
        k = torch.cat([k_pre[i % g], k_suf[i]], dim=1)
        v = torch.cat([v_pre[i % g], v_suf[i]], dim=1)
        expected = torch.softmax(q[i] @ k.transpose(-1, -2) * d ** -0.5, dim=-1) @ v
        torch.testing.assert_close(merged[i], expected, rtol=1e-4, atol=1e-5)


def _median(runner, point, cascade, repeats=5):
    runner.decode_step_s(point, cascade)  # warm-up
    return sorted(runner.decode_step_s(point, cascade) for _ in range(repeats))[repeats // 2]


@pytest.mark.parametrize("cascade", [False, True])
def test_step_time_grows_with_kv_tokens(runner, cascade):
    """64x more KV per request (own suffixes: 8 x 64 -> 8 x 4096 tokens) must cost more."""
    times = [_median(runner, DecodePoint(8, 8, 0, s), cascade) for s in (64, 4096)]
    assert times[0] < times[1]


def test_cascade_not_slower_for_a_large_shared_prefix(runner):
    """16 requests sharing an 8192-token prefix: cascade reads it once, per-request 16 times."""
    point = DecodePoint(16, 1, 8192, 16)
    assert _median(runner, point, cascade=True) < _median(runner, point, cascade=False)


def test_tiny_profile_run_is_a_valid_measured_profile():
    threads_before = torch.get_num_threads()
    profile = run_torch_profile("smollm2-135m", "cpu", profiled_layers=1, repeats=2, name="tiny",
                                decode_points=[DecodePoint(2, 1, 64, 16), DecodePoint(2, 2, 0, 16)],
                                prefill_points=[(8, 0), (8, 64)])
    validate_profile(profile, "tiny")
    rows = profile["measurements"]
    assert [r["phase"] for r in rows] == ["decode"] * 4 + ["prefill"] * 2
    assert {r["attention"] for r in rows[:4]} == {"per_request", "cascade"}
    assert rows[0]["unique_kv_tokens"] == 64 + 2 * 16 and rows[0]["total_kv_tokens"] == 2 * 80
    assert profile["settings"]["layer_scale"] == SHAPE.layers and profile["hardware"]["cores"] >= 1
    assert all(r["min_s"] <= r["median_s"] <= r["max_s"] and r["repeats"] == 2 for r in rows)
    # One thread is the default and is timed in thread CPU time; after an in-process vLLM CPU
    # engine (which disables torch.set_num_threads) the profile must say it ran multi-threaded.
    vllm_disabled_threads = torch.set_num_threads.__name__ == "skip_set_num_threads"
    assert profile["settings"]["threads"] == (threads_before if vllm_disabled_threads else 1)
    expected_clock = "thread_time" if profile["settings"]["threads"] == 1 else "perf_counter"
    assert profile["settings"]["clock"] == expected_clock and torch.get_num_threads() == threads_before


@pytest.mark.parametrize("cached", [0, 9])
def test_prefill_attention_equals_causal_attention_over_cache_and_new_tokens(runner, cached):
    n, kvh, d, heads = 5, SHAPE.kv_heads, SHAPE.head_dim, SHAPE.heads
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(n, heads, d, generator=gen)
    k_new, v_new = torch.randn(2, n, kvh, d, generator=gen)
    k_cached, v_cached = torch.randn(2, kvh, cached, d, generator=gen)
    got = runner._prefill_attention(q, k_new, v_new, *((k_cached, v_cached) if cached else ()))
    for head in range(heads):
        kv = head // (heads // kvh)
        k = torch.cat([k_cached[kv], k_new[:, kv]])
        v = torch.cat([v_cached[kv], v_new[:, kv]])
        scores = q[:, head] @ k.T * d ** -0.5
        scores = scores.masked_fill(torch.arange(cached + n)[None, :] > cached + torch.arange(n)[:, None], -torch.inf)
        torch.testing.assert_close(got[:, head], torch.softmax(scores, -1) @ v, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_vllm_backend_times_a_fixed_decode_batch_of_the_real_engine():
    pytest.importorskip("vllm")
    from feather_gym.costmodel.profiler_vllm import run_vllm_profile

    profile = run_vllm_profile(decode_points=[DecodePoint(2, 1, 256, 16)], prefill_points=[(16, 256)], repeats=2)
    validate_profile(profile, "vllm")
    decode, prefill = profile["measurements"]
    assert profile["backend"] == "vllm" and profile["software"]["vllm"]
    assert decode["repeats"] == 2 and decode["unique_kv_tokens"] == 256 + 2 * 16 and decode["median_s"] > 0
    assert prefill["new_tokens"] == 16 and prefill["median_s"] > 0
