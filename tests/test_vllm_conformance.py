"""The conformance plugin (deploy.conformance) and its script (scripts/vllm_conformance.py), without
a vLLM source tree: the substitution, the refusals by design, the classification and the report,
on a stand-in test package that binds vLLM's ``Scheduler`` as vLLM's tests do."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]


def config(prefix_caching=True, policy="fcfs", async_scheduling=False):
    return SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
                           scheduler_config=SimpleNamespace(policy=policy, async_scheduling=async_scheduling))


def test_refusals_by_design_name_their_reason_and_prefix_caching_can_be_forced():
    from deploy.conformance import SKIP_PREFIX, refusal

    assert refusal(config(), asynchronous=False) is None
    assert refusal(config(async_scheduling=True), asynchronous=True) is None
    assert "prefix caching" in refusal(config(prefix_caching=False), asynchronous=False)
    assert "'priority'" in refusal(config(policy="priority"), asynchronous=False)
    assert "async scheduling" in refusal(config(async_scheduling=True), asynchronous=False)
    assert refusal(config(policy="priority"), asynchronous=True).startswith(SKIP_PREFIX)
    forced = config(prefix_caching=False)
    assert refusal(forced, asynchronous=False, force_prefix_caching=True) is None
    assert forced.cache_config.enable_prefix_caching


def test_failures_are_classified_environment_fcfs_order_not_applicable_or_bug():
    from deploy.conformance import FCFS_ORDER, NOT_APPLICABLE, classify, test_key

    node = "tests/v1/core/test_scheduler.py::test_schedule_order[True]"
    assert test_key(node) == "test_scheduler.py::test_schedule_order" and test_key(node) in FCFS_ORDER
    failed = {"outcome": "failed"}
    assert classify(node, {node: failed})[0] == "environment"
    assert classify(node, {}, substituted=False)[0] == "environment"
    assert classify(node, {}) == ("fcfs_order", FCFS_ORDER[test_key(node)])
    assert classify(node, {}, {node: {"outcome": "passed"}})[0] == "fcfs_order"
    assert classify(node, {}, {node: failed})[0] == "bug"       # listed, but FCFS admission fails it too
    assert classify("tests/v1/core/test_scheduler.py::test_something_else", {}) == ("bug", "")
    (inapplicable, *_) = NOT_APPLICABLE
    assert classify(f"tests/v1/core/{inapplicable}", {})[0] == "not_applicable"


def test_substituted_classes_are_feather_schedulers_with_the_chosen_policy():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.admission import FCFSAdmission, PolicyAdmission
    from deploy.conformance import substitute, substitute_classes
    from deploy.model_free import model_free_scheduler
    from deploy.scheduler import FeatherAsyncScheduler, FeatherConfig, FeatherScheduler

    sync, asynchronous = substitute_classes(FeatherConfig(policy="feather-rule", policy_reload_s=None))
    assert issubclass(sync, FeatherScheduler) and issubclass(asynchronous, FeatherAsyncScheduler)
    shape = dict(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    assert isinstance(model_free_scheduler(sync, **shape).admission, PolicyAdmission)
    assert isinstance(model_free_scheduler(asynchronous, async_scheduling=True, **shape), AsyncScheduler)
    fcfs, _ = substitute_classes(FeatherConfig(policy=None, on_policy_error="fcfs", policy_reload_s=None))
    assert isinstance(model_free_scheduler(fcfs, **shape).admission, FCFSAdmission)
    control, _ = substitute_classes(None)
    assert control.__mro__[1] is Scheduler

    module = SimpleNamespace(__name__="tests.fake", Scheduler=Scheduler, Other=Scheduler, AsyncScheduler=AsyncScheduler,
                             unrelated=1)
    assert sorted(substitute([module], {Scheduler: sync, AsyncScheduler: asynchronous})) == [
        "tests.fake.AsyncScheduler", "tests.fake.Other", "tests.fake.Scheduler"]
    assert module.Scheduler is sync and module.Other is sync and module.AsyncScheduler is asynchronous


STAND_IN = '''
from vllm.v1.core.sched.scheduler import Scheduler

from deploy.model_free import model_free_scheduler

SHAPE = dict(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)


def test_builds_a_scheduler():
    scheduler = model_free_scheduler(Scheduler, **SHAPE)
    assert isinstance(scheduler, Scheduler)


def test_schedule_order():
    model_free_scheduler(Scheduler, **SHAPE)
    assert False, "stands in for an FCFS-order assertion"


def test_other_failure():
    assert False


def test_builds_nothing():
    pass
'''


@pytest.mark.parametrize("policy", ["vllm", "feather-rule"])
def test_the_plugin_substitutes_the_tests_classes_and_reports_every_test(pytester, policy):
    pytester.makepyfile(**{"tests/__init__": "", "tests/v1/__init__": "", "tests/v1/core/__init__": "",
                           "tests/v1/core/test_scheduler": STAND_IN})
    report = pytester.path / "report.json"
    result = pytester.runpytest_inprocess("-p", "deploy.conformance", "-p", "no:cacheprovider",
                                          "--feather-policy", policy, "--feather-report", str(report))
    result.assert_outcomes(passed=2, failed=2)
    data = json.loads(report.read_text())
    tests = {nodeid.split("::")[1]: entry for nodeid, entry in data["tests"].items()}
    assert set(tests) == {"test_builds_a_scheduler", "test_schedule_order", "test_other_failure", "test_builds_nothing"}
    assert tests["test_builds_nothing"] == {"outcome": "passed", "feather": False, "reason": ""}
    assert tests["test_other_failure"]["where"].endswith("assert False")
    if policy == "vllm":
        assert data["rebound"] == [] and not tests["test_builds_a_scheduler"]["feather"]
        assert {tests[name]["classification"] for name in ("test_schedule_order", "test_other_failure")} == {
            "environment"}
    else:
        assert data["rebound"] == ["tests.v1.core.test_scheduler.Scheduler"]
        assert tests["test_builds_a_scheduler"]["feather"] and tests["test_schedule_order"]["feather"]
        assert tests["test_schedule_order"]["classification"] == "fcfs_order"
        assert tests["test_other_failure"]["classification"] == "bug"
    assert data["counts"]["passed"] == 2 and data["counts"]["failed"] == 2


def load_script():
    spec = importlib.util.spec_from_file_location("vllm_conformance", ROOT / "scripts" / "vllm_conformance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_builds_the_pytest_command_and_summarises_the_report(tmp_path):
    script = load_script()
    args, extra = script.parse_args(["--vllm-src", str(tmp_path), "--policy", "feather-rule", "--force-prefix-caching",
                                     "--control", "c.json", "-x", "-k", "preempt"])
    command = script.pytest_command(args, extra, "feather-rule", tmp_path / "r.json", tmp_path / "copy")
    assert command[command.index("--feather-policy") + 1] == "feather-rule"
    assert command[command.index("--rootdir") + 1] == str(tmp_path / "copy")      # node ids as in the tree
    assert "--feather-force-prefix-caching" in command and "--noconftest" in command
    assert command[-3:] == ["-x", "-k", "preempt"] and "tests/v1/core/test_scheduler.py" in command
    env = script.environment(tmp_path / "model", tmp_path)
    assert env["HF_HUB_OFFLINE"] == "1"
    assert json.loads(Path(env["VLLM_MODEL_REDIRECT_PATH"]).read_text())["facebook/opt-125m"] == str(tmp_path / "model")
    from deploy.conformance import counts

    tests = {"a::t1": {"outcome": "passed", "feather": True, "reason": ""},
             "a::t2": {"outcome": "failed", "feather": True, "reason": "assert 1 == 2", "classification": "fcfs_order",
                       "where": "a.py:3: assert x"},
             "a::t3": {"outcome": "skipped", "feather": False, "reason": "feather refuses by design: x",
                       "classification": "refused_by_design"}}
    text = script.summary({"policy": "k4", "counts": counts(tests), "tests": tests})
    assert "1 passed (1 with a Feather scheduler), 1 failed" in text and "1 FCFS order" in text
    assert "[fcfs_order] a::t2: assert 1 == 2 [a.py:3: assert x]" in text and "[skipped x1]" in text
