"""A pytest plugin that runs vLLM's own scheduler tests against the Feather scheduler classes.

Load it into a pytest run over a vLLM source tree's ``tests/v1/core`` (``scripts/vllm_conformance.py``
builds the whole command)::

    pytest -p deploy.conformance --feather-policy feather-rule --noconftest tests/v1/core/test_scheduler.py

What it changes, and nothing else:

* **The classes.** After collection (every test module and its helpers imported), each global
  name in a ``tests.*`` module that is bound to vLLM's ``Scheduler`` or ``AsyncScheduler`` is
  rebound to a subclass of :class:`~deploy.scheduler.FeatherScheduler` /
  :class:`~deploy.scheduler.FeatherAsyncScheduler` configured with ``--feather-policy``. So
  ``tests/v1/core/utils.py``'s ``create_scheduler`` and the tests' own ``Scheduler(...)`` calls
  build Feather schedulers; ``isinstance(x, Scheduler)`` in a test still holds. Schedulers vLLM
  builds internally (``EngineCore``) and explicit other classes (``DiffusionScheduler``) stay
  vLLM's: such a test is reported as not having constructed a Feather scheduler.
  ``--feather-policy vllm`` substitutes nothing (the control run); ``--feather-policy fcfs``
  substitutes the Feather classes admitting FCFS (the CHT queue and the admission window, with
  vLLM's order), which tells a failure of the queue's plumbing from one of the admission order.
* **Refusals by design.** A scheduler config the Feather classes refuse (no prefix caching, a
  non-FCFS scheduling policy, the synchronous class under async scheduling) makes the test
  *skip* with ``"feather refuses by design: ..."`` instead of failing. Most of vLLM's tests leave
  prefix caching off: ``--feather-force-prefix-caching`` turns it on for them instead (in the
  control run too, so that like is compared with like).
* **The report.** With ``--feather-report PATH`` every test's outcome goes to a JSON file:
  ``{"tests": {nodeid: {"outcome", "feather", "reason", "where", "classification"}}, "counts": ...}``,
  where ``feather`` says whether the test constructed a Feather scheduler and ``where`` is the
  failing line of the test. A failure is classified ``environment`` when ``--feather-control``
  (a control run's report) has it failing too, ``not_applicable`` when :data:`NOT_APPLICABLE`
  lists it, ``fcfs_order`` when :data:`FCFS_ORDER` lists it (and, given
  ``--feather-fcfs-control``, a run of the Feather classes admitting FCFS passes it), else
  ``bug``.

The hub models the tests name are mapped to local folders by vLLM's own
``VLLM_MODEL_REDIRECT_PATH`` (the script writes that file), not by this plugin.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

#: Why a test that asserts vLLM's greedy FCFS admission fails under a policy that STOPs earlier.
_ADMITS_ALL = ("asserts that the step admits every waiting request the budgets allow, as vLLM's FCFS loop "
               "does; the policy STOPs admission earlier (the untrained k = 4 network), so a request the "
               "assertion reads is still waiting")
#: Tests that fail against the Feather classes only because they assert vLLM's FCFS admission:
#: its order, or that every request that fits is admitted in the step (a policy may STOP).
#: Keys are ``file::test`` (any parametrization); the report adds the failing assertion. Each
#: passes with the Feather classes admitting FCFS (``--feather-policy fcfs``), which
#: ``--feather-fcfs-control`` checks.
FCFS_ORDER: dict[str, str] = {
    "test_scheduler.py::test_schedule_order": (
        "asserts FCFS order: the 800-token requests 1, 2 are admitted before the 10-token 3, 4 (only 1 "
        "without chunked prefill); the CHT admits 3 and 4 first, fewer blocks missing"),
    "test_scheduler.py::test_fcfs_mixed_blocked_types_remote_load_drains_first": (
        "asserts FCFS order: 'regular' (20 tokens) is admitted before 'tail' (1 token) and fills the 20-token "
        "budget, so 'tail' stays waiting; the CHT admits 'tail' first"),
    "test_async_scheduler.py::test_abort": (
        "asserts every request decodes in every step from the first on (its output count is its abort "
        "position); a STOP defers some admissions"),
    "test_async_scheduler.py::test_kv_pressure_preempt_mid_handoff": _ADMITS_ALL,
    "test_async_scheduler.py::test_prefix_caching_for_multi_turn": _ADMITS_ALL,
    "test_async_scheduler.py::test_prefix_caching_for_prefill_dedup": _ADMITS_ALL,
    "test_deferred_block_free.py::test_allocation_retry_waits_for_fence_then_succeeds": (
        "asserts the waiting request's allocation is retried in the next step; the policy STOPs before vLLM "
        "tries it"),
    "test_deferred_block_free.py::test_cow_retentions_deferred_until_copy_step_processed": _ADMITS_ALL,
    "test_deferred_block_free.py::test_max_tokens_finish_frees_immediately_with_other_inflight": _ADMITS_ALL,
    "test_deferred_block_free.py::test_multiple_deferred_frees_drain_in_order": _ADMITS_ALL,
    "test_prefix_replay.py::test_hit_no_longer_than_window_is_ignored": _ADMITS_ALL,
    "test_prefix_replay.py::test_hit_replays_window_without_reallocating": _ADMITS_ALL,
    "test_prefix_replay.py::test_kv_load_zeroing_respects_loaded_groups": _ADMITS_ALL,
    "test_prefix_replay.py::test_replay_only_chunks_make_progress": _ADMITS_ALL,
    "test_scheduler.py::test_draft_slots_budgeted_per_scheduled_request": _ADMITS_ALL,
    "test_scheduler.py::test_external_prefix_cache_metrics": (
        "counts the connector's prefix queries of every request in the first step; the policy STOPs after one"),
    "test_scheduler.py::test_kv_connector_basic": _ADMITS_ALL,
    "test_scheduler.py::test_kv_connector_handles_preemption": _ADMITS_ALL,
    "test_scheduler.py::test_kv_connector_honors_skip_reading_prefix_cache": _ADMITS_ALL,
    "test_scheduler.py::test_long_prefill_threshold_applies_with_other_requests": _ADMITS_ALL,
    "test_scheduler.py::test_long_prefill_threshold_floored_by_fair_share": _ADMITS_ALL,
    "test_scheduler.py::test_max_num_active_seqs_caps_admission": _ADMITS_ALL,
    "test_scheduler.py::test_preempt_during_execution": _ADMITS_ALL,
    "test_scheduler.py::test_schedule": _ADMITS_ALL,
    "test_scheduler.py::test_schedule_concurrent_batches": _ADMITS_ALL,
    "test_scheduler.py::test_schedule_concurrent_partial_requests": _ADMITS_ALL,
    "test_scheduler.py::test_schedule_prefills_gating": _ADMITS_ALL,
    "test_scheduler.py::test_schedule_skip_tokenizer_init": _ADMITS_ALL,
    "test_scheduler.py::test_schedule_spec_decoding_stats": _ADMITS_ALL,
    "test_scheduler.py::test_scheduler_reset_prefix_cache": _ADMITS_ALL,
    "test_scheduler.py::test_scheduler_stats_waiting_queues": _ADMITS_ALL,
    "test_scheduler.py::test_spec_decode_padding_dropped_when_recurrent_alignment_clips": _ADMITS_ALL,
    "test_scheduler.py::test_spec_decode_padding_first_decode_step": _ADMITS_ALL,
    "test_scheduler.py::test_spec_decode_padding_skipped_for_diffusion": _ADMITS_ALL,
    "test_scheduler.py::test_spec_decode_padding_skipped_with_prefill_in_batch": _ADMITS_ALL,
    "test_scheduler.py::test_throttle_capacity_bound_guard_admits": _ADMITS_ALL,
    "test_scheduler.py::test_throttle_defers_inflight_prefill_chunk": _ADMITS_ALL,
    "test_scheduler.py::test_throttle_prefills_defers_remote_kv_resume_with_local_prefill": _ADMITS_ALL,
    "test_scheduler.py::test_throttle_prefills_excludes_fully_transferred_remote_kv": _ADMITS_ALL,
}
#: Tests that cannot run any subclass with state of its own: they build the scheduler with
#: ``object.__new__`` (no ``__init__``) and set only vLLM's attributes, so the Feather
#: scheduler's (``step_log``, ``admission``, its queue) never exist.
NOT_APPLICABLE: dict[str, str] = {
    f"{name}::test_abort_request_when_structured_output_fsm_cannot_advance": (
        "builds the scheduler with object.__new__ and only vLLM's attributes: the Feather state never exists")
    for name in ("test_scheduler.py", "test_async_scheduler.py")
}

SKIP_PREFIX = "feather refuses by design: "
#: This run's state: Feather schedulers built in the running test, outcomes, names rebound.
_state: dict = {"constructed": 0, "tests": {}, "rebound": []}


def refusal(vllm_config, *, asynchronous: bool, force_prefix_caching: bool = False) -> str | None:
    """Why the Feather class refuses ``vllm_config`` (by design), or None when it accepts it.
    With ``force_prefix_caching`` a config without prefix caching gets it turned on instead."""
    from vllm.v1.core.sched.request_queue import SchedulingPolicy

    if not vllm_config.cache_config.enable_prefix_caching:
        if not force_prefix_caching:
            return SKIP_PREFIX + "no prefix caching (the CHT is fed with vLLM's block hashes)"
        vllm_config.cache_config.enable_prefix_caching = True
    if SchedulingPolicy(vllm_config.scheduler_config.policy) != SchedulingPolicy.FCFS:
        return SKIP_PREFIX + f"scheduling policy {vllm_config.scheduler_config.policy!r} (it replaces the FCFS queue)"
    if vllm_config.scheduler_config.async_scheduling and not asynchronous:
        return SKIP_PREFIX + "the synchronous class under async scheduling (use FeatherAsyncScheduler)"
    return None


def substitute_classes(feather_config, *, force_prefix_caching: bool = False):
    """The (sync, async) classes the tests get: subclasses of the two Feather classes that use
    ``feather_config`` when none is passed and skip the running test on a config they refuse by
    design; with ``feather_config=None`` (the control) subclasses of vLLM's own two classes that
    only force prefix caching (``force_prefix_caching``) and refuse nothing."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.scheduler import FeatherAsyncScheduler, FeatherScheduler

    def feather_init(base, asynchronous):
        def __init__(self, vllm_config, *args, feather_config=None, **kwargs):
            reason = refusal(vllm_config, asynchronous=asynchronous, force_prefix_caching=force_prefix_caching)
            if reason is not None:
                pytest.skip(reason)
            _state["constructed"] += 1
            base.__init__(self, vllm_config, *args, feather_config=feather_config or config, **kwargs)
        return __init__

    def vllm_init(base):
        def __init__(self, vllm_config, *args, **kwargs):
            if force_prefix_caching:
                vllm_config.cache_config.enable_prefix_caching = True
            base.__init__(self, vllm_config, *args, **kwargs)
        return __init__

    config = feather_config
    if config is None:
        bases, inits = (Scheduler, AsyncScheduler), (vllm_init(Scheduler), vllm_init(AsyncScheduler))
    else:
        bases = (FeatherScheduler, FeatherAsyncScheduler)
        inits = (feather_init(FeatherScheduler, False), feather_init(FeatherAsyncScheduler, True))
    return tuple(type(base.__name__, (base,), {"__init__": init, "__module__": __name__})
                 for base, init in zip(bases, inits))


def substitute(modules, replacements: dict) -> list[str]:
    """Rebind every global of ``modules`` that ``is`` a key of ``replacements``; the names rebound."""
    rebound = []
    for module in modules:
        for name, value in list(vars(module).items()):
            for original, replacement in replacements.items():
                if value is original:
                    setattr(module, name, replacement)
                    rebound.append(f"{module.__name__}.{name}")
    return rebound


def test_key(nodeid: str) -> str:
    """``file::test`` without the directories and the parametrization of a node id."""
    path, _, rest = nodeid.partition("::")
    return Path(path).name + "::" + re.sub(r"\[.*$", "", rest)


def classify(nodeid: str, control: dict, fcfs_control: dict | None = None, *,
             substituted: bool = True) -> tuple[str, str]:
    """(classification, reason) of a failed test: ``environment`` (it fails in the ``control``
    run too, or this run substitutes nothing), ``not_applicable`` (:data:`NOT_APPLICABLE`),
    ``fcfs_order`` (:data:`FCFS_ORDER`, unless ``fcfs_control``, a run of the Feather classes
    admitting FCFS, has it failing too), else ``bug``."""
    failing = ("failed", "error")
    if not substituted or control.get(nodeid, {}).get("outcome") in failing:
        return "environment", "fails with vLLM's own classes too"
    key = test_key(nodeid)
    if key in NOT_APPLICABLE:
        return "not_applicable", NOT_APPLICABLE[key]
    reason = FCFS_ORDER.get(key)
    if reason is not None:
        if fcfs_control is not None and fcfs_control.get(nodeid, {}).get("outcome") in failing:
            return "bug", "listed as an FCFS-order failure but fails with FCFS admission too"
        return "fcfs_order", reason
    return "bug", ""


def pytest_addoption(parser) -> None:
    group = parser.getgroup("feather", "Feather conformance (deploy.conformance)")
    group.addoption("--feather-policy", default="vllm",
                    help="feather-rule, feather-hold, feather-resident, cht, cht-dfs, a *.onnx policy, fcfs (the "
                         "Feather classes admitting FCFS), or vllm (no substitution: the control)")
    group.addoption("--feather-force-prefix-caching", action="store_true",
                    help="turn prefix caching on where a test leaves it off, instead of skipping the test "
                         "(also in the control: compare like with like)")
    group.addoption("--feather-report", default=None, help="write the per-test JSON report here")
    group.addoption("--feather-control", default=None, help="a control run's report: its failures are environment")
    group.addoption("--feather-fcfs-control", default=None,
                    help="a --feather-policy fcfs run's report: an FCFS-order failure must pass there")


def pytest_configure(config) -> None:
    _state.update(constructed=0, tests={}, rebound=[])


def pytest_collection_modifyitems(session, config, items) -> None:
    policy = config.getoption("--feather-policy")
    force = config.getoption("--feather-force-prefix-caching")
    if policy == "vllm" and not force:
        return
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.scheduler import FeatherConfig

    feather_config = (None if policy == "vllm" else
                      FeatherConfig(policy=None, on_policy_error="fcfs", policy_reload_s=None) if policy == "fcfs"
                      else FeatherConfig(policy=policy, policy_reload_s=None))
    sync, asynchronous = substitute_classes(feather_config, force_prefix_caching=force)
    modules = [m for name, m in list(sys.modules.items()) if (name == "tests" or name.startswith("tests."))
               and m is not None]
    _state["rebound"] = substitute(modules, {Scheduler: sync, AsyncScheduler: asynchronous})


def pytest_runtest_setup(item) -> None:
    _state["constructed"] = 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.user_properties.append(("feather", _state["constructed"] > 0))


def _reason(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return report.longrepr[2].removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message.splitlines()[0][:300] if crash.message else ""
    return str(report.longrepr).splitlines()[-1][:300] if report.longrepr else ""


def _where(report) -> str:
    """``test_x.py:LINE: source`` of the innermost frame of a failure that lies in a test module."""
    import linecache

    entries = getattr(getattr(report.longrepr, "reprtraceback", None), "reprentries", ())
    for entry in reversed(entries):
        location = getattr(entry, "reprfileloc", None)
        if location is not None and Path(location.path).name.startswith("test_"):
            path = Path(location.path) if Path(location.path).is_absolute() else Path.cwd() / location.path
            source = linecache.getline(str(path), location.lineno).strip()
            return f"{Path(location.path).name}:{location.lineno}: {source}"
    return ""


def pytest_runtest_logreport(report) -> None:
    entry = _state["tests"].setdefault(report.nodeid, {"outcome": "passed", "feather": False, "reason": ""})
    entry["feather"] = entry["feather"] or dict(report.user_properties).get("feather", False)
    if report.failed:
        entry["outcome"] = "error" if report.when != "call" else "failed"
        entry["reason"] = _reason(report)
        entry["where"] = _where(report)
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
        entry["reason"] = _reason(report)


def pytest_sessionfinish(session, exitstatus) -> None:
    config = session.config
    path = config.getoption("--feather-report")
    if path is None:
        return
    control_path = config.getoption("--feather-control")
    control = json.loads(Path(control_path).read_text())["tests"] if control_path else {}
    fcfs_path = config.getoption("--feather-fcfs-control")
    fcfs_control = json.loads(Path(fcfs_path).read_text())["tests"] if fcfs_path else None
    tests = _state["tests"]
    for nodeid, entry in tests.items():
        if entry["outcome"] in ("failed", "error"):
            entry["classification"], why = classify(nodeid, control, fcfs_control,
                                                     substituted=config.getoption("--feather-policy") != "vllm")
            if why:
                entry["reason"] = f"{why}: {entry['reason']}"
        elif entry["outcome"] == "skipped" and entry["reason"].startswith(SKIP_PREFIX):
            entry["classification"] = "refused_by_design"
    report = {"policy": config.getoption("--feather-policy"),
              "force_prefix_caching": config.getoption("--feather-force-prefix-caching"), "rebound": _state["rebound"],
              "tests": tests, "counts": counts(tests)}
    Path(path).write_text(json.dumps(report, indent=1, sort_keys=True))


def counts(tests: dict) -> dict:
    """Outcome counts, failures by classification, and the tests that ran a Feather scheduler."""
    result = {"passed": 0, "failed": 0, "error": 0, "skipped": 0, "refused_by_design": 0,
              "passed_with_feather": 0, "environment": 0, "fcfs_order": 0, "not_applicable": 0, "bug": 0}
    for entry in tests.values():
        result[entry["outcome"]] += 1
        if entry.get("classification"):
            result[entry["classification"]] += 1
        if entry["outcome"] == "passed" and entry["feather"]:
            result["passed_with_feather"] += 1
    return result
