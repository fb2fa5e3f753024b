"""The documented server command: vLLM's OpenAI server with the Feather scheduler, over loopback HTTP.

The server (:mod:`server_process`) runs with the engine core in its own process as vLLM runs it
by default, in prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``), so Feather's
metrics from the engine core reach ``/metrics``; concurrent completions are sent with httpx.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import deploy_policies as policies
import pytest
from server_process import running_server

pytestmark = pytest.mark.live

REQUEST_TIMEOUT_S = 120.0
NUM_REQUESTS = 20
WORKLOAD = ("prefix-groups:num_requests=20,groups=4,prefix_tokens=256,suffix_tokens_min=8,suffix_tokens_max=64,"
            "output_tokens_min=4,output_tokens_max=24")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base url, model name, policy file, log file) of a running server; stopped at the end."""
    from feather_gym.vllm_engine import ensure_smollm2_hf

    root = tmp_path_factory.mktemp("server")
    policy = policies.untrained_policy(root / "policy.onnx")
    model = str(ensure_smollm2_hf())
    arguments = ["--model", model, "--kv-cache-memory-bytes", "1G", "--enable-prefix-caching",
                 "--scheduler-cls", "deploy.scheduler.FeatherScheduler",
                 "--additional-config", json.dumps({"feather": {"policy": str(policy), "max_wait_steps": 8}}),
                 # for this test only: a short start (no torch.compile) and a small model length
                 "--enforce-eager", "--dtype", "float32", "--max-model-len", "1024"]
    metrics_dir = root / "prometheus"
    metrics_dir.mkdir()
    with running_server(root, arguments, env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}) as (url, log):
        yield url, model, policy, log


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as sample name -> value summed over label sets."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30.0).text):
        for s in family.samples:
            samples[s.name] = samples.get(s.name, 0.0) + s.value
    return samples


def test_concurrent_completions_are_all_answered_in_full_by_the_feather_scheduler(server):
    import httpx

    from traces import resolve_workload

    url, model, policy, log = server
    trace = resolve_workload(WORKLOAD, seed=0)
    assert len(trace) == NUM_REQUESTS
    before = scrape(url)

    def complete(client: httpx.Client, request) -> dict:
        body = {"model": model, "prompt": request.tokens().tolist(), "max_tokens": request.output_len,
                "temperature": 0.0, "ignore_eos": True}
        response = client.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        response.raise_for_status()
        return response.json()

    with httpx.Client() as client, ThreadPoolExecutor(NUM_REQUESTS) as pool:
        answers = list(pool.map(lambda r: complete(client, r), trace))
    for request, answer in zip(trace, answers):
        assert answer["usage"]["prompt_tokens"] == request.input_len
        assert answer["usage"]["completion_tokens"] == request.output_len
        assert answer["choices"][0]["finish_reason"] == "length"
    text = log.read_text()
    assert "Using custom scheduler class deploy.scheduler.FeatherScheduler" in text     # vLLM's own notice
    assert f"deploy.scheduler: Feather policy {policy} loaded" in text                 # the policy runs
    assert "Feather policy failed" not in text                                         # no run-time fallback
    # Feather's metrics from the engine core, beside vLLM's own, on the server's /metrics
    after = scrape(url)
    moved = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after if name.startswith("feather:")}
    assert moved["feather:decisions_total"] + moved["feather:forced_admissions_total"] >= NUM_REQUESTS
    assert moved["feather:scheduler_step_seconds_count"] > 0 and moved["feather:scheduler_step_seconds_sum"] > 0
    assert after["feather:waiting_requests"] == 0.0 and "feather:cht_prefixes" in after
    assert after["vllm:request_success_total"] - before.get("vllm:request_success_total", 0.0) == NUM_REQUESTS
