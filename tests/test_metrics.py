"""Feather's Prometheus metrics (deploy.metrics) move as a Feather scheduler serves, model-free.

The OpenAI-server scrape is in test_openai_server.py (multiprocess mode) and test_replay_server.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

WORKLOAD = ("prefix-groups:num_requests=48,groups=4,prefix_tokens=96,suffix_tokens_min=8,suffix_tokens_max=80,"
            "output_tokens_min=1,output_tokens_max=24,rate=1000")


def sample(name: str, **labels) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def serve(policy: str) -> None:
    from deploy.model_free import ModelFreeEngine, model_free_scheduler, vllm_requests
    from deploy.scheduler import FeatherConfig, FeatherScheduler
    from traces import resolve_workload

    scheduler = model_free_scheduler(FeatherScheduler, block_size=16, num_blocks=4096, max_num_seqs=8,
                                     max_num_batched_tokens=256, max_model_len=1024, async_scheduling=False,
                                     feather_config=FeatherConfig(policy=policy, policy_reload_s=None))
    engine = ModelFreeEngine(scheduler, pipelined=False)
    engine.add_requests(vllm_requests(resolve_workload(WORKLOAD, seed=0), block_size=16))
    for _ in range(5000):
        if not scheduler.has_unfinished_requests():
            break
        engine.step()
    assert not scheduler.has_unfinished_requests()
    return scheduler


def test_counters_histograms_and_gauges_move_with_the_scheduler():
    names = [("feather:decisions_total", {"action": "add"}), ("feather:decisions_total", {"action": "stop"}),
             ("feather:forced_admissions_total", {"rule": "idle"}),
             ("feather:scheduler_step_seconds_count", {}), ("feather:decision_latency_seconds_count", {})]
    before = {(name, tuple(labels.items())): sample(name, **labels) for name, labels in names}
    scheduler = serve("feather-rule")
    after = {(name, tuple(labels.items())): sample(name, **labels) for name, labels in names}
    stats = scheduler.admission.stats
    delta = {key[0] + str(dict(key[1])): after[key] - before[key] for key in before}
    assert delta["feather:decisions_total{'action': 'add'}"] == stats.adds > 0
    assert delta["feather:decisions_total{'action': 'stop'}"] == stats.stops
    assert delta["feather:forced_admissions_total{'rule': 'idle'}"] == stats.forced_idle > 0
    assert delta["feather:decision_latency_seconds_count{}"] == stats.decisions
    assert delta["feather:scheduler_step_seconds_count{}"] >= scheduler.step_log.steps > 0
    # the queue drained: the gauges read the last step's sizes
    assert sample("feather:waiting_requests") == 0.0 and sample("feather:cht_prefixes") == 0.0


def test_every_documented_metric_is_registered_under_the_prefix():
    import deploy.metrics as metrics

    names = metrics.feather_metrics().names()
    assert all(name.startswith(metrics.PREFIX) for name in names)
    served = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    for name in names:
        assert f"``{name}" in metrics.__doc__, f"{name} is missing from deploy.metrics' table"
        assert f"| `{name}" in served, f"{name} is missing from docs/serving.md's table"


@pytest.mark.parametrize("swaps,refusals", [(0, 0), (2, 1)])
def test_recorder_turns_cumulative_counts_into_increments(swaps, refusals):
    from deploy.metrics import MetricsRecorder

    recorder = MetricsRecorder()
    before = sample("feather:policy_swaps_total"), sample("feather:policy_swaps_refused_total")
    recorder.policy_reloads(swaps=swaps, refusals=refusals)
    recorder.policy_reloads(swaps=swaps, refusals=refusals)       # the same totals again: nothing new
    assert sample("feather:policy_swaps_total") - before[0] == swaps
    assert sample("feather:policy_swaps_refused_total") - before[1] == refusals
