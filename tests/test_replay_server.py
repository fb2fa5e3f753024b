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


def prefix_cache_hits(url: str) -> float:
    import httpx

    metrics = httpx.get(f"{url}/metrics", timeout=30.0).text
    return float(re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)", metrics, re.M).group(1))


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
    with running_server(tmp_path, arguments, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}) as (url, log):
        model = httpx.get(f"{url}/v1/models", timeout=30.0).json()["data"][0]["id"]
        shared = rng.integers(100, 20000, size=2 * block).tolist()          # two pages
        hits = []
        for _ in range(3):
            prompt = shared + rng.integers(100, 20000, size=200).tolist()
            answer = httpx.post(f"{url}/v1/completions", timeout=120.0, json={
                "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}).json()
            assert answer["usage"]["completion_tokens"] == 8
            hits.append(prefix_cache_hits(url))
        assert "Using custom scheduler class deploy.replay_scheduler.SuffixReplayScheduler" in log.read_text()
    assert hits == [0.0, 2 * block, 4 * block]
