"""Generators: determinism, exact sizes, and the published statistics each one claims."""

from collections import defaultdict

import numpy as np
import pytest

import traces
from traces.generators import PrefixGroups, unit_sizes
from traces.stats import trace_stats


def common_prefix_len(prompts):
    """Length of the prefix shared by every prompt (token ids)."""
    shortest = min(map(len, prompts))
    equal = np.all([p[:shortest] == prompts[0][:shortest] for p in prompts[1:]], axis=0)
    return shortest if np.all(equal) else int(np.argmin(equal))


def by_label(trace, label):
    units = defaultdict(list)
    for r in trace:
        units[getattr(r, label)].append(r)
    return units


def rate(trace):
    return (len(trace) - 1) / trace.duration_s


@pytest.mark.parametrize("kind", traces.GENERATOR_KINDS)
def test_generators_are_deterministic_and_exactly_sized(kind):
    a = traces.generate(kind, seed=7, num_requests=60)
    b = traces.generate(kind, seed=7, num_requests=60)
    c = traces.generate(kind, seed=8, num_requests=60)
    assert len(a) == len(b) == len(c) == 60
    for x, y in zip(a, b):
        assert (x.request_id, x.arrival_s, x.output_len, x.session, x.group) == \
               (y.request_id, y.arrival_s, y.output_len, y.session, y.group)
        np.testing.assert_array_equal(x.tokens(), y.tokens())
    assert any(not np.array_equal(x.tokens(), y.tokens()) for x, y in zip(a, c))
    assert all(r.token_ids.dtype == np.int64 for r in a)
    assert [r.request_id for r in a] == [str(i) for i in range(60)]
    assert a.source.startswith(f"{kind}:") and a.source.endswith("seed=7")


def test_unit_sizes_sum_exactly_and_only_the_last_is_cut():
    rng = np.random.default_rng(0)
    for total in (1, 2, 7, 100, 1001):
        sizes = unit_sizes(rng, total, 3, 5)
        assert sizes.sum() == total and np.all((sizes[:-1] >= 3) & (sizes[:-1] <= 5)) and 1 <= sizes[-1] <= 5


def test_prefix_groups_claims():
    gen = PrefixGroups(num_requests=1000, groups=8, rate=20.0)
    trace = gen.generate(seed=1)
    groups = by_label(trace, "group")
    assert len(groups) == 8 and trace_stats(trace, block_size=16)["prefix_groups"] == 8
    for members in groups.values():
        prompts = [r.tokens() for r in members]
        prefix = common_prefix_len(prompts)
        assert 1000 <= prefix <= 10_000                                   # shared prefix 1K-10K
        assert all(32 <= len(p) - prefix <= 512 for p in prompts)         # unique suffix
    outputs = [r.output_len for r in trace]
    assert min(outputs) >= 1 and max(outputs) <= 200 and np.mean(outputs) == pytest.approx(100.5, rel=0.1)
    assert rate(trace) == pytest.approx(20.0, rel=0.1)                    # Poisson at the given rate
    fixed = traces.generate("prefix-groups", groups=3, prefix_tokens=5000, num_requests=60)
    assert {common_prefix_len([r.tokens() for r in m]) for m in by_label(fixed, "group").values()} == {5000}


@pytest.mark.parametrize("homogeneity", [0.0, 0.5, 0.9, 1.0])
def test_prefix_groups_homogeneity_knob(homogeneity):
    groups = 8
    gen = PrefixGroups(num_requests=2000, groups=groups, homogeneity=homogeneity)
    sequence = gen.group_sequence(np.random.default_rng(3))
    same = np.mean(sequence[1:] == sequence[:-1])
    assert same == pytest.approx(homogeneity + (1 - homogeneity) / groups, abs=0.04)
    if homogeneity < 1:                                                    # groups stay equally popular
        shares = np.bincount(sequence, minlength=groups) / len(sequence)
        p = 1 / groups                   # 4 sigma of a share over a chain with runs of mean 1/(1-h)
        sigma = np.sqrt(p * (1 - p) / len(sequence) * (1 + homogeneity) / (1 - homogeneity))
        assert np.all(np.abs(shares - p) < 4 * sigma)


def test_long_doc_qa_claims():
    trace = traces.generate("long-doc-qa", seed=2, num_requests=400)
    docs = by_label(trace, "group")
    counts = sorted(len(m) for m in docs.values())
    assert all(8 <= c <= 20 for c in counts[1:]) and 1 <= counts[0] <= 20   # only the last doc may be cut
    for members in docs.values():
        if len(members) < 2:
            continue
        prompts = [r.tokens() for r in members]
        doc = common_prefix_len(prompts)
        assert 5_000 <= doc <= 40_000
        assert all(16 <= len(p) - doc <= 128 for p in prompts)
    assert rate(trace) == pytest.approx(2.0, rel=0.15)
    assert trace_stats(trace, block_size=16)["prefix_groups"] == len(docs)


def test_tool_agent_claims():
    trace = traces.generate("tool-agent", seed=3, num_requests=800)
    system = common_prefix_len([r.tokens() for r in trace])
    assert system == 430                                                  # one shared system prompt
    tasks = by_label(trace, "session")
    calls = sorted(len(m) for m in tasks.values())
    assert all(3 <= c <= 5 for c in calls[1:]) and calls[0] >= 1
    first_prompts = []
    for members in tasks.values():
        first_prompts.append(members[0].input_len)
        for prev, nxt in zip(members, members[1:]):                      # a growing context
            np.testing.assert_array_equal(nxt.tokens()[:prev.input_len], prev.tokens())
            assert 64 <= nxt.input_len - prev.input_len - prev.output_len <= 512   # tool observation
            assert 16 <= prev.output_len <= 128
    tools_and_query = np.array(first_prompts) - 430
    assert np.mean(tools_and_query) == pytest.approx(6 * 200 + 96, rel=0.1)    # ~1.2K of tools + query
    stats = trace_stats(trace, block_size=16)
    assert stats["prefix_sharing_ratio"] > 0.5


def test_tool_agent_popular_tools_are_shared_beyond_the_system_prompt():
    trace = traces.generate("tool-agent", seed=4, num_requests=400)
    firsts = [m[0].tokens() for m in by_label(trace, "session").values()]
    # the most popular tool (Zipf rank 1) is chosen by most tasks and listed first
    with_top_tool = max(sum(np.array_equal(f[430:530], g[430:530]) for g in firsts) for f in firsts)
    assert with_top_tool > 0.5 * len(firsts)


def test_multi_turn_chat_claims():
    trace = traces.generate("multi-turn-chat", seed=5, num_requests=3000)
    conversations = by_label(trace, "session")
    turns = sorted(len(m) for m in conversations.values())
    assert all(3 <= t <= 7 for t in turns[1:])
    user_tokens, assistant_tokens = [], []
    for members in conversations.values():
        user_tokens.append(members[0].input_len)
        for prev, nxt in zip(members, members[1:]):                      # prompt = whole history
            np.testing.assert_array_equal(nxt.tokens()[:prev.input_len], prev.tokens())
            user_tokens.append(nxt.input_len - prev.input_len - prev.output_len)
        assistant_tokens += [r.output_len for r in members]
    assert min(user_tokens) >= 1
    assert np.mean(user_tokens) == pytest.approx(96, rel=0.1)
    assert np.mean(assistant_tokens) == pytest.approx(323, rel=0.1)


def test_no_sharing_claims():
    trace = traces.generate("no-sharing", seed=6, num_requests=2000)
    inputs = [r.input_len for r in trace]
    outputs = [r.output_len for r in trace]
    assert np.median(inputs) == pytest.approx(1020, rel=0.1) and max(inputs) <= 14_050
    assert np.percentile(inputs, 90) == pytest.approx(2735, rel=0.1)
    assert np.median(outputs) == pytest.approx(129, rel=0.1) and max(outputs) <= 1000
    assert np.percentile(outputs, 90) == pytest.approx(424, rel=0.1)
    assert rate(trace) == pytest.approx(5.5, rel=0.1)
    for block_size in (16, 512):
        stats = trace_stats(trace, block_size=block_size)
        assert stats["prefix_sharing_ratio"] == 0.0 and stats["prefix_groups"] == 0
    small = traces.generate("no-sharing", seed=6, num_requests=300)
    assert trace_stats(small, block_size=4)["prefix_sharing_ratio"] == 0.0
