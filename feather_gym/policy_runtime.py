"""The Feather ONNX policy at serving time: load, validate, choose STOP or a candidate in microseconds.

A policy file (the contract: input ``obs`` float32 ``[N, F]`` already normalised, ``F =
observation_size(k)``; output ``action_logits`` float32 ``[N, k + 1]``; ``feather.*`` metadata,
``feather.num_candidates`` = ``k``) is accepted only when its observation contract equals the
one this code builds for its ``k`` (:func:`feather_gym.observation.observation_contract`): same
``OBS_VERSION``, feature names in the same order, same normalisation, same action meanings.
Anything else is refused with :class:`PolicyLoadError` naming both versions, so a policy never
sees numbers it was not trained on.

Latency. A policy file whose graph is a chain of dense layers (what :mod:`trainer.export` writes:
``Gemm``, or ``MatMul`` then ``Add``, with ``Tanh`` or ``Relu`` between them) runs on the CPU in a
compiled evaluator (:class:`feather_gym._dense.DenseNet`), with no runtime call in between: it is
built from the file's weights and accepted only when its logits equal onnxruntime's within
:data:`NATIVE_PARITY_ATOL` on random observations (``kernel == "native"``). Any other graph, a
file that fails that check, or ``device="cuda"`` runs on onnxruntime (``kernel ==
"onnxruntime"``): a single-threaded session with no thread pool (nothing spins on the serving
cores), through an ``IOBinding`` to preallocated buffers. Either way a decision allocates nothing.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np

from feather_gym.observation import STOP, check_num_candidates, observation_contract, observation_size

logger = logging.getLogger(__name__)

INPUT_NAME = "obs"
OUTPUT_NAME = "action_logits"
#: Execution providers by the ``device`` argument of :class:`OnnxPolicy`.
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
#: Largest logit difference from onnxruntime at which the compiled evaluator serves a policy.
NATIVE_PARITY_ATOL = 1e-4
#: Random observations (uniform over the normalised range) that check it at load.
NATIVE_PARITY_ROWS = 256


def parity_observations(num_features: int) -> np.ndarray:
    """The :data:`NATIVE_PARITY_ROWS` random observations (float32, seeded, within the
    observation's clip) on which a compiled copy of a network must give its logits."""
    from feather_gym.observation import OBS_CLIP

    return np.random.default_rng(0).uniform(0.0, OBS_CLIP, (NATIVE_PARITY_ROWS, num_features)).astype(np.float32)
#: Gemm attributes (with ONNX's defaults) of a plain dense layer: alpha = beta = 1, A not transposed.
PLAIN_GEMM = (("alpha", 1.0), ("beta", 1.0), ("transA", 0))
#: ONNX activations the compiled evaluator runs, by the name it knows them by.
DENSE_ACTIVATIONS = {"Tanh": "tanh", "Relu": "relu"}


class PolicyLoadError(ValueError):
    """The policy file is unreadable, malformed or built for another observation contract."""


class PolicyOutputError(ValueError):
    """The policy returned non-finite logits for an observation."""


class MissingOnnxRuntimeError(ImportError):
    """onnxruntime is not installed; the message names the extra that brings it."""


def import_onnxruntime():
    """The ``onnxruntime`` module, or :class:`MissingOnnxRuntimeError` naming the serving extras.

    Each serving extra carries its runtime (``cpu``: ``onnxruntime``, ``cuda``: ``onnxruntime-gpu``);
    the ``train`` extra relies on the one beside it.
    """
    try:
        import onnxruntime
    except ImportError as exc:
        raise MissingOnnxRuntimeError(
            "an ONNX policy needs onnxruntime, which is not installed: pip install 'feather-gym[cpu]' "
            "(onnxruntime) or 'feather-gym[cuda]' (onnxruntime-gpu)") from exc
    return onnxruntime


def check_metadata(path: str | os.PathLike, metadata: dict[str, str]) -> int:
    """The policy's candidate count ``k``; :class:`PolicyLoadError` unless ``metadata`` (raw
    strings) matches this version's :func:`~feather_gym.observation.observation_contract` for
    that ``k``.

    The message names the file, the field, and both the policy's and this build's observation
    versions.
    """
    ours = observation_contract()["feather.obs_version"]
    theirs = metadata.get("feather.obs_version", "<missing>")
    k = 1
    if theirs == ours and "feather.num_candidates" in metadata:
        try:
            k = check_num_candidates(json.loads(metadata["feather.num_candidates"]))
        except (json.JSONDecodeError, ValueError, TypeError) as exc:
            raise PolicyLoadError(f"{path}: metadata field 'feather.num_candidates' is "
                                  f"{metadata['feather.num_candidates']!r}, not an integer >= 1") from exc
    expected = observation_contract(k)
    for key, want in expected.items():
        if key not in metadata:
            raise PolicyLoadError(
                f"{path}: metadata field {key!r} is missing (policy observation version {theirs!r}, "
                f"this feather-gym builds {ours!r}); re-export it with trainer.export")
        raw = metadata[key]
        try:
            got = raw if key == "feather.obs_version" else json.loads(raw)
        except json.JSONDecodeError as exc:
            raise PolicyLoadError(f"{path}: metadata field {key!r} is not valid JSON: {exc}") from exc
        if got != want:
            raise PolicyLoadError(
                f"{path}: incompatible policy: it was trained for observation version {theirs!r}, "
                f"this feather-gym builds {ours!r}; "
                f"field {key!r} is {raw!r}, expected {json.dumps(want)!r}. "
                "Retrain or re-export the policy for this version.")
    return k


def dense_layers(path: str | os.PathLike):
    """``(weights, biases, activation)`` of a policy file that is a chain of dense layers from
    ``obs`` to ``action_logits`` with one kind of activation between every two of them (see the
    module docstring; weights ``[out, in]``), or ``None`` for any other graph, or where the
    ``onnx`` package is missing."""
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError:
        return None
    graph = onnx.load(str(path)).graph
    constants = {tensor.name: numpy_helper.to_array(tensor) for tensor in graph.initializer}
    steps, current, nodes = [], INPUT_NAME, list(graph.node)     # ("dense", weight, bias) or ("act", name)
    while nodes:
        node = nodes.pop(0)
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.input[0] != current:
            return None
        plain_gemm = [attributes.get(name, default) for name, default in PLAIN_GEMM] == [1, 1, 0]
        if node.op_type == "Gemm" and len(node.input) == 3 and set(node.input[1:]) <= constants.keys() and plain_gemm:
            weight = constants[node.input[1]]
            steps.append(("dense", weight if attributes.get("transB", 0) else weight.T, constants[node.input[2]]))
        elif node.op_type == "MatMul" and node.input[1] in constants and nodes and nodes[0].op_type == "Add" \
                and nodes[0].input[0] == node.output[0] and nodes[0].input[1] in constants:
            add = nodes.pop(0)
            steps.append(("dense", constants[node.input[1]].T, constants[add.input[1]]))
            node = add
        elif node.op_type in DENSE_ACTIVATIONS:
            steps.append(("act", DENSE_ACTIVATIONS[node.op_type]))
        else:
            return None
        current = node.output[0]
    kinds = [step[0] for step in steps]
    activations = {step[1] for step in steps if step[0] == "act"}
    if current != OUTPUT_NAME or kinds != ["dense", "act"] * (len(kinds) // 2) + ["dense"] or len(activations) > 1:
        return None
    dense = [step for step in steps if step[0] == "dense"]
    return [w for _, w, _ in dense], [b for _, _, b in dense], activations.pop() if activations else "tanh"


class OnnxPolicy:
    """A validated Feather ONNX policy over ``num_candidates`` = ``k`` slots: ``act(obs)`` is the
    greedy action (0 STOP, ``i`` admit slot ``i - 1``), ``decide(obs)`` whether it admits at all.

    ``device="cpu"`` (default) runs the CPU execution provider: a tiny MLP is faster there
    than behind a GPU launch; with ``native`` (default) a dense chain runs in the compiled evaluator
    instead (``kernel``, see the module docstring). ``device="cuda"`` uses CUDA only when onnxruntime can actually
    create a CUDA session; otherwise it logs a warning and stays on CPU (``self.provider``
    says which one runs).

    Raises ``FileNotFoundError`` for a missing file, :class:`PolicyLoadError` for a corrupt
    or incompatible one, and :class:`MissingOnnxRuntimeError` without onnxruntime. Not thread-safe
    (one preallocated binding per instance).
    """

    def __init__(self, path: str | os.PathLike, *, device: str = "cpu", native: bool = True) -> None:
        ort = import_onnxruntime()
        if device not in PROVIDERS:
            raise ValueError(f"unknown policy device {device!r}; choose one of {sorted(PROVIDERS)}")
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"policy file {self.path} does not exist")
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        providers = [PROVIDERS[device]] + ([PROVIDERS["cpu"]] if device != "cpu" else [])
        try:
            self._session = ort.InferenceSession(str(self.path), options, providers=providers)
        except Exception as exc:  # onnxruntime raises its own exception types for bad protobufs/graphs
            raise PolicyLoadError(f"{self.path}: not a loadable ONNX model ({type(exc).__name__}: {exc})") from exc
        self.provider = self._session.get_providers()[0]
        if self.provider != PROVIDERS[device]:
            logger.warning("policy %s: %s is not available, running on %s", self.path, PROVIDERS[device], self.provider)
        self.metadata = dict(self._session.get_modelmeta().custom_metadata_map)
        self.num_candidates = check_metadata(self.path, self.metadata)
        self.num_features = observation_size(self.num_candidates)
        self.num_actions = self.num_candidates + 1
        self._check_signature()
        self._obs = np.zeros((1, self.num_features), dtype=np.float32)
        self._logits = np.zeros((1, self.num_actions), dtype=np.float32)
        self._binding = self._session.io_binding()
        self._binding.bind_cpu_input(INPUT_NAME, self._obs)
        self._binding.bind_output(OUTPUT_NAME, "cpu", element_type=np.float32,
                                  shape=self._logits.shape, buffer_ptr=self._logits.ctypes.data)
        self._session.run_with_iobinding(self._binding)  # warm-up: the first run initialises lazily
        self._native = self._native_network() if native and device == "cpu" else None
        self.kernel = "onnxruntime" if self._native is None else "native"

    def _native_network(self):
        """The compiled evaluator of this file's network when it is a dense chain that matches
        onnxruntime on :data:`NATIVE_PARITY_ROWS` random observations; None otherwise (logged)."""
        from feather_gym._dense import DenseNet

        layers = dense_layers(self.path)
        if layers is None:
            logger.info("policy %s: not a dense chain the compiled evaluator runs; serving on onnxruntime", self.path)
            return None
        network = DenseNet(*layers)
        rows = parity_observations(self.num_features)
        if network.num_inputs != self.num_features or not np.allclose(
                network.outputs(rows), self.logits(rows), rtol=0.0, atol=NATIVE_PARITY_ATOL, equal_nan=True):
            logger.warning("policy %s: the compiled evaluator disagrees with onnxruntime; serving on onnxruntime",
                           self.path)
            return None
        return network

    def _check_signature(self) -> None:
        inputs, outputs = self._session.get_inputs(), self._session.get_outputs()
        if [i.name for i in inputs] != [INPUT_NAME] or [o.name for o in outputs] != [OUTPUT_NAME]:
            raise PolicyLoadError(
                f"{self.path}: expected one input {INPUT_NAME!r} and one output {OUTPUT_NAME!r}, got inputs "
                f"{[i.name for i in inputs]} and outputs {[o.name for o in outputs]}")
        for arg, width in ((inputs[0], self.num_features), (outputs[0], self.num_actions)):
            if arg.type != "tensor(float)" or len(arg.shape) != 2 or arg.shape[1] != width:
                raise PolicyLoadError(
                    f"{self.path}: {arg.name!r} is {arg.type} {arg.shape}, expected tensor(float) [N, {width}]")

    def trained_bound_differs(self, max_wait_steps: int) -> str | None:
        """The waiting-time bound (engine steps) this policy was trained under, as its
        ``feather.max_wait_steps`` records it, when that is not ``max_wait_steps``; None when they
        agree or the file records none. A policy run under another bound meets states it was not
        trained in."""
        trained = self.metadata.get("feather.max_wait_steps")
        return None if trained in (None, str(max_wait_steps)) else trained

    def logits(self, obs: np.ndarray) -> np.ndarray:
        """Logits ``[N, k + 1]`` for observation rows ``[N, F]`` (batch path, allocates)."""
        (out,) = self._session.run([OUTPUT_NAME], {INPUT_NAME: np.ascontiguousarray(obs, dtype=np.float32)})
        return out

    def act(self, obs: np.ndarray) -> int:
        """The greedy action for one normalised observation of shape ``[F]``: the largest logit,
        the lowest action on ties (so STOP on a tie, as ``k = 1`` policies always did). Raises
        :class:`PolicyOutputError` when a logit is NaN or infinite. O(network size); no allocation.
        """
        if self._native is not None:
            action = self._native.act(obs)
            if action < 0:
                raise PolicyOutputError(f"policy {self.path} returned non-finite logits "
                                        f"{self._native.outputs(obs.reshape(1, -1))[0].tolist()}")
            return action
        self._obs[0] = obs
        self._session.run_with_iobinding(self._binding)
        logits = self._logits[0]
        if not np.isfinite(logits).all():
            raise PolicyOutputError(f"policy {self.path} returned non-finite logits {logits.tolist()}")
        return int(logits.argmax())

    def decide(self, obs: np.ndarray) -> bool:
        """True when the greedy action admits a candidate (ADD for ``k = 1``), False for STOP."""
        return self.act(obs) != STOP
