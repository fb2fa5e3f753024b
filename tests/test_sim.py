"""The serving simulator and its prefix-cached KV pool: invariants, determinism, CLI."""

import json

import numpy as np
import pytest

import traces
from feather_gym.cli import main
from feather_gym.costmodel import load_cost_model
from feather_gym.kv_cache import PrefixKVCache
from feather_gym.observation import ADD, FEATURE_NAMES, OBS_CLIP, build_observation
from feather_gym.orderings import CHTOrder
from feather_gym.policies import make_policy
from feather_gym.simulator import EngineConfig, Simulator, simulate
from traces import Request, Trace

BS = EngineConfig.block_size


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
def test_kv_shared_blocks_count_once_and_cached_blocks_are_evicted_tail_first():
    kv = PrefixKVCache(6)
    a, b = [1, 2, 3], [1, 2, 4]
    kv.acquire(a, hits=0, anonymous=1)
    assert kv.used_blocks == 4
    hits, claim = kv.blocks_to_claim(b, total_blocks=3)
    assert (hits, claim) == (2, 1)                    # 1 and 2 are shared: only block 4 is new
    kv.acquire(b, hits=2, anonymous=0)
    assert kv.used_blocks == 5
    kv.release(a, anonymous=1)
    assert kv.used_blocks == 3 and kv.cached_blocks == 1   # block 3 stays cached
    kv.release(b, anonymous=0)
    assert kv.used_blocks == 0 and kv.cached_blocks == 4
    assert kv.cached_prefix([1, 2, 4]) == 3
    kv.grow(4)                                        # needs 2 evictions: the tails go first
    assert kv.cached_blocks == 2 and kv.cached_prefix([1, 2, 3]) == 2
    assert kv.used_blocks + kv.cached_blocks <= kv.capacity_blocks


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
        assert sim.kv.used_blocks + sim.kv.cached_blocks <= sim.kv.capacity_blocks
        assert sim.now_s >= last_now
        last_now = sim.now_s
        obs = point.observation
        assert obs.shape == (len(FEATURE_NAMES),) and obs.dtype == np.float32
        assert np.all((obs >= 0) & (obs <= OBS_CLIP))
        sim.apply(policy.decide(point))
    return sim, sim.result(), finishes


@pytest.mark.parametrize("policy_name", ["fcfs", "feather-rule", "dfs"])
def test_invariants_under_kv_pressure(h200, policy_name):
    trace = small_trace()
    config = EngineConfig(kv_capacity_tokens=12 * BS * 8, token_budget=2048, max_num_seqs=64)
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


def test_prompt_tokens_are_hits_or_prefilled_without_preemption(h200):
    trace = small_trace()
    sim, result, _ = run_checked(trace, h200, "fcfs", EngineConfig())
    assert result.num_preemptions == 0
    assert result.prefill_tokens + result.cached_prompt_tokens == sum(r.input_len for r in trace)
    assert result.cached_prompt_tokens > 0                    # the shared prefixes hit


def test_simulation_is_deterministic(h200):
    trace = small_trace(seed=3)
    runs = [simulate(trace, h200, make_policy("feather-rule")) for _ in range(2)]
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


def test_prefill_is_chunked_by_the_token_budget(h200):
    trace = Trace("long", [request(0, 0.0, tokens(1, 5000), 2)])
    result = simulate(trace, h200, make_policy("fcfs"), config=EngineConfig(token_budget=1024, max_num_seqs=8))
    assert result.num_steps == 5 + 1                         # ceil(5000 / 1024) prefill steps, one decode


def test_request_too_large_for_the_cache_is_rejected(h200):
    trace = Trace("t", [request(0, 0.0, tokens(2, 3000), 4), request(1, 0.1, tokens(3, 100), 4)])
    result = simulate(trace, h200, make_policy("fcfs"), config=EngineConfig(kv_capacity_tokens=2048))
    assert list(result.finished) == [False, True]
    assert result.metrics()["rejected"] == 1


def test_observation_reflects_the_candidate(h200):
    prefix = tokens(4, 10 * BS)
    reqs = [request(i, 0.0, np.concatenate([prefix, tokens(10 + i, 50)]), 20) for i in range(3)]
    reqs.append(request(3, 0.0, tokens(99, 10 * BS + 50), 20))
    sim = Simulator(Trace("t", reqs), h200, CHTOrder())
    point = sim.next_admission()                              # request 0 was admitted unasked
    assert point.batch_size == 1 and point.candidate in (1, 2)
    assert point.stats.chunk_loss == 0 and point.stats.shared_chunks == 10
    sim.apply(ADD)
    point = sim.next_admission()
    sim.apply(ADD)
    point = sim.next_admission()
    assert point.candidate == 3 and point.stats.chunk_loss == 10
    expected = build_observation(batch_size=3, chunk_loss=10, same_prefix_waiting=0, running_common_prefix=10,
                                 candidate_context_tokens=10 * BS + 50, candidate_cached_fraction=0.0,
                                 kv_utilisation=sim.kv.used_blocks / sim.kv.capacity_blocks, num_waiting=1,
                                 oldest_wait_s=0.0)
    np.testing.assert_allclose(point.observation, expected)


def test_build_observation_takes_features_by_name_in_order():
    import inspect

    assert tuple(inspect.signature(build_observation).parameters) == FEATURE_NAMES


# ---------------------------------------------------------------- CLI
def test_sim_compare_cli_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "bars.png"
    code = main(["sim", "compare", "--workload", "prefix-groups:groups=3,num_requests=40,rate=50",
                 "--profile", "h200", "--policies", "fcfs,feather-rule,oracle", "--json", "--plot", str(plot)])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(out["policies"]) == ["fcfs", "feather-rule", "oracle"]
    assert out["policies"]["fcfs"]["ratio_to_fcfs"] == 1.0
    for metrics in out["policies"].values():
        assert metrics["requests"] == 40 and metrics["throughput_tok_s"] > 0
    assert plot.stat().st_size > 1000


def test_sim_compare_cli_rejects_unknown_policy(capsys):
    code = main(["sim", "compare", "--workload", "no-sharing:num_requests=5", "--profile", "h200",
                 "--policies", "fcfs,nonsense"])
    assert code == 2 and "nonsense" in capsys.readouterr().err
