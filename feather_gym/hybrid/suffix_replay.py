"""SuffixReplay on the real hybrid model: rebuild Gated DeltaNet (GDN) states at a page boundary
by replaying a short suffix of each linear layer's inputs ("anchors") from a zero state.

Everything here runs transformers' own ``Qwen3NextForCausalLM`` modules (no re-implemented
layers). Definitions, for a prefix of token ids ``x[0:T]`` and a page boundary ``p``
(a multiple of the page size, ``p <= T``):

* **GDN state at p** of layer ``l``: the pair (conv state, recurrent state) that layer leaves in
  the model's ``DynamicCache`` after the prefix ``x[0:p]``: conv state ``[1, conv_dim, K]``
  (the projected q/k/v inputs of the last ``K = linear_conv_kernel_dim`` tokens, as transformers
  keeps it; vLLM keeps ``K - 1``) and recurrent state ``[1, v_heads, k_dim, v_dim]``.
  :func:`run_prefix` computes it exactly (page-chunked prefill with the model's cache).
* **Anchors** of layer ``l`` at ``p`` with ``R`` replay tokens: the hidden states the GDN
  module's ``forward`` receives (its input, after the decoder layer's ``input_layernorm``) at
  positions ``[p - R, p)``, shape ``[R, hidden]``. Captured by forward pre-hooks on the GDN
  modules. :func:`run_prefix` also captures the decoder-layer inputs (the residual stream),
  which the layer-wise variant needs (the RMSNorm is not invertible, so GDN inputs cannot
  feed the layers above).
* **Replay** (:func:`replay_layer`): the same GDN module's ``forward`` over the anchors with a
  fresh ``DynamicCache`` (zero state); the state it leaves is the rebuilt state. Invariant
  (``tests/test_suffix_replay.py``): with ``R = p`` the rebuilt state equals the exact one to
  float tolerance (float32), since the two computations differ only in chunking. With
  ``R >= K`` the conv state is exact (it depends on the last ``K`` inputs only); the recurrent
  state's error is the exact state at ``p - R`` carried through the ``R`` gated delta-rule
  transitions ``exp(g_t) (I - beta_t k_t k_t^T)``, which shrink it.
* **Token-wise sparsity** (:func:`allocate_replay_tokens`): per-layer ``R_l`` within a global
  budget ``sum_l R_l``, proportional to a per-layer weight (equal, or the layer's measured
  memory length, :func:`memory_lengths`).
* **Layer-wise sparsity** (:func:`replay_layerwise`): only some GDN layers keep anchors, and
  these are residual-stream anchors (decoder-layer inputs). The GDN layers above an anchored
  one, up to the next anchored one, are rebuilt by running the decoder layers in between over
  the ``R`` suffix tokens from a fresh cache. Approximation: attention layers in between attend
  only over the replayed suffix (not over the exact prefix KV), and each non-anchored GDN layer
  sees inputs computed from replayed, not exact, states below it. With ``suffix_tokens`` the
  lowest layers can start from the token embeddings (free: the token ids are known), which at
  "no anchored layer" is plain suffix recomputation.
* **Continuation** (:func:`continuation_logits`): a new cache holding the exact attention KV of
  ``x[0:p]`` and the given GDN states, then the model's forward over the following tokens.
  Exact states through the same call reproduce a full forward (tested), so any difference in
  logits is due to the replayed states alone.

All tensors here have batch size 1; anchors are stored without the batch dimension.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch


class GDNState(NamedTuple):
    """One GDN layer's cache state: conv ``[1, conv_dim, K]`` and recurrent ``[1, v_heads, k_dim, v_dim]``."""

    conv: torch.Tensor
    recurrent: torch.Tensor


def gdn_modules(model) -> dict[int, torch.nn.Module]:
    """Decoder-layer index -> that layer's GDN module (``Qwen3NextGatedDeltaNet``), ascending."""
    return {i: layer.linear_attn for i, layer in enumerate(model.model.layers) if hasattr(layer, "linear_attn")}


def layerwise_anchor_layers(layer_types: list[str]) -> list[int]:
    """Layer-wise replay's anchored layers: each GDN (``linear_attention``) layer right after an
    attention layer; the layers between are rebuilt through the decoder layers from them."""
    return [i for i in range(1, len(layer_types))
            if layer_types[i] == "linear_attention" and layer_types[i - 1] == "full_attention"]


def fresh_cache(model):
    """An empty ``DynamicCache`` of the model's layer layout (zero GDN states, no KV)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def read_state(cache, layer: int) -> GDNState:
    """A copy of GDN layer ``layer``'s state in ``cache``."""
    cached = cache.layers[layer]
    return GDNState(cached.conv_states[0].detach().clone(), cached.recurrent_states[0].detach().clone())


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact||_F / ||exact||_F`` (in float64); ``inf`` if the exact tensor is zero and they differ."""
    diff = torch.linalg.vector_norm((approx - exact).double()).item()
    norm = torch.linalg.vector_norm(exact.double()).item()
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


@dataclass
class PrefixRun:
    """An exact pass over a prefix: captured layer inputs, GDN states at chosen boundaries, the cache.

    ``gdn_inputs[l]`` / ``residuals[l]`` are ``[T, hidden]``: the GDN module's input and the
    decoder layer's input at every prefix position. ``states[p][l]`` is GDN layer ``l``'s
    exact state after ``x[0:p]``. ``cache`` is the model cache after the whole prefix (its
    attention KV covers all ``T`` tokens; :func:`continuation_logits` crops it to ``p``).
    """

    token_ids: torch.Tensor
    gdn_inputs: dict[int, torch.Tensor]
    residuals: dict[int, torch.Tensor]
    states: dict[int, dict[int, GDNState]]
    cache: object = field(repr=False)

    def anchors(self, p: int, replay_tokens: int | dict[int, int], *, residual: bool = False,
                layers=None) -> dict[int, torch.Tensor]:
        """Anchors at boundary ``p``: layer -> the last ``R_l`` inputs before ``p`` (``[R_l, hidden]``).

        ``replay_tokens`` is one ``R`` for every layer or a per-layer dict (its keys are then the
        layers); ``residual`` selects decoder-layer inputs instead of GDN inputs.
        """
        source = self.residuals if residual else self.gdn_inputs
        if isinstance(replay_tokens, dict):
            per_layer = replay_tokens
        else:
            per_layer = dict.fromkeys(source if layers is None else layers, int(replay_tokens))
        for layer, r in per_layer.items():
            if layer not in source:
                raise ValueError(f"layer {layer} has no captured inputs (GDN layers: {sorted(source)})")
            if not 1 <= r <= p <= source[layer].shape[0]:
                raise ValueError(f"need 1 <= R ({r}) <= p ({p}) <= prefix length ({source[layer].shape[0]})")
        return {layer: source[layer][p - r:p] for layer, r in per_layer.items()}


@torch.no_grad()
def run_prefix(model, token_ids, boundaries, *, capture: bool = True) -> PrefixRun:
    """Run the model over ``token_ids`` with its cache, in chunks ending at each boundary, and keep
    the exact GDN states at every boundary (and, with ``capture``, every layer input).

    Only the last position's logits are computed (``logits_to_keep=1``), so long prefixes do
    not materialise ``T x vocab`` logits.
    """
    ids = torch.as_tensor(np.asarray(token_ids), dtype=torch.long).reshape(-1)
    cuts = sorted({int(b) for b in boundaries})
    if not cuts or cuts[0] < 1 or cuts[-1] > ids.numel():
        raise ValueError(f"boundaries must lie in [1, {ids.numel()}], got {boundaries}")
    modules = gdn_modules(model)
    gdn_chunks: dict[int, list] = {i: [] for i in modules}
    residual_chunks: dict[int, list] = {i: [] for i in modules}
    hooks = []
    if capture:
        for i, module in modules.items():
            hooks.append(module.register_forward_pre_hook(
                lambda _m, args, kwargs, i=i: gdn_chunks[i].append(_first_input(args, kwargs)[0].clone()),
                with_kwargs=True))
            hooks.append(model.model.layers[i].register_forward_pre_hook(
                lambda _m, args, kwargs, i=i: residual_chunks[i].append(_first_input(args, kwargs)[0].clone()),
                with_kwargs=True))
    cache, states, start = fresh_cache(model), {}, 0
    try:
        for end in cuts + ([ids.numel()] if cuts[-1] < ids.numel() else []):
            model(ids[None, start:end], past_key_values=cache, use_cache=True, logits_to_keep=1)
            if end in cuts:
                states[end] = {i: read_state(cache, i) for i in modules}
            start = end
    finally:
        for hook in hooks:
            hook.remove()
    joined = lambda chunks: {i: torch.cat(c) for i, c in chunks.items() if c}  # noqa: E731
    return PrefixRun(ids, joined(gdn_chunks), joined(residual_chunks), states, cache)


def _first_input(args, kwargs) -> torch.Tensor:
    """The hidden states a module's forward receives (positional or ``hidden_states=``)."""
    return args[0] if args else kwargs["hidden_states"]


@torch.no_grad()
def replay_layer(model, layer: int, anchors: torch.Tensor) -> GDNState:
    """Rebuild GDN layer ``layer``'s state by running that module's own forward over ``anchors``
    (``[R, hidden]``) from a zero state (a fresh cache), and reading the state it leaves."""
    module = gdn_modules(model)[layer]
    cache = fresh_cache(model)
    module(anchors[None].to(module.in_proj_qkvz.weight.dtype), cache_params=cache)
    return read_state(cache, layer)


def replay_states(model, anchors: dict[int, torch.Tensor]) -> dict[int, GDNState]:
    """:func:`replay_layer` for every anchored layer (token-wise: each layer from its own anchors)."""
    return {layer: replay_layer(model, layer, a) for layer, a in anchors.items()}


@torch.no_grad()
def replay_layerwise(model, residual_anchors: dict[int, torch.Tensor], p: int,
                     suffix_tokens: torch.Tensor | None = None) -> dict[int, GDNState]:
    """Rebuild every GDN layer's state at ``p`` from residual-stream anchors at a subset of layers.

    For each anchored layer ``a`` (its decoder-layer input ``[R, hidden]`` at positions
    ``[p - R, p)``), the decoder layers from ``a`` up to the last GDN layer below the next
    anchored layer run over the suffix with a fresh cache and positions ``p - R .. p - 1``; every
    GDN layer in that span takes the state it leaves. With ``suffix_tokens`` (the ``R`` token
    ids before ``p``) and layer 0 unanchored, layer 0 starts from the token embeddings.
    Approximate above the anchored layer (see the module docstring); ``ValueError`` if a GDN layer
    has no anchored layer (or embeddings) below it.
    """
    starts = dict(residual_anchors)
    if suffix_tokens is not None and 0 not in starts:
        starts[0] = model.model.embed_tokens(torch.as_tensor(suffix_tokens, dtype=torch.long).reshape(1, -1))[0]
    gdn = sorted(gdn_modules(model))
    if not starts or min(gdn) < min(starts):
        raise ValueError(f"GDN layers {[g for g in gdn if not starts or g < min(starts)]} have no anchored layer "
                         f"below them; anchor them or pass suffix_tokens")
    order = sorted(starts)
    states = {}
    for k, start in enumerate(order):
        stop = order[k + 1] if k + 1 < len(order) else len(model.model.layers)
        span = [g for g in gdn if start <= g < stop]
        if not span:
            continue
        hidden = starts[start][None]
        positions = torch.arange(p - hidden.shape[1], p)[None]
        embeddings = model.model.rotary_emb(hidden, positions)
        cache = fresh_cache(model)
        for j in range(start, span[-1] + 1):
            hidden = model.model.layers[j](hidden, position_embeddings=embeddings, attention_mask=None,
                                           position_ids=positions, past_key_values=cache)
        states.update({g: read_state(cache, g) for g in span})
    return states


def cache_at(model, exact_cache, p: int, gdn_states: dict[int, GDNState]):
    """A new cache at boundary ``p``: attention KV of ``exact_cache`` cropped to ``p`` tokens (copied)
    and the given GDN states (every GDN layer must have one)."""
    missing = sorted(set(gdn_modules(model)) - set(gdn_states))
    if missing:
        raise ValueError(f"no GDN state for layers {missing}")
    cache = fresh_cache(model)
    for i, layer in enumerate(cache.layers):
        if i in gdn_states:
            conv, recurrent = gdn_states[i]
            layer.lazy_initialization(conv_states=conv, recurrent_states=recurrent, conv_kernel_size=conv.shape[-1])
            layer.conv_states[0].copy_(conv)
            layer.recurrent_states[0].copy_(recurrent)
            layer.has_previous_state[0] = True
        else:
            source = exact_cache.layers[i]
            if source.get_seq_length() < p:
                raise ValueError(f"exact attention KV holds {source.get_seq_length()} tokens, need {p}")
            layer.update(source.keys[:, :, :p].clone(), source.values[:, :, :p].clone())
    return cache


@torch.no_grad()
def continuation_logits(model, exact_cache, p: int, gdn_states: dict[int, GDNState], tokens) -> torch.Tensor:
    """Logits ``[n, vocab]`` (float32) of the model over ``tokens`` (the ``n`` tokens after ``p``),
    resuming from the exact attention KV of ``x[0:p]`` and ``gdn_states``: row ``i`` predicts the
    token after ``tokens[i]``."""
    ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long).reshape(1, -1)
    out = model(ids, past_key_values=cache_at(model, exact_cache, p, gdn_states), use_cache=True)
    return out.logits[0].float()


def gdn_log_decay(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """A GDN layer's per-token, per-head log decay ``g = -exp(A_log) * softplus(a + dt_bias)``
    (float32, ``<= 0``), from the gate input ``a`` ``[..., heads]`` its ``in_proj_ba`` projects
    and the layer's parameters ``A_log`` (``a_log``) and ``dt_bias``."""
    return -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())


def head_memory_tokens(log_decay: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    """Per head, tokens until its gate decays a state by ``eps``, from the log decay ``[tokens,
    heads]``: ``ln(eps) / mean_t g`` (geometric-mean decay; the delta rule's erasure shortens memory
    further, so this is an upper-bound-style weight)."""
    return math.log(eps) / log_decay.float().mean(0).clamp(max=-1e-9)


def gate_memory_tokens(log_decay: torch.Tensor, eps: float = 1e-3) -> float:
    """The slowest head's :func:`head_memory_tokens`."""
    return float(head_memory_tokens(log_decay, eps).max())


@torch.no_grad()
def head_memory_lengths(model, gdn_inputs: dict[int, torch.Tensor], eps: float = 1e-3) -> dict[int, list[float]]:
    """Per GDN layer and value head: tokens until the gate decays a state's contribution by ``eps``
    (:func:`head_memory_tokens`), over the captured inputs, with
    the module's own projections and gate parameters (:func:`gdn_log_decay`)."""
    lengths = {}
    for layer, module in gdn_modules(model).items():
        x = gdn_inputs[layer][None].to(module.in_proj_ba.weight.dtype)
        *_, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x), module.in_proj_ba(x))
        lengths[layer] = head_memory_tokens(gdn_log_decay(a[0], module.A_log, module.dt_bias), eps).tolist()
    return lengths


def memory_lengths(model, gdn_inputs: dict[int, torch.Tensor], eps: float = 1e-3) -> dict[int, float]:
    """Per GDN layer: its slowest head's :func:`head_memory_lengths`."""
    return {layer: max(heads) for layer, heads in head_memory_lengths(model, gdn_inputs, eps).items()}


def allocate_replay_tokens(budget: int, weights: dict[int, float], *, minimum: int = 1,
                           maximum: int | None = None) -> dict[int, int]:
    """Split a global replay budget (tokens summed over layers) into per-layer ``R_l``.

    ``R_l`` is proportional to ``weights[l]`` (all-equal weights give an equal split), rounded by
    largest remainder so that ``sum R_l == budget`` exactly, with every ``R_l`` in
    ``[minimum, maximum]``: ``R_l = clip(lam * w_l, minimum, maximum)`` (a capped layer's surplus
    goes to the others, by weight), with ``lam`` solved exactly on the piecewise-linear sum
    between its breakpoints ``minimum / w_l`` and ``maximum / w_l``.
    ``ValueError`` if the budget cannot satisfy the bounds.
    """
    layers = sorted(weights)
    n = len(layers)
    cap = budget if maximum is None else maximum
    if not layers or budget < n * minimum or budget > n * cap:
        raise ValueError(f"budget {budget} cannot give {n} layers between {minimum} and {cap} tokens each")
    w = np.array([max(float(weights[l]), 0.0) for l in layers])
    w = np.where(w > 0, w, 1e-9 * w.max()) if w.max() > 0 else np.ones(n)
    points = np.unique(np.concatenate([minimum / w, cap / w]))     # the sum is linear between these
    sums = np.clip(points[:, None] * w, minimum, cap).sum(axis=1)  # n * minimum ... n * cap, non-decreasing
    j = int(np.searchsorted(sums, budget))                         # the first breakpoint reaching the budget
    lam = points[0] if j == 0 else points[j - 1] + (budget - sums[j - 1]) * (
        (points[j] - points[j - 1]) / (sums[j] - sums[j - 1]))
    alloc = np.clip(lam * w, minimum, cap)
    rounded = np.clip(np.floor(alloc + 1e-6).astype(int), minimum, cap)
    order = np.argsort(-(alloc - rounded), kind="stable")
    while rounded.sum() != budget:                   # largest remainder first, one token per layer per pass
        step = 1 if rounded.sum() < budget else -1
        room = [k for k in (order if step > 0 else order[::-1]) if minimum <= rounded[k] + step <= cap]
        rounded[room[:abs(budget - int(rounded.sum()))]] += step
    return {l: int(r) for l, r in zip(layers, rounded)}


def timed(fn, *args, repeats: int = 3, **kwargs) -> tuple[float, object]:
    """(median wall seconds over ``repeats`` calls, the last result)."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        times.append(time.perf_counter() - start)
    return float(np.median(times)), result
