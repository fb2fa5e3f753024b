"""The Feather scheduler: vLLM's v1 scheduler with a CHT waiting queue and a learned admission.

Plug it in with vLLM's ``scheduler_cls``::

    vllm serve MODEL --scheduler-cls deploy.scheduler.FeatherScheduler \\
        --additional-config '{"feather": {"policy": "policy.onnx"}}'

Use :class:`FeatherAsyncScheduler` where vLLM runs async scheduling (the GPU default):
vLLM's docs warn that a subclass of the synchronous ``Scheduler`` costs latency there, and this
module refuses that combination. Both classes share :class:`FeatherSchedulingMixin`, which
changes exactly three things of vLLM's scheduler:

* ``self.waiting`` is a :class:`~deploy.waiting_queue.CHTWaitingQueue` (fed with vLLM's own
  block hashes);
* ``schedule()`` opens the queue's admission window, so each admission of vLLM's loop is an
  ADD/STOP decision of :mod:`deploy.admission`;
* ``_free_request()`` tells the queue a running request left.

Budgets, KV allocation, chunked prefill, preemption and outputs stay vLLM's.

Configuration (``additional_config["feather"]``, keys of :class:`FeatherConfig`): ``policy``
(an ONNX file, or ``"feather-rule"``; default the ``FEATHER_POLICY`` environment variable),
``on_policy_error`` (``"refuse"``, the default: a missing/corrupt/incompatible policy stops the
engine from starting; ``"fcfs"``:
warn and schedule FCFS), ``max_wait_steps`` (waiting-time bound in engine steps, default
:data:`~feather_gym.policies.DEFAULT_MAX_WAIT_STEPS`) and ``device``
(``"cpu"`` default, or ``"cuda"``).

The online loop: every step that computes something is logged (:mod:`deploy.step_log`: the
last ``step_log_ring`` steps in memory, ``scheduler.step_log.recent()``, and with ``step_log``
a rotating JSONL file of at most ``step_log_max_bytes`` bytes plus ``step_log_backups`` older
files), and an ONNX policy file is watched (:mod:`deploy.policy_reload`, at most once per
``policy_reload_s`` seconds; ``None`` switches it off): a changed file that passes the contract
check replaces the policy between two steps, a bad one is refused and the old one keeps serving.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from deploy.vllm_compat import require_supported_vllm

require_supported_vllm()  # before touching vLLM internals

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.request_queue import SchedulingPolicy  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from cache_core.cht.tree import ChunkedHashTree  # noqa: E402
from deploy.admission import Admission, FCFSAdmission, PolicyAdmission  # noqa: E402
from deploy.metrics import MetricsRecorder  # noqa: E402
from deploy.plugin_config import config_section  # noqa: E402
from deploy.policy_reload import PolicyReloader  # noqa: E402
from deploy.resident_prefix import ResidentPrefix  # noqa: E402
from deploy.step_log import DecodeComposition, StepLog  # noqa: E402
from deploy.waiting_queue import CHTWaitingQueue  # noqa: E402
from feather_gym.costmodel.refit import LiveStep  # noqa: E402
from feather_gym.policies import DEFAULT_MAX_WAIT_STEPS, check_max_wait_steps  # noqa: E402

logger = logging.getLogger(__name__)

#: The ``additional_config`` key holding :class:`FeatherConfig` fields.
ADDITIONAL_CONFIG_KEY = "feather"
#: Environment variable naming the policy file when ``additional_config`` does not.
POLICY_ENV = "FEATHER_POLICY"
ON_POLICY_ERROR = ("refuse", "fcfs")


class PolicyStartupError(RuntimeError):
    """The configured policy cannot be used and ``on_policy_error`` is ``"refuse"``."""


@dataclass(frozen=True)
class FeatherConfig:
    """Settings of the Feather scheduler (see the module docstring)."""

    policy: str | None = None
    on_policy_error: str = "refuse"
    max_wait_steps: int = DEFAULT_MAX_WAIT_STEPS
    device: str = "cpu"
    step_log: str | None = None
    step_log_max_bytes: int = 64 * 2**20
    step_log_backups: int = 2
    step_log_ring: int = 4096
    policy_reload_s: float | None = 1.0

    def __post_init__(self) -> None:
        if self.on_policy_error not in ON_POLICY_ERROR:
            raise ValueError(f"feather.on_policy_error must be one of {ON_POLICY_ERROR}, got {self.on_policy_error!r}")
        check_max_wait_steps(self.max_wait_steps)

    def make_step_log(self) -> StepLog:
        return StepLog(ring_steps=self.step_log_ring, path=self.step_log, max_bytes=self.step_log_max_bytes,
                       backups=self.step_log_backups)

    def make_reloader(self) -> PolicyReloader | None:
        """The watcher of the policy file; None for a policy that is no file or with reloading off."""
        if self.policy_reload_s is None or not (self.policy or "").endswith(".onnx"):
            return None
        return PolicyReloader(self.policy, self.load_policy, interval_s=self.policy_reload_s)

    def load_policy(self, spec: str):
        """:func:`load_deployable_policy` on this config's device, at start and on every reload alike;
        logs a warning when an ONNX policy records another waiting-time bound than this config
        serves with (its decisions then meet states it was not trained in)."""
        policy = load_deployable_policy(spec, device=self.device)
        runtime = getattr(policy, "runtime", None)
        trained_bound = runtime.trained_bound_differs(self.max_wait_steps) if runtime is not None else None
        if trained_bound is not None:
            logger.warning("Feather policy %s was trained with max_wait_steps=%s and serves with %d: its "
                           "decisions meet states it was not trained in", spec, trained_bound, self.max_wait_steps)
        return policy

    @classmethod
    def from_additional_config(cls, additional_config: Mapping | None,
                               environ: Mapping[str, str] = os.environ) -> FeatherConfig:
        """Read ``additional_config["feather"]``; ``policy`` defaults to ``$FEATHER_POLICY``.

        Unknown keys raise ``ValueError`` listing the valid ones.
        """
        section = config_section(cls, additional_config, ADDITIONAL_CONFIG_KEY)
        section.setdefault("policy", environ.get(POLICY_ENV))
        return cls(**section)


def load_deployable_policy(spec: str, *, device: str = "cpu"):
    """The :class:`feather_gym.policies.Policy` named by ``spec``: a baseline that orders by the CHT
    (``"feather-rule"``, ``"feather-hold"``, ``"feather-resident"``, ``"cht"``, ``"cht-dfs"``) or an
    ONNX file.

    Raises ``ValueError`` for a policy that cannot run here (it orders candidates some other
    way than the CHT, reads the simulator's state, or its file's observation contract differs)
    and ``OSError`` for a missing or unreadable file.
    """
    from feather_gym.orderings import CHTOrder
    from feather_gym.policies import SIMULATOR_ONLY, make_policy

    policy = make_policy(spec, device=device)
    if spec in SIMULATOR_ONLY or type(policy.make_order()) is not CHTOrder:
        raise ValueError(f"policy {spec!r} cannot run in the Feather scheduler, which proposes the CHT's "
                         "candidates: use 'feather-rule', 'feather-hold', 'feather-resident', 'cht', 'cht-dfs' or a "
                         "*.onnx policy (vLLM's own scheduler is FCFS)")
    return policy


def trained_workloads(recorded: str | None) -> str | None:
    """A policy file's ``feather.workload`` for a log line: a mix (a JSON list, as ``feather train``
    records it) as its size and first workload, a single workload as it is."""
    try:
        mix = json.loads(recorded or "")
    except ValueError:
        return recorded
    if not isinstance(mix, list) or len(mix) < 2:
        return recorded
    return f"a mix of {len(mix)} workloads, the first {mix[0]} (the file's feather.workload lists them)"


def build_admission(config: FeatherConfig, *, num_running: Callable[[], int], kv_usage: Callable[[], float],
                    max_num_seqs: int, resident_tokens: Callable[[object], int],
                    resumable: Callable[[object, int], int] | None = None) -> Admission:
    """The admission for ``config``: the policy's, or FCFS when the policy is unusable and allowed.

    Raises :class:`PolicyStartupError` (naming the policy and the cause) when the policy is
    missing, corrupt, incompatible or not deployable and ``config.on_policy_error == "refuse"``.
    """
    try:
        if config.policy is None:
            raise FileNotFoundError(f"no policy configured (set additional_config['{ADDITIONAL_CONFIG_KEY}']"
                                    f"['policy'] or ${POLICY_ENV})")
        policy = config.load_policy(config.policy)
    except (OSError, ValueError) as exc:
        if config.on_policy_error == "refuse":
            raise PolicyStartupError(f"Feather scheduler refuses to start: {exc}") from exc
        logger.warning("Feather policy unusable (%s); scheduling FCFS as configured (on_policy_error='fcfs')", exc)
        return FCFSAdmission()
    runtime = getattr(policy, "runtime", None)
    if runtime is not None:
        metadata = runtime.metadata
        logger.info("Feather policy %s loaded (%s, trained on %s / %s)", config.policy,
                    "compiled evaluator" if runtime.kernel == "native" else f"onnxruntime {runtime.provider}",
                    metadata.get("feather.profile"), trained_workloads(metadata.get("feather.workload")))
    return PolicyAdmission(policy, num_running=num_running, kv_usage=kv_usage, max_num_seqs=max_num_seqs,
                           resident_tokens=resident_tokens, max_wait_steps=config.max_wait_steps,
                           resumable=resumable)


class FeatherSchedulingMixin:
    """The Feather changes to a vLLM v1 scheduler class (see the module docstring).

    ``feather_config`` is for in-process construction (tests, benchmarks); vLLM itself never
    passes it, so engines read :class:`FeatherConfig` from ``additional_config``. On a hybrid
    engine (composed with :class:`deploy.hybrid_placement.HybridPlacementMixin`) the policy's
    view counts only resumable shared blocks, through the mixin's ``resumable_blocks``.
    """

    def __init__(self, *args, feather_config: FeatherConfig | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not self.cache_config.enable_prefix_caching:
            raise ValueError("the Feather scheduler needs prefix caching (its CHT is fed with vLLM's block "
                             "hashes, which vLLM computes only then): start vLLM with --enable-prefix-caching")
        if self.policy != SchedulingPolicy.FCFS:
            raise ValueError(f"the Feather scheduler replaces the FCFS waiting queue; scheduling policy "
                             f"{self.policy.value!r} is not supported")
        if self.scheduler_config.async_scheduling and not isinstance(self, AsyncScheduler):
            raise ValueError("vLLM runs async scheduling here: use --scheduler-cls "
                             "deploy.scheduler.FeatherAsyncScheduler")
        config = feather_config or FeatherConfig.from_additional_config(self.vllm_config.additional_config)
        self.waiting = CHTWaitingQueue(ChunkedHashTree(chunk_size=self.hash_block_size))
        reloader = config.make_reloader()           # before loading: a change during the load is seen
        self.admission = build_admission(config, num_running=lambda: len(self.running),
                                         kv_usage=lambda: self.kv_cache_manager.usage,
                                         max_num_seqs=self.max_num_running_reqs,
                                         resident_tokens=ResidentPrefix(self.kv_cache_manager),
                                         resumable=getattr(self, "resumable_blocks", None))
        self.policy_reloader = reloader if isinstance(self.admission, PolicyAdmission) else None
        self.step_log = config.make_step_log()
        self.decode_composition = DecodeComposition(self.hash_block_size)
        self.metrics = getattr(self, "metrics", None) or MetricsRecorder()   # one per scheduler, shared by the mixins
        if isinstance(self.admission, PolicyAdmission):
            self.admission.decision_latencies_ns = []

    def schedule(self, throttle_prefills: bool = False):
        began = time.perf_counter()
        if self.policy_reloader is not None:
            policy = self.policy_reloader.poll()    # between steps: the whole scan below is one policy's
            if policy is not None:
                self.admission.policy = policy
        logging_on = self.step_log.enabled
        start = self.step_log.clock() if logging_on else None
        decisions = None
        if logging_on and isinstance(self.admission, PolicyAdmission):
            decisions = self.admission.decision_log = []
        with self.waiting.admitting(self.admission):
            output = super().schedule(throttle_prefills)
        if logging_on and output.total_num_scheduled_tokens:
            self.step_log.begin(output, self._step_record(output, decisions or []), start)
        self._report_metrics(time.perf_counter() - began)
        return output

    def _report_metrics(self, step_s: float) -> None:
        self.metrics.step(step_s, waiting=len(self.waiting), cht_prefixes=self.waiting.tree.num_prefixes)
        if isinstance(self.admission, PolicyAdmission):
            self.metrics.admission(self.admission.stats)
            self.metrics.decision_latencies(self.admission.decision_latencies_ns)
            self.admission.decision_latencies_ns.clear()
        if self.policy_reloader is not None:
            self.metrics.policy_reloads(swaps=self.policy_reloader.version, refusals=self.policy_reloader.refusals)

    def _step_record(self, output, decisions: list) -> LiveStep:
        """The log record of the step just scheduled (times are set when it ends)."""
        return LiveStep(step=self.step_log.steps, time_unix_s=time.time(), step_wall_s=0.0, step_cpu_s=0.0,
                        **self.decode_composition.update(output, self.requests),
                        running=len(self.running), waiting=len(self.waiting),
                        kv_usage=float(self.kv_cache_manager.usage), decisions=decisions,
                        policy_version=self.policy_reloader.version if self.policy_reloader else 0)

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self.step_log.end(scheduler_output)
        return outputs

    def _free_request(self, request, delay_free_blocks: bool = False):
        self.waiting.finish_running(request)
        self.decode_composition.leave(request.request_id)
        return super()._free_request(request, delay_free_blocks)

    def shutdown(self) -> None:
        self.step_log.close()
        super().shutdown()

    def feather_stats(self) -> dict:
        """The admission's name and counters (decisions, fallbacks, forced admissions...)."""
        return self.admission.describe()


class FeatherScheduler(FeatherSchedulingMixin, Scheduler):
    """Feather on vLLM's synchronous scheduler (the CPU platform; no async scheduling)."""


class FeatherAsyncScheduler(FeatherSchedulingMixin, AsyncScheduler):
    """Feather on vLLM's ``AsyncScheduler`` (GPU engines with async scheduling)."""
