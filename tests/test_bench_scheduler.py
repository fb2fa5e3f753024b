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


@pytest.mark.parametrize("owner, pipelined", [("standalone", False), ("feather-step-log", False),
                                             ("standalone", True), ("feather-step-log", True)])
def test_decode_composition_equals_the_scan_at_every_step(owner, pipelined):
    """The incremental composition against the from-scratch definition, under preemption (small
    cache): standalone beside vLLM's scheduler (requests leave unannounced), and the Feather
    scheduler's own, which its ``_free_request`` tells of every request that leaves; stepped
    synchronously and pipelined (async scheduling)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.model_free import ModelFreeEngine, model_free_scheduler, vllm_requests
    from deploy.scheduler import FeatherAsyncScheduler, FeatherConfig, FeatherScheduler
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

    config = {"feather_config": FeatherConfig(policy="feather-rule", policy_reload_s=None)}
    cls, kwargs = {("standalone", False): (Scheduler, {}), ("standalone", True): (AsyncScheduler, {}),
                   ("feather-step-log", False): (FeatherScheduler, config),
                   ("feather-step-log", True): (FeatherAsyncScheduler, config)}[owner, pipelined]
    scheduler = holder["scheduler"] = model_free_scheduler(
        cls, block_size=BLOCK, num_blocks=48, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
        async_scheduling=pipelined, **kwargs)
    engine = ModelFreeEngine(scheduler, pipelined=pipelined, on_schedule=on_schedule)
    engine.add_requests(vllm_requests(trace(40, seed=3), block_size=BLOCK))
    preempted = 0
    while scheduler.has_unfinished_requests():
        output = engine.step().scheduler_output
        preempted += len(output.preempted_req_ids or ()) if output is not None else 0
    engine.drain()
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
        assert side["own_us_per_request"] == pytest.approx(side["own_burst_us_per_admission"]
                                                           + side["own_add_us_mean"], abs=2e-3)
        assert 0 < side["own_step_us_p50"] < side["step_us_p50"]
        if label != "vllm":
            assert side["feather_over_vllm_step_p50"] > 0 and side["feather_over_vllm_burst_round"] > 0
            assert side["policy_decisions"] > 0 and side["policy_fallbacks"] == 0
            assert set(side["targets_met"]) >= {"own_time_10us_per_request", "burst_round_1_3x", "steady_step_1_05x"}
            assert side["own_us_per_request_beyond_vllm"] is not None
            assert ("ring_over_off_step_p50" in side) == label.endswith("/ring")
            assert ("ring_log_1_02x" in side["targets_met"]) == label.endswith("/ring")


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


# --- The invariants vLLM's own scheduler tests check (tests/v1/core; scripts/vllm_conformance.py runs those
# against the Feather classes), here for every class model-free: KV block accounting at every step,
# preempted requests resume before fresh admissions, aborts and a prefix-cache reset mid-run, and
# vLLM's prefix-cache hits under the Feather order.

def check_block_accounting(scheduler) -> None:
    """Every block a request holds is referenced once per holder; the free blocks and the held ones
    are the whole cache but vLLM's null block; a running request holds blocks for all its computed
    tokens (this step's included) and a waiting one holds none."""
    from collections import Counter

    (manager,) = scheduler.kv_cache_manager.coordinator.single_type_managers
    pool = scheduler.kv_cache_manager.block_pool
    holders = Counter(block.block_id for blocks in manager.req_to_blocks.values() for block in blocks
                      if not block.is_null)
    assert all(pool.blocks[block_id].ref_cnt == count for block_id, count in holders.items())
    assert pool.get_num_free_blocks() + len(holders) == len(pool.blocks) - 1
    for request in scheduler.running:
        assert len(manager.req_to_blocks[request.request_id]) * BLOCK >= request.num_computed_tokens
    for request in scheduler.waiting:
        assert not manager.req_to_blocks.get(request.request_id)


@pytest.mark.parametrize("name", ["vllm", "vllm-async", "feather", "feather-async"])
def test_blocks_are_accounted_at_every_step_and_preempted_requests_resume_before_fresh_ones(name):
    """Under a small cache (vLLM preempts): the block accounting holds after every ``schedule()``,
    and no request is admitted for the first time while a preempted one still waits (vLLM puts
    preempted requests back at the front; the Feather admission takes them first)."""
    from deploy.model_free import vllm_requests

    cls, kwargs, pipelined = scheduler_classes()[name]
    requests = vllm_requests(trace(), block_size=BLOCK)
    holder, scheduled, checked = {}, set(), []

    def on_schedule(output):
        scheduler = holder["scheduler"]
        check_block_accounting(scheduler)
        fresh = [r.req_id for r in output.scheduled_new_reqs if r.req_id not in scheduled]
        if fresh:
            assert not [r.request_id for r in scheduler.waiting if r.request_id in scheduled]
        scheduled.update(output.num_scheduled_tokens)
        checked.append(len(output.preempted_req_ids or ()))

    from deploy.model_free import ModelFreeEngine, model_free_scheduler

    scheduler = holder["scheduler"] = model_free_scheduler(
        cls, block_size=BLOCK, num_blocks=40, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
        async_scheduling=pipelined, **kwargs)
    engine = ModelFreeEngine(scheduler, pipelined=pipelined, on_schedule=on_schedule)
    engine.add_requests(requests)
    while scheduler.has_unfinished_requests():
        engine.step()
    engine.drain()
    assert sum(checked) > 0 and engine.finished == {r.request_id for r in requests}
    check_block_accounting(scheduler)


@pytest.mark.parametrize("name", ["vllm", "vllm-async", "feather", "feather-async"])
def test_aborted_requests_leave_the_queue_and_the_cache_and_the_rest_finish(name):
    """Aborting waiting and running requests mid-run (a step in flight when pipelined): the rest
    finish with their full output, every block returns, and the Feather queue's tree forgets them."""
    from vllm.v1.request import RequestStatus

    from deploy.model_free import vllm_requests

    cls, kwargs, pipelined = scheduler_classes()[name]
    source = trace()
    requests = vllm_requests(source, block_size=BLOCK)
    from deploy.model_free import ModelFreeEngine, model_free_scheduler

    scheduler = model_free_scheduler(cls, block_size=BLOCK, num_blocks=4096, max_num_seqs=8,
                                     max_num_batched_tokens=256, max_model_len=1024, async_scheduling=pipelined,
                                     **kwargs)
    engine = ModelFreeEngine(scheduler, pipelined=pipelined)
    engine.add_requests(requests)
    for _ in range(3):
        engine.step()
    running = {r.request_id for r in scheduler.running}
    waiting = {r.request_id for r in scheduler.waiting}
    aborted = set(sorted(running)[::2]) | set(sorted(waiting)[::2])
    assert aborted & running and aborted & waiting
    scheduler.finish_requests(aborted, RequestStatus.FINISHED_ABORTED)
    check_block_accounting(scheduler)
    assert not aborted & {r.request_id for r in scheduler.waiting}
    while scheduler.has_unfinished_requests():
        engine.step()
    engine.drain()
    kept = [(r, t) for r, t in zip(requests, source) if r.request_id not in aborted]
    assert engine.finished >= {r.request_id for r, _ in kept}
    assert all(r.num_output_tokens == max(t.output_len, 1) for r, t in kept)
    assert scheduler.kv_cache_manager.usage == 0.0 and not scheduler.running and not len(scheduler.waiting)
    if name.startswith("feather"):
        entries = scheduler.waiting.tree.memory_entries()
        assert entries == dict.fromkeys(entries, 0)


@pytest.mark.parametrize("name", ["vllm", "feather"])
def test_a_prefix_cache_reset_puts_the_running_requests_back_in_order_and_all_finish(name):
    """``reset_prefix_cache(reset_running_requests=True)`` (vLLM's test_scheduler_reset_prefix_cache):
    the running requests return to the waiting queue in their running order, readable by index as
    vLLM's deque queue is, and then every request finishes with its full output."""
    from deploy.model_free import ModelFreeEngine, model_free_scheduler, vllm_requests

    cls, kwargs, _ = scheduler_classes()[name]
    source = trace(24)
    requests = vllm_requests(source, block_size=BLOCK)
    scheduler = model_free_scheduler(cls, block_size=BLOCK, num_blocks=4096, max_num_seqs=8,
                                     max_num_batched_tokens=256, max_model_len=1024, **kwargs)
    engine = ModelFreeEngine(scheduler)
    engine.add_requests(requests)
    for _ in range(4):
        engine.step()
    running = [r.request_id for r in scheduler.running]
    waited = [r.request_id for r in scheduler.waiting]
    assert running and not scheduler.reset_prefix_cache()
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    assert not scheduler.running and scheduler.kv_cache_manager.usage == 0.0
    assert [scheduler.waiting[i].request_id for i in range(len(scheduler.waiting))] == running + waited
    assert [r.request_id for r in scheduler.waiting] == running + waited
    while scheduler.has_unfinished_requests():
        engine.step()
    assert engine.finished == {r.request_id for r in requests}
    assert all(r.num_output_tokens == max(t.output_len, 1) for r, t in zip(requests, source))


@pytest.mark.parametrize("name", ["vllm", "vllm-async", "feather", "feather-async"])
def test_a_second_turn_is_served_from_the_prefix_cache(name):
    """Multi-turn (vLLM's test_prefix_caching_for_multi_turn): a request whose prompt extends a
    finished one's starts with the finished prompt's full blocks computed, whatever order admits it."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    from deploy.model_free import ModelFreeEngine, model_free_scheduler, vllm_requests

    cls, kwargs, pipelined = scheduler_classes()[name]
    first = vllm_requests(trace(12, seed=5), block_size=BLOCK)
    scheduler = model_free_scheduler(cls, block_size=BLOCK, num_blocks=4096, max_num_seqs=8,
                                     max_num_batched_tokens=4096, max_model_len=1024, async_scheduling=pipelined,
                                     **kwargs)
    engine = ModelFreeEngine(scheduler, pipelined=pipelined)
    engine.add_requests(first)
    while scheduler.has_unfinished_requests():
        engine.step()
    engine.drain()
    hasher = get_request_block_hasher(BLOCK, sha256)
    rng = np.random.default_rng(1)
    second = [Request(f"turn2-{r.request_id}", list(r.prompt_token_ids) + rng.integers(1000, 2000, 20).tolist(),
                      SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0), None, block_hasher=hasher)
              for r in first]
    expected = {r.request_id: len(f.prompt_token_ids) // BLOCK * BLOCK for f, r in zip(first, second)}
    hits = {}

    def on_schedule(output):
        hits.update({new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs})

    engine.on_schedule = on_schedule
    engine.add_requests(second)
    while scheduler.has_unfinished_requests():
        engine.step()
    engine.drain()
    assert hits == expected
    assert scheduler.kv_cache_manager.usage == 0.0
