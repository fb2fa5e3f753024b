"""Held-out splits: trace files by arrival time (traces.split, traces.workload.split_spec), generators by seed."""

from __future__ import annotations

import pytest

import traces
from traces.split import time_window
from traces.workload import is_generated, resolve_workload, split_spec

GENERATED = "prefix-groups:groups=3,num_requests=60,rate=20"


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    """A generated trace written as a file: a recording that ignores the seed."""
    path = tmp_path_factory.mktemp("split") / "recorded.jsonl"
    traces.write_trace(resolve_workload(GENERATED, seed=5), path)
    return str(path)


def original_arrivals(part: traces.Trace, whole: traces.Trace) -> list[float]:
    by_id = {r.request_id: r.arrival_s for r in whole}
    return [by_id[r.request_id] for r in part]


def assert_eval_part_is_disjoint_and_later(spec: str, eval_fraction: float) -> tuple[traces.Trace, traces.Trace]:
    whole = resolve_workload(spec)
    train = resolve_workload(split_spec(spec, "train", eval_fraction), seed=1)
    held_out = resolve_workload(split_spec(spec, "eval", eval_fraction), seed=2)
    train_ids, eval_ids = {r.request_id for r in train}, {r.request_id for r in held_out}
    assert train_ids and eval_ids and not train_ids & eval_ids
    assert train_ids | eval_ids == {r.request_id for r in whole}                    # nothing lost at the boundary
    assert max(original_arrivals(train, whole)) < min(original_arrivals(held_out, whole))
    boundary = whole[0].arrival_s + (1 - eval_fraction) * whole.duration_s
    assert min(original_arrivals(held_out, whole)) >= boundary - 1e-9
    return train, held_out


@pytest.mark.parametrize("eval_fraction", [0.3, 0.5, 0.1])
def test_trace_file_eval_part_is_disjoint_from_and_later_than_training(trace_file, eval_fraction):
    train, held_out = assert_eval_part_is_disjoint_and_later(trace_file, eval_fraction)
    assert train[0].arrival_s == held_out[0].arrival_s == 0.0                      # each part starts at 0
    assert held_out.name.endswith(f"@{1 - eval_fraction:g}-1")


def test_trace_file_parts_ignore_the_seed(trace_file):
    spec = split_spec(trace_file, "eval")
    ids = [r.request_id for r in resolve_workload(spec, seed=1)]
    assert ids == [r.request_id for r in resolve_workload(spec, seed=2)]


@pytest.mark.skipif(traces.shared_trace_path("mooncake_conversation_trace.jsonl") is None,
                    reason="shared Mooncake trace not present")
def test_shared_mooncake_trace_split():
    train, held_out = assert_eval_part_is_disjoint_and_later("mooncake", 0.3)
    assert split_spec("mooncake", "eval") == "mooncake@0.7-1"
    assert len(held_out) > 1000 and len(train) > 2 * len(held_out)


def test_a_time_window_splits_within_itself_and_a_load_factor_stays_last(trace_file):
    assert split_spec(f"{trace_file}@0.2-0.6", "train") == f"{trace_file}@0.2-0.48"
    assert split_spec(f"{trace_file}@0.2-0.6", "eval") == f"{trace_file}@0.48-0.6"
    assert split_spec(f"{trace_file}@load=0.9", "eval") == f"{trace_file}@0.7-1@load=0.9"
    assert split_spec(f"{GENERATED}@load=0.9", "train") == f"{GENERATED}@load=0.9"
    window = resolve_workload(f"{trace_file}@0.2-0.6")
    parts = [resolve_workload(split_spec(f"{trace_file}@0.2-0.6", part)) for part in ("train", "eval")]
    assert [r.request_id for part in parts for r in part] == [r.request_id for r in window]   # disjoint, in order


def test_generators_keep_seed_splits():
    for part in ("train", "eval"):
        assert split_spec(GENERATED, part) == GENERATED
    assert is_generated(GENERATED) and is_generated(f"{GENERATED}@0-0.5")
    assert not is_generated("mooncake") and not is_generated("mooncake@0.7-1")
    a, b = resolve_workload(GENERATED, seed=10_001), resolve_workload(GENERATED, seed=1_000)
    assert [r.arrival_s for r in a] != [r.arrival_s for r in b]


def test_time_window_keeps_requests_and_shifts_arrivals(trace_file):
    whole = resolve_workload(trace_file)
    part = time_window(whole, 0.25, 0.75)
    kept = [r for r in whole if 0.25 * whole.duration_s <= r.arrival_s - whole[0].arrival_s < 0.75 * whole.duration_s]
    assert [r.request_id for r in part] == [r.request_id for r in kept]
    shift = kept[0].arrival_s
    assert [r.arrival_s for r in part] == [r.arrival_s - shift for r in kept]
    assert [(r.input_len, r.output_len, r.group) for r in part] == [(r.input_len, r.output_len, r.group) for r in kept]
    assert len(time_window(whole, 0, 1)) == len(whole)                            # the end 1 includes the last


@pytest.mark.parametrize("call, message", [
    (lambda f: split_spec(f, "test"), "one of train, eval"),
    (lambda f: split_spec(f, "eval", 1.0), "eval_fraction: must be in \\(0, 1\\)"),
    (lambda f: split_spec(f, "eval", 0.0), "eval_fraction: must be in \\(0, 1\\)"),
    (lambda f: resolve_workload(f"{f}@0.6-0.2"), "need 0 <= start < end <= 1"),
    (lambda f: resolve_workload(f"{f}@0.5-1.5"), "need 0 <= start < end <= 1"),
    (lambda f: resolve_workload(f"{f}@0.9999-0.99995"), "no request arrives"),
])
def test_split_errors_are_clear(trace_file, call, message):
    with pytest.raises(ValueError, match=message):
        call(trace_file)
