"""Each baseline's defining behaviour, on tiny hand-made traces."""

import copy
from types import SimpleNamespace

import numpy as np
import pytest

from feather_gym.costmodel import load_cost_model
from feather_gym.observation import ADD, FEATURE_INDEX, STOP
from feather_gym.orderings import LPMOrder
from feather_gym.policies import (
    DEFAULT_HOLD_STEPS,
    DEFAULT_PLAYOUT_SAMPLES,
    AlwaysAdd,
    FeatherRule,
    GroupLabelPolicy,
    ResidentFirstRule,
    RulePlayout,
    make_policy,
    playout_futures,
    sampled_output_lengths,
)
from feather_gym.simulator import EngineConfig, Simulator, simulate
from feather_gym.slo import DEFAULT_SLOS
from traces import Request, Trace

BS = 256                                                  # the tests' engine block size
ENGINE = EngineConfig(block_size=BS)
SERIAL = EngineConfig(block_size=BS, max_num_seqs=1)     # one request at a time: the order is the admission order


@pytest.fixture(scope="module")
def h200():
    return load_cost_model("h200")


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(300, 30_000, size=n, dtype=np.int64)


def req(i, arrival, prompt, output_len=4, group=None):
    return Request(str(i), arrival, len(prompt), output_len, token_ids=prompt, group=group)


def admission_order(result) -> list[int]:
    return [int(i) for i in np.argsort(result.first_scheduled_s, kind="stable")]


P, Q = tokens(1, 4 * BS), tokens(2, 4 * BS)


def cached_prefix_trace():
    """W (nothing cached) arrives first, then X under P, then Y1, Y2 under Q; P and Q are pre-cached."""
    return Trace("t", [req(0, 0.0, tokens(3, 4 * BS + 10)),
                       req(1, 0.0, np.concatenate([P, tokens(4, 10)])),
                       req(2, 0.0, np.concatenate([Q, tokens(5, 10)])),
                       req(3, 0.0, np.concatenate([Q, tokens(6, 10)]))])


def precache(sim, prefix) -> None:
    """Leave ``prefix``'s blocks registered and free in ``sim``'s KV cache, as a finished request would."""
    digests = sim.cht.digests_of(prefix).tolist()
    sim.kv.admit("warm-up", [])
    sim.kv.allocate("warm-up", len(digests))
    sim.kv.register("warm-up", digests, len(digests))
    sim.kv.release("warm-up")


#: One request at a time and no waiting-time bound: the order alone decides who goes next.
UNBOUNDED_SERIAL = EngineConfig(block_size=BS, max_num_seqs=1, max_wait_steps=10**6)


def run_with_cached(trace, cost_model, policy_name, prefixes=(), config=SERIAL):
    """Simulate with ``prefixes`` already resident (cached, unreferenced) in the KV cache."""
    policy = make_policy(policy_name)
    sim = Simulator(trace, cost_model, policy.make_order(), config=config, num_candidates=policy.num_candidates)
    for prefix in prefixes:
        precache(sim, prefix)
    while (point := sim.next_admission()) is not None:
        sim.apply(policy.decide(point))
    return sim.result()


def test_fcfs_admits_in_arrival_order(h200):
    trace = Trace("t", [req(i, 0.001 * i, tokens(10 + i, 300 - 50 * i)) for i in range(5)])
    assert admission_order(simulate(trace, h200, make_policy("fcfs"), config=SERIAL)) == [0, 1, 2, 3, 4]


def test_fcfs_fills_the_batch_up_to_max_num_seqs(h200):
    trace = Trace("t", [req(i, 0.0, tokens(20 + i, 100), output_len=50) for i in range(6)])
    result = simulate(trace, h200, make_policy("fcfs"), config=EngineConfig(block_size=BS, max_num_seqs=4))
    assert np.sum(result.first_scheduled_s == 0.0) == 4


def test_lpm_prefers_the_longest_cached_prefix(h200):
    order = admission_order(run_with_cached(cached_prefix_trace(), h200, "lpm", [P, Q]))
    assert order[:3] == [1, 2, 3] and order[3] == 0       # equal cached depth: FCFS among them, W last


def test_lpm_falls_back_to_fcfs_beyond_its_queue_limit(h200):
    trace = cached_prefix_trace()
    sim = Simulator(trace, h200, LPMOrder(fcfs_beyond=2), config=SERIAL)
    policy = AlwaysAdd("lpm-2", lambda: sim.order)
    for prefix in (P, Q):
        precache(sim, prefix)
    while (point := sim.next_admission()) is not None:
        sim.apply(policy.decide(point))
    assert admission_order(sim.result())[0] == 0           # 4 waiting > 2: FCFS head first


def test_feather_resident_takes_the_cached_groups_the_cht_ranks_cold(h200):
    """R decodes in a batch of two; W, X, Y1, Y2 (as in :func:`cached_prefix_trace`) then wait for
    the other slot, with P and Q resident and nothing of them running. The CHT ranks the
    waiting ones alike (arrival order); the resident rule takes the cached groups first, as LPM."""
    trace = Trace("t", [req(4, 0.0, tokens(9, BS + 10), output_len=400)]
                  + [Request(r.request_id, 0.01, r.input_len, r.output_len, token_ids=r.token_ids)
                     for r in cached_prefix_trace().requests])
    pair = EngineConfig(block_size=BS, max_num_seqs=2)
    assert admission_order(run_with_cached(trace, h200, "feather-rule", [P, Q], config=pair)) == [0, 1, 2, 3, 4]
    assert admission_order(run_with_cached(trace, h200, "feather-resident", [P, Q], config=pair)) == [0, 2, 3, 4, 1]
    # Nothing resident: the CHT's order.
    assert admission_order(run_with_cached(trace, h200, "feather-resident", config=pair)) == [0, 1, 2, 3, 4]


def slots(batch_size, *rows, step=1, oldest_wait_steps=5):
    """A decision point over ``len(rows)`` filled slots of 4; each row ``(resident_tokens, chunk_loss)``
    (chunk loss in chunks of 256 tokens)."""
    raw_rows = np.zeros((4, len(FEATURE_INDEX)))
    for row, (resident, loss) in zip(raw_rows, rows):
        row[FEATURE_INDEX["batch_size"]] = batch_size
        row[FEATURE_INDEX["candidate_resident_tokens"]] = resident
        row[FEATURE_INDEX["chunk_loss_tokens"]] = 256 * loss
        row[FEATURE_INDEX["oldest_wait_steps"]] = oldest_wait_steps
    return SimpleNamespace(batch_size=batch_size, raw_rows=raw_rows, raw=raw_rows[0], step=step,
                           candidates=tuple(range(len(rows))))


def test_feather_resident_decides_by_the_rule_on_the_deepest_resident_slot():
    resident = ResidentFirstRule(hold_steps=0)
    assert resident.num_candidates == 4 and make_policy("feather-resident").name == "feather-resident"
    assert resident.decide(slots(3, (0, 0), (512, 0), (512, 0))) == ADD + 1           # the first of the deepest
    assert resident.decide(slots(3, (0, 0), (0, 0))) == ADD                             # none resident: slot 0
    assert resident.decide(slots(30, (0, 0), (1024, 9))) == STOP     # the rule refuses the chosen one: STOP,
    assert resident.decide(slots(0, (0, 0), (1024, 9))) == ADD + 1   # not the next; an empty batch admits it
    held = ResidentFirstRule(hold_steps=3)
    assert held.decide(slots(3, (0, 0), (512, 0), oldest_wait_steps=2)) == STOP
    assert held.decide(slots(3, (0, 0), (512, 0), oldest_wait_steps=3)) == ADD + 1


def test_dfs_weight_visits_the_heavier_cached_subtree_first(h200):
    order = admission_order(run_with_cached(cached_prefix_trace(), h200, "dfs", [P, Q]))
    # Q's subtree (2 waiting) before P's (1) although X arrived first; once Y1 runs the
    # subtrees weigh 1 each and the tie goes to the first seen (X); uncached W comes last.
    assert order == [2, 1, 3, 0]


def test_hrrn_takes_the_shortest_uncached_prefill_among_equal_waits(h200):
    """R runs first; A (4 blocks + 10 tokens, uncached), B (P cached + 10 tokens) and C (2 blocks + 10)
    arrive together and wait alike, so the ratio ranks them by uncached prompt: B, C, A."""
    trace = Trace("t", [req(0, 0.0, tokens(3, 100), output_len=40),
                        req(1, 1e-6, tokens(4, 4 * BS + 10)),
                        req(2, 1e-6, np.concatenate([P, tokens(5, 10)])),
                        req(3, 1e-6, tokens(6, 2 * BS + 10))])
    assert admission_order(run_with_cached(trace, h200, "hrrn", [P], UNBOUNDED_SERIAL)) == [0, 2, 3, 1]
    assert admission_order(run_with_cached(trace, h200, "fcfs", [P], UNBOUNDED_SERIAL)) == [0, 1, 2, 3]


def test_hrrn_ages_a_long_request_past_a_short_newcomer(h200):
    """L (12 blocks) waits the whole of R's 300 decode steps; S (50 tokens) arrives for R's last
    steps. S's prefill is 60x shorter, but L has waited far more than 60x longer: L goes first
    (shortest-prefill-first would starve it). Had S arrived with L, S would have gone first."""
    def trace(s_arrival):
        return Trace("t", [req(0, 0.0, tokens(3, 100), output_len=300), req(1, 1e-6, tokens(4, 12 * BS)),
                           req(2, s_arrival, tokens(5, 50))])

    r_done = simulate(trace(1e-6), h200, make_policy("fcfs"), config=UNBOUNDED_SERIAL).finish_s[0]
    late = run_with_cached(trace(r_done * (1 - 1e-3)), h200, "hrrn", config=UNBOUNDED_SERIAL)
    assert admission_order(late) == [0, 1, 2]
    assert late.arrival_s[2] > late.first_token_s[0] + 0.99 * (late.finish_s[0] - late.first_token_s[0])
    assert admission_order(run_with_cached(trace(1e-6), h200, "hrrn", config=UNBOUNDED_SERIAL)) == [0, 2, 1]


def two_group_trace(n=6):
    """Groups A and B interleaved, all arriving at once, 10-chunk prefixes."""
    a, b = tokens(7, 10 * BS), tokens(8, 10 * BS)
    return Trace("ab", [req(i, 0.0, np.concatenate([a if i % 2 == 0 else b, tokens(100 + i, 20)]), 30,
                            group="A" if i % 2 == 0 else "B") for i in range(n)])


def test_feather_rule_keeps_the_batch_in_one_prefix_group(h200):
    trace = two_group_trace()
    rule = simulate(trace, h200, make_policy("feather-rule"), config=ENGINE)
    fcfs = simulate(trace, h200, make_policy("fcfs"), config=ENGINE)
    first_step = set(np.flatnonzero(rule.first_scheduled_s == 0.0))
    assert first_step == {0, 2, 4}                         # A admitted, B refused (chunk loss 10 > 5)
    assert np.all(fcfs.first_scheduled_s == 0.0)           # FCFS mixes both groups at once


def point(batch_size, chunk_loss=0, same_prefix_waiting=0, step=1, oldest_wait_steps=0):
    """A decision point with ``chunk_loss`` in chunks of 256 tokens (the rule's thresholds: 5 and 7)."""
    raw = np.zeros(len(FEATURE_INDEX))
    raw[FEATURE_INDEX["batch_size"]] = batch_size
    raw[FEATURE_INDEX["chunk_loss_tokens"]] = 256 * chunk_loss
    raw[FEATURE_INDEX["same_prefix_waiting"]] = same_prefix_waiting
    raw[FEATURE_INDEX["oldest_wait_steps"]] = oldest_wait_steps
    return SimpleNamespace(batch_size=batch_size, raw=raw, step=step)


def test_feather_rule_thresholds():
    rule = FeatherRule()
    assert rule.decide(point(0, chunk_loss=50)) == ADD                       # first request always
    assert rule.decide(point(20, chunk_loss=5)) == ADD
    assert rule.decide(point(20, chunk_loss=6)) == STOP
    assert rule.decide(point(20, chunk_loss=7, same_prefix_waiting=9)) == ADD   # 10 share the prefix
    assert rule.decide(point(20, chunk_loss=8, same_prefix_waiting=9)) == STOP


def test_feather_rule_floor_grows_with_refused_steps_up_to_ten():
    rule = FeatherRule(floor_growth_steps=4)
    assert rule.floor == 1
    for step in range(1, 9):                                # 8 refused steps
        assert rule.decide(point(3, chunk_loss=9, step=step)) == STOP
        rule.decide(point(3, chunk_loss=9, step=step))      # a second refusal in a step counts once
    assert rule.floor == 3
    for step in range(9, 13):
        rule.decide(point(3, chunk_loss=9, step=step))
    assert rule.floor == 4 and rule.decide(point(3, chunk_loss=9, step=13)) == ADD
    for step in range(14, 100):
        rule.decide(point(30, chunk_loss=9, step=step))
    assert rule.floor == 10
    rule.reset()
    assert rule.floor == 1


def test_feather_hold_admits_once_the_oldest_request_has_waited_its_hold():
    hold = make_policy("feather-hold")
    assert hold.name == "feather-hold" and hold.hold_steps == DEFAULT_HOLD_STEPS == 2
    assert hold.decide(point(0, oldest_wait_steps=0)) == ADD                 # an empty batch admits at once
    assert hold.decide(point(3, oldest_wait_steps=0)) == STOP
    assert hold.decide(point(3, oldest_wait_steps=1)) == STOP
    assert hold.decide(point(3, oldest_wait_steps=2)) == ADD
    assert hold.decide(point(20, chunk_loss=6, oldest_wait_steps=9)) == STOP  # the rule's own STOP stays
    assert FeatherRule().decide(point(3, oldest_wait_steps=0)) == ADD        # the rule holds nothing
    with pytest.raises(ValueError, match="hold_steps"):
        FeatherRule(hold_steps=-1)


def test_feather_hold_stops_do_not_grow_the_floor():
    hold = FeatherRule(hold_steps=5)
    for step in range(1, 20):
        assert hold.decide(point(3, step=step, oldest_wait_steps=0)) == STOP
    assert hold.floor == 1


def test_feather_hold_admits_a_newcomer_its_hold_later_than_the_rule(h200):
    """One request of A decodes; B's four arrive a few milliseconds apart. The rule admits the first
    of B in the step it arrives in; the hold waits until it has waited two engine steps, and admits
    no request of B earlier than the rule does."""
    a, b = tokens(7, 4 * BS), tokens(8, 4 * BS)
    trace = Trace("hold", [req(0, 0.0, np.concatenate([a, tokens(20, 10)]), 200)]
                  + [req(i, 0.05 + 0.004 * i, np.concatenate([b, tokens(20 + i, 10)]), 8) for i in range(1, 5)])
    rule, hold = (simulate(trace, h200, make_policy(name), config=ENGINE) for name in ("feather-rule", "feather-hold"))
    assert hold.first_scheduled_step[1] == rule.first_scheduled_step[1] + DEFAULT_HOLD_STEPS
    assert np.all(hold.first_scheduled_step[1:] >= rule.first_scheduled_step[1:])
    assert np.all(np.isfinite(hold.finish_s))


def test_group_label_serves_one_group_at_a_time(h200):
    trace = two_group_trace(8)
    result = simulate(trace, h200, GroupLabelPolicy(min_batch=1), config=ENGINE)
    a, b = result.first_scheduled_s[0::2], result.first_scheduled_s[1::2]
    assert a.max() < b.min()                               # no B joins while A runs


def test_group_label_admits_unlabelled_requests_like_fcfs(h200):
    trace = Trace("t", [req(i, 0.0, tokens(30 + i, 600), 20) for i in range(6)])
    result = simulate(trace, h200, make_policy("group-label"), config=ENGINE)
    assert np.all(result.first_scheduled_s == 0.0)


def test_a_simulator_fork_runs_on_alone(h200):
    trace = Trace("t", [req(i, 0.01 * i, tokens(40 + i % 3, 600), 12, group=i % 3) for i in range(12)])
    policy = make_policy("feather-rule")
    sim = Simulator(trace, h200, policy.make_order(), config=ENGINE)
    for _ in range(4):
        sim.apply(policy.decide(sim.next_admission()))
    fork, clock = sim.fork(), sim.now_s
    assert fork.trace is sim.trace and fork.kv is not sim.kv
    copy_policy = copy.deepcopy(policy)                             # the rule's floor state too
    while (point := fork.next_admission()) is not None:
        fork.apply(copy_policy.decide(point))
    assert sim.now_s == clock                                       # untouched by the fork's run
    while (point := sim.next_admission()) is not None:
        sim.apply(policy.decide(point))
    np.testing.assert_array_equal(sim.result().finish_s, fork.result().finish_s)


def test_rule_playout_never_finishes_later_than_the_rule_it_plays_out():
    """One step of policy iteration in a deterministic simulator: never worse than the steady-state
    rule on any trace, and better where another action pays (the CPU mix's overloaded regime)."""
    import traces

    cost_model, engine = load_cost_model("vllm-cpu"), EngineConfig(kv_capacity_tokens=5760)
    spec = "prefix-groups:num_requests=32,groups=8,prefix_tokens_min=256,prefix_tokens_max=1024,output_tokens_max=32"
    makespans = []
    for seed in range(3):
        trace = traces.resolve_workload(spec, seed=seed)
        rule, playout = (simulate(trace, cost_model, policy, config=engine).finish_s.max()
                         for policy in (FeatherRule.steady_state(), RulePlayout()))
        assert playout <= rule * (1 + 1e-9)
        makespans.append((rule, playout))
    assert any(playout < rule * (1 - 1e-3) for rule, playout in makespans)


def test_the_goodput_playout_never_meets_the_slo_for_fewer_requests_than_the_rule():
    """The same policy iteration on a terminal objective, the requests within the device's SLO."""
    import traces

    cost_model, engine = load_cost_model("vllm-cpu"), EngineConfig(kv_capacity_tokens=5760)
    slo = DEFAULT_SLOS[cost_model.device]
    spec = "prefix-groups:num_requests=32,groups=8,prefix_tokens_min=256,prefix_tokens_max=1024,output_tokens_max=32"
    met = []
    for seed in range(3):
        trace = traces.resolve_workload(spec, seed=seed)
        rule, playout = (int(slo.met(*simulate(trace, cost_model, policy, config=engine).latencies()).sum())
                         for policy in (FeatherRule.steady_state(), RulePlayout(objective="goodput")))
        assert playout >= rule
        met.append((rule, playout))
    assert any(playout > rule for rule, playout in met)
    assert make_policy("rule-playout-goodput").name == "rule-playout-goodput"
    sampled = make_policy("rule-playout-sampled-goodput")
    assert (sampled.name, sampled.samples, sampled.objective) == ("rule-playout-sampled-goodput",
                                                                  DEFAULT_PLAYOUT_SAMPLES, "goodput")
    with pytest.raises(ValueError, match="objective: one of finish, goodput"):
        RulePlayout(objective="latency")


def test_sampled_playouts_know_the_lengths_when_the_workload_has_only_one():
    """Every request of the trace has the same output length: each draw is the true future, so the
    sampled playouts decide exactly as the clairvoyant ones (which beat the rule here)."""
    import dataclasses

    import traces

    cost_model, engine = load_cost_model("vllm-cpu"), EngineConfig(kv_capacity_tokens=5760)
    spec = "prefix-groups:num_requests=32,groups=8,prefix_tokens_min=256,prefix_tokens_max=1024,output_tokens_max=32"
    trace = traces.resolve_workload(spec, seed=1)
    trace = Trace(trace.name, [dataclasses.replace(r, output_len=24) for r in trace.requests])
    rule, exact, sampled = (simulate(trace, cost_model, policy, config=engine).finish_s
                            for policy in (FeatherRule.steady_state(), RulePlayout(), RulePlayout(samples=2)))
    np.testing.assert_array_equal(sampled, exact)
    assert exact.max() < rule.max()


def test_sampled_output_lengths_exceed_what_each_request_emitted():
    trace = Trace("t", [req(i, 0.0, tokens(i, 300), output_len=n) for i, n in enumerate((1, 5, 9, 40))])
    sim = SimpleNamespace(trace=trace, emitted_tokens=lambda: np.array([0, 6, 39, 50]))
    draws = np.array([sampled_output_lengths(sim, np.random.default_rng(seed)) for seed in range(200)])
    assert set(draws[:, 0]) == {1, 5, 9, 40}                  # nothing emitted: any of the trace's lengths
    assert set(draws[:, 1]) == {9, 40} and set(draws[:, 2]) == {40}   # only those beyond what it emitted
    assert set(draws[:, 3]) == {51}                           # beyond every length: one more token
    np.testing.assert_array_equal(sampled_output_lengths(sim, np.random.default_rng(7)), draws[7])
    decision = SimpleNamespace(**vars(sim), step=5, num_decisions=2)
    assert playout_futures(decision, None) == [None]                     # the true lengths
    futures, again = playout_futures(decision, 3), playout_futures(decision, 3)
    assert len(futures) == 3 and all(np.array_equal(a, b) for a, b in zip(futures, again))   # seeded by the decision


def test_make_policy_names_and_errors():
    assert make_policy("rule-playout").name == "rule-playout"
    assert make_policy("rule-playout-sampled").samples == DEFAULT_PLAYOUT_SAMPLES
    with pytest.raises(ValueError, match="samples: at least 1"):
        RulePlayout(samples=0)
    for name in ("fcfs", "lpm", "dfs", "hrrn", "feather-rule", "feather-hold", "feather-resident", "group-label"):
        assert make_policy(name).name == name
    with pytest.raises(OSError, match="missing.onnx"):     # a policy file is loaded (and checked) when built
        make_policy("runs/missing.onnx")
    with pytest.raises(ValueError, match="feather-rule"):
        make_policy("sjf")
