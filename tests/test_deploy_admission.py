"""deploy: the CHT waiting queue under vLLM's admission protocol, the admission rules, start-up safety.

Real vLLM v1 ``Request`` objects with the engine's sha256 block hashes; no engine (see
test_deploy_live.py for that).
"""

from __future__ import annotations

import logging
import os
import shutil
import time

import deploy_policies as policies
import numpy as np
import pytest

from cache_core.cht.tree import ChunkedHashTree
from deploy.admission import FCFSAdmission, PolicyAdmission
from deploy.scheduler import FeatherConfig, PolicyStartupError, build_admission
from deploy.vllm_request import vllm_request
from deploy.waiting_queue import CHTWaitingQueue
from feather_gym.policies import DEFAULT_HOLD_STEPS, FeatherRule, OnnxFilePolicy, ResidentFirstRule, make_policy
from traces.chunk_hash import block_hash_digests

BLOCK = 16


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("policies")
    add = policies.constant_policy(root / "add.onnx", 1)
    return {"add": add, "stop": policies.constant_policy(root / "stop.onnx", 0),
            "nan": policies.nan_policy(add, root / "nan.onnx"),
            "old_version": policies.with_metadata(add, root / "old.onnx", obs_version="feather-obs-0"),
            "corrupt": policies.corrupt_file(root / "corrupt.onnx"), "missing": root / "missing.onnx"}


def tokens(*pieces: int) -> np.ndarray:
    """A prompt of full blocks; piece ``p`` is block content ``p`` (equal pieces -> equal blocks)."""
    return np.concatenate([np.full(BLOCK, 300 + p) + np.arange(BLOCK) for p in pieces])


def make_queue(prompts: dict[str, tuple[int, ...]], arrival_time: float | None = None):
    queue = CHTWaitingQueue(ChunkedHashTree(chunk_size=BLOCK))
    now = time.time() if arrival_time is None else arrival_time
    requests = {rid: vllm_request(rid, tokens(*pieces), block_size=BLOCK, arrival_time=now)
                for rid, pieces in prompts.items()}
    for request in requests.values():
        queue.add_request(request)
    return queue, requests


def admit(queue):
    """One admission as vLLM's loop does it: bool, peek, pop."""
    if not queue:
        return None
    assert queue.peek_request() is not None
    return queue.pop_request().request_id


def nothing_resident(request) -> int:
    """A prefix cache that holds nothing (these queues have no KV cache)."""
    return 0


class Running:
    """What PolicyAdmission reads from the scheduler: the running count, here settable."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def __call__(self) -> int:
        return self.n


def policy_admission(path, running: Running, **kwargs) -> PolicyAdmission:
    return PolicyAdmission(OnnxFilePolicy(str(path)), num_running=running, kv_usage=lambda: 0.25,
                           **{"max_num_seqs": 256, "resident_tokens": nothing_resident, **kwargs})


def test_block_hash_digests_follow_vllm_prefixes():
    a = vllm_request("a", tokens(1, 2, 3), block_size=BLOCK, arrival_time=0.0)
    b = vllm_request("b", tokens(1, 2, 4), block_size=BLOCK, arrival_time=0.0)
    da, db = (block_hash_digests(r.block_hashes, BLOCK, BLOCK) for r in (a, b))
    assert da.dtype == np.uint64 and len(da) == 3
    np.testing.assert_array_equal(da[:2], db[:2])
    assert da[2] != db[2]
    assert len(block_hash_digests([], BLOCK, BLOCK)) == 0


def test_outside_the_admission_window_the_queue_is_fcfs():
    queue, _ = make_queue({"a": (1, 2), "b": (3, 4), "c": (1, 5)})
    assert len(queue) == 3 and bool(queue)
    assert [admit(queue) for _ in range(3)] == ["a", "b", "c"]
    assert not queue and queue.num_running == 3


def test_policy_admits_the_cht_best_candidate(files):
    queue, requests = make_queue({"a": (1, 2, 3), "b": (7, 8, 9), "c": (1, 2, 5)})
    running = Running()
    admission = policy_admission(files["add"], running)
    with queue.admitting(admission):
        assert admit(queue) == "a"              # nothing runs: admitted unasked (rule 3)
        running.n = 1
        assert admit(queue) == "c"              # shares 2 blocks with a: before b, despite FCFS
        running.n = 2
        assert admit(queue) == "b"
        assert not queue
    assert admission.stats.forced_idle == 1 and admission.stats.adds == 2 and admission.stats.decisions == 2


def test_stop_ends_admission_for_the_step(files):
    queue, _ = make_queue({"a": (1,), "b": (2,)})
    running = Running()
    admission = policy_admission(files["stop"], running)
    with queue.admitting(admission):
        assert admit(queue) == "a"              # an empty batch is never left idle
        running.n = 1
        assert not queue                        # STOP: vLLM's loop breaks here
        assert len(queue) == 1                  # ... but the request still waits
    assert bool(queue)                          # outside the window: a plain queue again
    assert admission.stats.stops == 1


def test_waiting_time_bound_overrides_stop_after_its_engine_steps(files):
    """Added before step 1, the requests have waited 2 steps before step 3: the bound of 2 admits
    them all there, over the policy's STOP; the wall clock plays no part."""
    queue, _ = make_queue({"a": (1,), "b": (2,), "c": (3,)}, arrival_time=time.time() - 1e6)
    admission = policy_admission(files["stop"], Running(1), max_wait_steps=2)
    for _ in range(2):
        with queue.admitting(admission):
            assert not queue
    with queue.admitting(admission):
        assert [admit(queue) for _ in range(3)] == ["a", "b", "c"]
    assert admission.stats.forced_wait == 3 and admission.stats.stops == 2


def test_deployed_hold_admits_once_the_oldest_request_has_waited_its_hold():
    """``feather-hold`` deployed: while a batch runs, a request added before step 1 is held in steps
    1 and 2 (it has waited 0 and 1 steps) and admitted in step 3, by the rule, not the bound."""
    queue, _ = make_queue({"a": (1,)})
    admission = PolicyAdmission(make_policy("feather-hold"), num_running=Running(1), kv_usage=lambda: 0.0,
                                max_num_seqs=256, resident_tokens=nothing_resident)
    for _ in range(DEFAULT_HOLD_STEPS):
        with queue.admitting(admission):
            assert not queue
    with queue.admitting(admission):
        assert admit(queue) == "a"
    assert admission.stats.stops == DEFAULT_HOLD_STEPS and admission.stats.forced_wait == 0


def test_deployed_resident_rule_admits_the_candidate_the_prefix_cache_holds():
    """``feather-resident`` deployed reads each candidate's resident prefix from the engine's hook
    (here: "b"'s first block is cached), and admits it ahead of the CHT's own first candidate."""
    queue, _ = make_queue({"a": (1, 2), "b": (3, 4), "c": (5, 6)})
    resident = {"b": BLOCK + 3}                        # whole blocks only count
    admission = PolicyAdmission(ResidentFirstRule(hold_steps=0), num_running=Running(1), kv_usage=lambda: 0.0,
                                max_num_seqs=256, resident_tokens=lambda request: resident.get(request.request_id, 0))
    with queue.admitting(admission):
        assert admit(queue) == "b"
        assert admit(queue) == "a"                     # nothing else resident: the CHT's order
    assert admission.stats.adds == 2


def test_wait_steps_count_engine_steps_since_arrival_and_survive_preemption():
    queue, requests = make_queue({"a": (1,)})
    admission = FCFSAdmission()
    with queue.admitting(admission):
        assert queue.wait_steps(requests["a"]) == 0     # its arrival step
        assert admit(queue) == "a"
    queue.add_request(b := vllm_request("b", tokens(2), block_size=BLOCK, arrival_time=0.0))
    for step in (2, 3):
        with queue.admitting(admission):
            assert queue.step == step and queue.wait_steps(b) == step - 2
    queue.prepend_request(requests["a"])                # preempted: it keeps its arrival step
    with queue.admitting(admission):
        assert queue.wait_steps(requests["a"]) == 3 and queue.wait_steps(b) == 2
        assert admit(queue) == "a"
    queue.finish_running(requests["a"])                 # left the engine: forgotten
    with pytest.raises(KeyError):
        queue.wait_steps(requests["a"])


class RaisingPolicy:
    """A policy whose inference fails, as a broken runtime would (a Policy's interface)."""

    def __init__(self) -> None:
        self.calls = 0

    def decide(self, point) -> int:
        point.observation
        self.calls += 1
        raise RuntimeError("onnxruntime exploded")


@pytest.mark.parametrize("kind", ["raises", "nan"])
def test_runtime_policy_failure_falls_back_to_fcfs_for_the_step(files, kind, caplog):
    policy = RaisingPolicy() if kind == "raises" else OnnxFilePolicy(str(files["nan"]))
    queue, _ = make_queue({"a": (1,), "b": (2,), "c": (1, 3), "d": (4,)})
    running = Running(1)
    admission = PolicyAdmission(policy, num_running=running, kv_usage=lambda: 0.0, max_num_seqs=256,
                                resident_tokens=nothing_resident)
    with caplog.at_level(logging.WARNING, logger="deploy.admission"):
        with queue.admitting(admission):
            assert [admit(queue) for _ in range(2)] == ["a", "b"]   # FCFS, one failure for the step
        assert admission.stats.fallbacks == 1 and admission.stats.fcfs_admissions == 2
        with queue.admitting(admission):                            # next step: the policy is asked again
            assert admit(queue) == "c"
        assert admission.stats.fallbacks == 2
    assert caplog.text.count("Feather policy failed") == 2          # logged at 1, 2, 4, ...
    if kind == "raises":
        assert policy.calls == 2


def test_preempted_request_is_resumed_first_and_tree_empties(files):
    queue, requests = make_queue({"a": (1, 2), "b": (1, 3), "c": (5, 6, 7)})
    running = Running()
    admission = policy_admission(files["add"], running)
    with queue.admitting(admission):
        assert admit(queue) == "a"
        running.n = 1
        assert admit(queue) == "b"
    queue.prepend_request(requests["a"])          # vLLM preempts a: back to the front
    assert queue.tree.num_running == 1 and queue.is_resumed(requests["a"])
    running.n = 1
    with queue.admitting(admission):
        assert admit(queue) == "a"
    assert admission.stats.forced_resumed == 1
    queue.remove_requests([requests["c"], requests["b"]])   # b is running: ignored; c waits: removed
    assert len(queue) == 0
    for rid in ("a", "b"):
        queue.finish_running(requests[rid])
    assert set(queue.tree.memory_entries().values()) == {0}


def test_feather_config_from_additional_config(tmp_path):
    assert FeatherConfig.from_additional_config({}, environ={}) == FeatherConfig()
    assert FeatherConfig.from_additional_config(None, environ={"FEATHER_POLICY": "p.onnx"}).policy == "p.onnx"
    config = FeatherConfig.from_additional_config(
        {"feather": {"policy": "x.onnx", "on_policy_error": "fcfs", "max_wait_steps": 3}},
        environ={"FEATHER_POLICY": "p"})
    assert config == FeatherConfig(policy="x.onnx", on_policy_error="fcfs", max_wait_steps=3)
    with pytest.raises(ValueError, match="unknown .* keys \\['max_wait_s'\\]; valid keys.*max_wait_steps"):
        FeatherConfig.from_additional_config({"feather": {"max_wait_s": 10}}, environ={})
    with pytest.raises(ValueError, match="unknown .* keys \\['polcy'\\]; valid keys"):
        FeatherConfig.from_additional_config({"feather": {"polcy": "x"}}, environ={})
    with pytest.raises(ValueError, match="on_policy_error must be one of"):
        FeatherConfig(on_policy_error="ignore")


@pytest.mark.parametrize("name, message", [("missing", "does not exist"), ("corrupt", "not a loadable"),
                                           ("old_version", "feather-obs-0"), (None, "no policy configured")])
def test_unusable_policy_at_start_refuses_or_falls_back(files, name, message, caplog):
    path = None if name is None else str(files[name])
    hooks = {"num_running": lambda: 0, "kv_usage": lambda: 0.0, "max_num_seqs": 256,
             "resident_tokens": nothing_resident}
    with pytest.raises(PolicyStartupError, match=f"refuses to start: .*{message}"):
        build_admission(FeatherConfig(policy=path), **hooks)
    with caplog.at_level(logging.WARNING, logger="deploy.scheduler"):
        admission = build_admission(FeatherConfig(policy=path, on_policy_error="fcfs"), **hooks)
    assert isinstance(admission, FCFSAdmission)
    assert "scheduling FCFS" in caplog.text and message in caplog.text


def test_usable_policy_builds_a_policy_admission(files):
    admission = build_admission(FeatherConfig(policy=str(files["add"]), max_wait_steps=4),
                                num_running=lambda: 0, kv_usage=lambda: 0.0, max_num_seqs=256,
                                resident_tokens=nothing_resident)
    assert isinstance(admission, PolicyAdmission) and admission.max_wait_steps == 4
    for bad in (-1, 2.5, True, "10"):
        with pytest.raises(ValueError, match="max_wait_steps must be a whole number"):
            FeatherConfig(policy=str(files["add"]), max_wait_steps=bad)


def test_serving_with_another_waiting_bound_than_trained_warns(files, tmp_path, caplog):
    import torch

    from feather_gym.observation import observation_size
    from trainer.export import export_policy_module

    trained = tmp_path / "bound-32.onnx"
    export_policy_module(torch.nn.Linear(observation_size(1), 2), trained, profile="cpu", workload="prefix-groups",
                         observations=np.zeros((4, observation_size(1)), np.float32), max_wait_steps=32)
    hooks = {"num_running": lambda: 0, "kv_usage": lambda: 0.0, "max_num_seqs": 256,
             "resident_tokens": nothing_resident}
    with caplog.at_level(logging.WARNING, logger="deploy.scheduler"):
        build_admission(FeatherConfig(policy=str(trained), max_wait_steps=32), **hooks)
        assert "trained with max_wait_steps" not in caplog.text
        build_admission(FeatherConfig(policy=str(trained), max_wait_steps=8), **hooks)
    assert "trained with max_wait_steps=32 and serves with 8" in caplog.text
    # A policy swapped in later is checked alike: the reloader loads through the same config.
    caplog.clear()
    served = tmp_path / "served.onnx"
    shutil.copy(files["add"], served)
    reloader = FeatherConfig(policy=str(served), max_wait_steps=8, policy_reload_s=0.0).make_reloader()
    os.replace(trained, served)
    with caplog.at_level(logging.WARNING, logger="deploy.scheduler"):
        assert reloader.poll() is not None
    assert "trained with max_wait_steps=32 and serves with 8" in caplog.text


def test_the_start_line_names_a_training_mix_by_its_size(files, tmp_path, caplog):
    """A mix is logged as its size and first workload, not the whole list (one line per engine start)."""
    import torch

    from feather_gym.observation import observation_size
    from trainer.export import export_policy_module

    mix = [f"prefix-groups:groups={groups},num_requests=64@load=0.9" for groups in range(2, 40)]
    hooks = {"num_running": lambda: 0, "kv_usage": lambda: 0.0, "max_num_seqs": 256,
             "resident_tokens": nothing_resident}
    for name, workload in (("mix", mix), ("one", "prefix-groups:num_requests=40")):
        export_policy_module(torch.nn.Linear(observation_size(1), 2), tmp_path / f"{name}.onnx", profile="cpu",
                             workload=workload, observations=np.zeros((4, observation_size(1)), np.float32))
    with caplog.at_level(logging.INFO, logger="deploy.scheduler"):
        build_admission(FeatherConfig(policy=str(tmp_path / "mix.onnx")), **hooks)
        build_admission(FeatherConfig(policy=str(tmp_path / "one.onnx")), **hooks)
    mixed, single = (record.getMessage() for record in caplog.records if "loaded" in record.getMessage())
    assert f"trained on cpu / a mix of 38 workloads, the first {mix[0]} " in mixed and mix[1] not in mixed
    assert single.endswith("trained on cpu / prefix-groups:num_requests=40)")


def test_the_feather_rule_is_deployable_and_fcfs_orderings_are_refused():
    hooks = {"num_running": lambda: 0, "kv_usage": lambda: 0.0, "max_num_seqs": 256,
             "resident_tokens": nothing_resident}
    admission = build_admission(FeatherConfig(policy="feather-rule"), **hooks)
    assert isinstance(admission, PolicyAdmission) and isinstance(admission.policy, FeatherRule)
    for name in ("cht", "cht-dfs", "feather-hold", "feather-resident"):   # the CHT's order: no STOPs / a group
        # chosen / held / the deepest resident chosen
        assert build_admission(FeatherConfig(policy=name), **hooks).policy.name == name
    for name in ("fcfs", "dfs", "hrrn", "group-label", "rule-playout", "rule-playout-sampled",
                 "rule-playout-goodput", "rule-playout-sampled-goodput"):
        with pytest.raises(PolicyStartupError, match="cannot run in the Feather scheduler"):
            build_admission(FeatherConfig(policy=name), **hooks)


def test_deployed_rule_stops_a_candidate_of_another_prefix():
    """The rule's thresholds are in tokens: a candidate costing the batch's 96 blocks of 16 tokens
    of common prefix (1536 tokens > 1280) is a STOP, at this engine's block size of 16."""
    queue, _ = make_queue({"a": tuple(range(1, 1 + 6 * 16)), "b": tuple(range(200, 200 + 6 * 16))})
    running = Running()
    admission = PolicyAdmission(FeatherRule(), num_running=running, kv_usage=lambda: 0.0, max_num_seqs=256,
                                resident_tokens=nothing_resident, max_wait_steps=10**9)
    with queue.admitting(admission):
        assert admit(queue) == "a"
        running.n = 1
        assert not queue                         # b shares nothing with a
    assert admission.stats.stops == 1


def test_full_batch_ends_admission_without_asking(files):
    queue, _ = make_queue({"a": (1,), "b": (2,)})
    admission = policy_admission(files["add"], Running(4), max_num_seqs=4)
    with queue.admitting(admission):
        assert not queue
    assert admission.stats.decisions == 0 and len(queue) == 2


def test_a_bug_in_building_the_observation_raises_instead_of_falling_back(files):
    queue, _ = make_queue({"a": (1,), "b": (2,)})
    admission = PolicyAdmission(OnnxFilePolicy(str(files["add"])), num_running=Running(1), max_num_seqs=256,
                                kv_usage=lambda: 1 / 0, resident_tokens=nothing_resident)
    with queue.admitting(admission), pytest.raises(ZeroDivisionError):
        bool(queue)
    assert admission.stats.fallbacks == 0


def test_async_scheduler_variant_shares_the_mixin():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.scheduler import FeatherAsyncScheduler, FeatherScheduler, FeatherSchedulingMixin

    assert issubclass(FeatherAsyncScheduler, AsyncScheduler)
    assert issubclass(FeatherAsyncScheduler, FeatherSchedulingMixin)
    assert issubclass(FeatherScheduler, Scheduler) and not issubclass(FeatherScheduler, AsyncScheduler)
    # The mixin's overrides come first in both: schedule() opens the admission window.
    for cls in (FeatherScheduler, FeatherAsyncScheduler):
        assert cls.schedule is FeatherSchedulingMixin.schedule
        assert cls._free_request is FeatherSchedulingMixin._free_request


def test_cli_bench_policy_and_serve_bench_errors(files, capsys):
    import json

    from feather_cli.main import main

    assert main(["bench", "policy", "--policy", str(files["add"]), "--iterations", "50", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["provider"] == "CPUExecutionProvider" and report["policy_adds"] > 0 and report["policy_stops"] == 0
    assert 0 < report["decide_us_p50"] <= report["decide_us_p99"] and report["decision_us_p50"] > 0
    assert report["kernel"] == "native" and report["decide_onnxruntime_us_p50"] > 0
    assert main(["serve", "bench", "--policy", str(files["old_version"])]) == 2     # refused before any engine
    assert "feather-obs-0" in capsys.readouterr().err


def test_a_hybrid_engines_view_counts_only_resumable_shared_blocks(files):
    from feather_gym.observation import FEATURE_INDEX

    running = Running()
    seen = []

    class Recording:
        name = "recording"

        def make_order(self):
            from feather_gym.orderings import CHTOrder
            return CHTOrder()

        def decide(self, point):
            seen.append(point.raw[FEATURE_INDEX["candidate_cached_fraction"]])
            return 1

    for resumable in (None, lambda request, shared: min(shared, 1)):   # dense; a state kept at block 1
        queue, _ = make_queue({"a": (1, 2, 3, 4), "b": (1, 2, 3, 9)})
        admission = PolicyAdmission(Recording(), num_running=running, kv_usage=lambda: 0.0, max_num_seqs=8,
                                    resident_tokens=nothing_resident, resumable=resumable)
        running.n = 0
        with queue.admitting(admission):
            assert admit(queue) == "a"
            running.n = 1
            assert admit(queue) == "b"
    assert seen == [pytest.approx(3 / 4), pytest.approx(1 / 4)]
