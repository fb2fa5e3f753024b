"""``feather bench policy``: how long one Feather admission decision takes.

Four figures, each a distribution over ``iterations`` calls after a warm-up:

* ``session_run``: onnxruntime's plain ``session.run`` on one ``[1, F]`` row (the baseline);
* ``decide_onnxruntime``: :meth:`OnnxPolicy.decide` on onnxruntime (preallocated IOBinding + NaN
  check), the policy alone;
* ``decide``: the same as served (the compiled evaluator where the policy is a dense chain,
  ``kernel``);
* ``decision``: a whole :meth:`PolicyAdmission.next_admission` inside a
  :class:`CHTWaitingQueue` (the CHT's candidates, their statistics, the observation, the policy)
  with ``waiting`` real vLLM requests from a prefix-groups workload, ``running`` of them admitted
  (the prefix cache holds their blocks, which each candidate's resident prefix is looked up in).
  The queue does not change between calls: what it costs to admit requests into a changing queue,
  against vLLM's own scheduler, is ``feather bench scheduler``'s.
"""

from __future__ import annotations

import time

import numpy as np


def _percentiles_us(samples_ns: list[int], name: str) -> dict[str, float]:
    us = np.asarray(samples_ns, dtype=np.float64) / 1e3
    p50, p90, p99 = np.percentile(us, [50, 90, 99])
    return {f"{name}_us_p50": round(p50, 3), f"{name}_us_p90": round(p90, 3), f"{name}_us_p99": round(p99, 3)}


def _time_calls(call, args: list, warmup: int) -> list[int]:
    clock = time.perf_counter_ns
    samples = []
    for i, arg in enumerate(args):
        start = clock()
        call(arg)
        samples.append(clock() - start)
    return samples[warmup:]


def bench_policy(policy_path: str, *, iterations: int = 20_000, waiting: int = 1000, running: int = 256,
                 block_size: int = 16, device: str = "cpu", seed: int = 0) -> dict:
    """Decision-latency figures of the policy at ``policy_path`` (see the module docstring)."""
    from cache_core.cht.tree import ChunkedHashTree
    from deploy.admission import PolicyAdmission
    from deploy.vllm_request import vllm_request
    from deploy.waiting_queue import CHTWaitingQueue
    from feather_gym.policies import OnnxFilePolicy
    from feather_gym.policy_runtime import OnnxPolicy
    from traces import generate

    if iterations < 10 or not 0 < running < waiting:
        raise ValueError(f"need iterations >= 10 and 0 < running < waiting, got {iterations}, {running}, {waiting}")
    deployed = OnnxFilePolicy(policy_path, device=device)
    policy = deployed.runtime
    warmup = max(iterations // 10, 1)
    rng = np.random.default_rng(seed)
    rows = list(rng.uniform(0.0, 2.0, (iterations + warmup, policy.num_features)).astype(np.float32))
    report = {"policy": str(policy_path), "provider": policy.provider, "kernel": policy.kernel,
              "iterations": iterations}
    report |= _percentiles_us(_time_calls(lambda row: policy.logits(row[None]), rows, warmup), "session_run")
    on_onnxruntime = OnnxPolicy(policy_path, device=device, native=False)
    report |= _percentiles_us(_time_calls(on_onnxruntime.decide, rows, warmup), "decide_onnxruntime")
    report |= _percentiles_us(_time_calls(policy.decide, rows, warmup), "decide")

    trace = generate("prefix-groups", seed=seed, num_requests=waiting, groups=8, prefix_tokens=4 * block_size,
                     suffix_tokens_min=block_size, suffix_tokens_max=4 * block_size)
    queue = CHTWaitingQueue(ChunkedHashTree(chunk_size=block_size))
    now = time.time()
    for r in trace:
        queue.add_request(vllm_request(r.request_id, r.tokens(), block_size=block_size, arrival_time=now))
    cached = set()
    for _ in range(running):
        queue.peek_request()
        cached.update(queue.pop_request().block_hashes)

    def resident_tokens(request) -> int:
        hashes = request.block_hashes[:(request.num_tokens - 1) // block_size]
        return block_size * next((i for i, h in enumerate(hashes) if h not in cached), len(hashes))

    admission = PolicyAdmission(deployed, num_running=lambda: running, kv_usage=lambda: 0.5,
                                max_num_seqs=waiting, resident_tokens=resident_tokens, max_wait_steps=10**9)
    report |= _percentiles_us(_time_calls(admission.next_admission, [queue] * (iterations + warmup), warmup),
                              "decision")
    report |= {"waiting": waiting - running, "running": running,
               "policy_adds": admission.stats.adds, "policy_stops": admission.stats.stops}
    return report
