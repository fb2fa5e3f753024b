"""The foundation: the request/trace model, token synthesis and the `feather` umbrella."""

import logging

import numpy as np
import pytest

from feather_cli.main import LOGGED_PACKAGES, build_parser, log_progress, main
from traces.request import SYNTH_TOKEN_LOW, SYNTH_TOKEN_RANGE, Request, Trace, synthesise_tokens


def block_request(rid, ids, input_len, block_size=4, arrival=0.0):
    return Request(rid, arrival, input_len, 8, block_ids=np.array(ids), block_size=block_size)


def test_synthesised_tokens_follow_block_sharing():
    a = block_request("a", [7, 8, 9], input_len=11).tokens()
    b = block_request("b", [7, 8, 5], input_len=12).tokens()
    assert len(a) == 11 and len(b) == 12
    np.testing.assert_array_equal(a[:8], b[:8])            # equal blocks -> equal tokens
    assert np.all(a[8:11] != b[8:11])                       # a different block differs everywhere here
    assert a.min() >= SYNTH_TOKEN_LOW and a.max() < SYNTH_TOKEN_LOW + SYNTH_TOKEN_RANGE


def test_synthesis_is_deterministic_and_position_dependent():
    t1 = synthesise_tokens(np.array([42]), 64, 64)
    t2 = synthesise_tokens(np.array([42]), 64, 64)
    np.testing.assert_array_equal(t1, t2)
    assert len(set(t1.tolist())) > 60                      # not one token repeated


@pytest.mark.parametrize("kwargs, message", [
    (dict(input_len=0, output_len=1, token_ids=np.array([], dtype=np.int64)), "input_len"),
    (dict(input_len=2, output_len=0, token_ids=np.array([1, 2])), "output_len"),
    (dict(input_len=2, output_len=1), "exactly one"),
    (dict(input_len=3, output_len=1, token_ids=np.array([1, 2])), "token_ids"),
    (dict(input_len=9, output_len=1, block_ids=np.array([1, 2]), block_size=4), "need 3"),
    (dict(input_len=4, output_len=1, block_ids=np.array([1]), block_size=0), "block_size"),
])
def test_request_rejects_inconsistent_records(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Request("r", 0.0, **kwargs)


def test_trace_rejects_time_going_backwards_and_duplicate_ids():
    r = lambda rid, t: Request(rid, t, 1, 1, token_ids=np.array([1]))
    with pytest.raises(ValueError, match="arrives before"):
        Trace("t", [r("a", 1.0), r("b", 0.5)])
    with pytest.raises(ValueError, match="not unique"):
        Trace("t", [r("a", 0.0), r("a", 1.0)])
    trace = Trace("t", [r("a", 0.0), r("b", 2.5)])
    assert len(trace) == 2 and trace.duration_s == 2.5 and trace[1].request_id == "b"


def test_umbrella_lists_every_group_and_hides_the_old_names():
    help_text = build_parser().format_help()
    for group in ("train", "export", "trace", "bench", "placement", "profile", "sim", "hybrid", "replay"):
        assert f"\n    {group}" in help_text
    assert "\n    serve" not in help_text


def test_user_errors_exit_2_without_traceback(capsys, tmp_path):
    missing = tmp_path / "nope.jsonl"
    assert main(["trace", "stats", str(missing)]) == 2
    assert "feather: error:" in capsys.readouterr().err


def test_progress_logs_on_stderr_once_and_keeps_stdout_for_the_report(capsys):
    log_progress()
    log_progress()                       # idempotent: one line per record, not two
    logging.getLogger("deploy.bench.harness").info("round %d %s: done", 0, "fcfs")
    logging.getLogger("trainer.train").debug("too fine to print")
    logging.getLogger("vllm.engine").info("another project's record")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("round 0 fcfs: done") == 1
    assert "too fine" not in captured.err and "another project" not in captured.err
    assert {"deploy", "feather_gym", "trainer"} <= set(LOGGED_PACKAGES)
