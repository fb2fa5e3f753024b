"""The Feather MDP as a Gymnasium environment: STOP, or admit one of the CHT's candidate groups."""

from __future__ import annotations

import copy
import dataclasses
import functools

import gymnasium as gym
import numpy as np

import traces
from feather_gym.costmodel import hardware_profile, load_cost_model
from feather_gym.load import LoadedWorkloads
from feather_gym.observation import DEFAULT_NUM_CANDIDATES, OBS_CLIP, check_num_candidates, observation_size
from feather_gym.orderings import CHTOrder
from feather_gym.policies import make_policy
from feather_gym.simulator import EngineConfig, Simulator, simulate
from traces.workload import is_generated

#: Windows start on a grid of ``window_requests // WINDOW_STARTS_PER_WINDOW`` requests, so a
#: trace of N requests offers about ``4 N / window_requests`` distinct windows, each built once.
WINDOW_STARTS_PER_WINDOW = 4

#: Defaults: whole traces (the generators make at most 1000 requests), because batch formation
#: pays off only over many batches: a short window charges a group held out its delay but ends
#: before the batches that repay it, so short windows reward the wrong policy. ``max_decisions``
#: bounds the episodes of STOP-heavy policies (one that stops is asked again every engine step),
#: far above the decisions of a policy that mostly admits (about one per request): a truncated
#: episode never shows the cost of starving a group (its late drain), so truncating early teaches
#: starving.
DEFAULT_CONFIG = {
    "workloads": ("prefix-groups",),
    "profile": None,          # None: hardware_profile(), the shipped profile of this machine
    "seed": 0,
    "window_requests": 1000,
    "max_decisions": 25_000,
    "token_budget": None,
    "max_num_seqs": EngineConfig.max_num_seqs,
    "max_wait_steps": EngineConfig.max_wait_steps,
    "kv_capacity_tokens": None,   # None: the profile's
    "num_candidates": DEFAULT_NUM_CANDIDATES,   # k: 1 is ADD/STOP on the CHT's best candidate
    "workload_instances": 1,  # generated traces per workload spec, seeds seed .. seed + n - 1
}


def instances_of(spec: str, instances: int) -> int:
    """Traces the env builds of ``spec``: ``instances`` seeds of a generator, one of a trace file
    (which ignores the seed)."""
    return instances if is_generated(spec) else 1


@dataclasses.dataclass
class WorkloadSet:
    """An env configuration's traces, their block digests, and its windows (:meth:`BatchFormationEnv._window`:
    the window trace and its baseline run, built on first use). Every env of one process built with
    the same configuration shares one (:func:`workload_set`): RLlib builds a runner's sub-envs with
    one config, and each would otherwise build and simulate the same traces again."""

    traces: list
    digests: list
    windows: dict = dataclasses.field(default_factory=dict)


@functools.lru_cache(maxsize=4)
def workload_set(specs: tuple[str, ...], seed: int, instances: int, engine: EngineConfig, profile: str) -> WorkloadSet:
    """The shared :class:`WorkloadSet` of a configuration. ``profile`` is part of the key because
    the windows' baseline runs, and a ``SPEC@load=X``'s capacity, depend on it (a profile file is
    assumed not to change while the process runs). The loads of one trace share its capacity."""
    loaded = LoadedWorkloads(load_cost_model(profile), engine)
    built = [loaded.get(spec, seed + i) for spec in specs for i in range(instances_of(spec, instances))]
    return WorkloadSet([trace for trace, _ in built], [digests for _, digests in built])


class BatchFormationEnv(gym.Env):
    """Batch formation in a prefix-cached vLLM engine (the Feather MDP).

    ## Description
    A simulated vLLM v1 engine (:mod:`feather_gym.simulator`, step times from the cost model
    of ``profile``) serves a window of consecutive requests of a workload. At every admission
    point of an engine step the Chunked Hash Tree proposes up to ``k = num_candidates``
    candidates, the best waiting request (fewest chunks missing from the running batch) of each
    of its ``k`` best prefix groups (``ChunkedHashTree.top_candidates``; slot 0 is its overall
    best), and the agent admits one of them or stops. With ``k = 1`` (the env's default;
    ``feather-train`` trains ``k = 4``) that is ADD or STOP on the best candidate. The engine
    admits into an empty batch without asking, so an episode always progresses.

    ## Action Space
    ``Discrete(k + 1)``:

    | Num     | Action        | Effect                                                            |
    |---------|---------------|-------------------------------------------------------------------|
    | 0       | STOP          | admit nothing more this engine step; the step runs                |
    | 1       | ADD / ADD_1   | admit candidate slot 0, the CHT's best (its prefill starts now)   |
    | i <= k  | ADD_i         | admit candidate slot i - 1 (another prefix group)                 |

    Invalid actions: choosing an empty slot (``i - 1 >=`` the number of candidates offered, which
    the observation's mask shows) is STOP; the env never raises for an action of its space. The
    agent is asked before vLLM's KV check, as the deployed scheduler is: a chosen candidate
    whose sequence does not fit the free KV blocks ends admission for the step, as a failed
    check does in vLLM (so ADD on a slot 0 that does not fit is STOP, and another slot may fit).

    ## Observation Space
    ``Box(0, OBS_CLIP, (observation_size(k),), float32)``, ``observation_size(k) = 10 k + k - 1``
    (10 for ``k = 1``): ``k`` rows of the features of :mod:`feather_gym.observation`, one per
    candidate slot (empty slots all zeros), each feature divided by its scale and clipped to
    ``[0, 8]``, flattened row by row, then the validity mask of slots ``1 .. k - 1`` (1 filled,
    0 empty; slot 0 is always filled). The features of one row:

    | Num | Feature                      | Raw meaning (unit)                                   | Scale |
    |-----|------------------------------|------------------------------------------------------|-------|
    | 0   | batch_size                   | running requests, admitted this step included        | 32    |
    | 1   | chunk_loss_tokens            | shrink of the running common prefix if added (tokens)| 2048  |
    | 2   | same_prefix_waiting          | other waiting requests sharing its prefix            | 32    |
    | 3   | running_common_prefix_tokens | tokens common to every running request               | 8192  |
    | 4   | candidate_context_tokens     | candidate prompt + generated tokens                  | 8192  |
    | 5   | candidate_cached_fraction    | share of its full blocks in the running set          | 1     |
    | 6   | kv_utilisation               | fraction of KV blocks in use                         | 1     |
    | 7   | num_waiting                  | waiting requests                                     | 128   |
    | 8   | oldest_wait_steps            | engine steps the earliest-arrived waiting one waited | 64    |
    | 9   | candidate_resident_tokens    | its prefix held in the KV cache, running or not      | 8192  |

    ## Rewards
    Every step: ``r = (tokens - b * elapsed_s) / T``, measured against FCFS on the same window:

    | Term        | Meaning                                                                        |
    |-------------|--------------------------------------------------------------------------------|
    | tokens      | output tokens emitted from the decision to the next one (or the episode's end)  |
    | elapsed_s   | simulated seconds of that span (zero between admissions of one engine step; the |
    |             | first step also covers the run-up to the first decision)                       |
    | b           | FCFS's throughput on the window, output tokens/s (one simulation per window)   |
    | T           | the window's total output tokens                                               |

    A terminated episode has emitted ``T`` tokens in its makespan, so its return is
    ``1 - makespan / fcfs_makespan``: the share of FCFS's time the policy saves, positive exactly
    when it is faster than FCFS on the window. Returns rank policies as their end-to-end
    throughput on the window does, and stay of order 1 on windows of any size.

    ## Starting State
    A window of ``window_requests`` consecutive requests of one of the traces (``workload_instances``
    seeded traces of each generator spec of ``workloads``, one of each trace file; a spec ending in
    ``@load=X`` is that trace at ``X`` times its FCFS capacity, :mod:`feather_gym.load`; chosen, with
    its start on a grid of ``window_requests // 4`` requests, by the seeded ``np_random``;
    windows and their reward baselines are cached), arrival times shifted to start at 0, an empty KV
    cache; the first observation is the first admission point with a non-empty batch. Windows
    with no decision at all are redrawn.

    ## Episode End

    | End        | When                                                                         |
    |------------|------------------------------------------------------------------------------|
    | terminated | every request of the window has finished (or was rejected as too long for    |
    |            | the KV cache); the final observation is all zeros and the info holds         |
    |            | ``workload``, ``throughput_tok_s``, ``baseline_throughput_tok_s`` (FCFS's),  |
    |            | ``makespan_s`` and ``decisions``                                             |
    | truncated  | ``max_decisions`` decisions were taken, when that is positive                |

    A policy that always STOPs still terminates: the running batch drains, and an empty batch
    admits without asking. The truncation bounds the episodes of STOP-heavy policies, which are
    asked about the same candidate every engine step.

    ## Arguments
    ``gym.make("feather_gym/BatchFormation-v0", **config)`` or ``BatchFormationEnv(env_config)``
    (RLlib style); keys (defaults in ``DEFAULT_CONFIG``): ``workloads`` (workload specs for
    ``traces.resolve_workload``), ``profile`` (cost model name or file; None: ``hardware_profile()``),
    ``seed`` (workload
    generation, and the episode stream unless ``reset(seed=...)``), ``window_requests``,
    ``max_decisions`` (0: no limit), ``token_budget`` (None: the
    profile's), ``max_num_seqs``, ``max_wait_steps`` (the admission's waiting-time bound in engine steps, as deployed),
    ``kv_capacity_tokens`` (None: the profile's), ``num_candidates`` (``k``, >= 1),
    ``workload_instances`` (traces of each generator spec, seeds ``seed .. seed + n - 1``; a trace
    file is one trace).
    """

    metadata = {"render_modes": []}

    def __init__(self, env_config: dict | None = None, **kwargs) -> None:
        config = {**DEFAULT_CONFIG, **dict(env_config or {}), **kwargs}
        unknown = sorted(set(config) - set(DEFAULT_CONFIG))
        if unknown:
            raise ValueError(f"unknown env_config keys {unknown}; valid: {sorted(DEFAULT_CONFIG)}")
        workloads = [config["workloads"]] if isinstance(config["workloads"], str) else list(config["workloads"])
        if not workloads:
            raise ValueError("env_config 'workloads' needs at least one workload spec")
        if config["window_requests"] < 2:
            raise ValueError(f"window_requests must be >= 2, got {config['window_requests']}")
        if config["max_decisions"] < 0:
            raise ValueError(f"max_decisions must be >= 0 (0: no limit), got {config['max_decisions']}")
        self.config = config
        self.num_candidates = k = check_num_candidates(config["num_candidates"])
        profile = config["profile"] or hardware_profile()
        self.cost_model = load_cost_model(profile)
        self.engine = EngineConfig(token_budget=config["token_budget"], max_num_seqs=config["max_num_seqs"],
                                   max_wait_steps=config["max_wait_steps"],
                                   kv_capacity_tokens=config["kv_capacity_tokens"]).resolve(self.cost_model)
        if config["workload_instances"] < 1:
            raise ValueError(f"workload_instances must be >= 1, got {config['workload_instances']}")
        shared = workload_set(tuple(workloads), config["seed"], config["workload_instances"], self.engine, profile)
        self.workloads, self._digests, self._windows = shared.traces, shared.digests, shared.windows
        self.observation_space = gym.spaces.Box(0.0, OBS_CLIP, (observation_size(k),), np.float32)
        self.action_space = gym.spaces.Discrete(k + 1)
        self._terminal_obs = np.zeros(observation_size(k), dtype=np.float32)
        self._sim = None
        self._point = None
        self._seeded = False

    # ------------------------------------------------------------------ gym API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is None and not self._seeded:
            seed = self.config["seed"]
        super().reset(seed=seed)
        self._seeded = True
        for _ in range(100):
            point = self._start_episode()
            if point is not None:
                self._point = point
                return point.observation, {"workload": self.workloads[self._episode[0]].name}
        raise ValueError(f"workloads {[t.name for t in self.workloads]}: 100 windows without one admission decision; "
                         "raise the arrival rate or window_requests")

    def step(self, action):
        sim = self._sim
        if sim is None or self._point is None:
            raise RuntimeError("step() before reset() or after the episode ended")
        sim.apply(int(action))
        self._point = sim.next_admission()
        reward = self._reward()
        if self._point is None:
            return self._terminal_obs, reward, True, False, self._final_info()
        limit = self.config["max_decisions"]
        truncated = 0 < limit <= sim.num_decisions
        return self._point.observation, reward, False, truncated, {}

    def fork(self, output_len: np.ndarray | None = None) -> BatchFormationEnv:
        """An independent copy of this env mid-episode: the same pending decision, simulator state
        and reward bookkeeping, so stepping the copy (e.g. to try an action and play the episode
        out) never changes this env. The traces, windows, cost model and settings are shared, not
        copied (nothing changes them during an episode). With ``output_len`` the copy's unfinished
        requests have those output lengths (:meth:`~feather_gym.simulator.Simulator.suppose_output_len`)."""
        shared = (self.workloads, self._digests, self._windows, self.cost_model, self.engine, self.config, self.spec,
                  *(self._sim.read_only() if self._sim is not None else ()))
        env = copy.deepcopy(self, {id(obj): obj for obj in shared})
        if output_len is not None:
            env._sim.suppose_output_len(output_len)
        return env

    @property
    def admission_point(self):
        """The pending :class:`~feather_gym.simulator.AdmissionPoint` (None before reset and after
        the episode ends): what a heuristic :class:`~feather_gym.policies.Policy` decides on, so
        baselines can act in the env (the trainer's warm start records them this way)."""
        return self._point

    # ------------------------------------------------------------------ episode
    def _start_episode(self):
        rng = self.np_random
        w = int(rng.integers(len(self.workloads)))
        size = min(self.config["window_requests"], len(self.workloads[w]))
        stride = max(1, size // WINDOW_STARTS_PER_WINDOW)
        start = stride * int(rng.integers((len(self.workloads[w]) - size) // stride + 1))
        self._episode = (w, start)
        window, digests, self._baseline, self._reward_scale = self._window(w, start, size)
        self._sim = Simulator(window, self.cost_model, CHTOrder(), config=self.engine, digests=digests,
                              num_candidates=self.num_candidates)
        self._rewarded = (0, self._sim.now_s)   # tokens and clock already rewarded
        return self._sim.next_admission()

    def _window(self, w: int, start: int, size: int):
        """``(trace, digests, baseline_rate, total_output_tokens)`` of a window, built once and
        cached in the shared :class:`WorkloadSet`.

        The trace is ``size`` requests from ``start`` with arrivals shifted to 0; the baseline
        rate (output tokens/s) is one simulation of it under FCFS.
        """
        key = (w, start, size)
        if key not in self._windows:
            trace = self.workloads[w]
            requests = trace.requests[start:start + size]
            t0 = requests[0].arrival_s
            shifted = [dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in requests]
            window = traces.Trace(f"{trace.name}[{start}:{start + size}]", shifted, trace.source, trace.block_size)
            digests = self._digests[w][start:start + size]
            baseline = simulate(window, self.cost_model, make_policy("fcfs"),
                                config=self.engine, digests=digests)
            total_output = sum(r.output_len for r in shifted)
            self._windows[key] = (window, digests, baseline.metrics()["throughput_tok_s"], total_output)
        return self._windows[key]

    def _reward(self) -> float:
        """Reward of everything since the last one (the first step also covers the reset's run-up)."""
        sim = self._sim
        tokens, now = self._rewarded
        self._rewarded = (sim.tokens_out, sim.now_s)
        return float((sim.tokens_out - tokens - self._baseline * (sim.now_s - now)) / self._reward_scale)

    def _final_info(self) -> dict:
        sim = self._sim
        return {
            "workload": self.workloads[self._episode[0]].name,
            "throughput_tok_s": sim.tokens_out / max(sim.now_s, 1e-9),
            "baseline_throughput_tok_s": self._baseline,
            "makespan_s": sim.now_s,
            "decisions": sim.num_decisions,
        }
