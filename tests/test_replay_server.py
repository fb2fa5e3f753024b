"""SuffixReplay behind vLLM's OpenAI server: the documented command serves prefix hits by replay.

The server keeps no exact recurrent state (``state_budget_bytes`` 0), so every prefix hit it
reports comes from anchors; requests share two pages and are sent one after another.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from server_process import running_server

pytestmark = pytest.mark.live


def scraped(url: str, name: str) -> float:
    """The value of the first sample ``name`` (any labels) on the server's ``/metrics``."""
    import httpx

    metrics = httpx.get(f"{url}/metrics", timeout=30.0).text
    return float(re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", metrics, re.M).group(1))


def test_the_server_resumes_prefix_hits_by_replay_with_no_state_kept(tmp_path, hybrid_model_dir):
    import httpx

    from cache_core.hybrid.layout import HybridCacheLayout

    block = HybridCacheLayout.from_model_dir(hybrid_model_dir).vllm_block_size()       # vLLM's, on this CPU
    config = {"feather_hybrid": {"placement": "vllm", "state_budget_bytes": 0},
              "feather_replay": {"replay_tokens": 64}}
    arguments = ["--model", hybrid_model_dir, "--kv-cache-memory-bytes", "512M", "--enable-prefix-caching",
                 "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "4096",
                 "--worker-extension-cls", "deploy.replay_worker.ReplayWorkerExtension",
                 "--scheduler-cls", "deploy.replay_scheduler.SuffixReplayScheduler",
                 "--additional-config", json.dumps(config)]
    rng = np.random.default_rng(0)
    metrics_dir = tmp_path / "prometheus"        # the engine core's metrics reach the server's /metrics
    metrics_dir.mkdir()
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    with running_server(tmp_path, arguments, env=env) as (url, log):
        model = httpx.get(f"{url}/v1/models", timeout=30.0).json()["data"][0]["id"]
        shared = rng.integers(100, 20000, size=2 * block).tolist()          # two pages
        hits = []
        for _ in range(3):
            prompt = shared + rng.integers(100, 20000, size=200).tolist()
            answer = httpx.post(f"{url}/v1/completions", timeout=120.0, json={
                "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}).json()
            assert answer["usage"]["completion_tokens"] == 8
            hits.append(scraped(url, "vllm:prefix_cache_hits_total"))
        assert "Using custom scheduler class deploy.replay_scheduler.SuffixReplayScheduler" in log.read_text()
        # Feather's replay metrics on the same endpoint: both hits were rebuilt from anchors
        assert scraped(url, "feather:replay_hits_total") == 2
        assert scraped(url, "feather:rebuild_seconds_count") == 2 and scraped(url, "feather:rebuild_seconds_sum") > 0
        assert scraped(url, "feather:rebuilt_states_total") > 0
        assert scraped(url, "feather:anchor_bytes") > 0 and scraped(url, "feather:kept_state_bytes") == 0
    assert hits == [0.0, 2 * block, 4 * block]
