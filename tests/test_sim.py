"""The serving simulator and its prefix-cached KV pool: invariants, determinism, CLI."""

import copy
import dataclasses
import json

import numpy as np
import pytest

import traces
from feather_cli.main import main
from feather_gym.costmodel import load_cost_model
from feather_gym.kv_cache import PrefixKVCache
from feather_gym.observation import ADD, FEATURE_INDEX, FEATURE_NAMES, OBS_CLIP, STOP, normalise, raw_features
from feather_gym.orderings import CHTOrder
from feather_gym.policies import make_policy
from feather_gym.simulator import EngineConfig, Simulator, simulate
from traces import Request, Trace

BS = 256    # the tests' engine block size (the h200 profile's own is 16)


def engine(**kwargs) -> EngineConfig:
    return EngineConfig(block_size=BS, **kwargs)


@pytest.fixture(scope="module")
def h200():
    return load_cost_model("h200")


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(300, 30_000, size=n, dtype=np.int64)


def request(i: int, arrival: float, prompt: np.ndarray, output_len: int, group=None) -> Request:
    return Request(str(i), arrival, len(prompt), output_len, token_ids=prompt, group=group)


def small_trace(num_requests=60, rate=200.0, seed=0) -> Trace:
    spec = f"prefix-groups:groups=3,prefix_tokens=2000,rate={rate},num_requests={num_requests}"
    return traces.resolve_workload(spec, seed=seed)


# ---------------------------------------------------------------- KV cache
def check_pool(kv: PrefixKVCache) -> None:
    """The pool's invariants (module docstring of feather_gym.kv_cache)."""
    assert kv.free_blocks + sum(1 for r in kv._refs if r) == kv.capacity_blocks
    assert all((kv._refs[b] == 0) == (b in kv._free) for b in range(kv.capacity_blocks))
    assert all(kv._digest[b] == d for d, b in kv._block_of.items())
    assert all(kv._digest[b] == d for d, twins in kv._twins.items() for b in twins)
    held = sum(d is not None for d in kv._digest)
    assert held == len(kv._block_of) + sum(map(len, kv._twins.values()))


def test_kv_shared_blocks_count_once_and_free_blocks_form_one_lru_queue():
    kv = PrefixKVCache(6)
    kv.admit("a", [])
    assert kv.allocate("a", 4) and kv.used_blocks == 4
    kv.register("a", [1, 2, 3], 3)                         # 3 full blocks scheduled; the 4th is partial
    hits = kv.hit_blocks([1, 2, 4], 3)
    assert len(hits) == 2 and kv.blocks_to_claim(hits, 3) == 1   # 1 and 2 are shared: one new block
    kv.admit("b", hits)
    assert kv.allocate("b", 3) and kv.used_blocks == 5
    kv.register("b", [1, 2, 4], 3)
    check_pool(kv)
    kv.release("a")                                        # tail first: a's partial block, then 3
    assert kv.used_blocks == 3 and kv.cached_prefix([1, 2, 3]) == 3   # 3 stays registered, free
    kv.release("b")
    assert kv.used_blocks == 0 and kv.cached_blocks == 4
    check_pool(kv)
    # Allocation takes the free queue's head: a's partial block first (vLLM 0.32 puts a freed
    # block without a digest at the head), then the never-used block, then a's block 3,
    # evicting it although b's blocks, freed later, hold no more use.
    kv.admit("c", [])
    assert kv.allocate("c", 3) and kv._tables["c"] == [3, 5, 2]
    assert kv.cached_prefix([1, 2, 3]) == 2 and kv.cached_prefix([1, 2, 4]) == 3
    assert not kv.allocate("c", 7)                          # more than the pool: refused, unchanged
    assert kv.blocks_held("c") == 3
    check_pool(kv)


def test_kv_a_block_computed_twice_holds_its_digest_until_both_copies_are_evicted():
    """vLLM does not de-duplicate: a prefix computed again (its first copy not yet scheduled when
    the second was admitted) is cached twice; hits take the first copy, and evicting it leaves
    the second. Freed registered blocks join the tail, freed plain ones the head."""
    kv = PrefixKVCache(4)
    for request in ("a", "b"):
        kv.admit(request, [])
        kv.allocate(request, 2)
        kv.register(request, [7, 8], 1)                     # block 0 of each holds digest 7
    assert kv.hit_blocks([7], 1) == kv._tables["a"][:1] and kv.cached_blocks == 1
    check_pool(kv)
    kv.release("a")
    kv.release("b")
    assert list(kv._free) == [3, 1, 0, 2]                   # plain blocks at the head, b's last
    kv.admit("c", [])
    kv.allocate("c", 3)                                     # takes 3, 1 and a's copy of 7 (block 0)
    assert kv.hit_blocks([7], 1) == [2] and kv.cached_blocks == 1
    check_pool(kv)
    kv.allocate("c", 4)
    assert kv.hit_blocks([7], 1) == [] and kv.cached_blocks == 0
    check_pool(kv)


def test_kv_hit_on_a_free_registered_block_takes_it_out_of_the_free_queue():
    kv = PrefixKVCache(3)
    kv.admit("a", [])
    kv.allocate("a", 2)
    kv.register("a", [7, 8], 2)
    kv.release("a")
    hits = kv.hit_blocks([7, 8], 2)
    assert kv.blocks_to_claim(hits, 3) == 3                  # two free hits + one new block
    kv.admit("b", hits)
    assert kv.free_blocks == 1
    check_pool(kv)


# ---------------------------------------------------------------- invariants
def run_checked(trace, cost_model, policy_name, config):
    """Run to completion, checking invariants at every admission point."""
    policy = make_policy(policy_name)
    sim = Simulator(trace, cost_model, policy.make_order(), config=config)
    finishes = []
    finish = sim._finish
    sim._finish = lambda idx: (finishes.append(idx), finish(idx))
    last_now = sim.now_s
    while (point := sim.next_admission()) is not None:
        assert sim.kv.used_blocks <= sim.kv.capacity_blocks
        check_pool(sim.kv)
        assert sim.now_s >= last_now
        last_now = sim.now_s
        obs = point.observation
        assert obs.shape == (len(FEATURE_NAMES),) and obs.dtype == np.float32
        assert np.all((obs >= 0) & (obs <= OBS_CLIP))
        assert sim.emitted_tokens().sum() == sim.tokens_out       # every token emitted counted once
        sim.apply(policy.decide(point))
    return sim, sim.result(), finishes


@pytest.mark.parametrize("policy_name", ["fcfs", "feather-rule", "dfs"])
def test_invariants_under_kv_pressure(h200, policy_name):
    trace = small_trace()
    config = engine(kv_capacity_tokens=12 * BS * 8, token_budget=2048, max_num_seqs=64)
    sim, result, finishes = run_checked(trace, h200, policy_name, config)
    assert result.num_preemptions > 0                        # the tight cache really preempted
    assert sorted(finishes) == list(range(len(trace)))       # every request finished exactly once
    assert result.finished.all()
    out = np.array([r.output_len for r in trace])
    assert sim.tokens_out == out.sum()                       # tokens conserved
    assert np.all(result.first_token_s >= result.first_scheduled_s)
    assert np.all(result.finish_s >= result.first_token_s)
    assert np.all(result.first_scheduled_s >= result.arrival_s)
    prompt = sum(r.input_len for r in trace)
    assert result.prefill_tokens + result.cached_prompt_tokens >= prompt   # recomputation only adds
    assert sim.kv.used_blocks == 0                            # everything released


def test_a_fork_runs_on_with_the_output_lengths_it_is_given(h200):
    trace = small_trace()
    policy = make_policy("feather-rule")
    sim = Simulator(trace, h200, policy.make_order(),
                    config=engine(kv_capacity_tokens=12 * BS * 8, token_budget=2048, max_num_seqs=64))
    for _ in range(40):
        sim.apply(policy.decide(sim.next_admission()))

    def run_on(fork: Simulator) -> Simulator:
        rule = copy.deepcopy(policy)
        while (point := fork.next_admission()) is not None:
            fork.apply(rule.decide(point))
        return fork

    true = np.array([r.output_len for r in trace])
    np.testing.assert_array_equal(run_on(sim.fork(true)).result().finish_s, run_on(sim.fork()).result().finish_s)
    done, emitted = sim.result().finished, sim.emitted_tokens()
    assert done.any() and (~done & (emitted > 0)).any() and (emitted == 0).any()   # finished, part-way, unstarted
    shortest = run_on(sim.fork(emitted + 1))         # every unfinished request emits exactly one more token
    result = shortest.result()
    assert result.finished.all()
    np.testing.assert_array_equal(result.output_len, np.where(done, true, emitted + 1))
    assert shortest.tokens_out == sim.tokens_out + (~done).sum()
    with pytest.raises(ValueError, match="exceed the tokens it has emitted"):
        sim.fork(np.maximum(emitted, 1))
    with pytest.raises(ValueError, match="one per request"):
        sim.fork(true[:-1])


def test_prompt_tokens_are_hits_or_prefilled_without_preemption(h200):
    trace = small_trace()
    sim, result, _ = run_checked(trace, h200, "fcfs", engine())
    assert result.num_preemptions == 0
    assert result.prefill_tokens + result.cached_prompt_tokens == sum(r.input_len for r in trace)
    assert result.cached_prompt_tokens > 0                    # the shared prefixes hit


def test_simulation_is_deterministic(h200):
    trace = small_trace(seed=3)
    runs = [simulate(trace, h200, make_policy("feather-rule"), config=engine()) for _ in range(2)]
    for field in ("first_scheduled_s", "first_token_s", "finish_s"):
        np.testing.assert_array_equal(getattr(runs[0], field), getattr(runs[1], field))
    assert runs[0].metrics() == runs[1].metrics()


def test_step_times_come_from_the_cost_model(h200):
    """One request alone: its TTFT is the prefill step, then one decode step per token."""
    prompt = tokens(0, 1000)
    trace = Trace("one", [request(0, 0.0, prompt, 4)])
    result = simulate(trace, h200, make_policy("fcfs"))
    assert result.first_token_s[0] == pytest.approx(h200.prefill_s(1000, 0))
    assert result.num_steps == 4
    assert result.finish_s[0] > result.first_token_s[0]


def burst(trace: Trace) -> Trace:
    """``trace`` with every request arriving at time 0."""
    return Trace(trace.name, [dataclasses.replace(r, arrival_s=0.0) for r in trace], trace.source, trace.block_size)


def test_step_factors_of_one_change_nothing_and_a_constant_factor_scales_every_time(h200):
    trace = small_trace(seed=1)
    plain = simulate(trace, h200, make_policy("feather-rule"), config=engine())
    ones = simulate(trace, h200, make_policy("feather-rule"), config=engine(), step_factors=np.ones(5))
    for field in ("first_scheduled_s", "first_token_s", "finish_s"):
        np.testing.assert_array_equal(getattr(plain, field), getattr(ones, field))
    # With every request queued at 0 the same steps run, each twice as long.
    doubled, base = (simulate(burst(trace), h200, make_policy("feather-rule"), config=engine(),
                              step_factors=factors) for factors in (np.full(3, 2.0), None))
    assert doubled.num_steps == base.num_steps
    np.testing.assert_allclose(doubled.finish_s, 2 * base.finish_s, rtol=1e-12)
    np.testing.assert_allclose(doubled.first_token_s, 2 * base.first_token_s, rtol=1e-12)


def test_step_factors_follow_the_engine_step_also_across_jumped_decode_steps(h200, monkeypatch):
    """Step ``k`` takes factor ``(k - 1) mod n``: the same times whether the decode-only steps are
    jumped over in one go or run one by one."""
    trace = Trace("one", [request(0, 0.0, tokens(0, 1000), 40)])
    lone = simulate(trace, h200, make_policy("fcfs"), step_factors=np.array([2.0, 0.5, 3.0]))
    assert lone.first_token_s[0] == pytest.approx(2.0 * h200.prefill_s(1000, 0))    # step 1: the prefill
    trace, factors = small_trace(seed=2), np.random.default_rng(0).uniform(0.5, 2.0, 7)
    jumps = []
    forward = Simulator._fast_forward

    def counted(sim):
        before = sim.step
        forward(sim)
        jumps.append(sim.step - before)

    monkeypatch.setattr(Simulator, "_fast_forward", counted)
    jumped = simulate(trace, h200, make_policy("feather-rule"), config=engine(), step_factors=factors)
    assert max(jumps) > 1                                   # decode-only steps were jumped over
    monkeypatch.setattr(Simulator, "_fast_forward", lambda sim: None)
    stepped = simulate(trace, h200, make_policy("feather-rule"), config=engine(), step_factors=factors)
    assert stepped.num_steps == jumped.num_steps
    for field in ("first_scheduled_s", "first_token_s", "finish_s"):
        np.testing.assert_allclose(getattr(stepped, field), getattr(jumped, field), rtol=1e-9)


@pytest.mark.parametrize("factors", [np.array([]), np.array([1.0, 0.0]), np.array([1.0, -2.0]), np.ones((2, 2))])
def test_step_factors_must_be_positive_one_per_step(h200, factors):
    with pytest.raises(ValueError, match="step_factors"):
        simulate(small_trace(), h200, make_policy("fcfs"), config=engine(), step_factors=factors)


def test_prefill_is_chunked_by_the_token_budget(h200):
    trace = Trace("long", [request(0, 0.0, tokens(1, 5000), 2)])
    result = simulate(trace, h200, make_policy("fcfs"), config=engine(token_budget=1024, max_num_seqs=8))
    assert result.num_steps == 5 + 1                         # ceil(5000 / 1024) prefill steps, one decode


def test_request_too_large_for_the_cache_is_rejected(h200):
    trace = Trace("t", [request(0, 0.0, tokens(2, 3000), 4), request(1, 0.1, tokens(3, 100), 4)])
    result = simulate(trace, h200, make_policy("fcfs"), config=engine(kv_capacity_tokens=2048))
    assert list(result.finished) == [False, True]
    assert result.metrics()["rejected"] == 1


def test_observation_reflects_the_candidate(h200):
    prefix = tokens(4, 10 * BS)
    reqs = [request(i, 0.0, np.concatenate([prefix, tokens(10 + i, 50)]), 20) for i in range(3)]
    reqs.append(request(3, 0.0, tokens(99, 10 * BS + 50), 20))
    sim = Simulator(Trace("t", reqs), h200, CHTOrder(), config=engine())
    point = sim.next_admission()                              # request 0 was admitted unasked
    assert point.batch_size == 1 and point.candidate in (1, 2)
    assert point.stats.chunk_loss == 0 and point.stats.shared_chunks == 10
    assert point.raw[FEATURE_INDEX["candidate_resident_tokens"]] == 10 * BS    # request 0's prefix is cached
    sim.apply(ADD)
    point = sim.next_admission()
    sim.apply(ADD)
    point = sim.next_admission()
    assert point.candidate == 3 and point.stats.chunk_loss == 10
    expected = [3, 10 * BS, 0, 10 * BS, 10 * BS + 50, 0.0, sim.kv.used_blocks / sim.kv.capacity_blocks, 1, 0.0, 0.0]
    np.testing.assert_allclose(point.raw, expected)
    np.testing.assert_allclose(point.observation, normalise(np.array(expected)))


# ---------------------------------------------------------------- vLLM semantics
def test_blocks_are_registered_when_their_chunk_is_scheduled(h200):
    """vLLM registers a block in ``allocate_slots``, for the tokens scheduled so far, not the
    whole prompt at admission: mid chunked prefill only the scheduled chunks can be hit."""
    prompt = tokens(5, 8 * BS + 10)
    sim = Simulator(Trace("t", [request(0, 0.0, prompt, 4)]), h200, CHTOrder(), config=engine(token_budget=2 * BS + 10))
    chain = sim.digest_lists[0]
    sim._begin_step()
    assert sim._propose() is None                           # admitted unasked; its first chunk scheduled
    assert sim.kv.cached_prefix(chain) == 2 and sim.kv.blocks_held(0) == 3
    sim._execute_step()
    sim._begin_step()                                       # the next chunk: 2 * BS + 10 more tokens
    assert sim.kv.cached_prefix(chain) == 4 and sim.kv.blocks_held(0) == 5


def test_the_null_block_holds_no_request(h200):
    """vLLM's ``BlockPool`` keeps one of the engine's blocks as its null block: an engine of 8
    blocks gives requests 7, and its KV usage (``get_usage``) is counted over those 7."""
    sim = Simulator(Trace("t", [request(0, 0.0, tokens(2, 3 * BS), 4)]), h200, CHTOrder(),
                    config=engine(kv_capacity_tokens=8 * BS))
    assert sim.kv.capacity_blocks == 7
    sim._begin_step()
    assert sim._propose() is None and sim.kv_utilisation == 3 / 7


def test_a_request_refused_for_kv_is_admitted_in_the_step_after_a_finish_frees_it(h200):
    """vLLM tries the waiting queue every step: once a finish frees the blocks a waiting request
    needs, the next step admits it, even while another request decodes on (the simulator must
    not jump decode-only steps past that finish)."""
    bs = 16
    long_decoder = request(0, 0.0, tokens(20, bs), 60)    # decodes through all of it: 5 blocks at most
    blocker = request(1, 0.0, tokens(21, 100), 40)         # 7 blocks, 9 by its last token
    waiting = request(2, 0.0, tokens(22, 130), 10)         # needs 9 blocks: never free beside the other two
    config = EngineConfig(block_size=bs, kv_capacity_tokens=17 * bs)    # 16 blocks beside the null block
    result = simulate(Trace("t", [long_decoder, blocker, waiting]), h200, make_policy("fcfs"), config=config)
    assert result.num_preemptions == 0 and result.finished.all()
    assert list(result.first_scheduled_step[:2]) == [1, 1]
    assert result.first_scheduled_step[2] == 40 + 1          # the blocker's prefill emits 1 token, 39 decode steps


def test_the_policy_is_asked_before_the_kv_check_and_another_slot_may_fit(h200):
    """As deployed, the policy chooses before vLLM's KV check: with slot 0 too big for the free
    blocks, a policy that picks slot 1 admits it in the same step; ADD on slot 0 ends admission.
    Slots 0 and 1 miss as many of the running set's chunks (two), so the CHT ranks the earlier
    arrival first, but slot 0's partial last block needs a third block where two are free."""
    bs = 16
    running = request(0, 0.0, tokens(1, 4 * bs), 40)
    too_big = request(1, 1e-4, tokens(2, 2 * bs + 8), 4)
    fits = request(2, 2e-4, tokens(3, 2 * bs), 4)
    config = EngineConfig(block_size=bs, kv_capacity_tokens=8 * bs)    # 7 blocks beside the null block

    def run(action):
        sim = Simulator(Trace("t", [running, too_big, fits]), h200, CHTOrder(), config=config, num_candidates=2)
        point = sim.next_admission()
        assert (sim.step, point.candidates, sim.kv.free_blocks) == (2, (1, 2), 2)
        sim.apply(action)
        admitted = [idx for idx in (1, 2) if sim.first_scheduled_step[idx] == 2]
        sim.next_admission()
        return admitted, sim.step

    assert run(2) == ([2], 2)            # slot 1 fits: admitted; the same step then asks about slot 0 alone
    assert run(ADD) == ([], 3)           # slot 0 does not fit: admission ends for the step
    assert run(STOP) == ([], 3)


def test_generated_blocks_are_hashed_and_stay_cached_after_the_request(h200):
    prompt = tokens(8, 2 * BS + 10)
    sim = Simulator(Trace("t", [request(0, 0.0, prompt, 3 * BS)]), h200, CHTOrder(), config=engine())
    assert sim.next_admission() is None
    # KV was computed for 5 * BS + 9 tokens: 5 full blocks, 2 of prompt and 3 holding generated tokens
    assert len(sim._chains[0]) == 5 and sim.kv.cached_prefix(sim._chains[0]) == 5
    assert sim.kv.cached_blocks == 5 and sim.kv.used_blocks == 0


def test_waiting_time_bound_admits_overdue_requests_over_a_stop(h200):
    reqs = [request(i, 0.0, tokens(40 + i, 300), 400) for i in range(4)]
    always_stop = type("AlwaysStop", (), {"decide": lambda self, point: STOP})()

    def run(max_wait_steps):
        sim = Simulator(Trace("t", reqs), h200, CHTOrder(), config=engine(max_wait_steps=max_wait_steps))
        while (point := sim.next_admission()) is not None:
            sim.apply(always_stop.decide(point))
        return sim.result()

    bounded, unbounded = run(2), run(10**9)
    assert bounded.forced_wait_admissions == 3 and unbounded.forced_wait_admissions == 0
    # all arrive for step 1; the three STOPped ones have waited 2 steps before step 3
    assert bounded.first_scheduled_step.tolist() == [1, 3, 3, 3]
    assert bounded.finished.all() and unbounded.finished.all()
    # unbounded: always-STOP serves one at a time; bounded: the overdue ones join the batch
    assert bounded.metrics()["makespan_s"] < unbounded.metrics()["makespan_s"]
    assert np.nanmax(bounded.first_scheduled_s) < np.nanmax(unbounded.first_scheduled_s)


def test_the_block_size_and_token_budget_default_to_the_profile(h200):
    sim = Simulator(small_trace(num_requests=5), load_cost_model("cpu"), CHTOrder())
    assert (sim.block_size, sim.config.token_budget) == (128, 4096)
    sim = Simulator(small_trace(num_requests=5), h200, CHTOrder())
    assert (sim.block_size, sim.config.token_budget) == (16, 8192)


@pytest.mark.parametrize("block_size", [16, 128, 256])
def test_one_token_level_state_gives_one_observation_at_every_block_size(h200, block_size):
    """Prompts of multiples of 256 tokens: every feature is equal at block sizes 16, 128 and 256,
    except KV utilisation, whose blocks hold a decoder's growth in steps of one block (at most
    one block per running request apart) and whose capacity leaves out one null block of each size."""
    observations = [decision_observations(h200, block_size), decision_observations(h200, 256)]
    assert len(observations[0]) == len(observations[1]) >= 3
    kv = FEATURE_INDEX["kv_utilisation"]
    others = [i for i in range(len(FEATURE_NAMES)) if i != kv]
    for a, b in zip(*observations):
        np.testing.assert_allclose(a[others], b[others], rtol=1e-6)
        assert abs(a[kv] - b[kv]) <= (a[FEATURE_INDEX["batch_size"]] + 1) * 256 / (KV_TOKENS - 256)


KV_TOKENS = 64 * 256


def decision_observations(cost_model, block_size: int) -> list[np.ndarray]:
    """The raw features at every admission point of a fixed two-group trace (always ADD)."""
    shared = [tokens(50 + g, 4 * 256) for g in range(2)]
    reqs = [request(i, 0.01 * i, np.concatenate([shared[i % 2], tokens(60 + i, 256 * (1 + i % 3))]), 8)
            for i in range(8)]
    config = EngineConfig(block_size=block_size, kv_capacity_tokens=KV_TOKENS, token_budget=1024)
    sim = Simulator(Trace("t", reqs), cost_model, CHTOrder(), config=config)
    raws = []
    while (point := sim.next_admission()) is not None:
        raws.append(raw_features(sim, point.candidate))
        sim.apply(ADD)
    return raws


# ---------------------------------------------------------------- CLI
def test_sim_compare_cli_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "bars.png"
    code = main(["sim", "compare", "--workload", "prefix-groups:groups=3,num_requests=40,rate=50",
                 "--profile", "h200", "--policies", "fcfs,feather-rule,group-label", "--json", "--plot", str(plot)])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(out["policies"]) == ["fcfs", "feather-rule", "group-label"]
    assert out["policies"]["fcfs"]["ratio_to_fcfs"] == 1.0
    for metrics in out["policies"].values():
        assert metrics["requests"] == 40 and metrics["throughput_tok_s"] > 0
    assert plot.stat().st_size > 1000


def test_sim_compare_cli_rejects_unknown_policy(capsys):
    code = main(["sim", "compare", "--workload", "no-sharing:num_requests=5", "--profile", "h200",
                 "--policies", "fcfs,nonsense"])
    assert code == 2 and "nonsense" in capsys.readouterr().err
