"""How fast the Feather env steps: the figure ``feather bench env`` reports."""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np

from feather_gym.envs import ENV_ID


def env_speed(workload: str, *, profile: str, kv_capacity_tokens: int | None, steps: int) -> dict:
    """Steps per wall and per CPU second of ``steps`` steps of random ADD (80%) or STOP.

    Two passes over the same seeded episodes: the first builds every window and its FCFS
    baseline on first use (``cold``), the second is the steady state of training (``warm``).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    env = gym.make(ENV_ID, workloads=[workload], profile=profile, seed=0, kv_capacity_tokens=kv_capacity_tokens)
    rng = np.random.default_rng(0)

    def run() -> tuple[float, float, int]:
        env.reset(seed=0)
        episodes, wall, cpu = 0, time.perf_counter(), time.process_time()
        for _ in range(steps):
            _, _, terminated, _, _ = env.step(int(rng.random() < 0.8))
            if terminated:
                episodes += 1
                env.reset()
        return steps / (time.perf_counter() - wall), steps / (time.process_time() - cpu), episodes

    cold, cold_cpu, episodes = run()
    warm, warm_cpu, _ = run()
    return {"env_id": ENV_ID, "workload": workload, "profile": profile, "kv_capacity_tokens": kv_capacity_tokens,
            "steps": steps, "episodes": episodes, "steps_per_s_cold": cold, "steps_per_s_warm": warm,
            "steps_per_cpu_s_cold": cold_cpu, "steps_per_cpu_s_warm": warm_cpu}
