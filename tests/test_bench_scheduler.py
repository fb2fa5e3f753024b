"""Schedulers stepped model-free (deploy.model_free) and ``feather bench scheduler``.

vLLM's own ``Scheduler``/``AsyncScheduler`` and the Feather classes over a real KV-cache
manager, with synthetic model outputs: every request finishes with its full output, the KV
blocks return, preemption and resumption under a small cache, and async scheduling's order
(the next step scheduled before the previous one's output is applied).
"""

from __future__ import annotations

import json

import pytest

BLOCK = 16
WORKLOAD = ("prefix-groups:num_requests={n},groups=4,prefix_tokens=96,suffix_tokens_min=8,suffix_tokens_max=80,"
            "output_tokens_min=1,output_tokens_max=24,rate=1000")


def trace(n: int = 48, seed: int = 0):
    from traces import resolve_workload

    return resolve_workload(WORKLOAD.format(n=n), seed=seed)


def scheduler_classes():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.scheduler import FeatherAsyncScheduler, FeatherConfig, FeatherScheduler

    rule = {"feather_config": FeatherConfig(policy="feather-rule", policy_reload_s=None)}
    return {"vllm": (Scheduler, {}, False), "vllm-async": (AsyncScheduler, {}, True),
            "feather": (FeatherScheduler, rule, False), "feather-async": (FeatherAsyncScheduler, rule, True)}


def serve_all(cls, kwargs, pipelined, requests, *, num_blocks=4096, max_num_seqs=8, on_schedule=None):
    """Every request added at once, stepped until none is unfinished; the engine and its step count."""
    from deploy.model_free import ModelFreeEngine, model_free_scheduler

    scheduler = model_free_scheduler(cls, block_size=BLOCK, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=256, max_model_len=1024, async_scheduling=pipelined,
                                     **kwargs)
    engine = ModelFreeEngine(scheduler, pipelined=pipelined, on_schedule=on_schedule)
    engine.add_requests(requests)
    steps = 0
    while scheduler.has_unfinished_requests() and steps < 5000:
        engine.step()
        steps += 1
    engine.drain()
    return engine, steps


@pytest.mark.parametrize("name", ["vllm", "vllm-async", "feather", "feather-async"])
@pytest.mark.parametrize("num_blocks", [4096, 40])
def test_every_request_finishes_with_its_output_and_the_blocks_return(name, num_blocks):
    from deploy.model_free import vllm_requests

    cls, kwargs, pipelined = scheduler_classes()[name]
    source = trace()
    requests = vllm_requests(source, block_size=BLOCK)
    preemptions, budgets = [], []

    def on_schedule(output):
        preemptions.append(len(output.preempted_req_ids or ()))
        budgets.append((output.total_num_scheduled_tokens, len(output.num_scheduled_tokens),
                        sum(output.num_scheduled_tokens.values())))

    engine, steps = serve_all(cls, kwargs, pipelined, requests, num_blocks=num_blocks, on_schedule=on_schedule)
    scheduler = engine.scheduler
    # the step budgets hold: tokens within max_num_batched_tokens, requests within max_num_seqs
    assert all(total == summed <= 256 and count <= 8 for total, count, summed in budgets)
    assert steps < 5000 and not scheduler.has_unfinished_requests()
    assert engine.finished == {r.request_id for r in requests}
    assert all(r.num_output_tokens == max(t.output_len, 1) for r, t in zip(requests, source))
    assert scheduler.kv_cache_manager.usage == 0.0 and not scheduler.running and not len(scheduler.waiting)
    if num_blocks == 40:            # 40 blocks of 16 tokens hold a few requests: vLLM preempts and resumes
        assert sum(preemptions) > 0
    if name.startswith("feather"):
        stats = scheduler.feather_stats()
        assert stats["fallbacks"] == 0 and stats["decisions"] > 0
        assert scheduler.waiting.tree.memory_entries() == dict.fromkeys(scheduler.waiting.tree.memory_entries(), 0)


@pytest.mark.parametrize("name", ["vllm-async", "feather-async"])
def test_pipelined_steps_are_scheduled_before_the_previous_output_is_applied(name):
    """Async scheduling: a decoding request is scheduled again while its previous token is in flight
    (a placeholder), and every step's output is applied once."""
    from deploy.model_free import vllm_requests

    cls, kwargs, _ = scheduler_classes()[name]
    requests = vllm_requests(trace(24), block_size=BLOCK)
    in_flight = []
    holder = {}

    def on_schedule(output):
        scheduler = holder["engine"].scheduler
        pending = [scheduler.requests[rid].num_output_placeholders for rid in output.num_scheduled_tokens]
        in_flight.append(sum(count > 1 for count in pending))

    from deploy.model_free import ModelFreeEngine, model_free_scheduler

    scheduler = model_free_scheduler(cls, block_size=BLOCK, num_blocks=4096, max_num_seqs=8, max_num_batched_tokens=256,
                                     max_model_len=1024, async_scheduling=True, **kwargs)
    engine = holder["engine"] = ModelFreeEngine(scheduler, pipelined=True, on_schedule=on_schedule)
    engine.add_requests(requests)
    while scheduler.has_unfinished_requests():
        engine.step()
    engine.drain()
    assert max(in_flight) > 0           # two tokens pending for some request: the previous step was not applied yet
    assert engine.finished == {r.request_id for r in requests}
    assert all(r.num_output_placeholders == 0 for r in requests)


@pytest.mark.parametrize("owner", ["standalone", "feather-step-log"])
def test_decode_composition_equals_the_scan_at_every_step(owner):
    """The incremental composition against the from-scratch definition, under preemption (small
    cache): standalone beside vLLM's scheduler (requests leave unannounced), and the Feather
    scheduler's own, which its ``_free_request`` tells of every request that leaves."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.model_free import ModelFreeEngine, model_free_scheduler, vllm_requests
    from deploy.scheduler import FeatherConfig, FeatherScheduler
    from deploy.step_log import DecodeComposition, step_composition

    composition = DecodeComposition(BLOCK)
    scans, incremental = [], []
    holder = {}

    def on_schedule(output):
        requests = holder["scheduler"].requests
        if not output.total_num_scheduled_tokens:
            return
        scans.append(step_composition(output, requests, BLOCK))
        if owner == "standalone":
            incremental.append(composition.update(output, requests))

    cls, kwargs = ((Scheduler, {}) if owner == "standalone" else
                   (FeatherScheduler, {"feather_config": FeatherConfig(policy="feather-rule", policy_reload_s=None)}))
    scheduler = holder["scheduler"] = model_free_scheduler(
        cls, block_size=BLOCK, num_blocks=48, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
        **kwargs)
    engine = ModelFreeEngine(scheduler, on_schedule=on_schedule)
    engine.add_requests(vllm_requests(trace(40, seed=3), block_size=BLOCK))
    preempted = 0
    while scheduler.has_unfinished_requests():
        preempted += len(engine.step().scheduler_output.preempted_req_ids or ())
    if owner != "standalone":
        fields = ("decode_requests", "decode_kv_tokens", "decode_unique_kv_tokens", "decode_groups", "prefill_chunks")
        incremental = [{name: getattr(record, name) for name in fields} for record in scheduler.step_log.recent()]
    assert preempted > 0 and len(scans) > 20 and max(s["decode_requests"] for s in scans) > 2
    assert incremental == scans


def test_bench_scheduler_reports_every_side_against_vllm(capsys):
    from feather_cli.main import main

    assert main(["bench", "scheduler", "--workload", f"small={WORKLOAD}", "--waiting", "32", "--max-num-seqs", "8",
                 "--steps", "5", "--policies", "feather-rule,k4-untrained", "--step-logs", "off,ring", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (result,) = report["results"]
    assert result["workload"] == "small" and result["block_size_tokens"] == BLOCK and result["waiting"] == 32
    assert list(result["sides"]) == ["vllm", "feather-rule/off", "feather-rule/ring", "k4-untrained/off",
                                     "k4-untrained/ring"]
    for label, side in result["sides"].items():
        assert side["steady_steps"] == 5 and side["burst_admissions"] >= 8 and side["step_us_p50"] > 0
        assert side["bubble_h200"] > 0 and side["modelled_step_ms_h100"] > 0
        if label != "vllm":
            assert side["feather_over_vllm_step_p50"] > 0 and side["feather_over_vllm_burst_round"] > 0
            assert side["policy_decisions"] > 0 and side["policy_fallbacks"] == 0


def test_version_parity_digests_repeat_and_compare_names_the_first_difference(tmp_path, capsys):
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.bench.version_parity import CACHES, compare, run_side

    first, second = (run_side(Scheduler, {}, False, CACHES["tight"]) for _ in range(2))
    assert first == second and len(first["finished"]) == 72
    assert any(step["preempted"] for step in first["steps"]) and any(r[1] for s in first["steps"] for r in s["new"])
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"vllm": "x", "sides": {"vllm/tight": first}}))
    second["steps"][7]["total_tokens"] += 1
    b.write_text(json.dumps({"vllm": "y", "sides": {"vllm/tight": second}}))
    assert compare(a, a) == 0
    assert compare(a, b) == 1
    assert "step 7 differs in ['total_tokens']" in capsys.readouterr().out


def test_the_hybrid_plugins_run_model_free_and_keep_states_within_their_budget():
    from deploy.bench.version_parity import HYBRID_CACHES, STATE_BUDGET, run_side
    from deploy.hybrid_placement import HybridPlacementConfig, HybridPlacementScheduler

    config = HybridPlacementConfig(placement="dp", state_budget_bytes=STATE_BUDGET)
    side = run_side(HybridPlacementScheduler, {"hybrid_config": config}, False, HYBRID_CACHES["ample"], hybrid=True)
    stats = side["stats"]
    assert len(side["finished"]) == 72 and stats["states_evicted"] > 0 and stats["dp_solves"] > 0
    assert stats["max_states"] == STATE_BUDGET // stats["state_pool_bytes"]
    assert any(r[1] for s in side["steps"] for r in s["new"])          # prefix hits resume from kept states
