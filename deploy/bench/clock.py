"""Timing engine steps live, to calibrate a cost-model profile's clock (:mod:`feather_gym.costmodel.clock`).

:class:`StepTimedScheduler` is vLLM's own ``Scheduler`` that records every engine step it
schedules as a :class:`~feather_gym.costmodel.refit.LiveStep`: the step's composition
(:func:`deploy.step_log.step_composition`, read right after ``schedule()``) and its time on the
wall clock and in this thread's CPU time, from the start of its ``schedule()`` to the start of
the next one. That cycle is everything a live round pays per step: scheduling, the model,
sampling, the scheduler's update, the front end's output processing and the driver loop
(online, the submission of the requests that arrived meanwhile). A step after which the
engine had no unfinished request is not recorded: the driver may sleep until the next arrival
before the next ``schedule()``, and that idle wait is no step's time. Nor is the last step,
which no ``schedule()`` follows.

:func:`time_engine_steps` serves a trace once with it, every request at once or online (each at
its arrival time); :func:`~feather_gym.costmodel.clock.fit_clock` fits a cost model's clock
factors on the steps it returns (the engine should have served such batches before: a first
batch shape compiles kernels).
"""

from __future__ import annotations

import time

from vllm.v1.core.sched.scheduler import Scheduler

from deploy.engine_rounds import run_round
from deploy.step_log import step_composition
from feather_gym.costmodel.refit import LiveStep


class StepTimedScheduler(Scheduler):
    """vLLM's ``Scheduler`` appending one :class:`LiveStep` per closed step cycle to ``timed_steps``
    (see the module docstring); it schedules exactly as vLLM's."""

    def __init__(self, *args, timed_steps: list, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.timed_steps = timed_steps
        self._open: tuple[float, float, dict] | None = None

    def schedule(self, *args, **kwargs):
        wall, cpu = time.perf_counter(), time.thread_time()
        if self._open is not None:
            started_wall, started_cpu, composition = self._open
            self.timed_steps.append(LiveStep(step=len(self.timed_steps) + 1, time_unix_s=time.time(),
                                             step_wall_s=wall - started_wall, step_cpu_s=cpu - started_cpu,
                                             **composition))
        output = super().schedule(*args, **kwargs)
        self._open = (wall, cpu, step_composition(output, self.requests, self.hash_block_size))
        return output

    def update_from_output(self, *args, **kwargs):
        outputs = super().update_from_output(*args, **kwargs)
        if not self.has_unfinished_requests():
            self._open = None           # the engine is idle until the next arrival: no step's time
        return outputs


def time_engine_steps(llm, trace, *, online: bool = False) -> list[LiveStep]:
    """Serve ``trace`` once with :class:`StepTimedScheduler` (every request at once, or ``online``
    at its arrival time); its timed steps."""
    steps: list[LiveStep] = []
    result = run_round(llm, trace, StepTimedScheduler, label="clock calibration", round_index=-1, online=online,
                       timed_steps=steps)
    if result.lost:
        raise RuntimeError(f"clock calibration: {result.lost} of {len(trace)} requests did not finish")
    return steps

