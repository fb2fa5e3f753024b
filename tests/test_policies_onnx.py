"""A policy exported by the trainer runs in ``feather sim compare``; the simulator itself never loads onnxruntime."""

import json
import subprocess
import sys

import numpy as np
import pytest

from feather_cli.main import main
from feather_gym.observation import FEATURE_NAMES


@pytest.mark.slow
def test_exported_policy_runs_in_sim_compare(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from trainer.export import export_policy_module

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(len(FEATURE_NAMES), 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    path = tmp_path / "policy.onnx"
    observations = np.random.default_rng(0).uniform(0, 2, size=(64, len(FEATURE_NAMES))).astype(np.float32)
    export_policy_module(net, path, profile="h200", workload="prefix-groups", observations=observations)
    code = main(["sim", "compare", "--workload", "prefix-groups:groups=3,num_requests=30,rate=50",
                 "--profile", "h200", "--policies", f"fcfs,{path}", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["policies"][str(path)]["requests"] == 30


def test_simulator_does_not_import_onnxruntime():
    code = ("import sys, feather_gym.envs, feather_gym.policies, feather_gym.simulator, feather_gym.compare; "
            "feather_gym.policies.make_policy('feather-rule'); print('onnxruntime' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_sim_warns_of_a_policy_trained_under_another_waiting_bound(tmp_path, capsys):
    """As the deployed scheduler warns at start: a file trained with one bound, simulated with another."""
    torch = pytest.importorskip("torch")
    from trainer.export import export_policy_module

    path = tmp_path / "bound-32.onnx"
    observations = np.zeros((4, len(FEATURE_NAMES)), np.float32)
    export_policy_module(torch.nn.Linear(len(FEATURE_NAMES), 2), path, profile="h200", workload="prefix-groups",
                         observations=observations, max_wait_steps=32)
    compare = ["sim", "compare", "--workload", "prefix-groups:groups=3,num_requests=30,rate=50", "--profile", "h200",
               "--policies", str(path)]
    assert main(compare) == 0
    assert "warning" not in capsys.readouterr().err
    assert main([*compare, "--max-wait-steps", "8"]) == 0
    assert f"{path} was trained with max_wait_steps=32 and is simulated with 8" in capsys.readouterr().err
    assert main(["sim", "sweep", "--workload", "prefix-groups:groups=3,num_requests=30,rate=50", "--profile", "h200",
                 "--loads", "0.9", "--policies", f"fcfs,{path}", "--max-wait-steps", "8"]) == 0
    assert "was trained with max_wait_steps=32 and is simulated with 8" in capsys.readouterr().err
