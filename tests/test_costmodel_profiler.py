"""Profiler backends. Torch: attention variants agree numerically; measurements show what physics demands.
vLLM: the grids fit the engine's limits, and a live engine's steps are timed as composed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from feather_gym.costmodel import model_preset  # noqa: E402
from feather_gym.costmodel.profile_io import validate_profile  # noqa: E402
from feather_gym.costmodel.profiler_torch import (  # noqa: E402
    CUDA_HOMOGENEITY,
    HOMOGENEITY_POINTS,
    MAX_POOL_TOKENS,
    DecodePoint,
    TorchStepRunner,
    decode_grid,
    homogeneity_points,
    measurement_order,
    run_torch_profile,
)
from feather_gym.costmodel.profiler_vllm import (  # noqa: E402
    VLLM_HOMOGENEITY,
    EngineLimits,
    MixedPoint,
    PrefillPoint,
    check_grid,
    prefill_repeats,
    vllm_decode_grid,
    vllm_mixed_grid,
    vllm_prefill_grid,
)

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


def test_per_request_attention_reads_each_group_prefix_in_place(runner, monkeypatch):
    """per_request: one call per group, its requests a batch over the group's prefix broadcast to
    them (a stride-0 view of the pool, not a copy)."""
    b, g, prefix = 6, 2, 40
    kvh, d, per_kv = SHAPE.kv_heads, SHAPE.head_dim, SHAPE.heads // SHAPE.kv_heads
    k_pre, v_pre = torch.randn(2, g, kvh, prefix, d)
    calls, attend = [], runner._attend

    def spy(q, k, v, causal=False):
        calls.append((q.shape[0], k.shape[0], k.stride(0), k.data_ptr()))
        return attend(q, k, v, causal)

    monkeypatch.setattr(runner, "_attend", spy)
    runner._prefix_attention(torch.randn(b, kvh, per_kv, d), k_pre, v_pre, g, cascade=False)
    assert calls == [(3, 3, 0, k_pre[0].data_ptr()), (3, 3, 0, k_pre[1].data_ptr())]


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


def test_a_failed_graph_capture_falls_back_to_eager_timing_and_says_why(runner, monkeypatch):
    """The CUDA path's safety net, run where no capture can work (no CUDA here): the step is
    timed eagerly, and the runner records why and captures no more."""
    monkeypatch.setattr(runner, "cuda_graphs", True)
    monkeypatch.setattr(runner, "graph_error", None)
    assert runner.timing == "cuda_graph_events"
    assert runner.decode_step_s(DecodePoint(2, 1, 64, 16), cascade=True) > 0
    assert runner.cuda_graphs is False and runner.graph_error.startswith("RuntimeError: ")
    assert runner.timing == runner.clock.__name__


def test_a_cuda_grid_adds_serving_batches_and_holds_its_homogeneity_comparison():
    """Batches to 256 on CUDA (64 on CPU), every KV pool within its buffer, and the three batches
    of CUDA_HOMOGENEITY's comparison (mixed, one prefix, the split batches) in the full and quick grids."""
    grid = decode_grid(False, device="cuda")
    batch, groups, prefix, own = CUDA_HOMOGENEITY
    compared = {DecodePoint(batch, groups, prefix, own), DecodePoint(batch, 1, prefix, own),
                DecodePoint(batch // groups, 1, prefix, own)}
    assert compared <= set(homogeneity_points("cuda")) <= set(decode_grid(True, device="cuda"))
    assert compared <= set(grid)
    assert max(p.batch_size for p in grid) == 256 and max(p.batch_size for p in decode_grid(False)) == 64
    assert all(p.batch_size * p.unique_tokens_per_request <= MAX_POOL_TOKENS
               and p.num_groups * p.shared_prefix_tokens <= MAX_POOL_TOKENS for p in grid)


def test_measurement_order_puts_the_homogeneity_points_then_the_prefills_first():
    rest = [DecodePoint(2, 2, 0, 16), DecodePoint(4, 2, 64, 16), DecodePoint(8, 8, 0, 64)]
    decode, prefill = [rest[0], HOMOGENEITY_POINTS[1], *rest[1:]], [(8, 0), (8, 64)]
    order = measurement_order(decode, prefill, seed=3)
    assert order[:3] == [HOMOGENEITY_POINTS[1], *prefill] and sorted(order[3:], key=repr) == sorted(rest, key=repr)
    assert order == measurement_order(decode, prefill, seed=3)


def test_a_run_past_its_budget_keeps_what_it_measured_in_grid_order():
    """A budget spent before the second point: the first point of the order (here the first
    prefill, the grid having no homogeneity point) is measured, the rest counted as skipped."""
    decode, prefill = [DecodePoint(2, 1, 64, 16), DecodePoint(2, 2, 0, 16)], [(8, 0), (8, 64)]
    profile = run_torch_profile("smollm2-135m", "cpu", profiled_layers=1, repeats=1, name="budget",
                                decode_points=decode, prefill_points=prefill, budget_s=1e-9)
    validate_profile(profile, "budget")
    assert [(r["phase"], r.get("new_tokens"), r.get("cached_tokens")) for r in profile["measurements"]] == \
        [("prefill", 8, 0)]
    assert profile["settings"]["budget_s"] == 1e-9 and profile["settings"]["skipped_points"] == 3
    with pytest.raises(ValueError, match="budget_s"):
        run_torch_profile("smollm2-135m", "cpu", profiled_layers=1, decode_points=decode, budget_s=0)


#: What a GPU machine has where nothing of this project is installed: torch, what it imports, numpy.
BARE_PACKAGES = ("torch", "torchgen", "functorch", "numpy", "typing_extensions", "sympy", "mpmath", "networkx",
                 "jinja2", "markupsafe", "filelock", "fsspec")


def _bare_python(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -S ARGS`` from the repository root, seeing only :data:`BARE_PACKAGES` and the working tree."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    for name in BARE_PACKAGES:
        spec = importlib.util.find_spec(name)
        source = spec and (Path(spec.origin).parent if spec.submodule_search_locations else Path(spec.origin))
        if source and not (site / source.name).exists():
            (site / source.name).symlink_to(source)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1"}
    return subprocess.run([sys.executable, "-S", *args], cwd=Path(__file__).parents[1], env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_profile_commands_run_with_only_torch_and_numpy(tmp_path):
    """``python -m feather_cli.profile`` (what scripts/gpu_profile.sh runs on a lent GPU) imports
    nothing the project installs: ``run`` within a budget, and ``fit --against``, in an interpreter
    whose only packages are torch's and numpy."""
    assert _bare_python(tmp_path, "-c", "import xxhash").returncode != 0   # the project's packages are absent
    out = tmp_path / "p.json"
    run = _bare_python(tmp_path, "-m", "feather_cli.profile", "run", "--backend", "torch", "--device", "cpu",
                       "--model", "smollm2-135m", "--layers", "1", "--repeats", "1", "--budget-s", "0.001",
                       "-o", str(out))
    assert run.returncode == 0, run.stderr
    profile = validate_profile(json.loads(out.read_text()), "bare")
    first = min(HOMOGENEITY_POINTS, key=lambda p: (p.batch_size, p.num_groups))   # the grid's order
    assert [(r["batch_size"], r["num_groups"], r["attention"]) for r in profile["measurements"]] == \
        [(first.batch_size, first.num_groups, "per_request"), (first.batch_size, first.num_groups, "cascade")]
    assert "grid points left out by --budget-s" in run.stdout
    fit = _bare_python(tmp_path, "-m", "feather_cli.profile", "fit", "cpu", "--against", "vllm-cpu", "--json")
    assert fit.returncode == 0, fit.stderr
    assert json.loads(fit.stdout.splitlines()[-1])["variants"]["per_request"]["against"]["profile"] == "vllm-cpu"


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


CPU_ENGINE = EngineLimits(block_size=128, num_blocks=182, token_budget=4096, max_num_seqs=256, max_model_len=8192)


@pytest.mark.parametrize("quick", [False, True])
def test_vllm_grids_fit_the_cpu_engine_and_cover_every_step_kind(quick):
    decode, prefill, mixed = vllm_decode_grid(quick), vllm_prefill_grid(quick), vllm_mixed_grid(quick)
    check_grid(CPU_ENGINE, decode, prefill, mixed, repeats=8)
    assert len(set(decode)) == len(decode) and any(p.num_groups < p.batch_size for p in decode)
    assert any(p.cached_tokens for p in prefill) and any(p.requests > 1 for p in prefill) and mixed
    if not quick:  # the homogeneity comparison fit_report reads, and chunks up to the whole budget
        b, g, prefix, suffix = VLLM_HOMOGENEITY
        assert {DecodePoint(b, g, prefix, suffix), DecodePoint(b, 1, prefix, suffix),
                DecodePoint(b // g, 1, prefix, suffix)} <= set(decode)
        assert max(p.new_tokens * p.requests for p in prefill) == CPU_ENGINE.token_budget


@pytest.mark.parametrize("decode, prefill, mixed, message", [
    ([DecodePoint(4, 2, 100, 16)], [], [], "multiple of the block size"),
    ([DecodePoint(64, 64, 0, 512)], [], [],
     "needs 320 KV blocks, the engine has 181 for requests \\(182 less vLLM's null block\\)"),
    ([DecodePoint(300, 300, 0, 16)], [], [], "max_num_seqs"),
    ([], [PrefillPoint(16, 100)], [], "multiple of the block size"),
    ([], [PrefillPoint(1024, 0, 5)], [], "exceed the token budget 4096"),
    ([], [PrefillPoint(4096, 4096)], [], "max_model_len"),
    ([], [], [MixedPoint(DecodePoint(8, 8, 0, 16), (PrefillPoint(4090),))], "8 decode .* exceed the token budget"),
    ([], [], [MixedPoint(DecodePoint(8, 8, 0, 16), (PrefillPoint(64, 0, 2),))], "one prefill chunk"),
])
def test_check_grid_names_the_point_the_engine_cannot_run(decode, prefill, mixed, message):
    with pytest.raises(ValueError, match=message):
        check_grid(CPU_ENGINE, decode, prefill, mixed, repeats=8)


def test_points_measured_under_load_are_measured_again_in_later_passes(monkeypatch):
    """Task i sees the loads loads[i] in successive attempts; each keeps its least loaded attempt."""
    from feather_gym.costmodel import profiler_vllm

    loads = {"quiet": [0.0], "burst": [0.9, 0.1], "busy": [0.9, 0.5, 0.7]}
    attempts = {name: 0 for name in loads}
    current = []

    class FakeMeter:
        def others_cores(self) -> float:
            return current.pop()

    def task(name: str):
        def measure():
            current.append(loads[name][attempts[name]])
            attempts[name] += 1
            return attempts[name]  # the samples: which attempt

        return profiler_vllm.Task(name, measure, lambda attempt, load: [{"task": name, "attempt": attempt,
                                                                          "median_s": 1.0, "wall_median_s": 1.0,
                                                                          "others_cores": load}])

    monkeypatch.setattr(profiler_vllm, "LoadMeter", FakeMeter)
    lines = []
    rows = profiler_vllm.measure_least_loaded([task(name) for name in loads], lines.append)
    assert [(r["task"], r["attempt"], r["others_cores"]) for r in rows] == [("quiet", 1, 0.0), ("burst", 2, 0.1),
                                                                           ("busy", 2, 0.5)]
    assert attempts == {"quiet": 1, "burst": 2, "busy": 1 + profiler_vllm.LOAD_RETRIES}
    assert sum("measuring again" in line for line in lines) == profiler_vllm.LOAD_RETRIES


def test_prefill_repeats_fall_with_step_size():
    counts = [prefill_repeats(tokens, 8) for tokens in (16, 256, 512, 1024, 2048, 4096)]
    assert counts == sorted(counts, reverse=True) and counts[0] == 8 and counts[-1] == 2


@pytest.mark.live
def test_vllm_backend_times_controlled_steps_of_the_real_engine():
    pytest.importorskip("vllm")
    from feather_gym.costmodel.profiler_vllm import run_vllm_profile

    profile = run_vllm_profile(decode_points=[DecodePoint(2, 1, 256, 16)],
                               prefill_points=[PrefillPoint(16, 256), PrefillPoint(16, 0, 3)],
                               mixed_points=[MixedPoint(DecodePoint(2, 2, 0, 16), (PrefillPoint(16, 128),))],
                               repeats=2)
    validate_profile(profile, "vllm")
    decode, prefill, burst, mixed = profile["measurements"]
    settings = profile["settings"]
    assert profile["backend"] == "vllm" and profile["software"]["vllm"] and profile["block_size"] == 128
    assert profile["kv_cache_bytes"] == settings["kv_blocks"] * 128 * SHAPE.kv_bytes_per_token
    assert settings["clock"] == ("thread_time" if settings["threads"] == 1 else "perf_counter")
    assert decode["phase"] == "decode" and decode["repeats"] == 2 and decode["unique_kv_tokens"] == 256 + 2 * 16
    assert (prefill["new_tokens"], prefill["cached_tokens"], prefill["prefill_requests"]) == (16, 256, 1)
    assert (burst["new_tokens"], burst["prefill_requests"]) == (16, 3)
    assert mixed["phase"] == "mixed" and (mixed["batch_size"], mixed["new_tokens"], mixed["cached_tokens"]) \
        == (2, 16, 128)
    assert all(r["median_s"] > 0 and r["wall_median_s"] > 0 for r in profile["measurements"])
