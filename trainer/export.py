"""Export the Feather policy network to ONNX, the one file the simulator and vLLM load.

The file contract, for a policy over ``k`` candidate slots: one input ``obs``, float32 ``[N, F]``
with a dynamic ``N`` and ``F = observation_size(k)`` (``len(FEATURE_NAMES)`` for ``k = 1``),
already normalised; one output ``action_logits``, float32 ``[N, k + 1]`` (index 0 STOP, ``i``
admits slot ``i - 1``; ``k = 1``: STOP, ADD); opset >= 17; ``onnx.checker`` clean; metadata_props
describing the observation (version, feature names, normalisation, ``feather.num_candidates``),
the actions, the env, and the profile, workload and date of training. ``k`` is read from the
network's observation space (RLlib modules) unless given.

Every export is verified: onnxruntime (CPU provider) and torch must agree on random observations
and on real ones from the environment; the parity report is returned and a disagreement beyond
``atol`` raises.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import onnx
import torch

from feather_gym.policy_runtime import INPUT_NAME, OUTPUT_NAME, import_onnxruntime

OPSET = 18                      # >= 17; torch's exporter emits 18 natively (no version conversion)
PARITY_ATOL = 1e-4              # float32 MLP: torch vs onnxruntime differ by ~1e-7 in practice
PARITY_RANDOM_ROWS = 256
PARITY_REAL_ROWS = 512
TRAINING_INFO_FILE = "feather_training.json"   # inside the checkpoint: what export needs to label the policy


class PolicyLogits(torch.nn.Module):
    """An RLlib RLModule as a plain ``obs [N, F] -> action_logits [N, k + 1]`` network.

    Uses the module's inference forward pass, so only the policy path is traced; for PPO's
    default module that is the actor encoder plus the pi head (the value head is left out).
    """

    def __init__(self, rl_module: torch.nn.Module) -> None:
        super().__init__()
        self.rl_module = rl_module

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        from ray.rllib.core.columns import Columns

        return self.rl_module.forward_inference({Columns.OBS: obs})[Columns.ACTION_DIST_INPUTS]

    @property
    def num_candidates(self) -> int:
        """``k``, from the module's observation space (its width is ``observation_size(k)``)."""
        from feather_gym.observation import num_candidates_for

        return num_candidates_for(self.rl_module.observation_space.shape[0])


def rl_module_path(checkpoint: str | Path) -> Path:
    """Where the default RLModule lives inside an RLlib (new API stack) algorithm checkpoint.

    Accepts either the algorithm checkpoint directory or the RLModule directory itself.
    """
    from ray.rllib.core import COMPONENT_LEARNER, COMPONENT_LEARNER_GROUP, COMPONENT_RL_MODULE, DEFAULT_MODULE_ID

    checkpoint = Path(checkpoint)
    nested = checkpoint / COMPONENT_LEARNER_GROUP / COMPONENT_LEARNER / COMPONENT_RL_MODULE / DEFAULT_MODULE_ID
    return nested if nested.is_dir() else checkpoint


def load_policy_network(checkpoint: str | Path) -> PolicyLogits:
    """The trained policy network of an RLlib checkpoint, in eval mode, on CPU.

    Loads only the RLModule (no Ray cluster needed). Raises ``OSError`` when the path does not
    exist and ``ValueError`` when it is not a readable RLlib checkpoint.
    """
    from ray.rllib.core.rl_module.rl_module import RLModule

    checkpoint = Path(checkpoint).resolve()  # RLlib (pyarrow) rejects relative paths as URIs
    if not checkpoint.exists():
        raise FileNotFoundError(f"checkpoint {checkpoint} does not exist")
    module_dir = rl_module_path(checkpoint)
    try:
        rl_module = RLModule.from_checkpoint(module_dir)
    except (pickle.UnpicklingError, EOFError, FileNotFoundError, KeyError, AttributeError,
            TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(
            f"checkpoint {checkpoint} is not a readable RLlib checkpoint "
            f"(loading the RLModule from {module_dir} failed: {type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(rl_module, torch.nn.Module):
        raise ValueError(f"checkpoint {checkpoint} holds a {type(rl_module).__name__}, not a torch RLModule")
    return PolicyLogits(rl_module).eval()


def write_training_info(checkpoint: Path, *, profile: str, workloads: Sequence[str], trained_at: datetime,
                        max_wait_steps: int) -> None:
    """Label the checkpoint with what its policy was trained on (read back by ``feather-train export``
    and ``--resume``), its observation contract included."""
    from feather_gym.observation import OBS_VERSION

    info = {"profile": profile, "workloads": list(workloads), "trained_at": trained_at.isoformat(),
            "obs_version": OBS_VERSION, "max_wait_steps": max_wait_steps}
    (checkpoint / TRAINING_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")


def read_training_info(checkpoint: Path) -> dict | None:
    """The label written by :func:`write_training_info`, or None for a foreign checkpoint.

    ``ValueError`` when the label says the network was trained on another observation contract
    than this build's (a label without one predates ``feather-obs-4``): its inputs would mean
    other things here, so it can be neither exported as this contract nor fine-tuned."""
    from feather_gym.observation import OBS_VERSION

    path = Path(checkpoint) / TRAINING_INFO_FILE
    if not path.is_file():
        return None
    info = json.loads(path.read_text())
    theirs = info.get("obs_version", "feather-obs-3 or earlier")
    if theirs != OBS_VERSION:
        raise ValueError(f"checkpoint {checkpoint} was trained for observation version {theirs!r}, this "
                         f"feather-gym builds {OBS_VERSION!r}; retrain it (feather-train) for this version")
    return info


def onnx_metadata(*, profile: str, workload: str | Sequence[str], trained_at: datetime | None = None,
                  num_candidates: int = 1, max_wait_steps: int | None = None) -> dict[str, str]:
    """The ``feather.*`` metadata_props, from the observation builder of this version.

    ``workload`` is stored as the spec itself when it is one spec (or a one-element list), and as
    a JSON list for a mix. ``max_wait_steps``, the waiting-time bound it was trained with, is
    stored when known (the scheduler warns when it serves with another).
    """
    from feather_gym.envs import ENV_ID
    from feather_gym.observation import observation_contract

    trained_at = trained_at or datetime.now(UTC)
    contract = {key: value if isinstance(value, str) else json.dumps(value)
                for key, value in observation_contract(num_candidates).items()}
    return {
        **contract,
        "feather.env_id": ENV_ID,
        "feather.profile": profile,
        "feather.workload": workload if isinstance(workload, str) else
                            workload[0] if len(workload) == 1 else json.dumps(list(workload)),
        "feather.trained_at": trained_at.astimezone(UTC).isoformat(timespec="seconds"),
        **({} if max_wait_steps is None else {"feather.max_wait_steps": str(max_wait_steps)}),
    }


def sample_observations(*, profile: str, workload: str | Sequence[str], rows: int = PARITY_REAL_ROWS, seed: int = 0,
                        num_candidates: int = 1) -> np.ndarray:
    """``rows`` real observations from the Feather env with ``num_candidates`` slots, stepped with
    uniformly random actions."""
    import gymnasium as gym

    from feather_gym.envs import ENV_ID

    workloads = [workload] if isinstance(workload, str) else list(workload)
    env = gym.make(ENV_ID, workloads=workloads, profile=profile, seed=seed, num_candidates=num_candidates)
    rng = np.random.default_rng(seed)
    observations = []
    obs, _ = env.reset(seed=seed)
    while len(observations) < rows:
        observations.append(obs)
        obs, _, terminated, truncated, _ = env.step(int(rng.integers(num_candidates + 1)))
        if terminated or truncated:
            obs, _ = env.reset()
    env.close()
    return np.asarray(observations, dtype=np.float32)


def export_policy_module(
    torch_module: torch.nn.Module,
    path: str | Path,
    *,
    profile: str,
    workload: str | Sequence[str],
    trained_at: datetime | None = None,
    observations: np.ndarray | None = None,
    atol: float = PARITY_ATOL,
    num_candidates: int | None = None,
    max_wait_steps: int | None = None,
) -> dict:
    """Write ``torch_module`` (obs ``[N, F]`` -> logits ``[N, k + 1]``) to ``path`` as a Feather ONNX policy.

    ``num_candidates`` (``k``): None takes ``torch_module.num_candidates`` when it has one
    (:class:`PolicyLogits`), else 1. ``max_wait_steps``: the training bound, recorded
    (:func:`onnx_metadata`).

    ``observations`` are the real observations for the parity check; by default they are
    sampled from the env with ``profile`` and ``workload``. Returns the parity report
    (``max_abs_diff_random``, ``max_abs_diff_real``, action agreement, sizes); raises
    ``ValueError`` when the network has the wrong shape or onnxruntime disagrees beyond ``atol``.
    """
    from feather_gym.observation import OBS_CLIP, observation_size

    path = Path(path)
    k = num_candidates if num_candidates is not None else getattr(torch_module, "num_candidates", 1)
    num_features, num_actions = observation_size(k), k + 1
    module = torch_module.eval().cpu()
    example = torch.zeros(3, num_features)
    with torch.no_grad():
        out = module(example)
    if tuple(out.shape) != (3, num_actions):
        raise ValueError(f"policy network maps [3, {num_features}] observations to {list(out.shape)}, "
                         f"expected [3, {num_actions}] ({k} candidate slot{'s' if k > 1 else ''})")

    program = torch.onnx.export(
        module, (example,), None,
        input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
        dynamic_shapes=({0: torch.export.Dim("batch")},),
        opset_version=OPSET, dynamo=True, verbose=False,
    )
    model = program.model_proto
    onnx.helper.set_model_props(model, onnx_metadata(profile=profile, workload=workload, trained_at=trained_at,
                                                     num_candidates=k, max_wait_steps=max_wait_steps))
    onnx.checker.check_model(model, full_check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, path)

    if observations is None:
        observations = sample_observations(profile=profile, workload=workload, num_candidates=k)
    random_obs = np.random.default_rng(0).uniform(0.0, OBS_CLIP, (PARITY_RANDOM_ROWS, num_features)).astype(np.float32)
    report = {
        "path": str(path),
        "opset": OPSET,
        "num_features": num_features,
        "num_candidates": k,
        "num_random_observations": len(random_obs),
        "num_real_observations": len(observations),
        **_parity(module, path, random_obs, "random"),
        **_parity(module, path, np.asarray(observations, dtype=np.float32), "real"),
    }
    worst = max(report["max_abs_diff_random"], report["max_abs_diff_real"])
    if not worst <= atol:
        path.unlink()
        raise ValueError(f"ONNX export {path} disagrees with torch: max abs diff {worst:.3g} > {atol:g}")
    return report


def _parity(module: torch.nn.Module, path: Path, obs: np.ndarray, label: str) -> dict:
    """Max abs logit difference and argmax agreement of onnxruntime (CPU) vs torch on ``obs``."""
    session = import_onnxruntime().InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (onnx_logits,) = session.run([OUTPUT_NAME], {INPUT_NAME: obs})
    with torch.no_grad():
        torch_logits = module(torch.from_numpy(obs)).numpy()
    return {
        f"max_abs_diff_{label}": float(np.abs(onnx_logits - torch_logits).max()),
        f"action_agreement_{label}": float(np.mean(onnx_logits.argmax(1) == torch_logits.argmax(1))),
    }


def export_checkpoint(checkpoint: Path, output: Path, *, profile: str | None = None,
                      workloads: list[str] | None = None) -> dict:
    """Export the policy of a ``feather-train`` checkpoint to ``output`` (:func:`export_policy_module`),
    with the profile and workloads it records unless given; ``ValueError`` when it records
    neither (not written by feather-train) or was trained for another observation contract."""
    info = read_training_info(checkpoint) or {}
    network = load_policy_network(checkpoint)
    profile = profile or info.get("profile")
    workloads = workloads or info.get("workloads")
    if not profile or not workloads:
        raise ValueError(f"checkpoint {checkpoint} does not record its profile and workloads "
                         "(not written by feather-train); pass --profile and --workload")
    trained_at = datetime.fromisoformat(info["trained_at"]) if "trained_at" in info else None
    return export_policy_module(network, output, profile=profile, workload=workloads, trained_at=trained_at,
                                max_wait_steps=info.get("max_wait_steps"))
