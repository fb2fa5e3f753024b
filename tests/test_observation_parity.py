"""One observation across the simulator/engine boundary.

The same state is put into the simulator and into the vLLM scheduler's waiting queue (real
vLLM ``Request`` objects with the engine's sha256 block hashes, no engine), and both sides
build the observation through :func:`feather_gym.observation.raw_features`; the vectors must
be equal, also when the two sides run at different block sizes and with k candidate slots
(the same CHT candidates, rows and mask), and a trained policy must then take the same action
on both. Each candidate's resident prefix is looked up in a real vLLM prefix cache (a
model-free scheduler's block pool) holding the blocks of every request the simulator has
admitted, as far as the simulator still holds them. For a hybrid model with SuffixReplay, the
simulator's kept states and anchored pages are put into
:class:`~deploy.replay_scheduler.FeatherReplayScheduler` (model-free, the tiny hybrid's cache
layout), whose ``resumable_blocks`` the deployed view then reads.
"""

from __future__ import annotations

import math
import time
from functools import cache

import deploy_policies as policies
import numpy as np
import pytest

from cache_core.cht.tree import ChunkedHashTree
from deploy.admission import PolicyAdmission
from deploy.resident_prefix import ResidentPrefix
from deploy.vllm_request import vllm_request
from deploy.waiting_queue import CHTWaitingQueue
from feather_gym.costmodel import load_cost_model
from feather_gym.observation import ADD, FEATURE_NAMES, STOP, observation_size
from feather_gym.orderings import CHTOrder
from feather_gym.policies import OnnxFilePolicy
from feather_gym.simulator import EngineConfig, Simulator
from traces import Request, Trace


class Recorder:
    """A deployable policy over ``num_candidates`` slots that records the decision point it is
    shown and answers ADD."""

    name = "recorder"

    def __init__(self, num_candidates: int = 1) -> None:
        self.points = []
        self.num_candidates = num_candidates

    def decide(self, point) -> int:
        self.points.append(point)
        return ADD


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(300, 30_000, size=n, dtype=np.int64)


def workload() -> Trace:
    """Three prefix groups of 1024 and 512 tokens (multiples of 256) and loners, arriving over 50 ms;
    suffixes of whole 256-token blocks, so every side's block size sees the same token counts."""
    prefixes = [tokens(1, 1024), tokens(2, 512), tokens(3, 1024)]
    requests = []
    for i in range(12):
        group = i % 4
        own = tokens(100 + i, 256 * (1 + i % 3))
        prompt = own if group == 3 else np.concatenate([prefixes[group], own])
        requests.append(Request(str(i), 0.005 * i, len(prompt), 6 + i, token_ids=prompt))
    return Trace("parity", requests)


def returning_workload() -> Trace:
    """Group A's first two requests run and finish; 5 s later a loner, A's third request and two
    of group B arrive: A's prefix is still cached, and nothing of it runs."""
    a, b = tokens(1, 1024), tokens(2, 512)
    requests = [Request("a0", 0.0, 1280, 4, token_ids=np.concatenate([a, tokens(10, 256)])),
                Request("a1", 0.0, 1280, 4, token_ids=np.concatenate([a, tokens(11, 256)])),
                Request("loner", 5.0, 768, 40, token_ids=tokens(12, 768))]
    requests += [Request(f"{name}{i}", 5.001 + 0.001 * i, len(prefix) + 256, 8,
                         token_ids=np.concatenate([prefix, tokens(20 + 3 * i + len(name), 256)]))
                 for i in range(2) for name, prefix in (("a-again", a), ("b", b))]
    return Trace("returning", requests)


def simulator_at_decision(block_size: int, decisions: int, k: int = 1, hybrid=None, trace=None):
    """``(simulator, point)``: the simulator over ``trace`` (default :func:`workload`) with ``k``
    candidate slots (and the hybrid mode ``hybrid``) paused at its ``decisions``-th admission
    point (ADD before it)."""
    config = EngineConfig(block_size=block_size, token_budget=2048, kv_capacity_tokens=96 * 256, hybrid=hybrid)
    sim = Simulator(trace or workload(), load_cost_model("cpu"), CHTOrder(), config=config, num_candidates=k)
    for _ in range(decisions - 1):
        assert sim.next_admission() is not None
        sim.apply(ADD)
    point = sim.next_admission()
    assert point is not None
    return sim, point


def scheduler_queue_like(sim: Simulator, block_size: int, base_time: float) -> CHTWaitingQueue:
    """A vLLM waiting queue holding ``sim``'s running requests (admitted, in order) and its waiting
    ones (in arrival order, each added between the engine steps before the one it arrived in, as
    vLLM adds them), as real vLLM requests hashed at ``block_size``; the queue is in ``sim``'s step."""
    queue = CHTWaitingQueue(ChunkedHashTree(chunk_size=block_size))
    trace = sim.trace

    def vllm(idx: int):
        r = trace.requests[idx]
        return vllm_request(r.request_id, r.tokens(), block_size=block_size, arrival_time=base_time + r.arrival_s)

    for idx in sim.running:
        queue.add_request(vllm(idx))
        queue.pop_request()
    for idx in sorted(sim.cht.waiting_ids(), key=lambda i: trace.requests[i].arrival_s):
        queue.step = sim._arrival_step[idx] - 1
        queue.add_request(vllm(idx))
    queue.step = sim.step
    return queue


@cache
def engine_scheduler(block_size: int):
    """A model-free vLLM scheduler with the Feather plug-in at ``block_size`` (its block pool is
    the prefix cache the deployed view reads)."""
    from deploy.model_free import model_free_scheduler
    from deploy.scheduler import FeatherConfig, FeatherScheduler

    return model_free_scheduler(FeatherScheduler, block_size=block_size, num_blocks=4096, max_num_seqs=256,
                                max_num_batched_tokens=2048, max_model_len=8192,
                                feather_config=FeatherConfig(policy="feather-rule"))


def engine_prefix_cache_like(sim: Simulator, block_size: int):
    """The Feather scheduler's ``resident_tokens`` hook over a vLLM prefix cache holding what
    ``sim``'s holds: the leading prompt blocks of every request ``sim`` has admitted that ``sim``
    still holds (cached, then freed: resident and unreferenced), at ``block_size``, hashed by vLLM."""
    scheduler = engine_scheduler(block_size)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.reset_prefix_cache()
    for idx, r in enumerate(sim.trace.requests):
        if math.isnan(sim.first_scheduled_s[idx]):
            continue
        held = sim.kv.cached_prefix(sim.digest_lists[idx]) * sim.block_size // block_size
        if held:
            request = vllm_request(r.request_id, r.tokens(), block_size=block_size, arrival_time=0.0)
            blocks = pool.get_new_blocks(held)
            pool.cache_full_blocks(request, blocks, 0, held, block_size, 0)
            pool.free_blocks(blocks)
    return ResidentPrefix(scheduler.kv_cache_manager)


def deployed_point(sim: Simulator, block_size: int, policy, resumable=None):
    """The decision the deployed admission makes in ``sim``'s state, with ``policy`` (and a
    hybrid scheduler's ``resumable_blocks``)."""
    base = time.time() - 100.0
    queue = scheduler_queue_like(sim, block_size, base)
    recorder = Recorder(sim.num_candidates)
    admission = PolicyAdmission(recorder, num_running=lambda: len(sim.running), kv_usage=lambda: sim.kv_utilisation,
                                max_num_seqs=256, resident_tokens=engine_prefix_cache_like(sim, block_size),
                                max_wait_steps=10**9, resumable=resumable)
    admission.begin_step()
    assert admission.next_admission(queue) is not None
    (point,) = recorder.points
    return point, policy.decide(point) if policy is not None else None


@pytest.mark.parametrize("sim_block, engine_block", [(128, 128), (256, 16), (128, 16)])
@pytest.mark.parametrize("decisions", [1, 3, 5])
def test_simulator_and_vllm_queue_build_the_same_observation(sim_block, engine_block, decisions):
    sim, sim_point = simulator_at_decision(sim_block, decisions)
    engine_point, _ = deployed_point(sim, engine_block, None)
    assert engine_point.candidate == sim_point.request.request_id      # the same CHT candidate
    for name, a, b in zip(FEATURE_NAMES, sim_point.raw, engine_point.raw):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-9), name
    assert sim_point.batch_size == engine_point.batch_size and sim_point.raw[0] > 0


def test_a_policy_trained_at_one_block_size_serves_at_another(tmp_path):
    """The simulator at 256-token blocks and vLLM's queue at 16: same observation, same action."""
    policy = OnnxFilePolicy(str(policies.untrained_policy(tmp_path / "mlp.onnx")))
    actions = []
    for decisions in range(1, 7):
        sim, sim_point = simulator_at_decision(256, decisions)
        engine_point, engine_action = deployed_point(sim, 16, policy)
        np.testing.assert_allclose(engine_point.observation, sim_point.observation, rtol=1e-6)
        assert engine_action == policy.decide(sim_point)
        actions.append(engine_action)
    assert set(actions) <= {ADD, STOP} and len(actions) == 6


@pytest.mark.parametrize("k", [4, 12])
@pytest.mark.parametrize("sim_block, engine_block", [(128, 128), (256, 16)])
@pytest.mark.parametrize("decisions", [1, 2, 4, 6])
def test_k_candidates_are_the_same_on_both_sides(sim_block, engine_block, decisions, k):
    """The same CHT candidates in the same slots, the same rows, the same mask (k = 12 leaves
    slots empty)."""
    sim, sim_point = simulator_at_decision(sim_block, decisions, k=k)
    engine_point, _ = deployed_point(sim, engine_block, None)
    ids = [sim.trace.requests[idx].request_id for idx in sim_point.candidates]
    assert list(engine_point.candidates) == ids
    np.testing.assert_allclose(engine_point.raw_rows, sim_point.raw_rows, rtol=1e-6, atol=1e-9)
    np.testing.assert_array_equal(engine_point.mask, sim_point.mask)
    np.testing.assert_allclose(engine_point.observation, sim_point.observation, rtol=1e-6)
    assert sim_point.observation.shape == (observation_size(k),)


def test_the_states_offer_several_candidates_and_leave_slots_empty():
    """The states above are neither one-candidate states nor all full (the tests would be vacuous)."""
    counts = [len(simulator_at_decision(128, d, k=12)[1].candidates) for d in (1, 2, 4, 6)]
    assert max(counts) > 1 and min(counts) < 12, counts


@pytest.mark.parametrize("sim_block, engine_block", [(128, 128), (256, 16)])
def test_a_prefix_cached_but_no_longer_running_reads_alike_on_both_sides(sim_block, engine_block):
    """``candidate_resident_tokens`` from the simulator's prefix cache and from vLLM's block pool
    (``find_longest_cache_hit``) agree, in every row, also where a candidate's prefix is resident
    while nothing running shares it (its cached fraction 0, its resident tokens not)."""
    resident, fraction = FEATURE_NAMES.index("candidate_resident_tokens"), FEATURE_NAMES.index(
        "candidate_cached_fraction")
    cold_but_cached = 0
    for decisions in range(1, 5):
        sim, sim_point = simulator_at_decision(sim_block, decisions, k=4, trace=returning_workload())
        engine_point, _ = deployed_point(sim, engine_block, None)
        np.testing.assert_allclose(engine_point.raw_rows, sim_point.raw_rows, rtol=1e-6, atol=1e-9)
        rows = sim_point.raw_rows[:len(sim_point.candidates)]
        cold_but_cached += int(np.sum((rows[:, resident] > 0) & (rows[:, fraction] == 0)))
    assert cold_but_cached, "no state had a candidate whose prefix is cached but not running"


def test_a_k4_policy_takes_the_same_action_on_both_sides(tmp_path):
    policy = OnnxFilePolicy(str(policies.untrained_policy(tmp_path / "k4.onnx", k=4)))
    for decisions in range(1, 7):
        sim, sim_point = simulator_at_decision(256, decisions, k=4)
        engine_point, engine_action = deployed_point(sim, 16, policy)
        assert engine_action == policy.decide(sim_point)
        assert engine_point.slot(engine_action) == sim_point.slot(engine_action)


@pytest.fixture
def replay_scheduler_like():
    """``make(sim)``: a model-free :class:`~deploy.replay_scheduler.FeatherReplayScheduler` on the
    tiny hybrid's cache layout, holding ``sim``'s kept states and anchored pages (by vLLM's block
    hashes of the same pages, in the simulator's LRU order). Its GDN layers are declared
    replayable for the duration (no model is built)."""
    import json

    import torch

    from deploy.hybrid_placement import HybridPlacementConfig
    from deploy.model_free import model_free_scheduler
    from deploy.replay_plan import PLAN
    from deploy.replay_scheduler import FeatherReplayScheduler, SuffixReplayConfig
    from deploy.scheduler import FeatherConfig
    from feather_gym.hybrid.model import ensure_hybrid_hf

    layers = json.loads((ensure_hybrid_hf("tiny") / "config.json").read_text())["num_hidden_layers"]
    saved, PLAN.layers = PLAN.layers, {f"model.layers.{i}.linear_attn": i for i in range(layers)}

    def make(sim: Simulator):
        scheduler = model_free_scheduler(
            FeatherReplayScheduler, block_size=sim.block_size, num_blocks=400, max_num_seqs=256,
            max_num_batched_tokens=2048, max_model_len=8192, hybrid=True, enforce_eager=True,
            feather_config=FeatherConfig(policy="feather-rule"), replay_config=SuffixReplayConfig(replay_tokens=16),
            hybrid_config=HybridPlacementConfig(placement="vllm"))
        page = {}                                       # simulator digest -> (vLLM block hash, position)
        for idx, r in enumerate(sim.trace.requests):
            hashes = vllm_request(r.request_id, r.tokens(), block_size=sim.block_size, arrival_time=0.0).block_hashes
            page.update({d: (h, k + 1) for k, (d, h) in enumerate(zip(sim.digest_lists[idx], hashes))})
        store = scheduler.anchors
        for digest in sim.states.anchors:
            store.put(page[digest][0], {l: torch.zeros(r, store.hidden_size) for l, r in store.replay_tokens.items()})
        for digest in sim.states.registry:
            scheduler.states.keep(*page[digest])
        return scheduler

    yield make
    PLAN.layers = saved


def test_a_replay_scheduler_and_the_simulator_with_anchors_build_the_same_observation(replay_scheduler_like):
    """Kept states and anchored pages count as resumable on both sides alike (the simulator's
    ``StateKeeper.resumable``, the scheduler's ``resumable_blocks``), in every candidate row; the
    states met have candidates whose view anchors deepen and ones they leave short of the match."""
    from feather_gym.hybrid.state_keeping import HybridSimConfig

    hybrid = HybridSimConfig(placement="vllm", max_states=2, state_blocks=1, anchor_pages=6)
    deepened = short = 0
    for decisions in range(1, 7):
        sim, sim_point = simulator_at_decision(128, decisions, k=4, hybrid=hybrid)
        scheduler = replay_scheduler_like(sim)
        assert scheduler.admission.describe()["admission"] == "PolicyAdmission"
        engine_point, _ = deployed_point(sim, 128, None, resumable=scheduler.resumable_blocks)
        ids = [sim.trace.requests[idx].request_id for idx in sim_point.candidates]
        assert list(engine_point.candidates) == ids
        np.testing.assert_allclose(engine_point.raw_rows, sim_point.raw_rows, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(engine_point.observation, sim_point.observation, rtol=1e-6)
        for idx in sim_point.candidates:
            shared = sim.cht.candidate_stats(idx).shared_chunks
            chain = sim.digest_lists[idx][:shared]
            deepened += sim.states.anchors.deepest(chain, shared) > sim.states.registry.deepest(chain, shared)
            short += sim.resumable_blocks(idx, shared) < shared
    assert deepened and short, (deepened, short)


def test_on_a_hybrid_engine_the_resident_prefix_is_the_attention_groups_hit():
    """vLLM's combined hit needs a recurrent state at its boundary too (none kept here: 0 tokens);
    the view's resident prefix is the full-attention group's hit, which ``resumable_blocks``
    then cuts to what the kept states resume, as the simulator's hybrid mode does."""
    from deploy.hybrid_placement import FeatherHybridScheduler, HybridPlacementConfig
    from deploy.model_free import model_free_scheduler
    from deploy.scheduler import FeatherConfig

    scheduler = model_free_scheduler(
        FeatherHybridScheduler, block_size=128, num_blocks=400, max_num_seqs=256, max_num_batched_tokens=2048,
        max_model_len=8192, hybrid=True, enforce_eager=True, feather_config=FeatherConfig(policy="feather-rule"),
        hybrid_config=HybridPlacementConfig(placement="vllm"))
    coordinator, pool = scheduler.kv_cache_manager.coordinator, scheduler.kv_cache_manager.block_pool
    request = vllm_request("x", tokens(7, 5 * 128), block_size=128, arrival_time=0.0)
    resident = ResidentPrefix(scheduler.kv_cache_manager)
    assert resident.kind == "coordinator" and resident(request) == 0
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, 0, 3, 128, coordinator.full_attention_group_id)
    pool.free_blocks(blocks)
    assert resident(request) == 3 * 128
    assert coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)[1] == 0
    assert scheduler.resumable_blocks(request, 3) == 0
