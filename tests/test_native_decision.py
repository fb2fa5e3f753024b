"""The compiled decision path against its definitions.

The observation's kernel is checked column by column against the feature table of
``feather_gym.observation`` (computed here from the CHT's candidate statistics and the view),
normalisation against numpy's float32 arithmetic, and the layout (rows, then slot masks). The
dense evaluator is checked against onnxruntime on the exporter's files, tanh and relu, Gemm and
MatMul+Add graphs; any other graph is served by onnxruntime.
"""

from __future__ import annotations

import deploy_policies as policies
import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from cache_core.cht.tree import ChunkedHashTree
from feather_gym.observation import (
    _INV_SCALE,
    _OFFSET,
    FEATURE_INDEX,
    NUM_FEATURES,
    OBS_CLIP,
    DecisionPoint,
    normalise,
    observation_size,
    raw_feature_rows,
)
from feather_gym.policy_runtime import OnnxPolicy, PolicyOutputError, dense_layers


class View:
    """An AdmissionView with made-up figures; resumable is a fixed share of the blocks asked about."""

    def __init__(self, tree: ChunkedHashTree, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.tree = tree
        self.num_running = int(rng.integers(0, 300))
        self.kv_utilisation = float(rng.uniform())
        self.oldest_wait_steps = int(rng.integers(0, 100))
        self._context = {request_id: int(rng.integers(1, 20_000)) for request_id in tree.waiting_ids()}
        self._resident = {request_id: int(rng.integers(0, 40)) for request_id in tree.waiting_ids()}

    def context_tokens(self, request_id) -> int:
        return self._context[request_id]

    def resident_blocks(self, request_id) -> int:
        return self._resident[request_id]

    def resumable_blocks(self, request_id, shared_blocks: int) -> int:
        return shared_blocks // 2


def tree_with_groups(seed: int) -> ChunkedHashTree:
    rng = np.random.default_rng(seed)
    tree = ChunkedHashTree(chunk_size=4)
    stems = [rng.integers(0, 50, 4 * int(rng.integers(1, 6))) for _ in range(4)]
    for i in range(30):
        tail = rng.integers(0, 50, int(rng.integers(0, 20)))
        tree.add(i, tree.digests_of(np.concatenate([stems[i % 4], tail])))
    for _ in range(6):
        tree.activate(tree.find_best())
    return tree


def expected_row(view: View, request_id) -> list[float]:
    """The feature table of feather_gym.observation, feature by feature."""
    tree, stats = view.tree, view.tree.candidate_stats(request_id)
    row = [0.0] * NUM_FEATURES
    row[FEATURE_INDEX["batch_size"]] = view.num_running
    row[FEATURE_INDEX["chunk_loss_tokens"]] = stats.chunk_loss * tree.chunk_size
    row[FEATURE_INDEX["same_prefix_waiting"]] = stats.same_prefix_waiting
    row[FEATURE_INDEX["running_common_prefix_tokens"]] = tree.running_common_prefix * tree.chunk_size
    row[FEATURE_INDEX["candidate_context_tokens"]] = view.context_tokens(request_id)
    row[FEATURE_INDEX["candidate_cached_fraction"]] = (
        view.resumable_blocks(request_id, stats.shared_chunks) / stats.num_chunks if stats.num_chunks else 0.0)
    row[FEATURE_INDEX["kv_utilisation"]] = view.kv_utilisation
    row[FEATURE_INDEX["num_waiting"]] = tree.num_waiting
    row[FEATURE_INDEX["oldest_wait_steps"]] = view.oldest_wait_steps
    row[FEATURE_INDEX["candidate_resident_tokens"]] = (
        view.resumable_blocks(request_id, view.resident_blocks(request_id)) * tree.chunk_size)
    return row


@pytest.mark.parametrize("seed", range(5))
def test_each_feature_column_is_its_definition(seed):
    view = View(tree_with_groups(seed), seed)
    candidates = view.tree.top_candidates(4)
    rows = raw_feature_rows(view, candidates)
    assert rows.dtype == np.float64 and rows.shape == (len(candidates), NUM_FEATURES)
    np.testing.assert_array_equal(rows, [expected_row(view, c) for c in candidates])


def test_normalise_is_float32_arithmetic_with_the_clip():
    raw = np.random.default_rng(0).uniform(-100, 30_000, (50, NUM_FEATURES))
    numpy_way = np.clip((raw.astype(np.float32) - _OFFSET) * _INV_SCALE, 0.0, OBS_CLIP)
    got = normalise(raw)
    assert got.dtype == np.float32 and got.shape == raw.shape
    np.testing.assert_array_equal(got, numpy_way)
    np.testing.assert_array_equal(normalise(raw.reshape(5, 10, NUM_FEATURES)), numpy_way.reshape(5, 10, NUM_FEATURES))
    with pytest.raises(ValueError, match="raw features"):
        normalise(np.zeros((3, NUM_FEATURES + 1)))


@pytest.mark.parametrize("filled", [1, 3, 4])
def test_the_observation_is_the_normalised_rows_then_the_slot_masks(filled):
    view = View(tree_with_groups(7), 7)
    candidates = view.tree.top_candidates(4)[:filled]
    point = DecisionPoint(view, candidates, step=1, num_candidates=4)
    rows = np.zeros((4, NUM_FEATURES))
    rows[:filled] = [expected_row(view, c) for c in candidates]
    np.testing.assert_array_equal(point.raw_rows, rows)
    np.testing.assert_array_equal(point.raw, rows[0])
    mask = (np.arange(1, 4) < filled).astype(np.float32)
    assert point.observation.shape == (observation_size(4),)
    np.testing.assert_array_equal(point.observation, np.concatenate([normalise(rows).ravel(), mask]))


def _matmul_add_policy(path, activation: str):
    """A two-layer network written as MatMul + Add nodes by hand (not the exporter's Gemm)."""
    source = policies.untrained_policy(path.with_suffix(".gemm.onnx"), k=4)
    model = onnx.load(source)
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    (w1, b1), (w2, b2) = [(weights[n.input[1]], weights[n.input[2]]) for n in model.graph.node if n.op_type == "Gemm"]
    nodes = [helper.make_node("MatMul", ["obs", "w1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["h1"]),
             helper.make_node(activation, ["h1"], ["a1"]),
             helper.make_node("MatMul", ["a1", "w2"], ["m2"]), helper.make_node("Add", ["m2", "b2"], ["action_logits"])]
    inits = [numpy_helper.from_array(a, n) for n, a in (("w1", w1.T.copy()), ("b1", b1), ("w2", w2.T.copy()),
                                                        ("b2", b2))]
    graph = helper.make_graph(nodes, "mlp", list(model.graph.input), list(model.graph.output), inits)
    out = helper.make_model(graph, opset_imports=list(model.opset_import))
    out.ir_version = model.ir_version
    out.metadata_props.extend(model.metadata_props)
    onnx.save_model(out, path)
    return path


@pytest.mark.parametrize("build", ["gemm-tanh", "matmul-tanh", "matmul-relu"])
def test_dense_policies_run_compiled_and_act_as_onnxruntime(tmp_path, build):
    path = tmp_path / "p.onnx"
    if build == "gemm-tanh":
        policies.untrained_policy(path, k=4)
    else:
        _matmul_add_policy(path, "Tanh" if build.endswith("tanh") else "Relu")
    policy = OnnxPolicy(path)
    assert policy.kernel == "native" and dense_layers(path) is not None
    rows = np.random.default_rng(2).uniform(0.0, OBS_CLIP, (500, policy.num_features)).astype(np.float32)
    logits = policy.logits(rows)
    expected = [int(np.argmax(row)) for row in logits]
    assert [policy.act(row) for row in rows] == expected
    assert len(set(expected)) > 1                       # the network answers differently across rows


def test_other_graphs_are_served_by_onnxruntime(tmp_path):
    torch.manual_seed(0)
    size = observation_size(1)
    network = torch.nn.Sequential(torch.nn.Linear(size, 8), torch.nn.Sigmoid(), torch.nn.Linear(8, 2))
    path = policies.export(network, tmp_path / "sigmoid.onnx")
    policy = OnnxPolicy(path)
    assert dense_layers(path) is None and policy.kernel == "onnxruntime"
    row = np.full(size, 0.5, dtype=np.float32)
    assert policy.act(row) == int(np.argmax(policy.logits(row[None])[0]))


def test_non_finite_logits_raise_on_the_compiled_path(tmp_path):
    nan = policies.nan_policy(policies.constant_policy(tmp_path / "add.onnx", 1), tmp_path / "nan.onnx")
    policy = OnnxPolicy(nan)
    assert policy.kernel == "native"
    with pytest.raises(PolicyOutputError, match="non-finite"):
        policy.act(np.zeros(NUM_FEATURES, dtype=np.float32))
