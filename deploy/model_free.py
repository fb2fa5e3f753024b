"""vLLM v1 schedulers driven without a model: a real ``KVCacheManager``, synthetic model outputs.

:func:`model_free_scheduler` builds any scheduler class (vLLM's ``Scheduler`` or
``AsyncScheduler``, a Feather class) the way the engine core does, over a KV cache of
``num_blocks`` blocks of ``block_size`` tokens; the model config is SmolLM2-135M's local folder
(:func:`feather_gym.vllm_engine.ensure_smollm2_hf`), read for its shape only, so nothing
runs a model and nothing is downloaded.

:class:`ModelFreeEngine` steps it as vLLM's ``EngineCore`` does: ``schedule()``, then
``update_from_output()`` with what a model runner would return, one sampled token for every
scheduled request whose prefill is complete after this step (none for a prefill chunk). With
``pipelined`` (async scheduling, vLLM's batch queue of two) the next step is scheduled before
the previous step's output is applied. Requests stop at their ``max_tokens`` (``ignore_eos``).
Like vLLM's ``EngineCore``, the engine freezes the garbage collector's heap when it is built, so
what a step allocates is collected among the objects made after that (requests included).

Invariants: every step's output is applied exactly once, in scheduling order; a pipelined
engine holds at most one step in flight; :meth:`ModelFreeEngine.drain` applies it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

#: The token every synthetic step samples (requests ignore EOS, so its value never ends one).
SAMPLED_TOKEN = 1


def model_free_scheduler(scheduler_cls, *, block_size: int, num_blocks: int, max_num_seqs: int,
                         max_num_batched_tokens: int, max_model_len: int, async_scheduling: bool = False,
                         hybrid: bool = False, enforce_eager: bool = False, **kwargs):
    """A fresh ``scheduler_cls`` over a KV cache of ``num_blocks`` x ``block_size`` tokens (prefix caching on).

    ``hybrid``: the model config is the tiny Qwen3-Next hybrid's
    (:func:`feather_gym.hybrid.model.ensure_hybrid_hf`), so vLLM caches recurrent state in
    ``align`` mode, and the KV cache has one group per layer, as vLLM groups that model: a
    Gated DeltaNet state group for each linear-attention layer, an attention group for the
    full-attention one, the state page padded to at least the attention page.
    """
    import os

    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from feather_gym.hybrid.model import ensure_hybrid_hf
    from feather_gym.vllm_engine import ensure_smollm2_hf

    if min(block_size, num_blocks, max_num_seqs, max_num_batched_tokens, max_model_len) < 1:
        raise ValueError("block_size, num_blocks, max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1")
    scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                       max_model_len=max_model_len, enable_chunked_prefill=True,
                                       is_encoder_decoder=False, async_scheduling=async_scheduling)
    model_dir = ensure_hybrid_hf("tiny") if hybrid else ensure_smollm2_hf()
    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=max_model_len,
                               enforce_eager=enforce_eager)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config)
    vllm_config.cache_config.block_size = block_size      # the platform may prefer another; the scheduler gets this
    cache_config.num_gpu_blocks = num_blocks
    groups = (_hybrid_groups(vllm_config, block_size) if hybrid else
              [KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size, num_kv_heads=1, head_size=1,
                                                             dtype=torch.float32))])
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return scheduler_cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                         structured_output_manager=StructuredOutputManager(vllm_config), block_size=block_size,
                         hash_block_size=block_size, log_stats=True, **kwargs)


def _hybrid_groups(vllm_config, block_size: int) -> list:
    """The KV cache groups of the tiny Qwen3-Next hybrid (see :func:`model_free_scheduler`)."""
    import torch
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

    hf = vllm_config.model_config.hf_config
    state = {"shapes": tuple(Qwen3NextForCausalLM.get_mamba_state_shape_from_config(vllm_config)),
             "dtypes": tuple(Qwen3NextForCausalLM.get_mamba_state_dtype_from_config(vllm_config)),
             "block_size": block_size, "mamba_type": MambaAttentionBackendEnum.GDN_ATTN,
             "mamba_cache_mode": vllm_config.cache_config.mamba_cache_mode}
    attention = FullAttentionSpec(block_size, num_kv_heads=hf.num_key_value_heads, head_size=hf.head_dim,
                                  dtype=torch.float32)
    recurrent = MambaSpec(**state, page_size_padded=max(attention.page_size_bytes, MambaSpec(**state).page_size_bytes))
    return [KVCacheGroupSpec([f"model.layers.{i}.linear_attn"], recurrent) if kind == "linear_attention"
            else KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], attention)
            for i, kind in enumerate(hf.layer_types)]


@dataclass
class StepTiming:
    """One engine step: the thread CPU time of its ``schedule()`` and of its ``update_from_output()``,
    the requests it scheduled for the first time (admitted from the waiting queue, resumed ones
    included), the tokens it scheduled, and the output it returned."""

    schedule_ns: int
    update_ns: int
    admitted: int
    scheduled_tokens: int
    scheduler_output: object = None

    @property
    def step_ns(self) -> int:
        return self.schedule_ns + self.update_ns


class ModelFreeEngine:
    """Steps ``scheduler`` with synthetic model outputs (see the module docstring)."""

    def __init__(self, scheduler, *, pipelined: bool = False, on_schedule=None) -> None:
        from vllm.utils.gc_utils import freeze_gc_heap

        freeze_gc_heap()        # as vLLM's EngineCore does once built: what exists now leaves the GC's generations
        self.scheduler = scheduler
        self.pipelined = pipelined
        #: Called with each ``SchedulerOutput`` right after its ``schedule()``, outside the timing.
        self.on_schedule = on_schedule
        self._in_flight: tuple[object, object, int] | None = None   # (output, runner output, schedule ns)
        self.finished: set[str] = set()

    def add_requests(self, requests: Iterable) -> list[int]:
        """Add ``requests`` to the scheduler; the thread CPU ns of each ``add_request``."""
        clock, add, times = time.thread_time_ns, self.scheduler.add_request, []
        for request in requests:
            start = clock()
            add(request)
            times.append(clock() - start)
        return times

    def step(self) -> StepTiming:
        """One engine step. Pipelined: schedules the next step, then applies the one in flight
        (its ``schedule_ns`` is the in-flight step's, so every figure is one step's own)."""
        clock = time.thread_time_ns
        start = clock()
        output = self.scheduler.schedule()
        schedule_ns = clock() - start
        runner_output = self._runner_output(output)
        if self.on_schedule is not None:
            self.on_schedule(output)
        if self.pipelined:
            previous, self._in_flight = self._in_flight, (output, runner_output, schedule_ns)
            if previous is None:
                return StepTiming(0, 0, 0, 0)
            output, runner_output, schedule_ns = previous
        start = clock()
        engine_outputs = self.scheduler.update_from_output(output, runner_output)
        update_ns = clock() - start
        for outputs in engine_outputs.values():
            self.finished.update(o.request_id for o in outputs.outputs if o.finish_reason is not None)
        return StepTiming(schedule_ns, update_ns, len(output.scheduled_new_reqs),
                          output.total_num_scheduled_tokens, output)

    def drain(self) -> None:
        """Apply the step in flight, if any (pipelined)."""
        if self._in_flight is not None:
            output, runner_output, _ = self._in_flight
            self._in_flight = None
            self.scheduler.update_from_output(output, runner_output)

    def _runner_output(self, output):
        from vllm.v1.outputs import ModelRunnerOutput

        requests = self.scheduler.requests
        req_ids = list(output.num_scheduled_tokens)
        sampled = [[] if requests[rid].is_prefill_chunk else [SAMPLED_TOKEN] for rid in req_ids]
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                                 sampled_token_ids=sampled)


def vllm_requests(trace, *, block_size: int, prefix: str = "", arrival_time: float | None = None) -> list:
    """Real vLLM ``Request`` objects of ``trace`` (sha256 block hashes, greedy, ``ignore_eos``, the
    trace's output lengths), ids ``prefix + request_id``."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(block_size, sha256)
    now = time.time() if arrival_time is None else arrival_time
    return [Request(f"{prefix}{r.request_id}", np.asarray(r.tokens()).tolist(),
                    SamplingParams(max_tokens=max(int(r.output_len), 1), ignore_eos=True, temperature=0.0), None,
                    arrival_time=now, block_hasher=hasher) for r in trace]
