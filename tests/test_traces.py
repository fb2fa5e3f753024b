"""Trace files: format detection, the three loaders, bad input, skip_bad, the native round trip,
the shared real traces, workload specs and the ``feather trace`` CLI."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import traces
from feather_cli.main import main
from traces import Request, Trace, TraceFormatError, load_trace, resolve_workload, write_trace
from traces.stats import trace_stats

MOONCAKE = [
    {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
    {"timestamp": 0, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
    {"timestamp": 1500, "input_length": 512, "output_length": 9, "hash_ids": [0]},
]
AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,1396,109
2023-11-16 18:15:50.9951690,879,55
"""


def write_lines(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def assert_same_requests(a: Trace, b: Trace):
    assert (a.name, a.source, a.block_size, len(a)) == (b.name, b.source, b.block_size, len(b))
    for x, y in zip(a, b):
        assert (x.request_id, x.arrival_s, x.input_len, x.output_len, x.block_size, x.session, x.group) == \
               (y.request_id, y.arrival_s, y.input_len, y.output_len, y.block_size, y.session, y.group)
        for field in ("token_ids", "block_ids"):
            if getattr(x, field) is None:
                assert getattr(y, field) is None
            else:
                np.testing.assert_array_equal(getattr(x, field), getattr(y, field))


# ---- loaders on inline samples ------------------------------------------------------------

def test_mooncake_sample_keeps_block_ids(tmp_path):
    trace = load_trace(write_lines(tmp_path, "mc.jsonl", MOONCAKE))
    assert trace.block_size == 512 and len(trace) == 3 and trace.skipped_lines == 0
    assert [r.arrival_s for r in trace] == [0.0, 0.0, 1.5]
    assert [r.output_len for r in trace] == [5, 7, 9]
    np.testing.assert_array_equal(trace[1].block_ids, [0, 1, 2])
    assert trace[0].token_ids is None and len(trace[0].tokens()) == 1000
    np.testing.assert_array_equal(trace[0].tokens()[:512], trace[2].tokens())   # shared block 0
    # infinite cache, full 512-token blocks only: request 0 caches block 0 (its block 1 is
    # partial, never cached); requests 1 and 2 each hit block 0
    assert trace_stats(trace)["prefix_sharing_ratio"] == pytest.approx(2 * 512 / 2612)


def test_azure_sample_has_relative_times_and_unique_content(tmp_path):
    path = tmp_path / "az.csv"
    path.write_text(AZURE)
    trace = load_trace(path)
    assert [r.input_len for r in trace] == [374, 1396, 879]
    assert [r.output_len for r in trace] == [44, 109, 55]
    assert [r.arrival_s for r in trace] == pytest.approx([0.0, 4.314579, 4.314579])
    ids = np.concatenate([r.block_ids for r in trace])
    assert len(np.unique(ids)) == len(ids) == 1 + 3 + 2
    assert trace_stats(trace, block_size=16)["prefix_sharing_ratio"] == 0.0


def test_plain_token_jsonl_is_read_without_a_header(tmp_path):
    lines = [{"timestamp": 0.5, "token_ids": [1, 2, 3, 4], "output_length": 8},
             {"timestamp": 1.25, "token_ids": [1, 2, 3, 9, 9], "output_length": 2, "id": "b", "session": "s1"}]
    trace = load_trace(write_lines(tmp_path, "mine.jsonl", [json.dumps(line) for line in lines]))
    assert [r.arrival_s for r in trace] == [0.5, 1.25]
    assert [r.input_len for r in trace] == [4, 5]
    assert [r.output_len for r in trace] == [8, 2]
    assert trace.requests[1].token_ids.tolist() == [1, 2, 3, 9, 9]
    assert trace.requests[1].request_id == "b" and trace.requests[1].session == "s1"
    assert trace.block_size is None


@pytest.mark.parametrize("record, field, problem", [
    ({"timestamp": 0, "token_ids": [], "output_length": 1}, "token_ids", "at least one token id"),
    ({"timestamp": 0, "token_ids": [1, 2]}, "output_length", "missing field"),
    ({"timestamp": -1, "token_ids": [1, 2], "output_length": 1}, "timestamp", "negative time"),
    ({"timestamp": 0, "token_ids": [1, "x"], "output_length": 1}, "token_ids", "64-bit integers"),
])
def test_plain_token_jsonl_errors_name_the_field(tmp_path, record, field, problem):
    with pytest.raises(TraceFormatError, match=problem) as error:
        load_trace(write_lines(tmp_path, "bad.jsonl", [json.dumps(record)]))
    assert error.value.field == field


def test_unrecognised_and_empty_files(tmp_path):
    with pytest.raises(TraceFormatError, match="unrecognised trace format"):
        load_trace(write_lines(tmp_path, "x.txt", ["hello,world"]))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TraceFormatError, match="empty trace file"):
        load_trace(tmp_path / "empty.jsonl")


# ---- bad input -----------------------------------------------------------------------------

GOOD = {"timestamp": 100, "input_length": 600, "output_length": 3, "hash_ids": [4, 5]}

BAD_MOONCAKE = [
    ('{"timestamp": 200, "input_length": 6', None, "malformed JSON"),
    ({k: v for k, v in GOOD.items() if k != "output_length"} | {"timestamp": 200}, "output_length", "missing field"),
    (GOOD | {"timestamp": 200, "input_length": -5}, "input_length", "negative length"),
    (GOOD | {"timestamp": 200, "output_length": -1}, "output_length", "negative length"),
    (GOOD | {"timestamp": 50}, "timestamp", "time goes backwards"),
    (GOOD | {"timestamp": 200, "input_length": 1500}, "hash_ids", "too short: 2 ids where 3"),
    (GOOD | {"timestamp": 200, "hash_ids": [1, 2, 3]}, "hash_ids", "too long"),
    (GOOD | {"timestamp": 200, "hash_ids": ["a", "b"]}, "hash_ids", "list of 64-bit integers"),
    (GOOD | {"timestamp": "soon"}, "timestamp", "finite number"),
    ("[1, 2]", None, "expected a JSON object"),
]


@pytest.mark.parametrize("bad, field, message", BAD_MOONCAKE)
def test_mooncake_bad_line_names_file_line_and_field(tmp_path, bad, field, message):
    path = write_lines(tmp_path, "mc.jsonl", [GOOD, bad, GOOD | {"timestamp": 300}])
    with pytest.raises(TraceFormatError, match=message) as info:
        load_trace(path)
    err = info.value
    assert (err.path, err.line, err.field) == (str(path), 2, field)
    assert str(path) in str(err) and "line 2" in str(err)
    assert field is None or f"field '{field}'" in str(err)
    skipped = load_trace(path, skip_bad=True)
    assert len(skipped) == 2 and skipped.skipped_lines == 1


@pytest.mark.parametrize("row, field, message", [
    ("2023-11-16 18:15:47.0,-3,10", "ContextTokens", "negative length"),
    ("2023-11-16 18:15:47.0,30,", "GeneratedTokens", "integer length"),
    ("2023-11-16 18:15:47.0,30", None, "expected 3 comma-separated fields"),
    ("yesterday,30,10", "TIMESTAMP", "not a datetime"),
    ("2023-11-16 18:15:40.0,30,10", "TIMESTAMP", "time goes backwards"),
])
def test_azure_bad_row(tmp_path, row, field, message):
    path = tmp_path / "az.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,10,10\n{row}\n")
    with pytest.raises(TraceFormatError, match=message) as info:
        load_trace(path)
    assert (info.value.line, info.value.field) == (3, field)
    assert load_trace(path, skip_bad=True).skipped_lines == 1


def test_azure_header_missing_a_column(tmp_path):
    path = tmp_path / "az.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.0,10\n")
    with pytest.raises(TraceFormatError, match="missing column") as info:
        load_trace(path)
    assert (info.value.line, info.value.field) == (1, "GeneratedTokens")


HEADER = {"format": "feather-trace", "version": 1, "name": "t", "source": "", "block_size": None}
TOKENS = {"id": "a", "arrival_s": 1.0, "input_len": 3, "output_len": 2, "token_ids": [5, 6, 7]}


@pytest.mark.parametrize("bad, field, message", [
    ({k: v for k, v in TOKENS.items() if k != "id"}, "id", "missing field"),
    (TOKENS | {"id": "b", "input_len": 4}, "token_ids", "too short"),
    (TOKENS | {"id": "b", "input_len": -4}, "input_len", "negative length"),
    (TOKENS | {"id": "b", "arrival_s": 0.5}, "arrival_s", "time goes backwards"),
    (TOKENS | {"id": "b", "arrival_s": -1.0}, "arrival_s", "negative time"),
    (TOKENS, "id", "duplicate request id"),
    (TOKENS | {"id": "b", "block_ids": [1], "block_size": 4}, "token_ids", "exactly one of"),
    ({"id": "b", "arrival_s": 2, "input_len": 9, "output_len": 1, "block_ids": [1, 2], "block_size": 4},
     "block_ids", "too short"),
])
def test_native_bad_line(tmp_path, bad, field, message):
    path = write_lines(tmp_path, "n.jsonl", [HEADER, TOKENS, bad])
    with pytest.raises(TraceFormatError, match=message) as info:
        load_trace(path)
    assert (info.value.line, info.value.field) == (3, field)


def test_native_bad_header(tmp_path):
    with pytest.raises(TraceFormatError, match="unsupported version") as info:
        load_trace(write_lines(tmp_path, "n.jsonl", [HEADER | {"version": 9}, TOKENS]))
    assert (info.value.line, info.value.field) == (1, "version")
    with pytest.raises(TraceFormatError, match="malformed JSON") as info:
        load_trace(write_lines(tmp_path, "m.jsonl", ['{"format": "feather-trace", "version"', TOKENS]))
    assert info.value.line == 1


def test_skip_bad_counts_every_skipped_line_and_cli_reports_it(tmp_path, capsys):
    lines = [GOOD, "{oops", GOOD | {"timestamp": 50}, GOOD | {"timestamp": 200}, GOOD | {"input_length": -1},
             GOOD | {"timestamp": 250}]
    path = write_lines(tmp_path, "mc.jsonl", lines)
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    assert info.value.line == 2
    trace = load_trace(path, skip_bad=True)
    assert len(trace) == 3 and trace.skipped_lines == 3
    assert [r.request_id for r in trace] == ["0", "3", "5"]          # ids are data-line indices
    assert main(["trace", "stats", str(path), "--skip-bad", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "skipped 3 bad line(s)" in err
    assert json.loads(out.strip().splitlines()[-1])["skipped_lines"] == 3
    assert main(["trace", "stats", str(path)]) == 2                # strict by default
    assert "line 2" in capsys.readouterr().err


# ---- the native round trip -----------------------------------------------------------------

@st.composite
def small_traces(draw):
    n = draw(st.integers(0, 6))
    gaps = draw(st.lists(st.floats(0, 1e3, allow_nan=False), min_size=n, max_size=n))
    requests = []
    for i, arrival in enumerate(np.cumsum(gaps).tolist()):
        input_len = draw(st.integers(1, 40))
        label = st.none() | st.text(min_size=1, max_size=5)
        prompt = ({"token_ids": np.array(draw(st.lists(st.integers(0, 2**40), min_size=input_len,
                                                       max_size=input_len)), dtype=np.int64)}
                  if draw(st.booleans()) else
                  {"block_size": (bs := draw(st.integers(1, 16))),
                   "block_ids": np.array(draw(st.lists(st.integers(-2**62, 2**62), min_size=-(-input_len // bs),
                                                       max_size=-(-input_len // bs))), dtype=np.int64)})
        requests.append(Request(draw(st.text(min_size=1, max_size=4).map(lambda s, i=i: f"{i}{s}")), arrival,
                                input_len, draw(st.integers(1, 10**6)), session=draw(label), group=draw(label),
                                **prompt))
    return Trace(draw(st.text(max_size=8)), requests, source=draw(st.text(max_size=8)),
                 block_size=draw(st.none() | st.integers(1, 64)))


@settings(max_examples=60, deadline=None)
@given(trace=small_traces())
def test_native_round_trip(tmp_path_factory, trace):
    path = tmp_path_factory.mktemp("rt") / "t.jsonl"
    write_trace(trace, path)
    assert_same_requests(trace, load_trace(path))


def test_generated_and_mooncake_traces_round_trip(tmp_path):
    generated = traces.generate("multi-turn-chat", seed=3, num_requests=30)
    write_trace(generated, tmp_path / "g.jsonl")
    assert_same_requests(generated, load_trace(tmp_path / "g.jsonl"))
    mooncake = load_trace(write_lines(tmp_path, "mc.jsonl", MOONCAKE))
    write_trace(mooncake, tmp_path / "m.jsonl")
    assert_same_requests(mooncake, load_trace(tmp_path / "m.jsonl"))


# ---- the shared real traces ----------------------------------------------------------------

def shared(name):
    path = traces.shared_trace_path(traces.SHARED_TRACES[name])
    if path is None:
        pytest.skip(f"shared trace {name} is absent (looked in ../shared/traces or $FEATHER_SHARED_DIR/traces)")
    return path


def test_shared_mooncake_trace():
    trace = load_trace(shared("mooncake"))
    stats = trace_stats(trace, block_size=512)
    assert stats["num_requests"] == 12_031 and stats["skipped_lines"] == 0
    assert stats["prefix_sharing_ratio"] == pytest.approx(0.37, abs=0.01)   # README: 36.6% of blocks hit
    assert stats["input_len_tokens_mean"] == pytest.approx(12_035, abs=1)    # README: mean input 12,035
    assert stats["input_len_tokens_p50"] == 6_909 and stats["output_len_tokens_mean"] == pytest.approx(343, abs=1)
    assert all(r.block_ids[0] == 0 for r in trace)                           # README: every request starts so
    assert 3_500 < trace.duration_s < 3_600


def test_shared_azure_trace():
    trace = load_trace(shared("azure-conv"))
    stats = trace_stats(trace, block_size=512)
    assert stats["num_requests"] == 19_366 and stats["skipped_lines"] == 0
    assert stats["prefix_sharing_ratio"] == 0.0 and stats["prefix_groups"] == 0
    assert trace[0].arrival_s == 0.0 and 3_400 < trace.duration_s < 3_700
    assert stats["input_len_tokens_p50"] == 1020 and stats["output_len_tokens_p50"] == 129


def test_shared_trace_path_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FEATHER_SHARED_DIR", str(tmp_path))
    assert traces.shared_trace_path("mooncake_conversation_trace.jsonl") is None
    with pytest.raises(FileNotFoundError, match="FEATHER_SHARED_DIR"):
        resolve_workload("mooncake")
    (tmp_path / "traces").mkdir()
    write_lines(tmp_path / "traces", "mooncake_conversation_trace.jsonl", MOONCAKE)
    assert traces.shared_trace_path("mooncake_conversation_trace.jsonl") == \
        tmp_path / "traces" / "mooncake_conversation_trace.jsonl"
    assert len(resolve_workload("mooncake")) == 3


# ---- workload specs ------------------------------------------------------------------------

def test_resolve_workload_generator_specs():
    trace = resolve_workload("prefix-groups:groups=5,prefix_tokens=5000,rate=100,num_requests=50", seed=4)
    assert len(trace) == 50 and {r.group for r in trace} <= {f"group{g}" for g in range(5)}
    again = traces.generate("prefix-groups", seed=4, groups=5, prefix_tokens=5000, rate=100.0, num_requests=50)
    assert_same_requests(trace, again)
    spec, seed = trace.source.rsplit(" seed=", 1)                # the source is a spec that regenerates it
    assert_same_requests(trace, resolve_workload(spec, seed=int(seed)))
    assert resolve_workload("prefix-groups:prefix_tokens=None,num_requests=3").source.startswith("prefix-groups:")
    assert len(resolve_workload("no-sharing:num_requests=7")) == 7


def test_with_params_sets_a_generators_parameters_in_place_or_appended():
    from traces.workload import with_params

    spec = with_params("prefix-groups:num_requests=32,groups=4,rate=1000", num_requests=256, prefix_tokens=64)
    assert spec == "prefix-groups:num_requests=256,groups=4,rate=1000,prefix_tokens=64"
    assert len(resolve_workload(spec)) == 256
    assert with_params("no-sharing", num_requests=5) == "no-sharing:num_requests=5"
    for bad, message in (("mooncake", "not a generator"), ("no-sharing:groups=2", "valid keys"),
                         ("prefix-groups:groups", "bad parameter")):
        with pytest.raises(ValueError, match=message):
            with_params(bad, num_requests=5)
    with pytest.raises(ValueError, match="valid keys"):
        with_params("no-sharing", groups=2)


def test_resolve_workload_file(tmp_path):
    path = write_lines(tmp_path, "mc.jsonl", MOONCAKE)
    assert len(resolve_workload(str(path))) == 3


@pytest.mark.parametrize("spec, message", [
    ("nonsense", "generator kind \\(prefix-groups, long-doc-qa, tool-agent, multi-turn-chat, no-sharing"),
    ("prefix-groups:colour=red", "valid keys: num_requests, groups"),
    ("prefix-groups:groups", "bad parameter"),
    ("prefix-groups:groups=five", "groups expects int"),
    ("prefix-groups:homogeneity=2", "homogeneity must be in"),
    ("multi-turn-chat:turns_min=5,turns_max=4", "turns_min <= turns_max"),
    ("tool-agent:rate=3", "valid keys"),
    ("no-sharing:num_requests=-1", "num_requests must be >= 1, got -1"),
    ("tool-agent:call_gap_s=-1", "call_gap_s must be >= 0, got -1"),
    ("tool-agent:tools_per_task=65", "need tools_per_task <= tool_pool"),
])
def test_resolve_workload_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_workload(spec)


def test_generate_rejects_unknown_kind_and_keys():
    with pytest.raises(ValueError, match="valid kinds: prefix-groups"):
        traces.generate("bogus")
    with pytest.raises(ValueError, match="unknown parameter\\(s\\) bogus; valid: num_requests"):
        traces.generate("no-sharing", bogus=1)


# ---- CLI -----------------------------------------------------------------------------------

def test_cli_gen_then_stats(tmp_path, capsys):
    out = tmp_path / "pg.jsonl"
    assert main(["trace", "gen", "prefix-groups", "--seed", "2", "--num-requests", "40",
                 "--param", "groups=3", "--param", "prefix_tokens=1024", "-o", str(out)]) == 0
    capsys.readouterr()
    assert_same_requests(load_trace(out), traces.generate("prefix-groups", seed=2, num_requests=40, groups=3,
                                                          prefix_tokens=1024))
    assert main(["trace", "stats", str(out), "--block-size", "256", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats["num_requests"] == 40 and stats["block_size_tokens"] == 256
    assert stats["prefix_groups"] == 3 and stats["load_s"] >= 0 and stats["stats_s"] >= 0
    assert main(["trace", "stats", "tool-agent:num_requests=10"]) == 0
    assert "prefix_sharing_ratio" in capsys.readouterr().out


json_values = st.recursive(st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.just(10**400) | st.floats() |
                           st.text(max_size=5), lambda inner: st.lists(inner, max_size=4), max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from(sorted(GOOD)), value=json_values)
def test_any_field_value_loads_or_raises_trace_format_error(tmp_path_factory, field, value):
    path = write_lines(tmp_path_factory.mktemp("fz"), "mc.jsonl", [GOOD, GOOD | {field: value}])
    try:
        trace = load_trace(path)
    except TraceFormatError as err:
        # a bad value is named, or the field it disagrees with (input_length vs hash_ids)
        assert err.line == 2 and (err.field in (field, None) or {field, err.field} == {"input_length", "hash_ids"})
    else:
        assert len(trace) == 2
