"""Layer-wise SuffixReplay in vLLM: only some decoder layers keep anchors, and the Gated DeltaNet
layers between them are rebuilt by running the decoder layers' own forward over the suffix.

The model-level definition is :func:`feather_gym.hybrid.suffix_replay.replay_layerwise`: the
anchors of an anchored layer ``a`` are its decoder layer's input (the residual stream) at the
``R`` positions before the boundary ``B``; the decoder layers from ``a`` up to the last GDN layer
below the next anchored layer run over them from a zero state, attention layers crossed attending
over the suffix only, and every GDN layer in that span keeps the state it leaves. GDN layers below
the lowest anchored layer start from the suffix tokens' embeddings (no bytes: the token ids are
known); with no anchored layer at all the suffix is recomputed through every layer.

Inside vLLM's forward (0.32/0.33, CPU platform, eager), nothing of vLLM is changed:

* :class:`ReplayQwen3Next` is vLLM's ``Qwen3NextForCausalLM``, registered under the same
  architecture through vLLM's model registry (:func:`register_replay_model`, called by
  :func:`deploy.replay_layer.register_replay_layer`). Built, it hands :data:`~deploy.replay_plan.PLAN`
  its decoder stack and puts a forward pre-hook on every decoder layer: the residual stream is the
  decoder layer's input, which no GDN layer sees (vLLM's decoder layer fuses the residual add into
  ``input_layernorm`` and passes its GDN layer the normalised rows only).
* **capture** (a decoder layer in :attr:`ReplayPlan.residual <deploy.replay_plan.ReplayPlan>`):
  the hook copies the rows ``hidden_states + residual`` of the plan's anchor windows, found as the
  token-wise capture finds them (the request's slot in the layer's GDN metadata).
* **rebuild** (a decoder layer that starts a span, :attr:`ReplayPlan.spans`): for every request
  with a planned :class:`~deploy.replay_plan.Rebuild`, the hook runs the span's decoder layers
  (their own ``forward``: norms, GDN, attention, MoE) over the ``R`` rows at positions
  ``B - R .. B - 1``, with this layer's anchors or the suffix tokens' embeddings as input, under
  substituted metadata (:func:`~deploy.replay_plan.substituted_metadata`): each GDN layer a
  one-request prefill from a zero state into the request's slot of its own group (the token-wise
  rebuild's), each attention layer a one-request causal attention over the suffix alone, whose
  keys and values go to the request's attention block at ``B`` (its first block after the hit,
  which no other request holds; the step's own forward writes that layer's keys and values for
  positions ``B ..`` over them before anything reads them). The states the GDN layers leave in
  the slots are the rebuilt states; the span's output is dropped. Then vLLM's forward goes on.

Replay from the sequence start (``R = B``) through every layer computes what vLLM's prefill of
``0 .. B`` computes, so it reproduces vLLM's own states (``tests/test_replay_live.py``).
"""

from __future__ import annotations

import time

import torch

from deploy.vllm_compat import require_supported_vllm

require_supported_vllm()  # before touching vLLM internals

from vllm import _custom_ops as ops  # noqa: E402
from vllm import envs  # noqa: E402
from vllm.model_executor.model_loader.utils import _MODEL_ARCH_BY_HASH  # noqa: E402
from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM  # noqa: E402
from vllm.model_executor.models.registry import ModelRegistry  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata  # noqa: E402

from deploy.replay_plan import (  # noqa: E402
    PLAN,
    Rebuild,
    gdn_metadata,
    replay_metadata,
    request_rows,
    substituted_metadata,
)

ARCHITECTURE = "Qwen3NextForCausalLM"


def layer_spans(layer_types: list[str], anchored: list[int]) -> dict[int, int]:
    """The spans of layer-wise replay: first decoder layer -> last decoder layer run over the
    suffix. A span starts at each anchored layer, and at the lowest GDN layer when none is
    anchored below it (that span starts from the token embeddings); it ends at the last GDN layer
    before the next start. ``ValueError`` unless every anchored layer is a GDN layer."""
    gdn = [i for i, kind in enumerate(layer_types) if kind == "linear_attention"]
    wrong = sorted(set(anchored) - set(gdn))
    if wrong:
        raise ValueError(f"layer-wise anchors must be at GDN layers {gdn}, got {wrong}")
    starts = sorted(set(anchored) | ({gdn[0]} if gdn and (not anchored or gdn[0] < min(anchored)) else set()))
    spans = {}
    for k, start in enumerate(starts):
        stop = starts[k + 1] if k + 1 < len(starts) else len(layer_types)
        spans[start] = max(g for g in gdn if start <= g < stop)
    return spans


class ReplayQwen3Next(Qwen3NextForCausalLM):
    """vLLM's Qwen3-Next model, plus the decoder-layer hooks of layer-wise replay (see the module
    docstring). Without a layer-wise plan the hooks return at once."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        PLAN.model = self.model
        for index, layer in enumerate(self.model.layers):
            if hasattr(layer, "input_layernorm"):                      # not a pipeline-parallel stand-in
                layer.register_forward_pre_hook(_decoder_hook(index), with_kwargs=True)


def _decoder_hook(index: int):
    def hook(module, args, kwargs):
        if PLAN.spans and not PLAN.idle and (index in PLAN.spans or index in PLAN.residual):
            metadata = gdn_metadata(module.linear_attn.prefix)
            if metadata is not None:
                _capture_and_rebuild(index, kwargs["hidden_states"], kwargs["residual"], metadata)
    return hook


def _capture_and_rebuild(index: int, hidden: torch.Tensor, residual: torch.Tensor | None, metadata) -> None:
    """Decoder layer ``index``'s captures (rows of its input, the residual stream ``hidden +
    residual``) and the rebuilds of the span it starts, for every request in ``metadata``."""
    for slot, first in request_rows(metadata):
        if index in PLAN.residual:
            for capture in PLAN.captures.get(slot, ()):
                lo, hi = first + capture.chunk_row, first + capture.chunk_row + capture.count
                PLAN.capture(index, capture, hidden[lo:hi] if residual is None else hidden[lo:hi] + residual[lo:hi])
        rebuild = PLAN.rebuilds.get(slot)
        if rebuild is not None and index in PLAN.spans:
            started = time.perf_counter()
            PLAN.rebuilt_states += replay_span(index, PLAN.spans[index], rebuild, hidden.dtype)
            PLAN.rebuild_s += time.perf_counter() - started


@torch.inference_mode()
def replay_span(start: int, stop: int, rebuild: Rebuild, dtype: torch.dtype) -> int:
    """Run decoder layers ``start .. stop`` over the suffix of ``rebuild`` (from the anchors of
    ``start``, else the suffix tokens' embeddings), leaving each GDN layer's rebuilt state in the
    request's slot; returns the number of GDN states rebuilt."""
    model = PLAN.model
    hidden = rebuild.anchors.get(start)
    hidden = model.embed_input_ids(rebuild.tokens) if hidden is None else hidden.to(dtype)
    rows = hidden.size(0)
    positions = torch.arange(rebuild.boundary - rows, rebuild.boundary, dtype=torch.int64)
    layers = [model.layers[j] for j in range(start, stop + 1)]
    gdn = {layer.linear_attn.prefix: replay_metadata(rebuild.blocks[j], rows)
           for j, layer in zip(range(start, stop + 1), layers) if hasattr(layer, "linear_attn")}
    attention = {layer.self_attn.attn: rebuild.blocks[j]
                 for j, layer in zip(range(start, stop + 1), layers) if hasattr(layer, "self_attn")}
    metadata = {**gdn, **{attn.layer_name: suffix_attention_metadata(attn, block, rows, dtype)
                          for attn, block in attention.items()}}
    slots = {attn.layer_name: block * attn.kv_cache.size(2) + torch.arange(rows, dtype=torch.int64)
             for attn, block in attention.items()}
    with substituted_metadata(metadata, slots):
        residual = None
        for layer in layers:
            hidden, residual = layer(positions=positions, hidden_states=hidden, residual=residual)
    return len(gdn)


def suffix_attention_metadata(attn, block: int, rows: int, dtype: torch.dtype) -> CPUAttentionMetadata:
    """vLLM's CPU attention metadata of one request of ``rows`` new tokens and no past, held in
    KV block ``block``: causal attention over those rows alone."""
    impl = attn.impl
    query_start = torch.tensor([0, rows], dtype=torch.int32)
    seq_lens = torch.tensor([rows], dtype=torch.int32)
    return CPUAttentionMetadata(
        num_actual_tokens=rows, max_query_len=rows, query_start_loc=query_start, max_seq_len=rows,
        seq_lens=seq_lens, block_table=torch.tensor([[block]], dtype=torch.int32), slot_mapping=None, causal=True,
        scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads, head_dim=impl.head_size,
            seq_lens=seq_lens, dtype=dtype, query_start_loc=query_start, causal=True,
            sliding_window_size=impl.sliding_window, isa=attn.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=impl.kv_cache_dtype))


def require_moe_layers_by_name(compilation_config) -> None:
    """Refuse layer-wise replay where vLLM finds a forward's MoE layers by call order
    (``fast_moe_cold_start``, vLLM's default under torch < 2.11): a span's MoE calls inside the
    forward would shift that order for every layer after it. By name (torch >= 2.11) they do not."""
    if compilation_config.fast_moe_cold_start:
        raise ValueError("layer-wise SuffixReplay runs decoder layers (their MoE blocks included) inside the "
                         "forward, but this engine finds MoE layers by call order (compilation_config."
                         "fast_moe_cold_start, on by default under torch < 2.11: vllm/forward_context.py "
                         "all_moe_layers, moe_runner.get_layer_from_name): start it with fast_moe_cold_start=False")


def register_replay_model() -> None:
    """Have vLLM build :class:`ReplayQwen3Next` for the ``Qwen3NextForCausalLM`` architecture, for
    every engine started afterwards in this process (idempotent). vLLM caches each model path's
    resolved class (``_MODEL_ARCH_BY_HASH``), so the entries of engines started before on vLLM's own
    class are dropped: the next engine on that path resolves again and builds the replay model."""
    ModelRegistry.register_model(ARCHITECTURE, ReplayQwen3Next)
    for key, (model_cls, _) in list(_MODEL_ARCH_BY_HASH.items()):
        if model_cls is Qwen3NextForCausalLM:
            del _MODEL_ARCH_BY_HASH[key]
