"""The online loop without an engine: step composition, the step log (ring, rotation, a failing
disk), the policy file's hot swap, and the cost-model refit from logged steps (CLI included).

The live-engine side is in test_online_loop_live.py.
"""

from __future__ import annotations

import json
import logging
import shutil
from types import SimpleNamespace

import deploy_policies as policies
import numpy as np
import pytest

from feather_gym.costmodel.refit import LiveStep, read_step_logs, refit_profile

BLOCK = 16


def tokens(*pieces: int) -> np.ndarray:
    return np.concatenate([np.full(BLOCK, 300 + p) + np.arange(BLOCK) for p in pieces])


def live_step(step: int, seconds: float = 0.1, *, decode=(0, 0, 0, 0), chunks=(), decisions=()) -> LiveStep:
    b, total, unique, groups = decode
    return LiveStep(step=step, time_unix_s=1000.0 + step, step_wall_s=seconds, step_cpu_s=seconds * 0.9,
                    decode_requests=b, decode_kv_tokens=total, decode_unique_kv_tokens=unique, decode_groups=groups,
                    prefill_chunks=[list(c) for c in chunks], decisions=list(decisions))


# --- composition --------------------------------------------------------------------------------
def test_step_composition_counts_decodes_shared_blocks_groups_and_prefill_chunks():
    from deploy.step_log import step_composition
    from deploy.vllm_request import vllm_request

    prompts = {"a": (1, 2, 3), "b": (1, 2, 4), "c": (7, 8), "d": (1, 2, 5, 6, 9), "e": (11,)}
    requests = {rid: vllm_request(rid, tokens(*p), block_size=BLOCK, arrival_time=0.0) for rid, p in prompts.items()}
    scheduled = {"a": 1, "b": 1, "c": 1, "d": 32, "e": 1}
    before = {"a": 48, "b": 48, "c": 40, "d": 16, "e": 10}   # a, b, c decode (c past its prompt); d, e prefill
    for rid, request in requests.items():
        request.num_computed_tokens = before[rid] + scheduled[rid]   # as after vLLM's schedule()
    requests["c"].append_output_token_ids(list(range(9)))             # c: 32 prompt + 9 generated
    composition = step_composition(SimpleNamespace(num_scheduled_tokens=scheduled), requests, BLOCK)
    assert composition["decode_requests"] == 3
    assert composition["decode_kv_tokens"] == 49 + 49 + 41
    # a and b share blocks (1, 2): 3 full blocks each, 4 distinct; c: 2 full blocks + 9 tail tokens
    assert composition["decode_unique_kv_tokens"] == (4 + 2) * BLOCK + 1 + 1 + 9
    assert composition["decode_groups"] == 2                                       # {a, b}, {c}
    assert composition["prefill_chunks"] == [[1, 10], [32, 16]]                        # ascending


# --- the log --------------------------------------------------------------------------------------
def test_ring_is_bounded_and_records_round_trip_through_the_file(tmp_path):
    from deploy.step_log import StepLog

    log = StepLog(ring_steps=3, path=tmp_path / "steps.jsonl")
    for step in range(5):
        out = object()
        log.begin(out, live_step(step, decisions=[[[0.5, 1.0], 1]]), StepLog.clock())
        record = log.end(out)
        assert record.step_wall_s >= 0 and record.step_cpu_s >= 0
    assert log.end(object()) is None                               # never begun: nothing
    assert [r.step for r in log.recent()] == [2, 3, 4] and log.steps == 5
    log.close()
    steps, skipped = read_step_logs([tmp_path / "steps.jsonl"])
    assert [s.step for s in steps] == list(range(5)) and skipped == 0
    assert steps[0].decisions == [[[0.5, 1.0], 1]]


def test_file_rotates_at_its_size_bound_and_keeps_the_backups(tmp_path, monkeypatch):
    from deploy.step_log import StepLog

    monkeypatch.setattr(StepLog, "clock", staticmethod(lambda: (0.5, 0.5)))   # equal lines
    path = tmp_path / "steps.jsonl"
    record = live_step(0)
    record.step_wall_s = record.step_cpu_s = 0.5
    line = len(record.to_json()) + 1
    log = StepLog(ring_steps=0, path=path, max_bytes=3 * line, backups=2)
    assert log.enabled
    for step in range(10):
        out = object()
        log.begin(out, live_step(step), (0.0, 0.0))
        log.end(out)
    log.close()
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["steps.jsonl", "steps.jsonl.1", "steps.jsonl.2"]
    assert all(f.stat().st_size <= 3 * line for f in files)
    steps, _ = read_step_logs(files)
    assert [s.step for s in steps] == list(range(3, 10))          # [3-5] [6-8] [9]: the oldest dropped
    assert not StepLog(ring_steps=0).enabled


@pytest.mark.parametrize("where", ["full disk", "unwritable path"])
def test_a_failing_file_warns_once_and_the_ring_goes_on(tmp_path, caplog, where):
    from deploy.step_log import StepLog

    if where == "full disk":
        path = "/dev/full"                                           # every write: ENOSPC
    else:
        (tmp_path / "a-file").write_text("")
        path = tmp_path / "a-file" / "steps.jsonl"                   # its folder is a file
    log = StepLog(ring_steps=10, path=path)
    with caplog.at_level(logging.WARNING, logger="deploy.step_log"):
        for step in range(4):
            out = object()
            log.begin(out, live_step(step), StepLog.clock())
            log.end(out)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "serving and the in-memory log go on" in warnings[0].getMessage()
    assert len(log.recent()) == 4 and log.describe()["step_log_error"]


def test_config_validates_the_log_and_reload_settings():
    from deploy.scheduler import FeatherConfig

    config = FeatherConfig.from_additional_config({"feather": {"policy": "p.onnx", "step_log": "s.jsonl",
                                                               "step_log_max_bytes": 1000, "policy_reload_s": 0.5}})
    assert config.make_step_log().max_bytes == 1000 and config.make_reloader().interval_s == 0.5
    assert FeatherConfig(policy="feather-rule").make_reloader() is None
    assert FeatherConfig(policy="p.onnx", policy_reload_s=None).make_reloader() is None
    with pytest.raises(ValueError, match="max_bytes >= 1"):
        FeatherConfig(step_log_max_bytes=0).make_step_log()


# --- hot swap -------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("policies")
    add = policies.constant_policy(root / "add.onnx", 1)
    return {"add": add, "stop": policies.constant_policy(root / "stop.onnx", 0),
            "old_version": policies.with_metadata(add, root / "old.onnx", obs_version="feather-obs-0"),
            "corrupt": policies.corrupt_file(root / "corrupt.onnx")}


def replace_file(source, target) -> None:
    """Atomically, as a writer should (a new inode: a new signature even within one mtime tick)."""
    temporary = target.with_suffix(".tmp")
    shutil.copyfile(source, temporary)
    temporary.replace(target)


def test_reloader_looks_at_most_once_per_interval_and_refuses_bad_files(tmp_path, files, caplog):
    from deploy.policy_reload import PolicyReloader
    from deploy.scheduler import load_deployable_policy

    path = tmp_path / "policy.onnx"
    replace_file(files["stop"], path)
    clock, loads = Clock(), []

    def load(p):
        loads.append(p)
        return load_deployable_policy(p)

    reloader = PolicyReloader(path, load, interval_s=1.0, clock=clock)
    assert reloader.poll() is None and loads == []                  # unchanged
    replace_file(files["add"], path)
    clock.now = 0.5
    assert reloader.poll() is None                                  # not yet time to look
    clock.now = 1.0
    swapped = reloader.poll()
    assert swapped is not None and reloader.version == 1
    point = SimpleNamespace(observation=np.zeros(swapped.runtime.num_features, dtype=np.float32))
    assert swapped.decide(point) == 1                               # the new file's answer
    with caplog.at_level(logging.WARNING, logger="deploy.policy_reload"):
        for bad in ("corrupt", "old_version"):
            replace_file(files[bad], path)
            clock.now += 1.0
            assert reloader.poll() is None
            clock.now += 1.0
            assert reloader.poll() is None                          # the same bad file is not tried again
    assert reloader.refusals == 2 and len(loads) == 3 and reloader.version == 1
    assert "not a loadable ONNX model" in caplog.text and "feather-obs-0" in caplog.text
    path.unlink()
    clock.now += 1.0
    assert reloader.poll() is None                                  # a vanished file: keep serving
    replace_file(files["stop"], path)
    clock.now += 1.0
    assert reloader.poll() is not None and reloader.describe() == {"policy_version": 2, "policy_refusals": 2}


# --- refit ----------------------------------------------------------------------------------------
def synthetic_steps(model, n: int = 120, scale: float = 1.3, seed: int = 0) -> list[LiveStep]:
    """Steps the base model predicts, ``scale`` times slower (plus 2% noise), some with unlike chunks."""
    from feather_gym.costmodel.features import DecodeBatch

    rng = np.random.default_rng(seed)
    steps = []
    for i in range(n):
        b = int(rng.integers(1, 48))
        g = int(rng.integers(1, b + 1))
        prefix, own = int(rng.choice([0, 128, 256, 512])), int(rng.integers(16, 400))
        batch = DecodeBatch.from_groups(b, g, prefix, own)
        kind = i % 4
        chunk = (int(rng.integers(16, 1024)), int(rng.choice([0, 128, 512])))
        if kind == 0:                                            # decode only
            seconds, decode, chunks = model.step_s(batch), batch, ()
        elif kind == 1:                                          # one chunk, no decode
            seconds, decode, chunks = model.prefill_s(*chunk), None, (chunk,)
        elif kind == 2:                                          # mixed
            seconds, decode, chunks = model.step_s(batch, *chunk), batch, (chunk,)
        else:                                                    # two unlike chunks: not a profile row
            seconds, decode, chunks = model.step_s(batch, *chunk) * 2, batch, (chunk, (chunk[0] + 1, 0))
        fields = (decode.batch_size, decode.total_kv_tokens, decode.unique_kv_tokens, decode.num_groups) \
            if decode else (0, 0, 0, 0)
        steps.append(live_step(i, seconds * scale * (1 + 0.02 * rng.standard_normal()), decode=fields, chunks=chunks))
    return steps


def test_profile_rows_of_logged_steps():
    decode = live_step(0, decode=(4, 4 * 300, 2 * 256 + 4 * 44, 2)).profile_row()
    assert decode["phase"] == "decode" and decode["shared_prefix_tokens"] == 256 and decode["median_s"] == 0.1
    assert live_step(1, chunks=[(64, 128)] * 3).profile_row("cpu")["prefill_requests"] == 3
    assert live_step(1, chunks=[(64, 128)] * 3).profile_row("cpu")["median_s"] == pytest.approx(0.09)
    mixed = live_step(2, decode=(2, 40, 40, 2), chunks=[(64, 0)]).profile_row()
    assert mixed["phase"] == "mixed" and mixed["new_tokens"] == 64
    assert live_step(3, decode=(2, 40, 40, 2), chunks=[(64, 0), (32, 0)]).profile_row() is None
    assert live_step(4).profile_row() is None                     # no work


def test_refit_learns_a_slower_engine_and_writes_a_usable_profile(tmp_path):
    from feather_gym.costmodel.model import load_cost_model, profile_path
    from feather_gym.costmodel.profile_io import load_profile, save_profile

    base = load_profile(profile_path("vllm-cpu"))
    steps = synthetic_steps(load_cost_model("vllm-cpu"))
    profile, report = refit_profile(base, steps, clock="wall", held_out_fraction=0.3)
    assert report["unlike_chunk_steps"] == 30 and report["usable_steps"] == 90
    assert report["held_out_steps"] == 27 and report["fit_live_steps"] == 63 and report["fit_base_rows"] == 0
    assert report["mape_before"] > 0.2 and report["mape_after"] < 0.06            # 1.3x slower, 2% noise
    assert report["total_time_bias_before"] == pytest.approx(1 / 1.3 - 1, abs=0.03)
    assert abs(report["total_time_bias_after"]) < 0.03
    save_profile(profile, tmp_path / "refit.json")
    model = load_cost_model(tmp_path / "refit.json")
    assert model.name == "vllm-cpu-refit" and model.block_size == 128
    _, combined = refit_profile(base, steps, clock="wall", with_base=True)   # pulled toward the 1.0x base
    assert combined["fit_base_rows"] == 55 and 0.06 < combined["mape_after"] < report["mape_before"] / 2
    _, by_time = refit_profile(base, steps, clock="wall", split="time")
    assert by_time["split"] == "time" and by_time["mape_after"] < 0.06
    _, cpu = refit_profile(base, steps)                       # the base's clock: vllm-cpu is thread CPU time
    assert cpu["clock"] == "cpu" and cpu["total_time_bias_before"] == pytest.approx(1 / (1.3 * 0.9) - 1, abs=0.03)
    with pytest.raises(ValueError, match="too few"):
        refit_profile(base, steps[:8])


def test_profile_refit_cli_prints_the_report_as_json(tmp_path, capsys):
    from feather_cli.main import main
    from feather_gym.costmodel.model import load_cost_model

    log = tmp_path / "steps.jsonl"
    steps = synthetic_steps(load_cost_model("vllm-cpu"))
    log.write_text("".join(s.to_json() + "\n" for s in steps) + '{"cut by a full dis\n')
    out = tmp_path / "new.json"
    assert main(["profile", "refit", "--from-logs", str(log), "--profile", "vllm-cpu", "--output", str(out),
                 "--clock", "wall", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["held_out_steps"] == 27 and report["skipped_lines"] == 1
    assert report["mape_after"] < report["mape_before"] and report["output"] == str(out)
    assert load_cost_model(out).name == "vllm-cpu-refit"
    assert main(["profile", "refit", "--from-logs", str(tmp_path / "none.jsonl"), "--profile", "vllm-cpu",
                 "--output", str(out)]) != 0
